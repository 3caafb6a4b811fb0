"""The unix-socket transport and the control API it serves.

``ControlAPI`` implements every protocol op against the registry and the
engine; it knows nothing about sockets, so the same methods could be served
over another transport. ``Server`` owns the listening socket (created here or
passed by systemd socket activation), authenticates each connection with
SO_PEERCRED, splits the stream into frames and enforces per-connection limits
(message size, request rate) before a request reaches the API.

Everything runs on the daemon's asyncio loop thread using Protocol callbacks
(no coroutine per request): a request is decoded, handled and answered inside
one ``data_received`` call, which is what keeps the register round trip far
below a millisecond. Slow work (migrations) is never done here; the engine
runs it on a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import grp
import logging
import os
import pwd
import select
import socket
import stat
import struct
import termios
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from kvtier import ages, hintring, logs, placement, protocol
from kvtier.deferred import AfterWrite, relay
from kvtier.blocks import STUCK_NAMES, TIER_UNKNOWN, row_select

from kvtier.kernel import affinity, native, procfs
from kvtier.errors import KvtierError, KvtierOSError, PermissionDenied, ProcessGone, os_error
from kvtier.engine import Engine
from kvtier.registry import PER_BLOCK_MIN, PER_BLOCK_SPAN, Region, Registry
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.server")

SERVER_NAME = "kvtierd"
SD_LISTEN_FDS_START = 3
_PEERCRED = struct.Struct("3i")
# Stop answering (and reading from) a client whose unread answers exceed
# this: a client that pipelines without reading must not grow our memory.
WRITE_HIGH_WATER = 4 * 1024 * 1024
# ...and the unread answers of all of one uid's connections together: each
# connection's high water is UNREAD_BYTES_PER_UID divided by its uid's open
# connections (within [MIN_WRITE_HIGH_WATER, WRITE_HIGH_WATER]), set again
# whenever that count changes. Every answer queued for a client that never
# reads it is loop time spent for nothing, taken from every other client:
# with a fixed 4 MiB per connection, robustness.py's flood (ten connections
# of one uid, pipelined `stats` never read) was answered 18,000 times, 1.7 s
# of the loop's CPU under attack, and a uid opening its 128 connections
# could make that 230,000 answers (and 512 MiB). Per uid, what a client
# that stops reading costs the daemon no longer grows with the connections
# it opens. A client that reads is not slowed: the high water only bounds
# how far ahead of its reading the daemon answers.
UNREAD_BYTES_PER_UID = 8 * 1024 * 1024
MIN_WRITE_HIGH_WATER = 64 * 1024
# One connection's turn on the loop: at most this many frames, this much
# time and this many answer bytes before every other ready connection gets
# its turn. Server.run_queue runs one backlogged turn per loop iteration, so
# TURN_SECONDS is what a request from an idle client waits behind, however
# many connections have a backlog: 0.5 ms is ~20 cheap requests here, and
# the poll between two turns costs ~20 us.
FRAMES_PER_TURN = 64
TURN_SECONDS = 0.0005
TURN_ANSWER_BYTES = 1024 * 1024
# Within a turn, every TURN_POLL_SECONDS the loop's own poll set is asked
# (one poll(2) with no wait, ~1 us) whether anything else is ready: another
# connection's request, an answer to flush, a worker's result. If so the
# turn ends there, so a request from an idle client waits behind at most
# this much of a backlogged connection's work instead of a whole turn
# (robustness.py on a quiet host: 0.5 ms turns put the good client's p99 at
# 2-3x its baseline of 0.3 ms). A backlog with nobody else waiting still
# gets whole turns.
TURN_POLL_SECONDS = 0.0001
OUT_CHUNK = 64 * 1024  # hand answers to the transport in pieces of this size


# Linux 6.5 (include/uapi/asm-generic/socket.h); Python 3.11 lacks the name.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited; a zombie counts as
    gone (its pid is reused the moment it is reaped). poll, not select: the
    daemon's fds go past FD_SETSIZE."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


class Peer:
    """Who is at the other end of a connection.

    uid and gid are SO_PEERCRED's, fixed at connect(): they are what the
    connection is authorised by. The pid is only a name for the process that
    connected, and pids are reused (they cycle in well under a minute on a
    busy host), so the process is held as a pidfd taken at connect: the
    kernel's own SO_PEERPIDFD where it has it (it refers to the connecting
    process even if that process has since exited), else pidfd_open(pid)
    plus the start time read at accept. ``live_pid()`` re-checks that
    identity on every use; a pid whose process is gone is never used.
    """

    __slots__ = ("pid", "uid", "gid", "privileged", "pidfd", "kernel_pidfd", "start_time", "proc_root")

    def __init__(self, pid: int, uid: int, gid: int, privileged: bool, pidfd: int = -1,
                 start_time: int | None = None, proc_root: str = "/proc", kernel_pidfd: bool = False):
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.privileged = privileged  # root or member of security.admin_group
        self.pidfd = pidfd
        self.kernel_pidfd = kernel_pidfd  # from SO_PEERPIDFD: the connecting process by construction
        self.start_time = start_time
        self.proc_root = proc_root

    @classmethod
    def of_socket(cls, sock: socket.socket, admin_gid: int | None, proc_root: str = "/proc") -> "Peer":
        pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        privileged = is_privileged(uid, gid, admin_gid)
        pidfd = -1
        kernel_pidfd = False
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            kernel_pidfd = True
        except OSError:  # ENOPROTOOPT before 6.5
            if native.HAS_PIDFD_OPEN and pid > 0:
                try:
                    pidfd = native.pidfd_open(pid)
                except KvtierOSError:
                    pidfd = -1  # already gone: live_pid() will say so
        try:
            start = procfs.read_start_time(pid, proc_root) if pid > 0 else None
        except (KvtierError, OSError):
            start = None
        return cls(pid, uid, gid, privileged, pidfd, start, proc_root, kernel_pidfd)

    def alive(self) -> bool:
        """The process that connected still runs under ``pid``."""
        if self.pidfd >= 0 and _exited(self.pidfd):
            return False
        if self.kernel_pidfd:
            return True
        # pidfd_open after accept (or no pidfd at all) could have caught a
        # successor that reused the pid in between: the start time decides.
        if self.start_time is None:
            return False
        return procfs.process_alive(self.pid, self.start_time, self.proc_root)

    def live_pid(self) -> int:
        if not self.alive():
            raise ProcessGone(errno.ESRCH, f"use pid {self.pid} of this connection",
                              "the process that opened the connection has exited; its pid may belong "
                              "to another process now")
        return self.pid

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def group_gid(name: str) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise


def is_privileged(uid: int, gid: int, admin_gid: int | None) -> bool:
    if uid == 0:
        return True
    if admin_gid is None:
        return False
    if gid == admin_gid:
        return True
    # Supplementary groups of the peer's user, as the group database knows
    # them (SO_PEERCRED carries only the primary gid).
    try:
        name = pwd.getpwuid(uid).pw_name
        return admin_gid in os.getgrouplist(name, gid)
    except KeyError:
        return False


class WithFd:
    """A result sent with a file descriptor (SCM_RIGHTS on the unix socket);
    ``done(sent)`` is called once the transport has passed it or could not."""

    __slots__ = ("result", "fd", "done")

    def __init__(self, result: Any, fd: int, done: Callable[[bool], None]):
        self.result = result
        self.fd = fd
        self.done = done


class FdFrame(bytes):
    """An answer frame that must carry ``fd``: sent by Connection._send_fd."""

    rid: int = 0
    fd: int = -1
    done: Callable[[bool], None] = staticmethod(lambda sent: None)


# Ring hints of more distinct regions than this in one drain are first
# matched against the regions the connection may hint, with one isin: a
# ring full of made-up region ids then costs a sort, not a lookup each.
RING_REGIONS_DIRECT = 64
# The timer's drains take at most this many ring words per loop iteration,
# over all rings (about a millisecond of work), then yield to the other
# connections and go on in the next iteration, ring after ring: 64 rings
# kept full by one client held every other client 150 ms per pass when
# each was drained whole in one callback.
RING_SLICE_WORDS = 1 << 16


def _unread_bytes(fd: int) -> int:
    """Bytes this socket sent that its peer has not read yet (SIOCOUTQ; on a
    unix stream socket the kernel frees a sent buffer only once it is read)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _error_of(exc: BaseException) -> protocol.ProtocolError:
    """Map typed daemon errors to wire errors; anything else is internal."""
    if isinstance(exc, protocol.ProtocolError):
        return exc
    if isinstance(exc, KvtierOSError):
        return protocol.ProtocolError(exc.code, str(exc), errno=exc.errno or 0)
    if isinstance(exc, KvtierError):
        return protocol.ProtocolError(exc.code, str(exc))
    if isinstance(exc, OSError):
        return protocol.ProtocolError(protocol.E_OS, str(exc), errno=exc.errno or 0)
    return protocol.ProtocolError(protocol.E_INTERNAL, f"{type(exc).__name__}: {exc}")


# A large registration's rows are written this many per loop iteration
# (~0.4 ms of the loop thread: ~50 ns a row, page faults of fresh table
# memory included), so a 4 Mi-block region is 512 short steps, not one
# 200 ms stall of every other client.
STAGE_ROWS = 8192
# A staging started again this often (other regions added or removed
# between its steps) writes the rest in one step: it always ends.
STAGE_RESTARTS = 3


class UidTurns:
    """Work queued per uid, each uid's in arrival order, the uids taking
    turns (Stager, OpSteps); ``_step`` runs once per loop iteration, after
    that iteration's reads (a due timer, like the server's run queue),
    while any work is queued. Entries are sequences whose first item is the
    owner (the connection's peer) and last its future."""

    def __init__(self) -> None:
        self.queues: dict[int, collections.deque] = {}
        self.turns: collections.deque[int] = collections.deque()  # uids with a queue, next first
        self._handle: asyncio.TimerHandle | None = None

    def _enqueue(self, uid: int, entry: Any) -> None:
        q = self.queues.get(uid)
        if q is None:
            q = self.queues[uid] = collections.deque()
            self.turns.append(uid)
        q.append(entry)
        self._again()

    def _again(self) -> None:
        if self._handle is None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_at(loop.time(), self._step)

    def _step(self) -> None:
        raise NotImplementedError

    def _remove_owner(self, owner: Any, drop: Callable[[Any], None]) -> int:
        """Take ``owner``'s queued entries out, ``drop`` called on each."""
        n = 0
        for uid in list(self.queues):
            q = self.queues[uid]
            keep = collections.deque(e for e in q if e[0] is not owner)
            for e in q:
                if e[0] is owner:
                    drop(e)
                    n += 1
            if keep:
                self.queues[uid] = keep
            else:
                del self.queues[uid]
                self.turns.remove(uid)
        return n

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for q in self.queues.values():
            for e in q:
                e[-1].cancel()
        self.queues.clear()
        self.turns.clear()


