"""kvtierd attacked the way a hostile local user would: real daemon, real
processes, real kernel (pid reuse forced through ns_last_pid, floods and
stalls over a real unix socket). Each test is the regression test of one
defect of issue 12; on the code before the fix it fails.
"""

from __future__ import annotations

import json
import fcntl
import os
import signal
import socket
import struct
import termios
import subprocess
import sys
import time

import msgspec
import pytest

from kvtier import protocol

from test_daemon import DEADLINE, DROP, NOBODY, DaemonProc, PY, daemon, wait_for, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


def raw_call(sock: socket.socket, reader: protocol.FrameReader, req: dict | None) -> protocol.Response:
    """Send ``req`` (None: it was sent already) and read one answer."""
    if req is not None:
        sock.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    pending: list[bytes] = []
    while not pending:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionResetError("daemon closed the connection")
        pending += reader.feed(data)
    return protocol.decode_response(pending[0])


# The attacker: connects as nobody, forks, and the connecting process exits
# so that its pid can be handed to a root process. The child keeps the
# connection and, on "go", tries every op on the victim's region through it.
ATTACKER = DROP + r"""
import json, socket, msgspec
from kvtier import protocol
sock_path = sys.argv[1]
drop(65534, 65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
stale = os.getpid()
if os.fork():
    os._exit(0)  # the process the daemon saw connect is gone
print(json.dumps({"stale_pid": stale}), flush=True)
cmd = json.loads(sys.stdin.readline())
reader = protocol.FrameReader(1 << 30)
def call(**req):
    s.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    out = []
    while not out:
        out += reader.feed(s.recv(1 << 20))
    r = protocol.decode_response(out[0])
    return "ok" if r.ok else r.error.code
rid = cmd["region"]
blk = protocol.pack_blocks([0])
res = {}
for op, kw in [("query", {}), ("blocks", {}), ("explain", {"block": 0}), ("hint", {"blocks": blk}),
               ("phase", {"phase": "free"}), ("migrate", {"tier": 0}), ("pin", {}), ("unpin", {}),
               ("unregister", {})]:
    res[op] = call(op=op, id=1, region=rid, **kw)
res["register"] = call(op="register", id=2, start=cmd["addr"] + (1 << 20), length=1 << 20,
                       block_size=1 << 20)
print(json.dumps(res), flush=True)
"""

# Forks until a child gets ``target`` as its pid (ns_last_pid = target - 1
# before each fork; other processes on the host may take it first). That
# child, root, registers 4 MiB of its memory and waits for stdin to close.
VICTIM = r"""
import json, mmap, os, sys
from kvtier.client import Client
sock_path, target = sys.argv[1], int(sys.argv[2])
for attempt in range(500):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(target - 1))
    pid = os.fork()
    if pid == 0:
        if os.getpid() != target:
            os._exit(3)
        buf = mmap.mmap(-1, 4 << 20); buf.write(b"\1" * len(buf))
        c = Client(sock_path)
        r = c.register(buf, block_size=1 << 20, name="root-kv")
        print(json.dumps({"pid": os.getpid(), "region": r.id, "addr": r.start, "attempts": attempt + 1}), flush=True)
        sys.stdin.read()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 3:
        sys.exit(0)
print(json.dumps({"error": "pid %d never came back" % target}), flush=True)
"""


