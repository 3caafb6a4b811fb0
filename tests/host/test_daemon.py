"""The real kvtierd on a temporary socket, driven by real client processes.

Each test starts ``python -m kvtier.daemon`` as a subprocess and talks to it
with kvtier.client from child processes (so SO_PEERCRED, /proc/PID/maps,
pidfds and the state file are all real). Waits poll the daemon's state with
a generous deadline; nothing asserts on elapsed time.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import waiting

from kvtier import protocol
from kvtier.client import Client, KvtierClientError

pytestmark = pytest.mark.root

PY = sys.executable
DEADLINE = 20.0
NOBODY = 65534


wait_for = functools.partial(waiting.wait_for, timeout=DEADLINE, interval=0.02)


class DaemonProc:
    """kvtierd in a subprocess with its own socket, state file and config."""

    def __init__(self, workdir: str, extra_config: str = "", args: tuple[str, ...] = ()):
        self.dir = workdir
        self.sock = os.path.join(workdir, "kvtierd.sock")
        self.state = os.path.join(workdir, "state.json")
        self.config = os.path.join(workdir, "kvtierd.toml")
        self.log = os.path.join(workdir, "kvtierd.log")
        self.args = args  # e.g. ("--set", "daemon.tick_interval=0.2") to override the base config
        self.write_config(extra_config)
        self.proc: subprocess.Popen | None = None

    def write_config(self, extra: str = "") -> None:
        with open(self.config, "w") as f:
            f.write(textwrap.dedent(f"""\
                [daemon]
                socket = "{self.sock}"
                state_file = "{self.state}"
                tick_interval = 0.05
                state_flush_delay = 0.0
                socket_mode = 0o666
                [metrics]
                enabled = false
                """) + textwrap.dedent(extra))

    def start(self) -> "DaemonProc":
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([PY, "-m", "kvtier.daemon", "-c", self.config, *self.args],
                                     stdout=logf, stderr=logf)
        logf.close()

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"kvtierd exited {self.proc.returncode}: {self.read_log()}")
            try:
                Client(self.sock, reconnect_timeout=0).close()
                return True
            except (OSError, KvtierClientError):
                return False

        wait_for(up, "kvtierd to accept connections")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=DEADLINE)
        self.proc = None
        return rc

    def read_log(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def client(self, **kw) -> Client:
        return Client(self.sock, **kw)

    def regions(self) -> list[dict]:
        with self.client() as c:
            return list(c.regions())


@pytest.fixture
def workdir():
    # World-traversable so clients running as nobody reach the socket.
    d = tempfile.mkdtemp(prefix="kvtierd-test-")
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture
def daemon(workdir):
    d = DaemonProc(workdir).start()
    yield d
    rc = d.stop()
    assert rc == 0, d.read_log()
    assert "Traceback" not in d.read_log(), d.read_log()


@pytest.fixture
def counting_daemon(workdir):
    """For tests of how hinted counts add up and decay: runs of reads never
    end on silence here (at 50 ms ticks one batch of hints would end within
    a tick or two; tests/unit/test_hotness.py covers that rule)."""
    d = DaemonProc(workdir, extra_config="[hotness]\nend_of_run = 0\n").start()
    yield d
    rc = d.stop()
    assert rc == 0, d.read_log()
    assert "Traceback" not in d.read_log(), d.read_log()


# A client process: registers an anonymous mmap, then obeys commands on
# stdin, answering one JSON line per command on stdout.
CHILD = r"""
import json, mmap, sys, os
import numpy as np
from kvtier.client import Client, KvtierClientError
sock, size, bs, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if uid >= 0:  # drop root after the imports (the interpreter lives under /root)
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
buf = mmap.mmap(-1, size)
buf.write(b"\1" * size)  # touch every page so residency is measurable
c = Client(sock, reconnect_timeout=30)
def out(**kw):
    print(json.dumps(kw), flush=True)
region = None
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd.pop("cmd")
    try:
        if op == "register":
            region = c.register(buf, block_size=bs, **cmd)
            out(region=region.id, nblocks=region.nblocks, addr=region.start, pid=os.getpid())
        elif op == "register_raw":
            r = c.register(addr=cmd["addr"], length=cmd["length"], block_size=bs, pid=cmd.get("pid"))
            out(region=r.id)
        elif op == "hint":
            region.hint(cmd["blocks"], cmd.get("counts"))
            errs = c.flush()
            out(errors=[str(e) for e in errs])
        elif op == "phase":
            out(blocks=region.phase(cmd["phase"], cmd.get("blocks")))
        elif op == "discard":
            out(blocks=region.discard(cmd["blocks"], drop=cmd.get("drop", True)))
        elif op == "write":  # a new block in a slot: its KV written, then hinted
            b = cmd["block"]
            buf[b * bs:(b + 1) * bs] = b"\2" * bs
            region.hint([b])
            out(errors=[str(e) for e in c.flush()])
        elif op == "smaps":  # the pool mapping's Rss and Swap, kB (shmem swap included)
            from kvtier.client import buffer_address
            start = buffer_address(buf)[0]
            kb, cur = {}, False
            for l in open("/proc/self/smaps"):
                f = l.split()
                if "-" in f[0] and not f[0].endswith(":"):
                    cur = int(f[0].split("-")[0], 16) == start
                elif cur and f[0] in ("Rss:", "Swap:"):
                    kb[f[0][:-1]] = int(f[1])
            out(**kb)
        elif op == "query":
            out(tiers=region.query().tolist())
        elif op == "unregister":
            region.unregister()
            out(ok=True)
        elif op == "reconnects":
            out(reconnects=c.reconnects)
        elif op == "exit":
            out(ok=True)
            os._exit(0)
    except KvtierClientError as e:
        out(error=e.code, message=str(e), errno=e.errno)