class Stager(UidTurns):
    """Large registrations, a step of STAGE_ROWS rows per loop iteration,
    run after that iteration's reads (a due timer, like the server's run
    queue). The registering client's answer waits for its region; nobody
    else waits more than one step.

    One registration is written at a time (the rows go past the table's used
    part, where only one staging fits), and the next one is taken from the
    uids in turn: a uid that queues many large registrations (one per
    connection) delays another uid's by at most the one being written, not
    by all of its own. A registration whose connection closed before it was
    written is dropped (``forget``): no rows are written for a client that
    is gone, and no region appears that nobody asked for any more. A
    connection waiting for its answer reads nothing more (its EOF is not
    seen), so ``hung_up(owner)`` asks the socket itself before each step."""

    def __init__(self, table: Any, hung_up: Callable[[Any], bool] = lambda owner: False):
        super().__init__()
        self.table = table
        self.hung_up = hung_up
        # queues: uid -> its registrations in order: (owner, staged or None, finish, future)
        self.current: tuple | None = None

    @property
    def queue(self) -> list:
        """Every registration not answered yet, the one being written first."""
        return ([self.current] if self.current else []) + [e for q in self.queues.values() for e in q]

    def add(self, staged: Any, finish: Callable[[], Any], owner: Any = None, uid: int = 0) -> asyncio.Future:
        """A future of ``finish()``'s result (or its error), run once
        ``staged``'s rows are written (None: nothing to write)."""
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(uid, (owner, staged, finish, fut))
        return fut

    def forget(self, owner: Any) -> int:
        """``owner``'s connection closed: drop its registrations not written
        yet (the one being written too; its rows past the table's used part
        are simply written over by the next)."""
        n = 0
        if self.current is not None and self.current[0] is owner:
            self._drop(self.current)
            self.current = None
            n += 1
        return n + self._remove_owner(owner, self._drop)

    @staticmethod
    def _drop(entry: tuple) -> None:
        if not entry[3].done():
            entry[3].set_exception(protocol.ProtocolError(
                protocol.E_UNAVAILABLE, "the connection closed before the region's rows were written: "
                "nothing was registered"))

    def _next(self) -> tuple | None:
        if self.current is not None and self.hung_up(self.current[0]):
            self._drop(self.current)
            self.current = None
        while self.current is None and self.turns:
            uid = self.turns.popleft()
            q = self.queues[uid]
            entry = q.popleft()
            if q:
                self.turns.append(uid)  # its next one after every other uid's
            else:
                del self.queues[uid]
            if entry[3].done():
                continue
            if self.hung_up(entry[0]):
                self._drop(entry)
                continue
            self.current = entry
        return self.current

    def _step(self) -> None:
        self._handle = None
        entry = self._next()
        if entry is not None:
            _, staged, finish, fut = entry
            try:
                done = staged is None or staged.restarts >= STAGE_RESTARTS or self.table.fill(staged, STAGE_ROWS)
                if done:
                    self.current = None
                    fut.set_result(finish())
            except Exception as exc:  # the region's checks failed when it was added: the client is told
                self.current = None
                fut.set_exception(exc)
        if self.current is not None or self.turns:
            self._again()

    def close(self) -> None:
        if self.current is not None:
            self.current[3].cancel()
            self.current = None
        super().close()


# A whole-region op (or one naming more blocks than this) works on this
# many blocks per loop iteration: on a 4 Mi-block region one request of ~30
# bytes held the loop 0.2-4 s (phase, pin, release, measure...), every
# other client waiting; a step of 8 Ki blocks is well under a millisecond.
OP_STEP_BLOCKS = STAGE_ROWS


class OpSteps(UidTurns):
    """Large block ops (phase, pin, unpin, prefetch, release, measure) in
    steps of OP_STEP_BLOCKS blocks, one step per loop iteration run after
    that iteration's reads, as the Stager writes a large registration. The
    requesting connection's answer waits for the last step (it answers
    nothing else meanwhile, so its answers stay in order); nobody else
    waits more than one step. Each uid's ops run in arrival order and the
    steps go round-robin between uids: a uid with many large ops queued
    delays another uid's by one step per turn, not by all of its own.

    Each step is a whole op on its own blocks, so the region is consistent
    between steps: blocks of steps taken are done, the others untouched.
    The request's result is the sum of its steps' results. A connection
    that hung up (or closed) has its op dropped before the next step: the
    steps already taken stay applied (as if the client had sent only those
    blocks), the rest never are. A region removed between steps (unregister,
    its process exited) ends the op with that error, the steps taken
    applied to a region that no longer exists."""

    def __init__(self, hung_up: Callable[[Any], bool] = lambda owner: False):
        super().__init__()
        self.hung_up = hung_up
        # queues: uid -> its ops in order: [owner, chunks, next chunk, apply, result so far, future]

    def add(self, owner: Any, uid: int, chunks: list, apply: Callable[[Any], dict]) -> asyncio.Future:
        """A future of the sum of ``apply(chunk)`` over ``chunks``, one chunk a loop iteration."""
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(uid, [owner, chunks, 0, apply, {}, fut])
        return fut

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def forget(self, owner: Any) -> int:
        """``owner``'s connection closed: its ops take no more steps."""
        return self._remove_owner(owner, lambda e: e[5].cancel())

    def _step(self) -> None:
        self._handle = None
        if self.turns:
            uid = self.turns.popleft()
            q = self.queues[uid]
            e = q[0]
            owner, chunks, i, apply, acc, fut = e
            finished = True
            if fut.done():
                pass
            elif self.hung_up(owner):
                fut.cancel()
            else:
                try:
                    for k, v in apply(chunks[i]).items():
                        acc[k] = acc.get(k, 0) + v
                    e[2] = i = i + 1
                    finished = i >= len(chunks)
                    if finished:
                        fut.set_result(acc)
                except Exception as exc:  # the region went away, or the op failed: the client is told
                    fut.set_exception(exc)
            if finished:
                q.popleft()
            if q:
                self.turns.append(uid)
            else:
                del self.queues[uid]
        if self.turns:
            self._again()


def _may_register(peer: Peer, pid: int, own: bool) -> None:
    """PermissionDenied unless an unprivileged peer could ptrace-read the
    process itself (the kernel's rule, which the daemon's CAP_SYS_PTRACE
    would otherwise bypass): every uid of it (real, effective, saved) the
    peer's, every gid the peer's, and, for another process than the
    connecting one, dumpable. A setgid program (unix_chkpwd, chage) keeps
    the user's uids; a setuid-root program that only lowered its effective
    uid keeps root's saved uid; ssh-agent and gpg-agent make themselves
    undumpable so that their own user cannot read them."""
    uids, gids, owner = procfs.read_creds(pid, peer.proc_root)
    why = None
    if any(u != peer.uid for u in uids[:3]):
        why = f"it runs as uids {'/'.join(map(str, uids[:3]))}, you are uid {peer.uid}"
    elif any(g != peer.gid for g in gids[:3]):
        why = f"it runs as gids {'/'.join(map(str, gids[:3]))}, you are gid {peer.gid}"
    elif not own and owner != (peer.uid, peer.gid):
        why = "it is not dumpable (setuid/setgid exec, setuid() or prctl(PR_SET_DUMPABLE, 0)): its own user may not read it"
    if why is not None:
        raise PermissionDenied(errno.EPERM, f"register memory of pid {pid}",
                               f"{why}; only root or security.admin_group may register memory of a process "
                               "its user could not ptrace")