def test_stale_peer_pid_cannot_take_over_a_reused_pid(daemon):
    """Defect 1: a connection whose process exited keeps no rights over the
    process that later gets its pid (here root's, forced with ns_last_pid)."""
    attacker = subprocess.Popen([PY, "-c", ATTACKER, daemon.sock], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    victim = None
    try:
        stale = json.loads(attacker.stdout.readline())["stale_pid"]
        attacker.wait(timeout=20)  # reaped: the pid is free for reuse
        victim = subprocess.Popen([PY, "-c", VICTIM, daemon.sock, str(stale)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        v = json.loads(victim.stdout.readline())
        assert "error" not in v, v
        assert v["pid"] == stale
        # The attacker's child still holds the old connection and the pipes.
        attacker.stdin.write(json.dumps(v) + "\n")
        attacker.stdin.flush()
        res = json.loads(attacker.stdout.readline())
        assert {op: r for op, r in res.items() if op != "register"} == {
            op: "permission_denied" for op in ("query", "blocks", "explain", "hint", "phase", "migrate",
                                               "pin", "unpin", "unregister")}, res
        # Registering "my own" memory through the stale pid would name root's.
        assert res["register"] == "process_gone", res
        regions = daemon.regions()
        assert [(r["pid"], r["name"], r["owner_uid"]) for r in regions] == [(stale, "root-kv", 0)], regions
    finally:
        for p in (attacker, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


FLOOD_LIMITS = """
    [limits]
    max_message_bytes = 65536
    requests_per_second = 1e9
    request_burst = 1000000000
    """


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(DEADLINE)
    s.connect(path)
    return s


def _backlogs(path: str, nconn: int, blob: bytes) -> list[socket.socket]:
    """``nconn`` connections that each pipelined ``blob`` and read nothing,
    returned once the daemon has begun reading every one of them."""
    bads = []
    for _ in range(nconn):
        b = _connect(path)
        b.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
        bads.append(b)
    for b in bads:
        b.sendall(blob)
    deadline = time.monotonic() + DEADLINE
    while any(_outq(b) == len(blob) for b in bads):
        assert time.monotonic() < deadline, "the daemon never read the floods"
        time.sleep(0.001)
    return bads


def _outq(s: socket.socket) -> int:
    """Bytes this socket sent that the peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]



def test_pipelined_flood_gets_turns_not_the_whole_loop(workdir):
    """Defect 2: 40,000 pipelined requests on one connection are answered in
    turns; a request from another connection, sent once the flood is in the
    daemon's socket, is answered after a few turns, not after the flood."""
    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    try:
        flood = 40_000
        good = _connect(d.sock)
        reader = protocol.FrameReader(1 << 30)
        raw_call(good, reader, {"op": "hello", "id": 1})
        bad = _connect(d.sock)
        # The whole flood fits in the socket buffer, so sendall returns at
        # once however fast the daemon reads.
        bad.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
        # unregister of a region nobody has: a small answer (never near the
        # unread-answer high water), a full trip through decode and handler.
        frame = protocol.frame(msgspec.msgpack.encode({"op": "unregister", "id": 7, "region": (1 << 31) - 1}))
        # The stats request is sent once the daemon has taken the first
        # bytes of the flood out of its socket (SIOCOUTQ: bytes sent and not
        # yet read), i.e. while it works through them (asyncio reads 256 KiB,
        # ~7,500 frames, at a time). The daemon is stopped while the flood
        # is written: else it reads the first ~32 KiB the kernel queues (one
        # skb), and a daemon that answered every frame of a read in one go
        # (no turns at all) passed, its stats request waiting behind only
        # those ~900.
        total = len(frame) * flood
        d.proc.send_signal(signal.SIGSTOP)
        try:
            bad.sendall(frame * flood)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + DEADLINE
        while _outq(bad) == total:  # spin: a poll interval would let the daemon run ahead
            assert time.monotonic() < deadline, "the daemon never read the flood"
        st = raw_call(good, reader, {"op": "stats", "id": 2}).result
        answered_before = st["errors"].get("unregister:not_found", 0)
        one_read = (256 << 10) // len(frame)
        # Every frame of the flood is still answered, in order, nothing lost.
        got = 0
        breader = protocol.FrameReader(1 << 30)
        while got < flood:
            for payload in breader.feed(bad.recv(1 << 20)):
                r = protocol.decode_response(payload)
                assert r.id == 7 and r.error.code == "not_found"
                got += 1
        assert answered_before < one_read // 2, (
            f"{answered_before} of {flood} flood frames were answered before another connection's request")
        bad.close()
        good.close()
    finally:
        assert d.stop() == 0


def _frames_between(sock: str, nconn: int, flood: int, samples: int) -> list[int]:
    """``nconn`` connections each pipeline ``flood`` cheap frames (an
    unregister of no region: not_found) and read nothing; another connection
    asks ``stats`` back to back ``samples`` times. What the daemon answers
    between two of its answers is what its request waited behind: those
    counts, in flood frames, taken while the floods still ran."""
    frame = protocol.frame(msgspec.msgpack.encode({"op": "unregister", "id": 7, "region": (1 << 31) - 1}))
    good = _connect(sock)
    reader = protocol.FrameReader(1 << 30)
    raw_call(good, reader, {"op": "hello", "id": 1})
    bads = _backlogs(sock, nconn, frame * flood)

    def answered() -> int:
        return raw_call(good, reader, {"op": "stats", "id": 2}).result["errors"].get("unregister:not_found", 0)

    prev = answered()
    between = []
    for _ in range(samples):
        n = answered()
        between.append(n - prev)
        prev = n
    assert prev < nconn * flood, "the floods were over before the samples: nothing was measured"
    for b in bads:
        b.close()
    good.close()
    return between


def test_backlogged_connections_delay_another_request_by_one_turn_not_one_each(workdir):
    """Defect 2, fairness: ten connections each with a backlog of pipelined
    requests; a request from an eleventh connection is answered after about
    one of their turns, not after a turn of every one of them (each queued
    its own turn, all of which ran before the loop polled the sockets again:
    robustness.py's good client waited 20-40 ms behind ten flooders).
    Measured in frames the daemon answered in between, not in time."""
    from kvtier.server import FRAMES_PER_TURN

    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    try:
        between = _frames_between(d.sock, 10, 20_000, 30)
        median = sorted(between)[len(between) // 2]
        assert median <= 3 * FRAMES_PER_TURN, (
            f"a request waited behind a median of {median} flood frames (turns of <= {FRAMES_PER_TURN}): {between}")
    finally:
        assert d.stop() == 0


def test_a_backlogged_turn_ends_when_another_connection_has_a_request(workdir):
    """Defect 2, fairness within a turn: a request arriving while a
    backlogged connection has its turn waited for the rest of that turn
    (64 frames or 0.5 ms: robustness.py's good client, at 0.3-0.5 ms alone,
    had its p99 at 0.7-0.9 ms under the flood on a quiet host). The turn
    now asks the loop's poll set every TURN_POLL_SECONDS whether anything
    else is waiting and ends there. Counted in flood frames answered between
    two back-to-back requests of another connection: before, every sample
    was one whole turn (64 frames, its frame cap: these frames cost ~5 us);
    now ~20 (0.1 ms of frames, and those answered while our client turns
    round)."""
    from kvtier.server import FRAMES_PER_TURN

    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    try:
        between = _frames_between(d.sock, 1, 40_000, 40)
        median = sorted(between)[len(between) // 2]
        assert median <= FRAMES_PER_TURN // 2, (
            f"a request waited behind a median of {median} frames of one backlogged connection "
            f"(whole turns are {FRAMES_PER_TURN} frames or 0.5 ms): {between}")
    finally:
        assert d.stop() == 0


def test_a_large_register_is_written_in_steps_others_answered_meanwhile(workdir):
    """Defect 2, registration: a register of a 1 Mi-block region wrote all
    its rows in one handler (4-8 ms quiet, 478 ms on a busy host, while
    every other client waited: robustness.py's slowest request). Its rows
    are now written a step per loop iteration and the region appears at
    once when they are all written: a query sent on another connection
    right after the register is answered before the register is, and the
    region is then whole."""
    import mmap

    from kvtier.server import STAGE_ROWS

    nblocks = 1 << 20
    d = DaemonProc(workdir).start()
    small = mmap.mmap(-1, 16 * 4096)
    big = mmap.mmap(-1, nblocks * 4096)  # address space only: never touched
    try:
        addr = protocol_addr(big)
        good, x = _connect(d.sock), _connect(d.sock)
        greader, xreader = protocol.FrameReader(1 << 30), protocol.FrameReader(1 << 30)
        rid = raw_call(good, greader, {"op": "register", "id": 1, "start": protocol_addr(small),
                                       "length": 16 * 4096, "block_size": 4096}).result["region"]
        query = protocol.frame(msgspec.msgpack.encode({"op": "query", "id": 2, "region": rid}))
        x.sendall(protocol.frame(msgspec.msgpack.encode(
            {"op": "register", "id": 3, "start": addr, "length": nblocks * 4096, "block_size": 4096})))
        good.sendall(query)
        assert raw_call(good, greader, None).ok
        x.setblocking(False)
        try:
            early = x.recv(1 << 16)
        except BlockingIOError:
            early = b""
        assert not early, (f"the register of {nblocks} blocks ({nblocks // STAGE_ROWS} steps) was answered "
                           "before a query sent after it on another connection")
        x.setblocking(True)
        x.settimeout(DEADLINE)
        r = raw_call(x, xreader, None)
        assert r.ok and r.result["blocks"] == nblocks, r
        page = raw_call(x, xreader, {"op": "blocks", "id": 4, "region": r.result["region"],
                                     "first": nblocks - 3, "count": 3}).result
        assert page["count"] == 3 and "next" not in page
        assert raw_call(good, greader, {"op": "query", "id": 5, "region": rid}).ok
        good.close()
        x.close()
    finally:
        small.close()
        big.close()
        assert d.stop() == 0


def protocol_addr(buf) -> int:
    from kvtier.client import buffer_address

    return buffer_address(buf)[0]


def test_after_a_deferred_answer_the_next_request_is_not_queued_behind_every_backlog(workdir):
    """Defect 2, fairness: an answer sent late (unregister waits for the
    state file) left its connection in the run queue with nothing to do and
    not reading, so its next request waited a turn of every backlogged
    connection (robustness.py --trace: 17 and 141 ms behind the flood).
    Two idle connections send a request at once right after one of them got
    a deferred answer: both are answered within about a turn of each other,
    counted in flood frames the daemon answered in between."""
    import mmap

    from kvtier.server import FRAMES_PER_TURN

    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    buf = mmap.mmap(-1, 16 * 4096)
    try:
        # 30,000 answers a connection stay under its 4 MiB of unread answers.
        nconn, flood = 10, 30_000
        total = nconn * flood
        frame = protocol.frame(msgspec.msgpack.encode({"op": "unregister", "id": 7, "region": (1 << 31) - 1}))
        g1, g2 = _connect(d.sock), _connect(d.sock)
        r1, r2 = protocol.FrameReader(1 << 30), protocol.FrameReader(1 << 30)
        raw_call(g2, r2, {"op": "hello", "id": 1})
        bads = _backlogs(d.sock, nconn, frame * flood)
        stats = protocol.frame(msgspec.msgpack.encode({"op": "stats", "id": 9}))
        gaps = []
        for i in range(10):
            rid = raw_call(g1, r1, {"op": "register", "id": 2, "start": protocol_addr(buf),
                                    "length": 16 * 4096, "block_size": 4096}).result["region"]
            assert raw_call(g1, r1, {"op": "unregister", "id": 3, "region": rid}).ok  # answered late
            g1.sendall(stats)
            g2.sendall(stats)
            a1 = raw_call(g1, r1, None).result["errors"].get("unregister:not_found", 0)
            a2 = raw_call(g2, r2, None).result["errors"].get("unregister:not_found", 0)
            if max(a1, a2) >= total:
                break  # the floods are over: a later sample has nothing to wait behind
            gaps.append(a1 - a2)
        # Each sample waits for a state-file write; on a quiet host the
        # daemon answered all 200,000 frames of a smaller flood within the
        # first samples (fresh-clone CI at a577fdc).
        assert len(gaps) >= 3, f"the floods ({total} frames) were over after {len(gaps)} samples: nothing was measured"
        median = sorted(gaps)[len(gaps) // 2]
        assert median <= FRAMES_PER_TURN, (
            f"after a deferred answer, a request waited a median of {median} flood frames more than one "
            f"sent with it on another connection (turns of <= {FRAMES_PER_TURN}): {gaps}")
        for b in bads:
            b.close()
        g1.close()
        g2.close()
    finally:
        buf.close()
        assert d.stop() == 0


def test_unread_answers_stop_the_daemon_answering(workdir):
    """Defect 2: a client that pipelines big requests and reads nothing gets
    at most the unread-answer high water (4 MiB) answered ahead, not all of
    them held in the daemon's memory; reading them later loses none."""
    import mmap

    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    buf = mmap.mmap(-1, 4096 * 4096)
    try:
        with d.client() as c:
            region = c.register(buf, block_size=4096)
            n = 200
            # Each answer is a page of 4096 blocks x 14 bytes (57 KiB) here.
            bad = _connect(d.sock)
            bad.sendall(protocol.frame(msgspec.msgpack.encode({"op": "blocks", "id": 9, "region": region.id})) * n)

            def settled():
                a = c.stats()["requests"].get("blocks", 0)
                time.sleep(0.2)
                return a if a == c.stats()["requests"].get("blocks", 0) and a else None

            answered = wait_for(settled, "the daemon to stop answering the unread client")
            assert answered < n // 2, f"{answered} of {n} answers ({answered * 57} KiB) queued for a client that reads none"
            got = 0
            breader = protocol.FrameReader(1 << 30)
            while got < n:
                for payload in breader.feed(bad.recv(1 << 20)):
                    r = protocol.decode_response(payload)
                    assert r.ok and len(r.result["tiers"]) == 4096
                    got += 1
            bad.close()
            region.unregister()
    finally:
        buf.close()
        assert d.stop() == 0


def test_unread_answers_are_bounded_per_uid_not_per_connection(workdir):
    """Defect 2: a uid that opens many connections, each pipelining big
    requests it never reads, gets about server.UNREAD_BYTES_PER_UID of
    answers made for all of them together, not WRITE_HIGH_WATER (4 MiB)
    each: every answer made for nobody is loop time taken from the other
    clients (robustness.py's flood). Reading them later loses none."""
    import mmap

    from kvtier.server import MIN_WRITE_HIGH_WATER, UNREAD_BYTES_PER_UID, WRITE_HIGH_WATER

    nconn, n = 16, 100
    assert UNREAD_BYTES_PER_UID // nconn >= MIN_WRITE_HIGH_WATER
    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    buf = mmap.mmap(-1, 4096 * 4096)
    try:
        with d.client() as c:
            region = c.register(buf, block_size=4096)
            frame = protocol.frame(msgspec.msgpack.encode({"op": "blocks", "id": 9, "region": region.id}))
            bads = [_connect(d.sock) for _ in range(nconn)]
            for b in bads:
                b.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
                b.sendall(frame * n)
            # One answer's size on the wire, from a connection that reads it.
            probe = _connect(d.sock)
            probe.sendall(frame)
            preader = protocol.FrameReader(1 << 30)
            got: list[bytes] = []
            while not got:
                got += preader.feed(probe.recv(1 << 20))
            answer = protocol.HEADER_SIZE + len(got[0])

            def settled():
                a = c.stats()["requests"].get("blocks", 0)
                time.sleep(0.3)
                return a if a == c.stats()["requests"].get("blocks", 0) and a > nconn else None

            answered = wait_for(settled, "the daemon to stop answering the unread clients") - 1  # the probe's
            # What the kernel holds of a connection's answers besides the
            # daemon's own buffer: its socket's send buffer (the daemon sets none).
            kernel = int(open("/proc/sys/net/core/wmem_default").read())
            bound = UNREAD_BYTES_PER_UID + nconn * (kernel + 2 * answer)
            per_conn_before = nconn * WRITE_HIGH_WATER  # what 4 MiB per connection allowed
            assert answered * answer <= bound < per_conn_before, (
                f"{answered} answers ({answered * answer >> 10} KiB) made for {nconn} connections that read none; "
                f"bound {bound >> 10} KiB")
            for b in bads:
                got = 0
                breader = protocol.FrameReader(1 << 30)
                while got < n:
                    for payload in breader.feed(b.recv(1 << 20)):
                        r = protocol.decode_response(payload)
                        assert r.ok and r.id == 9
                        got += 1
                b.close()
            probe.close()
            region.unregister()
    finally:
        buf.close()
        assert d.stop() == 0


def test_answers_stay_within_max_message_bytes_and_page(workdir):
    """Defect 2: a `blocks` or `query` answer never exceeds max_message_bytes;
    it carries `next` and the client library pages through the rest."""
    import mmap

    import numpy as np

    d = DaemonProc(workdir, FLOOD_LIMITS).start()
    nblocks = 100_000
    buf = mmap.mmap(-1, nblocks * 4096)  # never touched: costs no memory
    try:
        with d.client() as c:
            region = c.register(buf, block_size=4096)
            s = _connect(d.sock)
            reader = protocol.FrameReader(1 << 30)
            for op, per_block in (("blocks", 14), ("query", 1)):
                first, seen = 0, 0
                while True:
                    s.sendall(protocol.frame(msgspec.msgpack.encode({"op": op, "id": 3, "region": region.id, "first": first})))
                    frames: list[bytes] = []
                    while not frames:
                        frames += reader.feed(s.recv(1 << 20))
                    assert len(frames[0]) <= 65536, f"{op} answer of {len(frames[0])} bytes > max_message_bytes"
                    r = protocol.decode_response(frames[0]).result
                    assert r["first"] == first and len(r["tiers"]) == r["count"] > 0
                    seen += r["count"]
                    if "next" not in r:
                        break
                    assert r["next"] == first + r["count"]
                    first = r["next"]
                assert seen == nblocks, op
            tiers = region.query()
            assert tiers.shape == (nblocks,) and tiers.dtype == np.int8
            assert region.query(99_990, 5).shape == (5,)
            s.close()
            region.unregister()
    finally:
        buf.close()
        assert d.stop() == 0


def _closed_with(s: socket.socket) -> str:
    """The error code the daemon sent before closing ``s`` (it must close it)."""
    reader = protocol.FrameReader(1 << 30)
    frames: list[bytes] = []
    while True:
        try:
            data = s.recv(1 << 16)
        except ConnectionResetError:
            # Closed with some of our bytes unread: the kernel may then drop
            # what the daemon answered. Closed is what counts; the caller
            # checks the daemon's error counters for the reason.
            return "reset"
        if not data:
            break
        frames += reader.feed(data)
    assert frames, "closed without an answer"
    return protocol.decode_response(frames[-1]).error.code


def test_stalled_frame_and_idle_connection_are_closed(workdir):
    """Defect 5: a half-sent frame is dropped after limits.frame_timeout and
    a connection without requests after limits.idle_timeout; a client that
    keeps talking is not."""
    d = DaemonProc(workdir, """
        [limits]
        frame_timeout = 0.5
        idle_timeout = 1.5
        """).start()
    try:
        stalled = _connect(d.sock)
        stalled.sendall(protocol.HEADER.pack(60000) + b"\x81" * 100)
        idle = _connect(d.sock)
        raw_call(idle, protocol.FrameReader(), {"op": "hello", "id": 1})
        busy = _connect(d.sock)
        busy_reader = protocol.FrameReader()
        t0 = time.monotonic()
        assert _closed_with(stalled) == "bad_frame"
        stalled_after = time.monotonic() - t0
        # The busy client's frames each arrive within the deadline, slowly.
        while time.monotonic() - t0 < 2.5:
            frame = protocol.frame(msgspec.msgpack.encode({"op": "stats", "id": 5}))
            busy.sendall(frame[:3])
            time.sleep(0.2)
            busy.sendall(frame[3:])
            assert raw_call(busy, busy_reader, None).ok
        assert _closed_with(idle) == "limit_exceeded"
        assert stalled_after < 1.5 + 2, stalled_after  # not the idle timeout: the frame deadline
        with d.client() as c:
            assert c.stats()["connections_timed_out"] == 2
        busy.close()
    finally:
        assert d.stop() == 0


def test_a_frame_cut_by_the_clients_shutdown_is_dropped_unanswered(daemon):
    """Item 12 (docs/protocol.md 6.1, "closes or shuts down its side in the
    middle of a frame"): the complete frames before the cut are answered,
    the partial one is not, and the daemon closes the connection."""
    s = _connect(daemon.sock)
    stats = protocol.frame(msgspec.msgpack.encode({"op": "stats", "id": 3}))
    s.sendall(stats + stats + stats[: len(stats) // 2])
    s.shutdown(socket.SHUT_WR)
    reader = protocol.FrameReader(1 << 30)
    got: list[bytes] = []
    while data := s.recv(1 << 20):  # b"": the daemon closed its side
        got += reader.feed(data)
    assert [protocol.decode_response(p).id for p in got] == [3, 3]
    assert reader.pending == 0, "a partial answer"
    s.close()
    with daemon.client() as c:
        wait_for(lambda: c.request("status")["connections"] == 1, "the cut connection to be closed")
        assert not any(k.startswith("frame:") for k in c.stats()["errors"]), c.stats()["errors"]


OWNER_OPS = DROP + r"""
import json, mmap
from kvtier import protocol
from kvtier.client import Client, KvtierClientError
drop(65534, 65534)
buf = mmap.mmap(-1, 4 << 20); buf.write(b"\1" * len(buf))
c = Client(sys.argv[1])
r = c.register(buf, block_size=1 << 20)
res = {}
for op, kw in [("migrate", {"tier": 0}), ("pin", {"tier": 0}), ("unpin", {}), ("measure", {})]:
    try:
        c.request(op, region=r.id, **kw); res[op] = "ok"
    except KvtierClientError as e:
        res[op] = e.code
print(json.dumps({"region": r.id, **res}), flush=True)
sys.stdin.read()
"""


def test_an_unprivileged_owner_may_migrate_and_pin_its_own_region(daemon):
    """Item 12, decided: owner access covers migrate, pin and unpin
    (docs/protocol.md section 4; security.admin_group is only for other
    users' memory and regions): nobody moves, pins, unpins and measures its
    own region. Others' regions stay refused
    (test_unprivileged_client_cannot_use_others_regions)."""
    p = subprocess.Popen([PY, "-c", OWNER_OPS, daemon.sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        got = json.loads(p.stdout.readline())
        assert {k: v for k, v in got.items() if k != "region"} == {
            "migrate": "ok", "pin": "ok", "unpin": "ok", "measure": "ok"}, got
        (reg,) = daemon.regions()
        assert reg["id"] == got["region"] and reg["owner_uid"] == NOBODY
    finally:
        p.kill()
        p.wait()


def test_incomplete_frames_are_capped_per_uid(workdir):
    """Defect 5: connections of one uid that each send most of a big frame
    hold at most limits.max_pending_bytes_per_uid between them; the one
    that goes past it is closed, the others and other uids are unaffected."""
    d = DaemonProc(workdir, """
        [limits]
        max_message_bytes = 4194304
        max_pending_bytes_per_uid = 1048576
        frame_timeout = 60
        """).start()
    try:
        conns = [_connect(d.sock) for _ in range(4)]
        part = protocol.HEADER.pack(4 << 20) + b"\x81" * (400 << 10)
        for s in conns:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed by the daemon while we were still sending: checked below
        # The third pushes the uid past 1 MiB: it alone is closed.
        assert _closed_with(conns[2]) in ("limit_exceeded", "reset")
        conns[2].close()
        for s in (conns[0], conns[1]):
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s.recv(1)  # still open, still waiting for the rest of its frame
        assert _closed_with(conns[3]) in ("limit_exceeded", "reset")
        with d.client() as c:  # same uid, nothing pending: served
            assert c.request("status")["connections"] == 3
            assert c.stats()["errors"]["frame:limit_exceeded"] == 2
        for s in conns:
            s.close()
    finally:
        assert d.stop() == 0


HOG = DROP + r"""
import socket, json
drop(65534, 65534)
held = []
while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.settimeout(0.5)
    try:
        data = s.recv(4096)  # refused connections get an error and EOF
    except socket.timeout:
        held.append(s)
        continue
    break
print(json.dumps({"held": len(held)}), flush=True)
sys.stdin.read()
"""


def test_connections_are_reserved_for_root(workdir):
    """Defect 6: an unprivileged user taking every connection it can leaves
    limits.reserved_connections for root: kvtierctl status still works."""
    d = DaemonProc(workdir, """
        [limits]
        max_connections = 12
        max_connections_per_uid = 100
        reserved_connections = 3
        """).start()
    hog = subprocess.Popen([PY, "-c", HOG, d.sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(hog.stdout.readline())["held"]
        assert held == 12 - 3
        r = subprocess.run([PY, "-m", "kvtier.ctl", "--socket", d.sock, "status"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with d.client() as c:
            assert c.request("status")["connections"] == held + 1
    finally:
        hog.kill()
        hog.wait()
        assert d.stop() == 0


def test_deeply_nested_msgpack_is_an_invalid_request_logged_once(daemon):
    """Defect 9: nesting past the decoder's recursion limit, even under a key
    the daemon ignores, is `invalid_request` and the connection stays usable;
    200 such frames make one rate-limited log line, no traceback."""
    s = _connect(daemon.sock)
    reader = protocol.FrameReader(1 << 30)
    deep = b"\x83\xa2op\xa5stats\xa2id\x05\xa1x" + b"\x91" * 50_000 + b"\x01"
    for _ in range(200):
        s.sendall(protocol.frame(deep))
        r = raw_call(s, reader, None)
        assert not r.ok and r.error.code == "invalid_request" and r.id == 0, r
        assert "nested too deeply" in r.error.message
    assert raw_call(s, reader, {"op": "stats", "id": 6}).ok
    s.close()
    log = daemon.read_log()
    assert "Traceback" not in log and "internal error" not in log
    lines = [ln for ln in log.splitlines() if "nested too deeply" in ln]
    assert 1 <= len(lines) <= 3, lines


# Registers and unregisters one buffer as fast as it can, saying which
# answers it got; when the daemon dies it waits for "go" and registers the
# same buffer again.
CHURN = r"""
import mmap, sys
from kvtier.client import Client
buf = mmap.mmap(-1, 4 << 20); buf.write(b"\1" * len(buf))
c = Client(sys.argv[1], reconnect_timeout=0)
try:
    while True:
        r = c.register(buf, block_size=1 << 20)
        print("r", r.id, flush=True)
        r.unregister()
        print("u", r.id, flush=True)
except Exception as e:
    print("x", type(e).__name__, flush=True)
sys.stdin.readline()
info = Client(sys.argv[1]).call(__import__("kvtier.protocol", fromlist=["x"]).Register(
    start=r.start, length=r.length, block_size=1 << 20))
print("again", info["region"], info.get("existing", False), flush=True)
"""


def test_kill_9_never_brings_back_an_unregistered_region(workdir):
    """Defect 4: kill -9 in a register/unregister loop; the restarted daemon
    re-adopts no region whose unregister was answered, and registering the
    exact range of a region it did re-adopt hands that region back."""
    import random

    d = DaemonProc(workdir, args=("--set", "daemon.state_flush_delay=0.05"))
    rng = random.Random(12)
    for trial in range(5):
        d.start()
        churn = subprocess.Popen([PY, "-c", CHURN, d.sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert churn.stdout.readline().startswith("r ")
            time.sleep(rng.uniform(0.05, 0.4))
            d.stop(signal.SIGKILL)
            answered: dict[int, str] = {}
            for line in churn.stdout:
                kind, _, rest = line.strip().partition(" ")
                if kind == "x":
                    break
                answered[int(rest)] = kind
            d.start()
            adopted = {r["id"] for r in d.regions()}
            removed = {rid for rid, kind in answered.items() if kind == "u"}
            assert not adopted & removed, f"trial {trial}: unregistered region(s) {adopted & removed} came back"
            churn.stdin.write("go\n")
            churn.stdin.flush()
            _, rid, existing = churn.stdout.readline().split()
            if adopted:
                assert (int(rid), existing) == (adopted.pop(), "True")
            else:
                assert existing == "False"
        finally:
            churn.kill()
            churn.wait()
            d.stop(signal.SIGKILL)


def test_unreadable_config_is_a_clear_error_and_reload_keeps_running(daemon):
    """Defect 3: a config that is not UTF-8 or nests too deeply is exit 78
    with the reason for --check-config, and SIGHUP with it keeps the daemon
    on its old config instead of killing it."""
    good = open(daemon.config, "rb").read()
    bad = {
        "not UTF-8": good + b'\n[security]\nadmin_group = "\xff\xfe"\n',
        "nested too deeply": good + b"\n[policy]\ncapacity = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    }
    try:
        for n, (why, text) in enumerate(bad.items(), 1):
            with open(daemon.config, "wb") as f:
                f.write(text)
            r = subprocess.run([PY, "-m", "kvtier.daemon", "--check-config", "-c", daemon.config],
                               capture_output=True, text=True)
            assert r.returncode == 78 and why in r.stderr and "Traceback" not in r.stderr, r
            daemon.proc.send_signal(signal.SIGHUP)
            with daemon.client() as c:
                wait_for(lambda: c.stats()["config_reload_errors_total"] == n, "the reload to fail")
            assert daemon.proc.poll() is None
    finally:
        with open(daemon.config, "wb") as f:
            f.write(good)
    assert "Traceback" not in daemon.read_log()


def test_bad_state_files_are_moved_aside_and_ids_stay_on_the_wire(workdir):
    """Defect 8: a state file that nests too deeply or is not JSON no longer
    stops start-up or gets overwritten: it is moved aside with the reason
    logged. Non-object entries are counted; a next_id at or past 2^31-1
    does not make every register fail: ids wrap within the wire's range."""
    import glob
    import mmap

    d = DaemonProc(workdir)
    buf = mmap.mmap(-1, 4 << 20)
    try:
        for text, why in ((b'{"version": 1, "regions": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
                          (b'{"version": 1, "regi', "not JSON")):
            with open(d.state, "wb") as f:
                f.write(text)
            d.start()
            with d.client() as c:
                c.register(buf, block_size=1 << 20).unregister()
            d.stop()
            aside = glob.glob(d.state + ".bad-*")
            assert len(aside) == 1 and open(aside[0], "rb").read() == text, aside
            assert why in d.read_log() and "moved to" in d.read_log()
            os.unlink(aside[0])
        with open(d.state, "w") as f:
            json.dump({"version": 1, "next_id": (1 << 31) - 2, "regions": [7, "x", None]}, f)
        d.start()
        assert "dropped 3 of 3 entries" in d.read_log()
        with d.client() as c:
            ids = []
            for _ in range(3):
                r = c.register(buf, block_size=1 << 20)
                ids.append(r.id)
                r.unregister()
        assert ids == [(1 << 31) - 2, (1 << 31) - 1, 1], ids
        d.stop()
        with open(d.state, "w") as f:
            json.dump({"version": 1, "next_id": 1 << 40, "regions": []}, f)
        d.start()
        with d.client() as c:
            assert c.register(buf, block_size=1 << 20).id == 1
    finally:
        buf.close()
        assert d.stop() == 0
    assert "Traceback" not in d.read_log()


def test_client_without_daemon_fails_at_once_and_retried_register_learns_the_id(workdir):
    """Defect 11: Client(connect=False) with no daemon raises on its first
    call instead of waiting out reconnect_timeout (30 s); and a register
    whose answer a client lost is learnt by registering again (the daemon
    hands back the same region instead of `overlap`)."""
    import mmap

    from kvtier.client import Client, DaemonUnavailable

    c = Client(os.path.join(workdir, "none.sock"), connect=False, reconnect_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        c.request("status")
    assert time.monotonic() - t0 < 10, "waited for a daemon that was never there"
    d = DaemonProc(workdir).start()
    buf = mmap.mmap(-1, 4 << 20)
    try:
        with d.client() as c1:
            first = c1.register(buf, block_size=1 << 20)
            # As if the answer above had been lost: the same request again.
            again = c1.call(protocol.Register(start=first.start, length=first.length, block_size=1 << 20))
            assert again["region"] == first.id and again["existing"] is True
            assert len(d.regions()) == 1
            first.unregister()
    finally:
        buf.close()
        assert d.stop() == 0


def test_idle_metrics_connections_cost_no_thread_each(workdir):
    """Defect 7: 300 idle TCP connections to the exporter leave the daemon's
    thread count bounded (a fixed pool), and a scrape works again once the
    idle ones time out or go."""
    import urllib.request

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    d = DaemonProc(workdir)
    d.write_config(f"""
        [metrics]
        enabled = true
        address = "127.0.0.1"
        port = {port}
        """)
    # The base config turns metrics off; this test's table replaces it.
    text = open(d.config).read().replace("[metrics]\nenabled = false\n", "", 1)
    open(d.config, "w").write(text)
    d.start()

    def threads() -> int:
        with open(f"/proc/{d.proc.pid}/status") as f:
            return int(next(ln for ln in f if ln.startswith("Threads:")).split()[1])

    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert b"kvtier_" in urllib.request.urlopen(url, timeout=10).read()
        base = threads()
        idle = []
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            idle.append(s)
        time.sleep(1.0)
        assert threads() <= base + 8, f"{threads()} threads with 300 idle connections (was {base})"
        for s in idle:
            s.close()
        body = wait_for(lambda: _scrape(url), "a scrape to succeed again")
        assert b"kvtier_connections" in body
    finally:
        assert d.stop() == 0


def _scrape(url: str) -> bytes | None:
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        return None