"""


# Become an unprivileged user after the imports: the venv's interpreter lives
# under /root, which nobody cannot read, so the child starts as root and drops.
DROP = "import os, sys\ndef drop(uid, gid):\n    os.setgroups([]); os.setgid(gid); os.setuid(uid)\n"


class ChildClient:
    def __init__(self, sock: str, size: int = 16 << 20, block_size: int = 1 << 20, user: int | None = None):
        self.p = subprocess.Popen([PY, "-c", CHILD, sock, str(size), str(block_size), str(-1 if user is None else user)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.p.pid

    def __call__(self, cmd: str, **kw) -> dict:
        self.p.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"client process died (rc={self.p.poll()})"
        return json.loads(line)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def measured(child) -> list[int]:
    """The region's tiers once the daemon has measured every block."""

    def probe():
        t = child("query")["tiers"]
        return t if -1 not in t else None

    return wait_for(probe, "residency measured")


def test_register_hint_query_unregister(counting_daemon):
    daemon = counting_daemon
    with ChildClient(daemon.sock) as child:
        r = child("register", name="kv0", tenant="team-a", priority=3, constraints=["never_swap"])
        assert r["nblocks"] == 16
        regs = daemon.regions()
        assert [(x["id"], x["pid"], x["name"], x["tenant"], x["priority"], x["constraints"]) for x in regs] == [
            (r["region"], child.pid, "kv0", "team-a", 3, ["never_swap"])
        ]
        assert child("hint", blocks=[1, 2, 2, 15], counts=[1, 2, 3, 4])["errors"] == []
        # One node on this host: once measured, every touched block is in tier 0.
        tiers = measured(child)
        assert tiers == [0] * 16
        with daemon.client() as c:
            b = c.request("blocks", region=r["region"])
            temps = protocol.unpack(b["temps"], protocol.TEMPS_DTYPE, "temps")
            # Counts add up per block (2+3 for block 2), then decay together.
            assert temps[0] == 0 and temps[2] > temps[15] > temps[1] > 0
            assert temps[2] / temps[1] == pytest.approx(5, rel=1e-3)
            assert c.stats()["block_hints_total"] == 4
            assert "region 1 index 15" in c.request("explain", region=r["region"], block=15)["text"]
        assert child("phase", phase="prefill_done", blocks=[0, 1])["blocks"] == 2
        assert child("unregister") == {"ok": True}
        assert daemon.regions() == []
        assert child("query")["error"] == "not_found"


def test_client_that_exits_is_cleaned_up(daemon):
    child = ChildClient(daemon.sock)
    child("register")
    child2 = ChildClient(daemon.sock)
    r2 = child2("register")
    try:
        assert len(daemon.regions()) == 2
        child.kill()  # SIGKILL: no chance to unregister; the pidfd tells the daemon
        wait_for(lambda: [x["id"] for x in daemon.regions()] == [r2["region"]], "dead client's region dropped")
        with daemon.client() as c:
            assert c.stats()["regions_dropped_exit_total"] == 1
        with open(daemon.state) as f:
            wait_for(lambda: [x["id"] for x in json.load(open(daemon.state))["regions"]] == [r2["region"]],
                     "state file updated")
    finally:
        child2.kill()


def test_restart_readopts_live_registrations(daemon):
    with ChildClient(daemon.sock) as alive, ChildClient(daemon.sock) as dying:
        ra = alive("register", name="alive")
        rd = dying("register", name="dying")
        alive("hint", blocks=[0])
        with daemon.client() as c:
            c.request("pin", region=ra["region"], tier=0, blocks=protocol.pack_blocks([2, 3]))
        assert daemon.stop() == 0
        with open(daemon.state) as f:
            saved = json.load(f)
        assert sorted(x["id"] for x in saved["regions"]) == sorted([ra["region"], rd["region"]])
        dying.kill()  # exits while the daemon is down: must not be re-adopted
        daemon.start()
        regs = daemon.regions()
        assert [(x["id"], x["pid"], x["name"]) for x in regs] == [(ra["region"], alive.pid, "alive")]
        # Operator pins survive the restart too.
        with daemon.client() as c:
            flags = protocol.unpack(c.request("blocks", region=ra["region"])["flags"], protocol.FLAGS_DTYPE, "f")
            assert [i for i, f in enumerate(flags) if f & 16] == [2, 3]
        # The same Client object reconnects transparently and its handle is still valid.
        assert alive("hint", blocks=[3])["errors"] == []
        assert alive("reconnects")["reconnects"] == 1
        assert measured(alive) == [0] * 16
        with daemon.client() as c:
            st = c.stats()
            assert st["regions_adopted_total"] == 1 and st["regions_stale_total"] == 1
        # New ids never collide with re-adopted ones.
        with ChildClient(daemon.sock) as other:
            assert other("register")["region"] > max(ra["region"], rd["region"])


def test_pid_reuse_is_not_adopted(workdir):
    # A state entry whose pid is alive but whose start time differs is a different process.
    d = DaemonProc(workdir)
    me = os.getpid()
    with open(d.state, "w") as f:
        json.dump({"version": 1, "next_id": 5, "regions": [{
            "id": 4, "pid": me, "start_time": 1, "start": 4096, "length": 1 << 20, "block_size": 4096,
            "name": "x", "tenant": "", "priority": 0, "constraints": [], "owner_uid": 0}]}, f)
    d.start()
    try:
        assert d.regions() == []
        with d.client() as c:
            assert c.stats()["regions_stale_total"] == 1
    finally:
        assert d.stop() == 0


def test_unmapped_and_file_backed_ranges_are_refused(daemon):
    with ChildClient(daemon.sock) as child:
        r = child("register_raw", addr=4096, length=1 << 20)
        assert r["error"] == "range_not_mapped"
        # The interpreter's own text is file-backed: not KV memory.
        with open(f"/proc/{child.pid}/maps") as f:
            text = next(line for line in f if "r-xp" in line and "python" in line)
        lo = int(text.split("-")[0], 16)
        r = child("register_raw", addr=lo, length=1 << 20)
        assert r["error"] == "range_not_mapped"
        assert "not private anonymous or shared memory" in r["message"]
    assert daemon.regions() == []