class ControlAPI:
    """One method per op: ``handle(peer, request) -> result``. Raises typed
    errors; the transport turns them into error responses."""

    def __init__(self, registry: Registry, engine: Engine, stats: DaemonStats,
                 max_message_bytes: int, version: str = "0"):
        self.registry = registry
        self.engine = engine
        self.stats = stats
        self.max_message_bytes = max_message_bytes
        self.version = version
        self._pushers: dict[Peer, Callable[[str, dict], None]] = {}
        self._hangups: dict[Peer, Callable[[], bool]] = {}
        # Set by the composition root: a future done once the current
        # registry is in the state file (None: no state file).
        self.durable: Callable[[], "asyncio.Future | None"] = lambda: None
        self._handlers: dict[type, Callable[[Peer, Any], Any]] = {
            t: getattr(self, "op_" + op) for op, t in protocol.OPS.items()
        }
        self.stager = Stager(registry.table, lambda peer: peer in self._hangups and self._hangups[peer]())
        self.steps = OpSteps(lambda peer: peer in self._hangups and self._hangups[peer]())
        # Shared-memory hint rings (op hint_ring), one per connection at most.
        self.rings: dict[Peer, hintring.DaemonRing] = {}
        self.ring_entries = hintring.DEFAULT_ENTRIES  # limits.hint_ring_entries (0: no rings)
        self.ring_interval = hintring.DEFAULT_INTERVAL  # daemon.hint_ring_interval
        self._ring_timer: asyncio.TimerHandle | None = None
        self._ring_wait = self.ring_interval  # until the next drain pass: backs off while the rings are empty
        self.ring_passes = 0  # drain passes of the timer (work an idle ring costs)
        # The timer's pass in progress: (peer, words taken from its ring in
        # this pass) still to drain, each ring at most its capacity a pass.
        self._ring_pass: collections.deque[tuple[Peer, int]] = collections.deque()
        self._ring_found = False

    def handle(self, peer: Peer, req: protocol.Request) -> Any:
        # A request applies after the hints its connection published in its
        # ring before sending it, as after hints sent on the socket before it
        # (a phase "free" must not be undone by a hint written earlier).
        if self.rings and peer in self.rings:
            ring = self.rings[peer]
            before = ring.consumed
            self._drain_ring(peer, ring)
            if ring.consumed != before:
                self._rings_busy()
        return self._handlers[type(req)](peer, req)

    # -- authorisation ---------------------------------------------------

    def _own(self, peer: Peer, region_id: int) -> Region:
        """The region, if ``peer``'s uid registered it or ``peer`` is privileged.

        Never by pid: the pid a connection was opened from may since belong
        to another process (pid reuse) or to a setuid program the client
        exec'd; the uid of the connection cannot change."""
        reg = self.registry.get(region_id)
        if peer.uid == reg.owner_uid or peer.privileged:
            return reg
        raise PermissionDenied(errno.EPERM, f"access region {region_id}",
                               f"owned by uid {reg.owner_uid}, you are uid {peer.uid}")

    def _register_target(self, peer: Peer, pid: int | None) -> tuple[int, int]:
        """(pid, start time) of the process whose memory a register names.

        The connecting process by default, re-checked through its pidfd. An
        unprivileged peer may only name a process whose real and effective
        uid are its own (a setuid program it exec'd is not). The uid and
        start time are read while a pidfd holds the process, and the pidfd is
        checked afterwards, so both belong to one process, not a successor."""
        own = pid is None or pid == peer.pid
        if own:
            pid = peer.live_pid()
            pidfd = -1
        else:
            try:
                pidfd = native.pidfd_open(pid) if native.HAS_PIDFD_OPEN else -1
            except KvtierOSError as e:
                raise ProcessGone(e.errno or errno.ESRCH, f"register memory of pid {pid}",
                                  "no such process") from None
        try:
            if not peer.privileged:
                _may_register(peer, pid, own)
            start = procfs.read_start_time(pid, peer.proc_root)
            if own:
                peer.live_pid()
            elif pidfd >= 0 and _exited(pidfd):
                raise ProcessGone(errno.ESRCH, f"register memory of pid {pid}", "process exited")
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return pid, start

    # -- client ops ------------------------------------------------------

    def op_hello(self, peer: Peer, req: protocol.Hello) -> dict:
        common = sorted(set(req.versions) & set(protocol.SUPPORTED_VERSIONS))
        if not common:
            raise protocol.ProtocolError(
                protocol.E_UNSUPPORTED_VERSION,
                f"no common protocol version: client {req.versions}, daemon {list(protocol.SUPPORTED_VERSIONS)}",
            )
        return {
            "version": common[-1],
            "versions": list(protocol.SUPPORTED_VERSIONS),
            "server": SERVER_NAME,
            "server_version": self.version,
            "capabilities": list(protocol.CAPABILITIES),
            "max_message_bytes": self.max_message_bytes,
            "page_size": native.PAGE_SIZE,
            "pid": peer.pid,
            "uid": peer.uid,
            "privileged": peer.privileged,
        }

    def op_register(self, peer: Peer, req: protocol.Register) -> Any:
        pid, start_time = self._register_target(peer, req.pid)
        if -(-req.length // max(1, req.block_size)) <= STAGE_ROWS:
            return self._add_registered(peer, pid, start_time, req, None)
        # A large region: checked now, its rows written a step per loop
        # iteration, added (and answered) once all are written.
        staged = None
        if self._same_region(peer, pid, start_time, req) is None:
            staged = self.registry.stage(pid, req.start, req.length, req.block_size, tenant=req.tenant,
                                         priority=req.priority, constraints=tuple(dict.fromkeys(req.constraints)),
                                         start_time=start_time)
        return AfterWrite(self.stager.add(staged, lambda: self._add_registered(peer, pid, start_time, req, staged),
                                          peer, peer.uid), None)

    def _add_registered(self, peer: Peer, pid: int, start_time: int, req: protocol.Register, staged) -> dict:
        same = self._same_region(peer, pid, start_time, req)
        if same is not None:
            return {"region": same.id, "blocks": same.nblocks, "block_size": same.block_size, "pid": pid,
                    "existing": True}
        reg = self.registry.add(
            pid, req.start, req.length, req.block_size, name=req.name, tenant=req.tenant,
            priority=req.priority, constraints=tuple(dict.fromkeys(req.constraints)),
            owner_uid=peer.uid, start_time=start_time, staged=staged,
        )
        return {"region": reg.id, "blocks": reg.nblocks, "block_size": reg.block_size, "pid": pid}

    def _same_region(self, peer: Peer, pid: int, start_time: int, req: protocol.Register) -> Region | None:
        """The process's region of exactly this range and block size, if the
        caller may use it: registering it again hands it back instead of
        failing with `overlap`. That is what a client needs after a register
        whose answer it lost (timeout, daemon restart) and after a restart
        re-adopted a region the client had not heard about."""
        for rid in self.registry.by_pid.get(pid, ()):
            r = self.registry.regions[rid]
            if (r.start, r.length, r.block_size, r.start_time) == (req.start, req.length, req.block_size, start_time) \
                    and (r.owner_uid == peer.uid or peer.privileged):
                return r
        return None

    def op_allocate(self, peer: Peer, req: protocol.Allocate) -> dict:
        """Choose the node for memory the caller mapped and has not touched,
        and register it; the client mbinds it there before the first touch."""
        pid, start_time = self._register_target(peer, None)
        want = None if req.tier == "auto" else self._tier_index(req.tier)
        # a tenant no region has yet has no DRAM in use; its name is not
        # given an id before a region of it is added (registry.tenant_id)
        tid = self.registry.tenants.get(req.tenant, -1)
        where = placement.choose(req.length, self._tier_rooms(pid, tid), want, req.pinned)
        plc = {"tier": where.tier, "tier_name": where.tier_name, "node": where.node, "reason": where.reason}
        reg = self.registry.add(
            pid, req.start, req.length, req.block_size, name=req.name, tenant=req.tenant,
            priority=req.priority, constraints=tuple(dict.fromkeys(req.constraints)),
            owner_uid=peer.uid, start_time=start_time, placement=plc, pinned=req.pinned,
        )
        logs.event(log, "region_allocated", region=reg.id, pid=pid, tier=where.tier_name,
                   node=where.node, pinned=req.pinned, reason=where.reason)
        return {"region": reg.id, "blocks": reg.nblocks, "block_size": reg.block_size, "pid": pid,
                "pinned": req.pinned, **plc}

    # -- engine-mode regions (kvtier.engine_moves) -----------------------

    def connected(self, peer: Peer, push: Callable[[str, dict], None],
                  hung_up: Callable[[], bool] | None = None) -> None:
        """The transport can send ``peer`` unasked frames through ``push``,
        and ``hung_up()`` says whether the client closed its end (its EOF may
        not have been read yet)."""
        self._pushers[peer] = push
        if hung_up is not None:
            self._hangups[peer] = hung_up

    def disconnected(self, peer: Peer) -> None:
        ring = self.rings.pop(peer, None)
        if ring is not None:
            self._drain_ring(peer, ring)  # what was published before the close still counts
            ring.close()
            self.stats.hint_rings_open = len(self.rings)
        self._pushers.pop(peer, None)
        self._hangups.pop(peer, None)
        self.stager.forget(peer)
        self.steps.forget(peer)
        self.engine.engine_moves.detach(peer)

    def _engine_tiers(self, packed: bytes, nblocks: int) -> np.ndarray:
        tiers = protocol.unpack(packed, protocol.TIERS_DTYPE, "tiers")
        if tiers.size != nblocks:
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT, f"{tiers.size} tiers for {nblocks} blocks")
        ntiers = len(self.engine.tier_names())
        if tiers.size and (int(tiers.max()) >= ntiers or int(tiers.min()) < -1):
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT,
                                         f"tiers must be -1 (not placed) or 0..{ntiers - 1}")
        return tiers.astype(np.int8)

    def _attach(self, peer: Peer, region_id: int) -> None:
        push = self._pushers.get(peer)
        if push is None:
            raise protocol.ProtocolError(protocol.E_FEATURE, "this transport cannot send move events")
        self.engine.engine_moves.attach(region_id, peer, push)

    def op_register_engine(self, peer: Peer, req: protocol.RegisterEngine) -> dict:
        pid, start_time = self._register_target(peer, None)
        tiers = self._engine_tiers(req.tiers, req.blocks)
        reg = self.registry.add(
            pid, 0, req.blocks * req.block_size, req.block_size, name=req.name, tenant=req.tenant,
            priority=req.priority, constraints=tuple(dict.fromkeys(req.constraints)),
            owner_uid=peer.uid, start_time=start_time, engine_tiers=tiers,
        )
        self._attach(peer, reg.id)
        return {"region": reg.id, "blocks": reg.nblocks, "block_size": reg.block_size, "pid": pid}

    def op_attach(self, peer: Peer, req: protocol.Attach) -> dict:
        reg = self._own(peer, req.region)
        if reg.mode != "engine":
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT, f"region {reg.id} is not an engine region")
        if req.tiers is not None:
            self.registry.set_engine_tiers(reg.id, self._engine_tiers(req.tiers, reg.nblocks))
        self._attach(peer, reg.id)
        return {"region": reg.id}

    def op_move_done(self, peer: Peer, req: protocol.MoveDone) -> dict:
        ok = protocol.unpack(req.ok, protocol.FLAGS_DTYPE, "ok")
        eng = self.engine
        result, eng.pstate = eng.engine_moves.ack(peer, req.move, ok, req.error, eng.policy_cfg, eng.pstate)
        return result

    def _tier_index(self, spec: str) -> int:
        names = self.engine.tier_names()
        if spec in names:
            return names.index(spec)
        # ASCII digits only: str.isdigit() also takes "²" (int() refuses it)
        # and other scripts' digits ("١" would be tier 1).
        if spec.isascii() and spec.isdigit() and int(spec) < len(names):
            return int(spec)
        raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT, f"no tier {spec!r} (tiers: {', '.join(names) or 'none'})")

    def _tier_rooms(self, pid: int, tenant_id: int) -> list[placement.TierRoom]:
        """Room per tier for a new pool of ``pid``: measured usage plus what
        allocate placed but the daemon has not measured yet (so two quick
        allocations cannot both take the last room), nodes by distance from
        the caller's CPUs."""
        eng, table = self.engine, self.registry.table
        topo, cfg = eng.topology, eng.policy_cfg
        states = eng.tier_states()
        ntiers = len(states)
        reserved = np.zeros(ntiers)
        tenant0 = float(table.nbytes[(table.tenant == tenant_id) & (table.tier == 0)].sum())
        for r in self.registry.regions.values():
            if r.placement is None or not 0 <= r.placement["tier"] < ntiers:
                continue
            unmeasured = table.region_view(r.id, "tier") == TIER_UNKNOWN
            nb = float(table.region_view(r.id, "nbytes")[unmeasured].sum())
            reserved[r.placement["tier"]] += nb
            if r.placement["tier"] == 0 and r.tenant_id == tenant_id:
                tenant0 += nb
        quota = cfg.tenant_dram_quota.get(tenant_id)
        cpus = set(affinity.caller_cpus(pid, topo.proc_root))
        home = [n for n in topo.nodes.values() if cpus & set(n.cpus)]
        movable = affinity.movable_only_nodes(topo.sys_root)
        nodes = {}
        for n in topo.nodes.values():
            dists = [h.distances[n.node] for h in home if n.node in h.distances]
            nodes[n.node] = (int(n.free), n.node in movable, min(dists) if dists else None,
                             n.perf.read_latency_ns if n.perf else None)
        return placement.rooms(
            states, [cfg.target_bytes(t) for t in states], cfg.high_wm, reserved, nodes,
            {t.index: t.nodes for t in topo.tiers if t.kind != "swap"},
            np.inf if quota is None else float(quota) - tenant0,
        )

    def _in_steps(self, peer: Peer, reg: Region, packed: bytes | None, apply: Callable[[Any], dict]) -> Any:
        """``apply(blocks)`` (None: the whole region) at once for up to
        OP_STEP_BLOCKS blocks, else in OpSteps' steps (slices of the region,
        or pieces of ``blocks``), answered after the last. The indices are
        checked first: a bad one fails the request before any block is
        touched."""
        blocks = protocol.unpack(packed, protocol.BLOCKS_DTYPE, "blocks")
        chunks = self._chunks(reg, blocks)
        if len(chunks) == 1:
            return apply(blocks)
        return AfterWrite(self.steps.add(peer, peer.uid, chunks, apply), None)

    def _chunks(self, reg: Region, blocks: np.ndarray | None) -> list:
        """The request's blocks (None: all of the region) in parts of at most
        OP_STEP_BLOCKS: slices of the region, or pieces of ``blocks``; one
        part (``blocks`` itself) if they fit. The indices are checked first."""
        n = reg.nblocks if blocks is None else int(blocks.size)
        if n <= OP_STEP_BLOCKS:
            return [blocks]
        if blocks is None:
            return [slice(i, min(n, i + OP_STEP_BLOCKS)) for i in range(0, n, OP_STEP_BLOCKS)]
        if int(blocks.max()) >= reg.nblocks:
            self.registry.rows(reg.id, blocks[[int(blocks.argmax())]])  # raises the range error
        return [blocks[i:i + OP_STEP_BLOCKS] for i in range(0, n, OP_STEP_BLOCKS)]

    def op_prefetch(self, peer: Peer, req: protocol.Prefetch) -> Any:
        reg = self._own(peer, req.region)
        return self._in_steps(peer, reg, req.blocks,
                              lambda b: self.engine.schedule(self.registry.rows(reg.id, b), "prefetch"))

    def op_release(self, peer: Peer, req: protocol.Release) -> Any:
        reg = self._own(peer, req.region)
        return self._in_steps(peer, reg, req.blocks,
                              lambda b: self.engine.schedule(self.registry.rows(reg.id, b), "release"))

    def op_unregister(self, peer: Peer, req: protocol.Unregister) -> dict:
        self._own(peer, req.region)
        reg = self.registry.remove(req.region)
        self.engine.engine_moves.forget_region(reg.id)
        logs.event(log, "region_unregistered", region=reg.id, pid=reg.pid, name=reg.name, by_uid=peer.uid)
        # Answered once the state file no longer holds the region: after a
        # crash the restarted daemon must not re-adopt what the client removed.
        return AfterWrite(self.durable(), {})

    def op_hint(self, peer: Peer, req: protocol.Hint) -> Any:
        reg = self._own(peer, req.region)
        blocks = protocol.unpack(req.blocks, protocol.BLOCKS_DTYPE, "blocks")
        counts = protocol.unpack(req.counts, protocol.COUNTS_DTYPE, "counts")
        n = int(blocks.size)
        if n <= OP_STEP_BLOCKS:
            return {"accepted": self.registry.hint(req.region, blocks, counts)}
        # A 16 MiB frame is 4 Mi hints: one fold of them all held every other
        # client ~100-200 ms. Checked whole first, then folded in steps like
        # the other large block ops (docs/protocol.md, "Large block ops").
        if counts is not None and counts.size != n:
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT, f"counts has {counts.size} entries, blocks {n}")
        self._chunks(reg, blocks)  # raises the range error of the largest index
        parts = [slice(i, min(n, i + OP_STEP_BLOCKS)) for i in range(0, n, OP_STEP_BLOCKS)]
        return AfterWrite(self.steps.add(peer, peer.uid, parts, lambda part: {"accepted": self.registry.hint(
            reg.id, blocks[part], None if counts is None else counts[part])}), None)

    # -- the shared-memory hint ring (kvtier.hintring) --------------------

    def op_hint_ring(self, peer: Peer, req: protocol.HintRing) -> Any:
        """The connection's ring: made and passed as an fd the first time,
        its counters (after the drain handle() just did) every time."""
        ring = self.rings.get(peer)
        if ring is not None:
            return self._ring_answer(ring, False)
        if not self.ring_entries:
            raise protocol.ProtocolError(protocol.E_FEATURE, "hint rings are off (limits.hint_ring_entries = 0)")
        ring = hintring.DaemonRing(hintring.capacity_for(req.entries, self.ring_entries))
        self.rings[peer] = ring
        self.stats.hint_rings_open = len(self.rings)

        def done(sent: bool) -> None:
            ring.close_fd()  # the client holds its own now (or never will)
            if not sent and self.rings.get(peer) is ring:
                del self.rings[peer]
                ring.close()
                self.stats.hint_rings_open = len(self.rings)

        self._rings_busy()  # its first hints are drained at the interval, not after an idle wait
        return WithFd(self._ring_answer(ring, True), ring.fd, done)

    @staticmethod
    def _ring_answer(ring: hintring.DaemonRing, new: bool) -> dict:
        return {"new": new, "entries": ring.capacity, "bytes": hintring.ring_bytes(ring.capacity),
                "word_size": hintring.WORD_SIZE, "words_offset": hintring.WORDS_OFFSET,
                "tail": ring.consumed,
                **{k: ring.counts[k] for k in (hintring.ACCEPTED, hintring.BAD_REGION, hintring.BAD_BLOCK,
                                               hintring.BAD_HEAD)}}

    def _arm_ring_timer(self) -> None:
        if self._ring_timer is None and self.rings:
            self._ring_timer = asyncio.get_running_loop().call_later(self._ring_wait, self._drain_rings)

    def _rings_busy(self) -> None:
        """A ring had words: drain at the interval again, from now on."""
        self._ring_wait = self.ring_interval
        timer = self._ring_timer
        if timer is not None and timer.when() > asyncio.get_running_loop().time() + self.ring_interval:
            timer.cancel()
            self._ring_timer = None
        self._arm_ring_timer()

    def _drain_rings(self) -> None:
        """The timer's pass over every ring, in slices of RING_SLICE_WORDS
        words per loop iteration (the rings in turn, each at most its
        capacity per pass), so a pass over many full rings never holds the
        other connections more than one slice. A pass that finds them all
        empty doubles the wait before the next one, up to
        hintring.IDLE_INTERVAL_MAX (never below the interval); one that
        finds a word drains at the interval again."""
        self._ring_timer = None
        todo = self._ring_pass
        if not todo:
            self.ring_passes += 1
            todo.extend((peer, 0) for peer in self.rings)
            self._ring_found = False
        budget = RING_SLICE_WORDS
        while todo and budget > 0:
            peer, taken = todo.popleft()
            ring = self.rings.get(peer)
            if ring is None:
                continue
            before = ring.consumed
            limit = min(budget, ring.capacity - taken)
            try:
                self._drain_ring(peer, ring, limit)
            except Exception:  # one client's ring never stops the others'
                log.exception("draining the hint ring of pid %s", peer.pid)
            if ring.consumed != before:
                self._ring_found = True
            taken += ring.taken
            budget -= ring.taken + hintring.MIN_ENTRIES  # an empty ring costs a little too
            if ring.waiting and taken < ring.capacity:
                todo.append((peer, taken))  # the rest after the other rings' turns
        if todo:  # the pass goes on in the next loop iteration, after its reads
            self._ring_timer = asyncio.get_running_loop().call_later(0, self._drain_rings)
            return
        base = self.ring_interval
        self._ring_wait = base if self._ring_found else max(base, min(2 * self._ring_wait,
                                                                      hintring.IDLE_INTERVAL_MAX))
        self._arm_ring_timer()

    def close_rings(self) -> None:
        if self._ring_timer is not None:
            self._ring_timer.cancel()
            self._ring_timer = None
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        self._ring_pass.clear()

    def _count_ring(self, ring: hintring.DaemonRing, result: str, n: int) -> None:
        if n:
            ring.counts[result] += n
            self.stats.hint_ring_entries[result] += n

    def _drain_ring(self, peer: Peer, ring: hintring.DaemonRing, limit: int | None = None) -> None:
        """Apply what the client published: its hints, copied out of the
        shared memory and decoded by ``take_runs``, validated as the
        socket's hint op validates (a region this connection may hint, a
        block in range), hint by hint: the bad ones are counted and
        dropped, the rest applied. Work per drain is bounded by the ring's
        capacity: array operations over its hints, a dict look-up per
        distinct region, and one ``Registry.hint_rows`` for all of them.
        ``limit``: at most that many words (the timer's slices)."""
        run_rid, lengths, blocks = ring.take_runs(limit)
        if ring.bad_heads != ring.bad_heads_seen:
            self._count_ring(ring, hintring.BAD_HEAD, ring.bad_heads - ring.bad_heads_seen)
            ring.bad_heads_seen = ring.bad_heads
        if not blocks.size:
            return
        if run_rid.size <= RING_REGIONS_DIRECT:
            # a run per client batch: a few dozen at most, cheaper in Python than np.unique
            named = run_rid.tolist()
            distinct = sorted(set(named))
            index_of = {rid: i for i, rid in enumerate(distinct)}
            ids = np.array(distinct, dtype=np.int64)
            which = np.array([index_of[rid] for rid in named], dtype=np.intp)
        else:
            ids, which = np.unique(run_rid, return_inverse=True)
        regions = self.registry.regions
        may = peer.privileged
        if ids.size >= RING_REGIONS_DIRECT:
            # a ring naming many regions (made-up ids, maybe) is first
            # matched against the connection's own, with one isin
            mine = np.fromiter((rid for rid, r in regions.items() if may or r.owner_uid == peer.uid),
                               dtype=np.int64)
            known = np.isin(ids, mine)
        else:
            known = np.ones(ids.size, dtype=bool)
        start = np.zeros(ids.size, dtype=np.int64)
        nblocks = np.zeros(ids.size, dtype=np.int64)
        slices = self.registry.table.slices
        for i in np.flatnonzero(known).tolist():
            rid = int(ids[i])
            reg = regions.get(rid)
            if reg is None or not (may or reg.owner_uid == peer.uid):
                known[i] = False
                continue
            start[i] = slices[rid].start
            nblocks[i] = reg.nblocks
        run_ok = known[which]
        if not run_ok.all():
            self._count_ring(ring, hintring.BAD_REGION, int(lengths[~run_ok].sum()))
        # a block in range of its run's region: tested per run first (its
        # largest index), hint by hint only in the runs that fail it
        cut = np.cumsum(lengths) - lengths
        run_nb = nblocks[which]
        bad_run = run_ok & (np.maximum.reduceat(blocks, cut) >= run_nb)
        # each hint's block as an index into the drain's regions laid end
        # to end (``packed``: what the per-block sums count over)
        packed_at = np.cumsum(nblocks) - nblocks
        packed = blocks.astype(np.int64)
        if run_ok.all() and not bad_run.any():
            packed += np.repeat(packed_at[which], lengths)
            hinted = np.bincount(which, weights=lengths, minlength=ids.size)
        else:
            keep = np.repeat(run_ok, lengths)
            if bad_run.any():
                keep &= packed < np.repeat(run_nb, lengths)
                in_bad = np.repeat(bad_run, lengths)
                self._count_ring(ring, hintring.BAD_BLOCK,
                                 int(np.count_nonzero(in_bad) - np.count_nonzero(keep & in_bad)))
            packed += np.repeat(packed_at[which], lengths)
            packed = packed[keep]
            hinted = np.bincount(np.repeat(which, lengths)[keep], minlength=ids.size)
        if not packed.size:
            return
        per_region = [(int(ids[i]), int(hinted[i])) for i in np.flatnonzero(hinted).tolist()]
        if self.registry.recorder is not None:
            # a recording keeps the messages region by region, as the socket's
            for rid, _ in per_region:
                i = int(np.searchsorted(ids, rid))
                mine = packed[(packed >= packed_at[i]) & (packed < packed_at[i] + nblocks[i])] - packed_at[i]
                self._count_ring(ring, hintring.ACCEPTED, self.registry.hint(rid, mine.astype(np.uint32), None))
            return
        n = int(packed.size)
        span = int(nblocks.sum())
        listed = None
        if n >= PER_BLOCK_MIN and span <= PER_BLOCK_SPAN * n:
            # many hints of few blocks (the requests that read them): summed
            # per block first, so the registry works per block, not per hint
            listed = np.bincount(packed, minlength=span)
            packed = np.flatnonzero(listed)
            listed = listed[packed]
        i = np.searchsorted(packed_at, packed, side="right") - 1
        rows = start[i] + (packed - packed_at[i])
        self._count_ring(ring, hintring.ACCEPTED, self.registry.hint_rows(rows, listed, n, per_region))

    def op_phase(self, peer: Peer, req: protocol.Phase) -> Any:
        reg = self._own(peer, req.region)
        return self._in_steps(peer, reg, req.blocks,
                              lambda b: {"blocks": self.registry.phase(reg.id, req.phase, b)})

    def _page(self, reg: Region, first: int, count: int | None, bytes_per_block: int) -> tuple[slice, dict]:
        """Table rows of one answer page of ``[first, first+count)`` and the
        answer's paging fields: an answer never exceeds max_message_bytes
        (nor protocol.MAX_ANSWER_BYTES, which keeps one answer under a
        millisecond of work); ``next`` is where the following page starts, absent on the
        last one."""
        if first > reg.nblocks:
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT,
                                  f"first {first} beyond region {reg.id}'s {reg.nblocks} blocks")
        stop = reg.nblocks if count is None else min(reg.nblocks, first + count)
        room = min(self.max_message_bytes, protocol.MAX_ANSWER_BYTES) - protocol.ANSWER_OVERHEAD
        end = min(stop, first + max(1, room // bytes_per_block))
        s = self.registry.table.slices[reg.id]
        paging = {"region": reg.id, "first": first, "count": end - first}
        if end < stop:
            paging["next"] = end
        return slice(s.start + first, s.start + end), paging

    def op_query(self, peer: Peer, req: protocol.Query) -> dict:
        reg = self._own(peer, req.region)
        sl, out = self._page(reg, req.first, req.count, protocol.TIERS_DTYPE.itemsize)
        out["tiers"] = self.registry.table.tier[sl].astype(protocol.TIERS_DTYPE).tobytes()
        out["tier_names"] = self.engine.tier_names()
        return out

    def op_stats(self, peer: Peer, req: protocol.Stats) -> dict:
        return self.stats.to_dict()

    # -- operator ops ----------------------------------------------------

    def op_status(self, peer: Peer, req: protocol.Status) -> dict:
        s = self.stats
        return {
            "server": SERVER_NAME, "server_version": self.version, "pid": os.getpid(),
            "uptime_s": time.monotonic() - s.started_mono,
            "regions": s.regions, "processes": s.processes, "blocks": s.blocks,
            "registered_bytes": s.registered_bytes, "connections": s.connections_open,
            "engine": self.engine.status(),
        }

    def op_tiers(self, peer: Peer, req: protocol.Tiers) -> dict:
        return {"tiers": self.engine.tiers()}

    def op_regions(self, peer: Peer, req: protocol.Regions) -> dict:
        """One page of the regions the caller may see, by ascending id from
        ``after``; ``next`` (the ``after`` of the following page) is present
        when more remain. A page ends at ``limit`` regions, at
        REGIONS_PAGE_BLOCKS blocks summarised, or before the region that
        would take its encoding past min(max_message_bytes, MAX_ANSWER_BYTES)
        (each region is encoded once, as it is added)."""
        table, regions = self.registry.table, self.registry.regions
        limit = req.limit or protocol.REGIONS_PAGE_DEFAULT
        room = min(self.max_message_bytes, protocol.MAX_ANSWER_BYTES) - protocol.ANSWER_OVERHEAD
        ids = np.fromiter(regions, dtype=np.int64, count=len(regions))
        ids = np.sort(ids[ids > req.after])
        out: list[msgspec.Raw] = []
        used = blocks = 0
        last = None
        more = False
        for rid in ids.tolist():
            r = regions[rid]
            if req.pid is not None and r.pid != req.pid:
                continue
            if not (peer.privileged or r.owner_uid == peer.uid):
                continue
            if len(out) >= limit or blocks >= protocol.REGIONS_PAGE_BLOCKS:
                more = True
                break
            d = r.to_dict()
            tiers = table.region_view(r.id, "tier")
            # tier values are -2..63: one bincount, no sort
            counts = np.bincount(tiers.astype(np.int64) + 2)
            d["blocks_by_tier"] = {str(v - 2): int(counts[v]) for v in np.flatnonzero(counts).tolist()}
            d["temp_sum"] = float(table.region_view(r.id, "temp").sum())
            raw = msgspec.Raw(protocol.encode_value(d))
            if out and used + len(raw) > room:
                more = True
                break
            out.append(raw)
            used += len(raw)
            blocks += r.nblocks
            last = rid
        page: dict[str, Any] = {"regions": out}
        if more and last is not None:
            page["next"] = last
        return page

    def op_ages(self, peer: Peer, req: protocol.Ages) -> Any:
        """Bytes by time since last access, per tier and tenant, over the
        regions the caller may see (all for privileged callers). Worked on
        the explain thread a piece of rows at a time (ages.age_bytes_of_rows):
        on the loop it held every client 0.88 s at 1 Mi blocks."""
        table, reg = self.registry.table, self.registry
        now = reg.clock()
        uid = None if peer.privileged else peer.uid

        def read() -> dict:
            if uid is None:
                spans = [(0, len(table))]
            else:
                slices = dict(table.slices)
                spans = sorted((slices[r.id].start, slices[r.id].stop) for r in list(reg.regions.values())
                               if r.owner_uid == uid and r.id in slices)
            cols = (table.tier, table.tenant, table.nbytes, table.last_access)
            return ages.age_bytes_of_rows(cols, spans, now)

        names = {tid: name for name, tid in reg.tenants.items()}
        tier_names = self.engine.tier_names()

        def answer(by_key: dict) -> dict:
            rows = [{"tier": t, "tenant": names.get(tn, str(tn)), "bytes": b} for (t, tn), b in sorted(by_key.items())]
            return {"buckets": list(ages.AGE_LABELS), "edges_s": list(ages.AGE_EDGES), "rows": rows,
                    "tier_names": tier_names}

        out = asyncio.get_running_loop().create_future()
        self.engine.read_soon(read).add_done_callback(lambda f: relay(f, out, answer))
        return AfterWrite(out, None)

    def op_blocks(self, peer: Peer, req: protocol.Blocks) -> dict:
        reg = self._own(peer, req.region)
        sl, out = self._page(reg, req.first, req.count, protocol.BLOCK_ANSWER_BYTES)
        t = self.registry.table
        out.update({
            "tiers": t.tier[sl].astype(protocol.TIERS_DTYPE).tobytes(),
            "temps": t.temp[sl].astype(protocol.TEMPS_DTYPE).tobytes(),
            "flags": t.flags[sl].astype(protocol.FLAGS_DTYPE).tobytes(),
            # why an unmovable block is (blocks.STUCK_NAMES index; 0 = none)
            "stuck": t.stuck[sl].astype(protocol.FLAGS_DTYPE).tobytes(),
            "stuck_names": list(STUCK_NAMES),
            "last_access_age": (self.registry.clock() - t.last_access[sl]).astype(protocol.TIMES_DTYPE).tobytes(),
            "tier_names": self.engine.tier_names(),
        })
        return out

    def op_migrate(self, peer: Peer, req: protocol.Migrate) -> Any:
        """Up to OP_STEP_BLOCKS blocks at once, more a part per loop
        iteration (OpSteps): each part's mapping is checked and its mapped
        blocks queued, and the mover takes them in jobs of
        engine.MANUAL_JOB_BLOCKS from the first part on. Answered after the
        last part (``wait``: once the last block is done)."""
        reg = self._own(peer, req.region)
        if reg.pinned:
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT,
                                  f"region {reg.id} is pinned by its engine: its pages cannot move")
        chunks = self._chunks(reg, protocol.unpack(req.blocks, protocol.BLOCKS_DTYPE, "blocks"))
        s = self.registry.table.slices[reg.id]
        ticket = self.engine.open_move(slice(s.start, s.stop), req.tier, wait=req.wait)
        move = _MigrateSteps(self, reg, ticket, whole=req.blocks is None)
        if len(chunks) == 1:
            try:
                move.part(chunks[0])
            finally:
                self.engine.close_move(ticket)
            return move.answer(req.wait)
        steps = self.steps.add(peer, peer.uid, chunks, move.part)
        out = asyncio.get_running_loop().create_future()

        def finished(f: asyncio.Future) -> None:
            self.engine.close_move(ticket)  # after a failure or hang-up the parts queued still move
            # move.answer raises when the region's memory is all gone: the client is told why
            relay(f, out, lambda _: move.answer(req.wait))

        steps.add_done_callback(finished)
        return AfterWrite(out, None)

    def op_measure(self, peer: Peer, req: protocol.Measure) -> Any:
        reg = self._own(peer, req.region)
        return self._in_steps(peer, reg, req.blocks,
                              lambda b: {"queued": self.engine.request_measure(self.registry.rows(reg.id, b))})

    def op_pin(self, peer: Peer, req: protocol.Pin) -> Any:
        reg = self._own(peer, req.region)
        self.engine.check_tier(req.tier)
        return self._in_steps(peer, reg, req.blocks, lambda b: {"blocks": self.registry.pin(reg.id, b, req.tier)})

    def op_unpin(self, peer: Peer, req: protocol.Unpin) -> Any:
        reg = self._own(peer, req.region)
        return self._in_steps(peer, reg, req.blocks, lambda b: {"blocks": self.registry.unpin(reg.id, b)})

    def op_explain(self, peer: Peer, req: protocol.Explain) -> Any:
        """Answered once the explain thread has run the policy over a copy
        of the table (O(table): 0.4 s at 1 Mi blocks, not on the loop)."""
        reg = self._own(peer, req.region)
        if req.block >= reg.nblocks:
            raise protocol.ProtocolError(protocol.E_INVALID_ARGUMENT,
                                  f"block {req.block} out of range: region {reg.id} has {reg.nblocks}")
        out = asyncio.get_running_loop().create_future()
        text = self.engine.explain_soon(reg.id, req.block)
        text.add_done_callback(lambda f: relay(f, out, lambda t: {"region": reg.id, "block": req.block, "text": t}))
        return AfterWrite(out, None)


class _MigrateSteps:
    """One `migrate` request's parts: what was queued, what is not mapped."""

    def __init__(self, api: ControlAPI, reg: Region, ticket: Any, whole: bool):
        self.api, self.reg, self.ticket = api, reg, ticket
        self.whole = whole  # the request names all of the region: its parts check all of its mapping
        self.queued = 0
        self.unmapped = 0
        self.checked = reg.mode == "kernel"  # every part's mapping was read
        self.ranges: list[list[int]] = []

    def part(self, blocks: np.ndarray | slice | None) -> dict:
        """Queue these blocks of the region (None: all), the mapped ones."""
        api, reg = self.api, self.reg
        rows = api.registry.rows(reg.id, blocks)  # not_found if the region went away meanwhile
        if reg.mode == "kernel":
            # Memory the owner freed is not queued: the answer says which
            # blocks, and a region with nothing mapped left is dropped.
            try:
                mask = api.engine.mapped_part(reg.id, rows)
            except (KvtierError, OSError):  # process gone: the pid watcher drops it; the move says why
                mask = None
                self.checked = False
            if mask is not None and not mask.all():
                start = api.registry.table.slices[reg.id].start
                gone = row_select(rows, ~mask) - start
                self.unmapped += int(gone.size)
                self._add_ranges(_ranges(gone))
                rows = row_select(rows, mask)
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        api.engine.add_move(self.ticket, rows)
        self.queued += int(rows.size)
        return {}

    def _add_ranges(self, runs: list[list[int]], limit: int = 64) -> None:
        if runs and self.ranges and self.ranges[-1][1] + 1 == runs[0][0]:
            self.ranges[-1][1] = runs[0][1]  # a run across two parts
            runs = runs[1:]
        self.ranges = (self.ranges + runs)[:limit]

    def answer(self, wait: bool) -> Any:
        """The answer once every part is queued (and the ticket closed)."""
        api, reg = self.api, self.reg
        if self.checked:
            api.registry.get(reg.id)  # not_found if it went away since the last part
            if self.whole:
                dropped = not api.engine.mapping_seen(reg.id, self.unmapped)
            else:
                # Blocks named and none of them mapped: is any of the region
                # left? (One pass over it, only then.)
                dropped = bool(self.unmapped and not self.queued
                               and api.engine.check_mapping([reg.id]).get(reg.id, True) is None)
            if dropped:
                api.registry.get(reg.id)  # none of it mapped: raises not_found with the reason
        extra = {"unmapped": self.unmapped, "unmapped_blocks": self.ranges}
        if wait:
            fut = asyncio.get_running_loop().create_future()
            self.ticket.future.add_done_callback(lambda f: fut.set_result({**f.result(), **extra}))
            return AfterWrite(fut, None)
        if api.engine.migrator.dry_run:
            extra["dry_run"] = True  # queued to be planned and counted: none of them will move
        return {"queued": self.queued, **extra}


def _ranges(blocks: np.ndarray, limit: int = 64) -> list[list[int]]:
    """[[first, last], ...] runs of sorted block indices, the first ``limit``."""
    if blocks.size == 0:
        return []
    b = np.sort(blocks)
    brk = np.flatnonzero(np.diff(b) != 1) + 1
    firsts = np.concatenate(([0], brk))[:limit]
    lasts = np.concatenate((brk, [b.size]))[:limit] - 1
    return [[int(b[f]), int(b[l])] for f, l in zip(firsts, lasts)]


class TokenBucket:
    """requests_per_second sustained, ``burst`` at once."""

    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.last = time.monotonic()

    def take(self) -> float:
        """0 if a token was taken, else seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Connection(asyncio.Protocol):
    """One client. Frames are answered in turns: at most FRAMES_PER_TURN
    frames, TURN_SECONDS of work or TURN_ANSWER_BYTES of answers, and never
    while more than its high water of answers waits unread (its share of
    UNREAD_BYTES_PER_UID, at most WRITE_HIGH_WATER). A turn
    that leaves frames unanswered stops reading the socket and joins the
    server's run queue behind every other backlogged connection, so one
    client pipelining thousands of requests gets its share of the loop, not
    all of it, and the bytes the daemon holds for it stay bounded: one read
    (256 KiB) of pending frames, the unread answers, and one answer. A
    connection without a backlog is answered at once, in data_received."""

    def __init__(self, server: "Server"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.reader = protocol.FrameReader(server.max_message_bytes)
        self.bucket = TokenBucket(server.requests_per_second, server.request_burst)
        self.closing = False
        self.write_paused = False  # the client is not reading its answers
        self.read_paused = False
        self.turn_queued = False
        self.waiting: asyncio.Future | None = None  # a deferred answer (AfterWrite) not sent yet
        self.held = 0  # bytes of input accounted to the uid (Server.hold)
        self.frame_started = 0.0  # monotonic time the incomplete frame began; 0 = none
        self.last_request = time.monotonic()
        self.high_water = WRITE_HIGH_WATER  # unread answer bytes above which its turns stop (Server.admit)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self.peer = Peer.of_socket(sock, self.server.admin_gid, self.server.proc_root)
        refuse = self.server.admit(self)
        if refuse:
            self._fail(protocol.ProtocolError(protocol.E_LIMIT, refuse, fatal=True))
            return
        self.server.api.connected(self.peer, self._push, self._hung_up)

    def _push(self, name: str, body: dict) -> None:
        """An unasked frame (an engine-mode move request) to this client."""
        if not self.closing:
            self._write([protocol.event(name, body)])

    def _hung_up(self) -> bool:
        """The client closed the connection (POLLHUP: both directions are
        shut; a client that only shut down its writing still waits for its
        answers), told by the socket even while we read nothing."""
        if self.closing or self.transport is None:
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return True
        p = select.poll()
        p.register(sock.fileno(), select.POLLHUP)
        return any(ev & select.POLLHUP for _, ev in p.poll(0))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.release(self)
        if self.peer is not None:
            self.server.api.disconnected(self.peer)
            self.peer.close()

    # Backpressure: when the client stops reading answers, stop answering
    # (and so reading) its requests.
    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._carry_on()

    def set_high_water(self, high: int) -> None:
        """Unread answers above ``high`` pause this connection's turns
        (asyncio calls pause_writing at once if the buffer is above it
        already, resume_writing once it drains below a quarter of it)."""
        self.high_water = high
        if self.transport is not None and not self.closing:
            self.transport.set_write_buffer_limits(high=high)

    def _update_reading(self) -> None:
        if self.transport is None or self.closing:
            return
        want_pause = self.write_paused or self.waiting is not None or self.reader.has_frame()
        if want_pause != self.read_paused:
            self.read_paused = want_pause
            if want_pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _queue_turn(self) -> None:
        if not self.turn_queued and not self.closing:
            self.turn_queued = True
            self.server.run_later(self)

    def _fail(self, err: protocol.ProtocolError) -> None:
        st = self.server.stats
        st.errors[("frame", err.code)] += 1
        self.server.malformed_log.note(self.peer, err)
        if self.transport is not None:
            self.transport.write(protocol.error(err.req_id, err))
            self.closing = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.server.stats.bytes_in += len(data)
        self.reader.push(data)
        if not self.frame_started:
            self.frame_started = time.monotonic()
        if not self.server.hold(self, self.reader.pending):
            lim = self.server.limits
            self._fail(protocol.ProtocolError(
                protocol.E_LIMIT, f"uid {self.peer.uid} holds more than {lim.max_pending_bytes_per_uid} bytes "
                "of unanswered requests (limits.max_pending_bytes_per_uid)", fatal=True))
            return
        if not self.turn_queued:
            self._turn(queued=False)

    def _turn(self, queued: bool = True) -> None:
        if queued:
            self.turn_queued = False
        if self.closing or self.transport is None:
            return
        tr = self.transport
        out: list[bytes] = []
        held = 0
        now = time.monotonic()
        deadline = now + TURN_SECONDS
        poll_at = now + TURN_POLL_SECONDS
        others_ready = self.server.others_ready
        for n in range(FRAMES_PER_TURN):
            if self.waiting is not None:
                break
            if self.write_paused or tr.get_write_buffer_size() + held >= self.high_water:
                break  # resume_writing queues the next turn
            if n:
                now = time.monotonic()
                yield_now = now >= deadline
                if not yield_now and now >= poll_at:
                    poll_at = now + TURN_POLL_SECONDS
                    yield_now = others_ready()
            else:
                yield_now = False
            if held >= TURN_ANSWER_BYTES or yield_now:
                # Queued only with a frame waiting: a connection in the run
                # queue is not answered in data_received, so a spurious turn
                # (one slow request, nothing after it) made its next request
                # wait a turn of every backlogged connection (17-141 ms
                # behind robustness.py's flood).
                if self.reader.has_frame():
                    self._queue_turn()
                break
            try:
                payload = self.reader.next()
            except protocol.ProtocolError as e:
                self._write(out)
                self._fail(e)
                return
            if payload is None:
                break
            self.last_request = time.monotonic()
            if self.reader.pending:
                self.frame_started = self.last_request  # the next frame's bytes have begun
            answer = self._answer(payload)
            if self.waiting is not None:
                break  # _resume answers it and queues the next turn
            if type(answer) is FdFrame:
                self._write(out)  # the answers before it go first
                out, held = [], 0
                answer = self._send_fd(answer)
                if not answer:
                    continue
            out.append(answer)
            held += len(answer)
            if held >= OUT_CHUNK:
                self._write(out)
                out, held = [], 0
        else:
            if self.reader.has_frame():
                self._queue_turn()
        self._write(out)
        self._track_input()
        self._update_reading()

    def _send_fd(self, frame: FdFrame) -> bytes:
        """Send ``frame`` with its fd attached (SCM_RIGHTS) straight on the
        socket: b"" once sent, else an error answer to send instead. The fd
        rides on the frame's first bytes, so nothing may be queued before
        them in the transport, nor unread in the socket (SIOCOUTQ: bytes
        sent that the client has not read yet): a client that has not read
        its answers is told to read them and ask again. Checking only the
        transport's buffer, the fd rode behind answers the client had not
        read, which a plain read(2) of them past their frame discards."""
        tr = self.transport
        sent = -1
        why = "answers to earlier requests are unread: read them, then ask again"
        sock = tr.get_extra_info("socket") if tr is not None else None
        if sock is not None and not tr.get_write_buffer_size() and not _unread_bytes(sock.fileno()):
            # asyncio's socket wrapper has no sendmsg; a dup of the fd is the
            # same socket (and already non-blocking).
            dup = socket.socket(fileno=os.dup(sock.fileno()))
            try:
                sent = dup.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", frame.fd))])
            except OSError as e:
                why = f"sendmsg: {os.strerror(e.errno) if e.errno else e}"
            finally:
                dup.close()
        frame.done(sent > 0)
        if sent > 0:
            self.server.stats.bytes_out += len(frame)
            if sent < len(frame):
                tr.write(bytes(frame[sent:]))
            return b""
        err = protocol.ProtocolError(protocol.E_UNAVAILABLE, f"could not pass the hint ring's fd: {why}")
        self.server.stats.errors[("hint_ring", err.code)] += 1
        return protocol.error(frame.rid, err)

    def _resume(self, rid: int, fut: asyncio.Future, result: Any, op: str) -> None:
        """A deferred answer is ready: send it (``result``, or the future's
        own when None; its error if it failed), then carry on with the
        frames that arrived meanwhile."""
        self.waiting = None
        if self.closing or self.transport is None:
            return
        exc = None if not fut.cancelled() else asyncio.CancelledError()
        exc = exc or fut.exception()
        if exc is not None:
            err = _error_of(exc)
            if err.code == protocol.E_INTERNAL:
                log.error("internal error serving %s from pid %s: %r", op, self.peer.pid, exc)
            self.server.stats.errors[(op, err.code)] += 1
            self._write([protocol.error(rid, err)])
        else:
            self._write([protocol.ok(rid, fut.result() if result is None else result)])
        self._carry_on()

    def _carry_on(self) -> None:
        """Answer what arrived meanwhile in a turn of the run queue, or, with
        no frame waiting, read again: the next request is then answered in
        data_received, not behind a turn of every backlogged connection."""
        if self.reader.has_frame():
            self._queue_turn()
        else:
            self._update_reading()

    def _track_input(self) -> None:
        """After frames were taken out: what is left is accounted, and the
        frame deadline restarts with the next frame's first byte."""
        if self.closing:
            return
        pending = self.reader.pending
        self.server.hold(self, pending)
        if not pending:
            self.frame_started = 0.0

    def _write(self, out: list[bytes]) -> None:
        if out and self.transport is not None:
            blob = out[0] if len(out) == 1 else b"".join(out)
            self.server.stats.bytes_out += len(blob)
            self.transport.write(blob)

    def _answer(self, payload: bytes) -> bytes:
        """One frame's answer; every failure becomes an error answer, never a crash."""
        st = self.server.stats
        op = "?"
        rid = 0
        try:
            wait = self.bucket.take()
            if wait:
                raise protocol.ProtocolError(
                    protocol.E_RATE, f"more than {self.bucket.rate:g} requests/s (limits.requests_per_second)",
                    retry_after_ms=max(1, int(wait * 1000)), req_id=protocol._salvage_id(payload),
                )
            req = protocol.decode_request(payload)
            rid = req.id
            op = req.__struct_config__.tag
            st.requests[op] += 1
            result = self.server.api.handle(self.peer, req)
            if isinstance(result, AfterWrite):
                if result.future is not None:
                    self.waiting = result.future
                    result.future.add_done_callback(
                        lambda f, r=rid, res=result.result, o=op: self._resume(r, f, res, o))
                    return b""
                result = result.result
            if isinstance(result, WithFd):
                frame = FdFrame(protocol.ok(rid, result.result))
                frame.rid, frame.fd, frame.done = rid, result.fd, result.done
                return frame
            return protocol.ok(rid, result)
        except Exception as exc:
            err = _error_of(exc)
            if err.code == protocol.E_INTERNAL:
                log.exception("internal error serving %s from pid %s", op, self.peer.pid)
            elif op == "?":
                self.server.malformed_log.note(self.peer, err)
            st.errors[(op, err.code)] += 1
            return protocol.error(rid or err.req_id, err)


class PidfdWatcher:
    """Registry's PidWatcher: a pidfd per watched process in the event loop.

    A pidfd becomes readable when its process exits, so exit is noticed
    immediately and without polling; the pidfd also pins the identity (it
    can never refer to a later process that reuses the pid).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.fds: dict[int, int] = {}

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None:
        if not native.HAS_PIDFD_OPEN:
            return  # Registry.check_alive() polls each tick instead
        fd = native.pidfd_open(pid)
        self.fds[pid] = fd
        self.loop.add_reader(fd, self._fired, pid, on_exit)

    def _fired(self, pid: int, on_exit: Callable[[int], None]) -> None:
        self.unwatch(pid)
        on_exit(pid)

    def unwatch(self, pid: int) -> None:
        fd = self.fds.pop(pid, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        for pid in list(self.fds):
            self.unwatch(pid)


def listen_fds() -> list[int]:
    """Sockets passed by systemd socket activation (sd_listen_fds(3))."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(k, None)
    return list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n))