def test_unprivileged_client_may_not_register_another_process(daemon):
    with ChildClient(daemon.sock) as victim, ChildClient(daemon.sock, user=NOBODY) as mallory:
        v = victim("register")
        # Guess the victim's mapping exactly: still refused, by pid alone.
        r = mallory("register_raw", addr=v["addr"], length=1 << 20, pid=victim.pid)
        assert r["error"] == "permission_denied" and r["errno"] == 1
        mine = mallory("register")
        assert "region" in mine
        assert {x["pid"] for x in daemon.regions()} == {victim.pid, mallory.pid}


def test_unprivileged_client_cannot_use_others_regions(daemon):
    with ChildClient(daemon.sock) as victim:
        v = victim("register")
        code = (
            DROP + "from kvtier.client import Client, KvtierClientError\n"
            "drop(65534, 65534)\nc = Client(sys.argv[1])\n"
            "for op, kw in [('unregister', {}), ('query', {}), ('hint', {'blocks': b'\\0\\0\\0\\0'}),"
            " ('migrate', {'tier': 0}), ('pin', {})]:\n"
            "    try:\n        c.request(op, region=int(sys.argv[2]), **kw); print(op, 'ok')\n"
            "    except KvtierClientError as e: print(op, e.code)\n"
            "print('regions', len(c.request('regions')['regions']))\n"
        )
        out = subprocess.run([PY, "-c", code, daemon.sock, str(v["region"])], capture_output=True, text=True, check=True).stdout.split("\n")
        assert out[:6] == ["unregister permission_denied", "query permission_denied",
                           "hint permission_denied", "migrate permission_denied", "pin permission_denied",
                           "regions 0"]
        assert len(daemon.regions()) == 1


def test_client_splits_hint_batches_above_the_frame_limit(workdir):
    import mmap as _mmap

    import numpy as np

    d = DaemonProc(workdir, extra_config="[limits]\nmax_message_bytes = 65536\n").start()
    try:
        with d.client(hint_batch=20000) as h:  # 160 KB of indices + counts > one 64 KiB frame
            buf = _mmap.mmap(-1, 1 << 20)
            r = h.register(buf, block_size=1 << 12)
            r.hint(np.arange(20000) % 256, np.full(20000, 2))
            assert h.flush() == []
            st = h.stats()
            assert st["block_hints_total"] == 20000 and st["requests"]["hint"] == 3
            assert st["errors"] == {}
            r.unregister()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("timeout", [10.0, None])
def test_hint_batches_copy_at_once_and_mix_counts(daemon, timeout):
    """The client's pending hints: a caller that reuses its array right
    after hint() must not change what is sent; lists, 2-D arrays, counted and
    uncounted hints share one batch. With and without a socket timeout (the
    client writes hints without waiting either way)."""
    import mmap as _mmap

    import numpy as np

    # the socket's batches (tests/host/test_hint_ring.py: the ring's path)
    c = daemon.client(hint_batch=1 << 20, hint_interval=3600, timeout=timeout, hint_ring=False)
    buf = _mmap.mmap(-1, 4096 * 4096)
    r = c.register(buf, block_size=4096)
    ids = np.array([1, 2])
    r.hint(ids)  # the first hint after an interval without any leaves at once
    assert c.stats()["block_hints_total"] == 2
    ids = np.array([8, 9])
    r.hint(ids)
    ids[:] = 7  # reused by the engine for its next step: block 7 was never hinted
    r.hint([3])
    r.hint(np.array([[4], [5]]))
    r.hint([6], counts=[5])
    r.hint(np.arange(100, 2100))  # after counts appeared: counts of 1 are filled in
    assert c.stats()["block_hints_total"] == 2  # the rest still pending
    assert c.flush() == []
    assert c.stats()["block_hints_total"] == 2 + 2 + 1 + 2 + 1 + 2000
    temps = protocol.unpack(c.request("blocks", region=r.id)["temps"], protocol.TEMPS_DTYPE, "temps")
    assert temps[7] == 0 and temps[0] == 0 and temps[2100] == 0
    # Blocks 1-2 left in the first batch, the rest together at the flush: a
    # tick between the two batches may weigh them differently (the decay and
    # a run's start), so each batch is compared within itself.
    assert temps[2] == pytest.approx(temps[1], rel=1e-3) and temps[1] > 0
    assert np.allclose(temps[[4, 5, 8, 9]], temps[3], rtol=1e-3) and temps[3] > 0
    assert temps[6] / temps[3] == pytest.approx(5, rel=1e-3)
    assert (temps[100:2100] > 0).all()
    r.unregister()
    c.close()


def test_bad_block_ids_and_hints_after_unregister_are_errors_at_the_call(daemon):
    """A negative id raised numpy's OverflowError, an int64 -1 wrapped to
    4294967295 and was only counted as bad_block in a later answer, a float
    id was truncated, and hint() after unregister() was queued silently:
    each is now a ValueError naming the region at the call, nothing queued."""
    import mmap as _mmap

    import numpy as np

    c = daemon.client(hint_interval=3600, hint_ring=False)
    buf = _mmap.mmap(-1, 8 * 4096)
    r = c.register(buf, block_size=4096)
    for bad in ([-1], np.array([-1]), [8], np.array([0, 8], dtype=np.int64), [1.5], np.array([True])):
        with pytest.raises(ValueError, match=f"region {r.id}"):
            r.hint(bad)
        with pytest.raises(ValueError, match=f"region {r.id}"):
            r.discard(bad, drop=False)
    r.hint([0, 7])
    r.hint([])
    assert c.flush() == []
    assert c.stats()["block_hints_total"] == 2
    r.unregister()
    for blocks in ([1], np.array([1], dtype=np.uint32)):
        with pytest.raises(ValueError, match="unregistered"):
            r.hint(blocks)
    c.close()


def test_hint_batches_leave_on_time_with_few_clock_reads(daemon, monkeypatch):
    """The client reads the clock every few hint calls, not every call (a
    clock read is a system call in some VMs): at a steady rate a batch still
    leaves within a quarter interval of hint_interval, and when the engine
    suddenly hints far less often the next batch is not held back for long."""
    import mmap as _mmap
    from types import SimpleNamespace

    import numpy as np

    from kvtier import client as client_mod

    now, reads = [0.0], [0]

    def monotonic():
        reads[0] += 1
        return now[0]

    c = daemon.client(hint_batch=1 << 20, hint_interval=0.2)
    buf = _mmap.mmap(-1, 64 << 12)
    r = c.register(buf, block_size=4096)
    ids = np.arange(4, dtype=np.uint32)
    monkeypatch.setattr(client_mod, "time", SimpleNamespace(monotonic=monotonic, sleep=time.sleep))

    def run(calls: int, step: float) -> list[float]:
        """Fake time at which each batch left, relative to its first hint."""
        ages, first = [], None
        for _ in range(calls):
            if first is None:
                first = now[0]
            r.hint(ids)
            if r._pending == 0:
                ages.append(now[0] - first)
                first = None
            now[0] += step
        return ages

    ages = run(2000, 0.001)  # a decode step every millisecond
    assert len(ages) >= 9 and max(ages) <= 0.2 + 0.05
    assert reads[0] <= 2000 / 4  # the point: most calls read no clock
    reads[0] = 0
    ages = run(100, 0.1)  # then a hint every 100 ms
    assert max(ages) <= 0.2 + 0.1 * client_mod.MAX_CLOCK_STRIDE
    assert sorted(ages)[len(ages) // 2] <= 0.2 + 0.1  # after the first slow batch: every call reads the clock
    assert c.flush() == []
    assert c.stats()["block_hints_total"] == 4 * 2100
    r.unregister()
    c.close()


def test_limits_give_clear_errors(workdir):
    d = DaemonProc(workdir, extra_config="""
        [limits]
        max_regions_per_process = 2
        max_message_bytes = 65536
        requests_per_second = 1
        request_burst = 50
        """).start()
    try:
        with d.client() as c:
            n = d.client()
            import mmap
            bufs = [mmap.mmap(-1, 1 << 20) for _ in range(3)]
            c.register(bufs[0], block_size=1 << 16)
            c.register(bufs[1], block_size=1 << 16)
            with pytest.raises(KvtierClientError) as ei:
                c.register(bufs[2], block_size=1 << 16)
            assert ei.value.code == "limit_exceeded" and "max_regions_per_process" in str(ei.value)
            # Rate: the bucket (50) runs dry; the answer says when to retry.
            codes = []
            for _ in range(60):
                try:
                    n.status()
                    codes.append("ok")
                except KvtierClientError as e:
                    codes.append(e.code)
                    assert e.retry_after_ms > 0
            assert "rate_limited" in codes and codes[0] == "ok"
            n.close()
        # Oversized frame: an error, then the connection is closed.
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.sock)
        s.sendall(protocol.HEADER.pack(65537))
        data = s.recv(4096)
        resp = protocol.decode_response(data[4:])
        assert resp.error.code == "message_too_large"
        assert s.recv(4096) == b""
        s.close()
    finally:
        assert d.stop() == 0


def test_sighup_reloads_and_bad_config_keeps_running(daemon):
    with daemon.client() as c:
        assert c.server["max_message_bytes"] == 16 << 20
    daemon.write_config("[limits]\nmax_message_bytes = 1048576\n")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: Client(daemon.sock).server["max_message_bytes"] == 1 << 20, "reload")
    daemon.write_config("[limits]\nmax_message_bytes = 1\n")
    daemon.proc.send_signal(signal.SIGHUP)
    with daemon.client() as c:
        wait_for(lambda: c.stats()["config_reload_errors_total"] == 1, "failed reload counted")
        assert c.server["max_message_bytes"] == 1 << 20
    assert "limits.max_message_bytes: must be >= 4096" in daemon.read_log()