def bind_unix(path: str, mode: int, group: str) -> socket.socket:
    """Create the listening socket: replace a stale socket file (never any
    other kind of file), then chmod/chgrp before listen() so no client can
    connect with the wrong permissions.

    The socket is bound under a temporary name beside ``path`` and renamed
    onto it once it listens, so the path never names a socket that refuses
    connections: a client (or a unit's ExecStartPost) that waits for the
    file and then connects is never refused (seen in the guest: a test that
    saw the file between bind() and listen() got ECONNREFUSED)."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, mode=0o755, exist_ok=True)

    def clear(p: str) -> None:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise os_error(errno.EEXIST, f"bind {p}", "exists and is not a socket")
        os.unlink(p)

    clear(path)
    # sun_path holds 107 bytes and a NUL: a path too long for the suffix is bound in place
    tmp = f"{path}.new" if len(os.fsencode(path)) + 4 <= 107 else path
    if tmp != path:
        clear(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(tmp)
        gid = group_gid(group)
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.chmod(tmp, mode)
        sock.listen(512)
        if tmp != path:
            os.rename(tmp, path)
    except OSError as e:
        sock.close()
        if tmp != path:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise os_error(e.errno, f"listen on {path}") from None
    return sock


@dataclass
class ServerLimits:
    """The [limits] keys the transport enforces (config.py documents them)."""

    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE
    requests_per_second: float = 50000.0
    request_burst: int = 5000
    max_connections: int = 1024
    max_connections_per_uid: int = 128
    reserved_connections: int = 16
    max_pending_bytes_per_uid: int = 32 * 1024 * 1024
    frame_timeout: float = 10.0
    idle_timeout: float = 600.0

    @classmethod
    def of(cls, limits: Any) -> "ServerLimits":
        return cls(**{k: getattr(limits, k) for k in cls.__dataclass_fields__ if hasattr(limits, k)})


class RateLimitedLog:
    """One warning line per error code per ``interval`` about requests that
    never became one (bad frames, undecodable payloads, closed connections),
    with a count of the lines held back: a hostile client sending thousands
    of them must not fill the journal or spend the loop on logging."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def note(self, peer: Peer | None, err: protocol.ProtocolError) -> None:
        now = time.monotonic()
        code = err.code
        if now - self.last.get(code, -1e9) < self.interval:
            self.suppressed[code] = self.suppressed.get(code, 0) + 1
            return
        self.last[code] = now
        held = self.suppressed.pop(code, 0)
        who = f"pid {peer.pid} uid {peer.uid}" if peer is not None else "a client"
        log.warning("%s from %s: %s%s", code, who, err,
                    f" ({held} more like it in the last {self.interval:g} s not logged)" if held else "")