def test_socket_permissions_and_group(workdir):
    # --set overrides the fixture config's 0o666.
    d = DaemonProc(workdir, args=("--set", "daemon.socket_mode=0o660", "--set", 'daemon.socket_group="nogroup"'))
    d.start()
    try:
        st = os.stat(d.sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == 65534
        code = DROP + "from kvtier.client import Client\ndrop(65534, int(sys.argv[2]))\nClient(sys.argv[1])\n"
        r = subprocess.run([PY, "-c", code, d.sock, "65534"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr  # nogroup member may connect
        r = subprocess.run([PY, "-c", code, d.sock, "1"], capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr
    finally:
        assert d.stop() == 0
    assert not os.path.exists(d.sock)


def test_bad_config_fails_before_start(workdir):
    d = DaemonProc(workdir, extra_config="[policy]\nhigh_wm = 0.5\nlow_wm = 0.9\n")
    r = subprocess.run([PY, "-m", "kvtier.daemon", "-c", d.config], capture_output=True, text=True)
    assert r.returncode == 78 and "policy: need 0 < low_wm <= high_wm" in r.stderr
    assert not os.path.exists(d.sock)
    r = subprocess.run([PY, "-m", "kvtier.daemon", "-c", d.config, "--set", "daemon.tick_intervl=1"],
                       capture_output=True, text=True)
    assert r.returncode == 78 and "daemon.tick_intervl: unknown option" in r.stderr


def test_sd_notify_ready_and_watchdog(workdir):
    ns = os.path.join(workdir, "notify.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(ns)
    rx.settimeout(DEADLINE)
    env = dict(os.environ, NOTIFY_SOCKET=ns, WATCHDOG_USEC="200000")
    d = DaemonProc(workdir)
    logf = open(d.log, "ab")
    p = subprocess.Popen([PY, "-m", "kvtier.daemon", "-c", d.config], env=env, stdout=logf, stderr=logf)
    try:
        msgs = []
        while not any(m.startswith("READY=1") for m in msgs):
            msgs.append(rx.recv(4096).decode())
        ready = next(m for m in msgs if m.startswith("READY=1"))
        assert f"MAINPID={p.pid}" in ready and "STATUS=0 regions" in ready
        while "WATCHDOG=1" not in msgs:
            msgs.append(rx.recv(4096).decode())
        p.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in msgs:
            msgs.append(rx.recv(4096).decode())
        assert p.wait(timeout=DEADLINE) == 0
    finally:
        if p.poll() is None:
            p.kill()
        logf.close()
        rx.close()


def held_socket(path: str) -> socket.socket:
    """What systemd's kvtierd.socket holds: a listening socket at ``path``,
    there before the service starts and after it stops."""
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(16)
    return ls


def activated(d: DaemonProc, ls: socket.socket) -> subprocess.Popen:
    """kvtierd started as systemd starts it for kvtierd.socket: ``ls`` as fd 3, LISTEN_FDS/LISTEN_PID."""
    code = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ['LISTEN_FDS'] = '1'; "
            "os.environ['LISTEN_PID'] = str(os.getpid()); "
            "os.execv(sys.executable, [sys.executable, '-m', 'kvtier.daemon', '-c', sys.argv[2]])")
    return subprocess.Popen([PY, "-c", code, str(ls.fileno()), d.config], pass_fds=(ls.fileno(),),
                            stderr=subprocess.DEVNULL)


def test_socket_activation(workdir):
    path = os.path.join(workdir, "activated.sock")
    ls = held_socket(path)
    d = DaemonProc(workdir)
    p = activated(d, ls)
    ls.close()
    try:
        c = wait_for(lambda: _try_client(path), "activated daemon")
        assert c.server["server"] == "kvtierd"
        c.close()
        assert not os.path.exists(d.sock)  # it did not bind its own
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=DEADLINE) == 0


class Stalled(Exception):
    pass


def test_hints_never_wait_for_a_socket_nobody_serves_yet(workdir):
    """Installed as README says, kvtierd.socket keeps the socket listening
    while kvtierd.service restarts (RestartSec=2s, then its start-up): a
    connect succeeds at once and nothing answers until the new daemon runs.
    A hint that reconnected waited there for hello's answer (the client's
    timeout: 10 s of a decode loop). Hints must go on without waiting; once
    the daemon serves the socket they arrive and the same handle works."""
    import mmap as _mmap

    path = os.path.join(workdir, "activated.sock")
    ls = held_socket(path)
    d = DaemonProc(workdir)
    p = activated(d, ls)
    # timeout=None: a client that waits for an answer here waits for good;
    # the alarm turns that into this test's failure instead of a stuck suite.
    c = wait_for(lambda: _try_client(path, timeout=None, hint_ring=False, hint_interval=0), "activated daemon")
    buf = _mmap.mmap(-1, 4 << 20)
    buf.write(b"\1" * len(buf))
    r = c.register(buf, block_size=1 << 20)
    r.hint([0])
    assert c.flush() == []
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=DEADLINE) == 0  # the service is down; the socket stays (ls)

    def stalled(*_):
        raise Stalled("a hint call waited for an answer")

    old = signal.signal(signal.SIGALRM, stalled)
    signal.alarm(30)
    try:
        for b in (1, 2, 3):  # the first finds the connection closed, the next ones connect to the held socket
            r.hint([b])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    p = activated(d, ls)  # the service is back on the same socket
    try:
        assert r.phase("free", [3]) == 1  # same handle: re-adopted from the state file
        assert c.flush() == []
        assert [x["block_hints"] for x in c.regions() if x["id"] == r.id] == [3]  # 1, 2, 3: none lost
        c.close()
    finally:
        ls.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=DEADLINE) == 0


def _try_client(path, **kw):
    try:
        return Client(path, reconnect_timeout=0, **kw)
    except (OSError, KvtierClientError):
        return None


def ctl(daemon, *args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvtier.ctl", "--socket", daemon.sock, *args], capture_output=True, text=True)


def test_kvtierctl_against_the_daemon(counting_daemon):
    daemon = counting_daemon
    with ChildClient(daemon.sock, size=4 << 20) as child:
        r = child("register", name="kv-ctl", tenant="t1")
        child("hint", blocks=[2, 2, 3])
        measured(child)
        rid = str(r["region"])
        regs = json.loads(ctl(daemon, "--json", "regions").stdout)["regions"]
        assert [(x["id"], x["name"], x["blocks_by_tier"]) for x in regs] == [(r["region"], "kv-ctl", {"0": 4})]
        assert "kv-ctl" in ctl(daemon, "regions").stdout and "client" in ctl(daemon, "regions").stdout
        # Blocks 2 and 3 were just hinted (1 MiB each), 0 and 1 never: ">10m".
        (age_row,) = json.loads(ctl(daemon, "--json", "ages").stdout)["rows"]
        assert (age_row["tier"], age_row["tenant"]) == (0, "t1")
        assert sum(age_row["bytes"][:3]) == 2 << 20 and age_row["bytes"][-1] == 2 << 20, age_row
        assert "t1" in ctl(daemon, "ages").stdout and ">10m" in ctl(daemon, "ages").stdout
        b = json.loads(ctl(daemon, "blocks", rid, "--json").stdout)  # --json after the command works too
        assert b["tiers"] == [0, 0, 0, 0] and b["temps"][2] > b["temps"][3] > 0 == b["temps"][0]
        assert b["last_access_age"][0] is None  # never accessed: null, not Infinity
        m = ctl(daemon, "--json", "migrate", rid, "dram", "--blocks", "0-1,3", "--pin")
        assert json.loads(m.stdout) == {"queued": 3, "unmapped": 0, "unmapped_blocks": [], "pinned": 3}
        flags = json.loads(ctl(daemon, "--json", "blocks", rid).stdout)["flags"]
        assert [bool(f & 16) for f in flags] == [True, True, False, True]  # F_MANUAL_PIN
        assert json.loads(ctl(daemon, "--json", "unpin", rid).stdout) == {"blocks": 4}
        assert "plan:" in ctl(daemon, "explain", rid, "2").stdout
        bad = ctl(daemon, "pin", rid, "--tier", "nvme9")
        assert bad.returncode == 1 and "no tier named 'nvme9'" in bad.stderr
        st = json.loads(ctl(daemon, "--json", "status").stdout)
        assert st["regions"] == 1 and st["engine"]["tiers"][0] == "dram"
        assert json.loads(ctl(daemon, "--json", "tiers").stdout)["tiers"][0]["kvtier_blocks"] == 4
    down = subprocess.run([PY, "-m", "kvtier.ctl", "--socket", daemon.sock + ".none", "status"],
                          capture_output=True, text=True)
    assert down.returncode == 3 and "is kvtierd running?" in down.stderr
    topo = subprocess.run([PY, "-m", "kvtier.ctl", "--json", "topology"], capture_output=True, text=True)
    assert json.loads(topo.stdout)["tiers"][0]["kind"] == "dram"


def test_procmap_query_agrees_with_maps_text(tmp_path):
    """The ioctl path and the /proc/PID/maps parser judge every kind of KV
    memory the same way (anonymous, MAP_SHARED anonymous, memfd, /dev/shm)."""
    import mmap as _mmap

    from kvtier.kernel import procfs, procmap
    from kvtier.errors import RangeNotMapped

    pid = os.getpid()
    anon = _mmap.mmap(-1, 1 << 20, flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
    shared = _mmap.mmap(-1, 1 << 20, flags=_mmap.MAP_SHARED | _mmap.MAP_ANONYMOUS)
    mfd = os.memfd_create("kvtier-test")
    os.ftruncate(mfd, 1 << 20)
    memfd = _mmap.mmap(mfd, 1 << 20)
    shm_path = f"/dev/shm/kvtier-test-{pid}"
    with open(shm_path, "wb") as f:
        f.truncate(1 << 20)
    shm = _mmap.mmap(os.open(shm_path, os.O_RDWR), 1 << 20)
    plain = tmp_path / "file"
    plain.write_bytes(b"\0" * (1 << 20))
    filemap = _mmap.mmap(os.open(plain, os.O_RDWR), 1 << 20)
    try:
        import ctypes as _ct
        from kvtier.client import buffer_address

        maps = procfs.read_maps(pid)
        fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY)
        name = _ct.create_string_buffer(procmap.NAME_MAX)
        try:
            mine = {buffer_address(b)[0] for b in (anon, shared, memfd, shm, filemap)}
            same = 0
            for m in maps:
                if m.path == "[vsyscall]":  # not a VMA: PROCMAP_QUERY does not report it
                    continue
                q = procmap._vma(fd, m.start, name)
                if m.start in mine:
                    assert q == m
                # Other mappings of this process may come and go meanwhile
                # (the allocator, garbage-collected buffers of earlier tests).
                same += q == m
            assert same >= len(maps) - 8
        finally:
            os.close(fd)
        for buf in (anon, shared, memfd, shm):
            addr, n = buffer_address(buf)
            procmap.check_range(pid, addr, n)
        addr, n = buffer_address(filemap)
        with pytest.raises(RangeNotMapped, match="not private anonymous or shared memory"):
            procmap.check_range(pid, addr, n)
        with pytest.raises(RangeNotMapped, match="not mapped"):
            procmap.check_range(pid, 4096, 4096)
    finally:
        for b in (anon, shared, memfd, shm, filemap):
            b.close()
        os.close(mfd)
        os.unlink(shm_path)


def test_operator_moves_blocks_to_swap_and_back(swapfile, workdir):
    """The engine's worker really acts: kvtierctl migrate pages blocks out to
    the swap tier (process_madvise) and back in (fault-in + move_pages)."""
    d = DaemonProc(workdir).start()  # swap is on before start: a swap tier exists
    try:
        with ChildClient(d.sock, size=8 << 20) as child, ChildClient(d.sock, size=2 << 20) as pinned:
            rid = str(child("register")["region"])
            measured(child)
            tiers = json.loads(ctl(d, "--json", "tiers").stdout)["tiers"]
            names = [t["name"] for t in tiers]
            swap = next(t["index"] for t in tiers if t["kind"] == "swap")
            r = ctl(d, "--json", "migrate", rid, names[swap], "--blocks", "0-3")
            assert json.loads(r.stdout) == {"queued": 4, "unmapped": 0, "unmapped_blocks": []}, r.stderr
            wait_for(lambda: child("query")["tiers"][:4] == [swap] * 4, "blocks 0-3 in swap")
            assert child("query")["tiers"][4:] == [0] * 4
            with d.client() as c:
                assert c.stats()["migrations"].get(f"0:{swap}") == 4
            # All 8 are queued; only the 4 in swap move (the counter below says so).
            assert json.loads(ctl(d, "--json", "migrate", rid, "0").stdout)["queued"] == 8
            wait_for(lambda: child("query")["tiers"] == [0] * 8, "blocks back in DRAM")
            with d.client() as c:
                assert c.stats()["migrations"].get(f"{swap}:0") == 4
            # The policy itself: blocks pinned to DRAM but found in swap are planned
            # back (after the policy's minimum residence time) without an operator move.
            ctl(d, "migrate", rid, str(swap), "--blocks", "4-5")
            wait_for(lambda: child("query")["tiers"][4:6] == [swap] * 2, "blocks 4-5 in swap")
            assert json.loads(ctl(d, "--json", "pin", rid, "--tier", "0", "--blocks", "4-5").stdout) == {"blocks": 2}
            wait_for(lambda: child("query")["tiers"] == [0] * 8, "policy moved pinned blocks home")
            with d.client() as c:
                assert c.stats()["migrations"].get(f"{swap}:0") == 6
            # A never_swap region refuses the operator's move to swap.
            p = pinned("register", constraints=["never_swap"])
            bad = ctl(d, "migrate", str(p["region"]), str(swap))
            assert bad.returncode == 1 and "never_swap" in bad.stderr
    finally:
        assert d.stop() == 0


def test_discarded_blocks_leave_swap_unread_and_come_back_as_new_blocks(swapfile, workdir):
    """Phase discard through the client: the dead blocks' pages are dropped
    in the owner (their swap slots freed without a swap-in), the daemon
    takes them as never touched and plans nothing for them, and a write into
    the slot is a new block measured where first touch put it. Without the
    drop the daemon finds the pages again (data to the kernel)."""
    d = DaemonProc(workdir).start()
    try:
        with ChildClient(d.sock, size=8 << 20) as child:
            rid = str(child("register")["region"])
            measured(child)
            tiers = json.loads(ctl(d, "--json", "tiers").stdout)["tiers"]
            swap = next(t["index"] for t in tiers if t["kind"] == "swap")
            ctl(d, "migrate", rid, str(swap), "--blocks", "0-3")
            wait_for(lambda: child("query")["tiers"][:4] == [swap] * 4, "blocks 0-3 in swap")
            before = child("smaps")
            assert before["Swap"] >= 3 * 1024, before
            assert child("discard", blocks=[0, 1])["blocks"] == 2
            after = child("smaps")
            # 2 MiB of swap freed, nothing read back in
            assert after["Swap"] <= before["Swap"] - 2 * 1024 + 64, (before, after)
            assert after["Rss"] <= before["Rss"] + 64, (before, after)
            with d.client() as c:
                moves = c.stats()["migrations"]
            ctl(d, "measure", rid)
            never = 1 << 5

            def blocks():
                return json.loads(ctl(d, "--json", "blocks", rid).stdout)

            wait_for(lambda: (b := blocks())["tiers"][:4] == [-1, -1, swap, swap]
                     and all(f & never for f in b["flags"][:2]), "discarded blocks never touched")
            # an operator's move of the whole region moves the live blocks only
            assert json.loads(ctl(d, "--json", "migrate", rid, "0").stdout)["queued"] == 8
            wait_for(lambda: child("query")["tiers"] == [-1, -1] + [0] * 6, "live blocks back in DRAM")
            with d.client() as c:
                st = c.stats()
            assert st["migrations"].get(f"{swap}:0", 0) - moves.get(f"{swap}:0", 0) == 2, st["migrations"]
            assert st["migration_failed_pages"] == {}, st["migration_failed_pages"]
            # the slot's next write is a new block, where first touch put it
            assert child("write", block=0)["errors"] == []
            wait_for(lambda: child("query")["tiers"][0] == 0, "the new block measured in DRAM")
            # without the drop the pages are still there: data again
            ctl(d, "migrate", rid, str(swap), "--blocks", "2")
            wait_for(lambda: child("query")["tiers"][2] == swap, "block 2 in swap")
            assert child("discard", blocks=[2], drop=False)["blocks"] == 1
            ctl(d, "measure", rid)
            wait_for(lambda: child("query")["tiers"][2] == swap, "undropped block found in swap again")
    finally:
        assert d.stop() == 0


def test_register_buffer_objects(daemon):
    """numpy arrays (not page-aligned: malloc'ed), MAP_SHARED memfd mmaps and
    read-only buffers all register by the buffer protocol."""
    import mmap as _mmap

    import numpy as np

    with daemon.client() as c:
        arr = np.ones(3 << 20, dtype=np.uint8)
        ra = c.register(arr, block_size=1 << 20, name="numpy")
        assert (ra.start, ra.length, ra.nblocks) == (arr.ctypes.data, arr.nbytes, 3)
        fd = os.memfd_create("kv")
        os.ftruncate(fd, 4 << 20)
        shared = _mmap.mmap(fd, 4 << 20)
        rs = c.register(shared, block_size=1 << 20, tenant="t")
        ro = np.frombuffer(shared, dtype=np.uint8)[: 1 << 20]  # read-only view of the same memory
        with pytest.raises(KvtierClientError) as ei:
            c.register(ro, block_size=1 << 20)
        assert ei.value.code == "overlap"
        del ei, ro  # the traceback's frames would keep the view (and its export) alive
        with pytest.raises(ValueError, match="C-contiguous"):
            c.register(arr.reshape(3, -1)[:, ::2], block_size=1 << 20)
        names = {r["name"] for r in c.request("regions")["regions"]}
        assert names == {"numpy", ""}
        with ra, rs:
            pass  # the context manager unregisters
        assert c.request("regions")["regions"] == []
        shared.close()  # no export left behind by the client library
        os.close(fd)


def test_pipelined_hints_survive_a_daemon_restart(daemon):
    import mmap as _mmap

    c = daemon.client(reconnect_timeout=30)
    buf = _mmap.mmap(-1, 4 << 20)
    buf.write(b"\1" * len(buf))
    r = c.register(buf, block_size=1 << 20)
    r.hint([0, 1])
    assert c.flush() == []
    daemon.stop()
    daemon.start()
    for _ in range(3):  # sent into the dead connection or the new one: never an exception
        r.hint([2, 3])
        c.flush()
    r.hint([3])
    assert c.flush() == []
    assert r.query().size == 4  # same handle, re-adopted region
    c.close()


def test_a_daemon_that_stays_away_costs_one_reconnect_wait_not_one_per_call(daemon):
    """An engine calls phase/discard/prefetch as requests finish. With the
    daemon stopped for good, the first such call waits reconnect_timeout
    for a restart and raises DaemonUnavailable; the later ones raise at
    once (before, each waited the whole reconnect_timeout again: an engine
    calling phase per finished request stalled 30 s per request). Hints
    never raise meanwhile, and once the daemon is back the same handle
    works again and the hints made while it was away arrive."""
    import mmap as _mmap

    from kvtier.client import DaemonUnavailable

    c = daemon.client(reconnect_timeout=1.0)
    buf = _mmap.mmap(-1, 4 << 20)
    buf.write(b"\1" * len(buf))
    r = c.register(buf, block_size=1 << 20)
    hs = r.hint_set([0])
    assert daemon.stop() == 0
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        r.phase("free", [1])
    assert 0.9 < time.monotonic() - t0 < 10
    for call in (lambda: r.phase("free", [1]), lambda: r.prefetch([1]), lambda: r.discard([2]), c.status):
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            call()
        assert time.monotonic() - t0 < 0.5
    r.hint([3])  # never raises, never waits
    hs.touch()
    daemon.start()
    assert r.phase("free", [1]) == 1  # same handle: the daemon re-adopted the region
    assert c.flush() == []
    assert [x["block_hints"] for x in c.regions() if x["id"] == r.id] == [2]
    c.close()


def test_hints_never_block_on_a_stalled_daemon(daemon):
    """A daemon that stops reading (SIGSTOP here; a long GC or a starved CPU
    in real life) must not stall the engine's hint calls: what the socket
    cannot take queues up to hint_queue_max, the oldest is dropped and
    counted, and everything else arrives once the daemon runs again."""
    import mmap as _mmap

    import numpy as np

    c = daemon.client(hint_batch=4096, hint_queue_max=1 << 18)
    buf = _mmap.mmap(-1, 64 << 20)
    r = c.register(buf, block_size=4096)
    blocks = np.arange(4096, dtype=np.uint32)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        # A blocking client would hang here for good (the daemon never reads):
        # the alarm turns that into a failure instead of a stuck suite.
        signal.alarm(120)
        for _ in range(2000):  # 8 M block hints, far more than the socket buffers hold
            r.hint(blocks)
        signal.alarm(0)
        assert c.hints_dropped > 0
        assert c._hint_queued <= (1 << 18)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert c.flush() == []
    sent = 2000 * 4096 - c.hints_dropped
    assert c.stats()["block_hints_total"] == sent
    c.close()


def test_measure_on_demand_measures_every_page(daemon):
    """kvtierctl measure: the region's blocks are measured page by page with
    the next ticks, outside the residency budget."""
    import mmap as _mmap

    c = daemon.client()
    buf = _mmap.mmap(-1, 32 << 20)
    buf.write(b"\1" * len(buf))
    r = c.register(buf, block_size=2 << 20)
    before = c.stats()["residency_full_blocks_total"]
    out = ctl(daemon, "--json", "measure", str(r.id))
    assert json.loads(out.stdout)["queued"] == 16
    wait_for(lambda: c.stats()["residency_full_blocks_total"] - before >= 16, "the 16 blocks measured whole")
    assert (r.query() == 0).all()  # every block in DRAM (tier 0), as this one-node host has it
    r.unregister()
    c.close()


def test_never_written_blocks_are_never_touched_not_failed_moves(swapfile, workdir):
    """Half a region written, half only read (read faults map the kernel's
    zero page: move_pages answers EFAULT). On main the read half measured
    tier -1 without the never-touched flag, and moving the region counted
    EFAULT and NOT_PAGED_OUT failures (the issue saw 304 in one run)."""
    from kvchild import KVChild

    d = DaemonProc(workdir).start()
    half = 4 << 20
    try:
        with KVChild(2 * half, "--sparse") as kv, ChildClient(d.sock, size=1 << 20) as owner:
            assert kv.ask(f"write 0 {half} 7") == "ok"
            assert kv.ask(f"touch {half} {half}").startswith("ok")
            rid = str(owner("register_raw", addr=kv.addr, length=kv.size, pid=kv.pid)["region"])  # 1 MiB blocks
            ctl(d, "measure", rid)

            def blocks():
                return json.loads(ctl(d, "--json", "blocks", rid).stdout)

            never = 1 << 5  # flag 5 of `blocks`: never touched
            wait_for(lambda: (b := blocks())["tiers"][:4] == [0] * 4
                     and all(f & never for f in b["flags"][4:]), "written half in DRAM, read half never touched")
            b = blocks()
            assert b["tiers"][4:] == [-1] * 4 and not any(f & never for f in b["flags"][:4])
            text = ctl(d, "blocks", rid).stdout.splitlines()
            assert all(line.split()[3] == "-" for line in text[1 + 4 : 1 + 8]), text
            assert "no page touched yet" in ctl(d, "explain", rid, "6").stdout

            tiers = json.loads(ctl(d, "--json", "tiers").stdout)["tiers"]
            swap = next(t for t in tiers if t["kind"] == "swap")
            assert json.loads(ctl(d, "--json", "migrate", rid, swap["name"]).stdout)["queued"] == 8
            wait_for(lambda: blocks()["tiers"][:4] == [swap["index"]] * 4, "written half in swap")
            assert json.loads(ctl(d, "--json", "migrate", rid, "0").stdout)["queued"] == 8
            wait_for(lambda: blocks()["tiers"][:4] == [0] * 4, "written half back")
            time.sleep(0.5)  # a few more ticks: nothing retried, nothing failed
            with d.client() as c:
                st = c.stats()
            assert st["migration_failed_pages"] == {}, st["migration_failed_pages"]
            assert st["migrations"] == {f"0:{swap['index']}": 4, f"{swap['index']}:0": 4}, st["migrations"]
            b = blocks()
            assert b["tiers"][4:] == [-1] * 4 and all(f & never for f in b["flags"][4:])
            assert kv.ask(f"touch 0 {half}") == f"ok {7 * half // 4096}"
    finally:
        assert d.stop() == 0