# How often connections are checked for stalled frames and idleness: the
# timeouts are enforced within this much of their configured value.
SWEEP_INTERVAL = 0.5


def _loop_poll(loop: asyncio.AbstractEventLoop) -> Any:
    """A poll object watching the event loop's epoll fd: an epoll fd polls
    readable while any fd in its set is ready, so one poll(0) on it asks
    "is anything else waiting for the loop" for all connections at once.
    asyncio's selector loop keeps its selector as ``_selector``; another
    loop gives None."""
    selector = getattr(loop, "_selector", None)
    if selector is None or not hasattr(selector, "fileno"):
        return None
    try:
        fd = selector.fileno()
    except (OSError, ValueError):
        return None
    p = select.poll()
    p.register(fd, select.POLLIN)
    return p


class Server:
    def __init__(
        self,
        api: ControlAPI,
        stats: DaemonStats,
        *,
        path: str,
        mode: int = 0o660,
        group: str = "",
        admin_group: str = "",
        limits: Any = None,
        inherited_fds: list[int] | None = None,
        proc_root: str = "/proc",
    ):
        self.api = api
        self.stats = stats
        self.path = path
        self.mode = mode
        self.group = group
        self.admin_gid = group_gid(admin_group)
        self.limits = ServerLimits() if limits is None else ServerLimits.of(limits)
        self.inherited_fds = inherited_fds or []
        self.proc_root = proc_root
        self.activated = bool(self.inherited_fds)
        self.conns: set[Connection] = set()
        self.per_uid: dict[int, set[Connection]] = {}  # uid -> its open connections
        self.pending_per_uid: dict[int, int] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._own_socket = False
        self._sweeper: asyncio.TimerHandle | None = None
        self.malformed_log = RateLimitedLog()
        self.run_queue: collections.deque[Connection] = collections.deque()
        self._runner: asyncio.TimerHandle | None = None
        self._loop_poll: Any = None  # a poll object on the loop's own epoll fd (others_ready)

    # Read by each new Connection.
    @property
    def max_message_bytes(self) -> int:
        return self.limits.max_message_bytes

    @property
    def requests_per_second(self) -> float:
        return self.limits.requests_per_second

    @property
    def request_burst(self) -> int:
        return self.limits.request_burst

    def apply_limits(self, limits: Any, admin_group: str) -> None:
        """SIGHUP: new limits; frame size and rate apply to new connections
        (existing keep theirs), the rest at once."""
        self.limits = ServerLimits.of(limits)
        self.admin_gid = group_gid(admin_group)
        self.api.max_message_bytes = limits.max_message_bytes
        self.api.ring_entries = limits.hint_ring_entries  # new rings; existing ones keep their size

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_poll = _loop_poll(loop)
        if self.inherited_fds:
            socks = [socket.socket(fileno=fd) for fd in self.inherited_fds]
        else:
            socks = [bind_unix(self.path, self.mode, self.group)]
            self._own_socket = True
        for s in socks:
            s.setblocking(False)
            self._servers.append(await loop.create_unix_server(lambda: Connection(self), sock=s))
        log.info("listening on %s%s", self.path if self._own_socket else f"fds {self.inherited_fds}",
                 " (socket activation)" if self.activated else "")

    def admit(self, conn: Connection) -> str:
        uid = conn.peer.uid
        st = self.stats
        lim = self.limits
        # The last reserved_connections slots are for root and admin_group:
        # users filling the daemon must not lock the operator out.
        cap = lim.max_connections if conn.peer.privileged else lim.max_connections - lim.reserved_connections
        if len(self.conns) >= cap:
            st.connections_refused += 1
            reserved = "" if conn.peer.privileged else \
                f"; {lim.reserved_connections} more are reserved for root and admin_group (limits.reserved_connections)"
            return f"daemon has {len(self.conns)} connections (limits.max_connections){reserved}"
        if len(self.per_uid.get(uid, ())) >= lim.max_connections_per_uid:
            st.connections_refused += 1
            return f"uid {uid} has {len(self.per_uid[uid])} connections (limits.max_connections_per_uid)"
        self.conns.add(conn)
        self.per_uid.setdefault(uid, set()).add(conn)
        self._share_unread(uid)
        st.connections_open = len(self.conns)
        st.connections_total += 1
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_INTERVAL, self._sweep)
        return ""

    def _share_unread(self, uid: int) -> None:
        """Split UNREAD_BYTES_PER_UID between ``uid``'s open connections
        (O(its connections), at most max_connections_per_uid, at each of
        its connects and closes)."""
        mine = self.per_uid[uid]
        high = min(WRITE_HIGH_WATER, max(MIN_WRITE_HIGH_WATER, UNREAD_BYTES_PER_UID // len(mine)))
        for c in mine:
            c.set_high_water(high)

    def others_ready(self) -> bool:
        """Whether the loop's poll set has anything ready now (a read, a
        write, an accept, the self-pipe of a worker's result), without
        waiting and without taking it: the loop's next poll still sees it.
        False when the loop is not an epoll selector loop (turns then end
        only on their budgets)."""
        return self._loop_poll is not None and bool(self._loop_poll.poll(0))

    def run_later(self, conn: Connection) -> None:
        """Queue ``conn``'s next turn behind the other backlogged connections."""
        self.run_queue.append(conn)
        if self._runner is None:
            self._schedule_runner()

    def _schedule_runner(self) -> None:
        """The next backlogged turn runs after the next poll's reads.

        A timer due now, not call_soon: asyncio runs the callbacks already
        ready (call_soon) before it polls, and timers that are due after the
        reads the poll found. So a request from a connection with no backlog
        is read and answered before the next backlogged turn instead of
        after it: it waits only for the callback running when it arrives."""
        loop = asyncio.get_running_loop()
        self._runner = loop.call_at(loop.time(), self._run_one)

    def _run_one(self) -> None:
        """One backlogged connection's turn per loop iteration.

        Between two turns the loop polls the sockets, and a request from a
        connection with no backlog is answered in its data_received: it waits
        behind the one turn that was running when it arrived, not behind a
        turn of every backlogged connection (ten flooding connections made
        that 20-40 ms when each connection queued its own turn with
        call_soon, all of which ran before the next poll)."""
        self._runner = None
        q = self.run_queue
        while q:
            conn = q.popleft()
            if conn.turn_queued and not conn.closing:
                conn._turn()
                break
            conn.turn_queued = False
        if q and self._runner is None:
            self._schedule_runner()

    def release(self, conn: Connection) -> None:
        if conn in self.conns:
            self.conns.discard(conn)
            uid = conn.peer.uid
            mine = self.per_uid[uid]
            mine.discard(conn)
            if mine:
                self._share_unread(uid)
            else:
                del self.per_uid[uid]
            self.hold(conn, 0)
        self.stats.connections_open = len(self.conns)

    def hold(self, conn: Connection, nbytes: int) -> bool:
        """Account ``conn`` as holding ``nbytes`` of unanswered input; False
        if that takes its uid past max_pending_bytes_per_uid."""
        uid = conn.peer.uid
        total = self.pending_per_uid.get(uid, 0) - conn.held + nbytes
        conn.held = nbytes
        if total:
            self.pending_per_uid[uid] = total
        else:
            self.pending_per_uid.pop(uid, None)
        return total <= self.limits.max_pending_bytes_per_uid

    def _sweep(self) -> None:
        """Close connections with a frame stalled past frame_timeout or no
        request for idle_timeout. O(connections) twice a second."""
        self._sweeper = None
        now = time.monotonic()
        lim = self.limits
        for c in list(self.conns):
            if c.closing:
                continue
            # Only a frame the client is still sending counts: not complete
            # frames waiting for their turn, nor input we stopped reading.
            stalled = c.frame_started and not c.read_paused and not c.reader.has_frame()
            if stalled and now - c.frame_started > lim.frame_timeout:
                self.stats.connections_timed_out += 1
                c._fail(protocol.ProtocolError(
                    protocol.E_BAD_FRAME, f"incomplete frame: {c.reader.pending} bytes in "
                    f"{now - c.frame_started:.1f} s (limits.frame_timeout={lim.frame_timeout:g})", fatal=True))
            elif lim.idle_timeout and not c.reader.pending and now - c.last_request > lim.idle_timeout:
                self.stats.connections_timed_out += 1
                c._fail(protocol.ProtocolError(
                    protocol.E_LIMIT, f"no request for {now - c.last_request:.0f} s "
                    f"(limits.idle_timeout={lim.idle_timeout:g})", fatal=True))
        if self.conns:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_INTERVAL, self._sweep)

    async def close(self) -> None:
        self.api.stager.close()
        self.api.close_rings()
        self.api.steps.close()
        if self._runner is not None:
            self._runner.cancel()
            self._runner = None
        self.run_queue.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for s in self._servers:
            s.close()
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
        for s in self._servers:
            await s.wait_closed()
        if self._own_socket:
            try:
                os.unlink(self.path)
            except OSError:
                pass
