"""kvtierd attacked by an unprivileged local user through the mappings
behind its regions and through requests that are valid per
docs/protocol.md: real daemon run as root, a real ``nobody`` client over
the real unix socket. Each test is the regression test of one defect; on
the code before its fix it fails (the commit that added it says how).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvtier import protocol

from test_attacks import _connect, raw_call
from test_daemon import DROP, DaemonProc, PY, daemon, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

# As nobody: registers 4 MiB of anonymous memory, then maps the file argv[2]
# (which it may read, not write) over the region with MAP_FIXED, faults its
# pages in by reading them, and asks for the region to be moved to swap.
REMAP = DROP + r"""
import ctypes, json, mmap
from kvtier.client import Client, KvtierClientError
sock_path, victim = sys.argv[1], sys.argv[2]
drop(65534, 65534)
size = 4 << 20
buf = mmap.mmap(-1, size)
buf.write(b"\1" * size)
c = Client(sock_path)
r = c.register(buf, block_size=1 << 20)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(victim, os.O_RDONLY)
got = libc.mmap(r.start, size, mmap.PROT_READ, mmap.MAP_SHARED | 0x10, fd, 0)  # MAP_FIXED
assert got == r.start, ctypes.get_errno()
view = (ctypes.c_char * size).from_address(r.start)
sum(view[i] != b"\0" for i in range(0, size, 4096))  # every page mapped here
swap = next(t["index"] for t in c.request("tiers")["tiers"] if t["kind"] == "swap")
try:
    out = c.request("migrate", region=r.id, tier=swap, wait=True)
except KvtierClientError as e:
    out = {"error": e.code}
print(json.dumps(out), flush=True)
sys.stdin.read()  # alive until the test has looked
"""


def _cached_bytes(path: str) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def test_a_file_mapped_over_a_region_is_never_paged_out_by_the_daemon(workdir, swapfile):
    """The kernel lets a process page out (MADV_PAGEOUT) the page cache of
    a file only if it could write the file (mm/madvise.c,
    can_do_file_pageout: an eviction side channel otherwise), and judges
    the caller of process_madvise, here the root daemon. A user who maps a
    root-owned read-only file over its registered region then had the
    daemon evict that file from the page cache with `migrate` to swap: the
    moves checked only that the range was mapped, not that it was still
    the private anonymous or shared memory registration had accepted."""
    victim = os.path.join(workdir, "victim")
    with open(victim, "wb", buffering=0) as f:
        for _ in range(1024):  # page by page: small folios, which MADV_PAGEOUT takes
            f.write(os.urandom(4096))
        os.fsync(f.fileno())
    os.chmod(victim, 0o644)  # root's: nobody may read it, not write it
    with open(victim, "rb") as f:
        f.read()  # all of it in the page cache
    assert _cached_bytes(victim) == 4 << 20
    d = DaemonProc(workdir).start()
    try:
        p = subprocess.Popen([PY, "-c", REMAP, d.sock, victim], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert line, f"the client died: rc={p.wait()}"
        out = json.loads(line)
        assert not out.get("pages_moved"), out
        assert _cached_bytes(victim) == 4 << 20, f"the daemon evicted a file nobody may not write: {out}"
        p.stdin.close()
        assert p.wait(timeout=30) == 0
    finally:
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()


def test_allocate_names_a_tier_by_ascii_digits_only(daemon):
    """allocate's `tier` is "auto", a tier name or a tier index as a
    string. str.isdigit() also takes "²" (which int() refuses: the request
    was answered internal_error, with a Traceback in the log) and "١"
    (Arabic-Indic one, taken as tier 1)."""
    s = _connect(daemon.sock)
    reader = protocol.FrameReader(1 << 30)
    try:
        for spec in ("²", "١", "0x1", " 1"):
            r = raw_call(s, reader, {"op": "allocate", "id": 5, "start": 1 << 30, "length": 1 << 20,
                                     "block_size": 1 << 20, "tier": spec})
            assert (r.id, r.ok, r.error.code) == (5, False, "invalid_argument"), (spec, r)
            assert "no tier" in r.error.message, (spec, r.error.message)
    finally:
        s.close()


def test_clients_trickling_a_request_do_not_hold_the_metrics_exporter(workdir):
    """The exporter's socket timeout restarts with every byte: four local
    clients sending a request a byte every second held its four worker
    threads for good, and every scrape waited behind them (seen: a scrape
    with a 15 s timeout failed while they trickled). The request line and
    headers now have HTTP_TIMEOUT in all; the daemon then hangs up on the
    trickler, and a scrape is answered while they go on."""
    import socket
    import threading
    import time

    from kvtier.metrics import HTTP_WORKERS
    from test_attacks import _scrape
    from test_daemon import wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProc(workdir)
    d.write_config(f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n')
    # The base config turns metrics off; this test's table replaces it.
    text = open(d.config).read().replace("[metrics]\nenabled = false\n", "", 1)
    open(d.config, "w").write(text)
    d.start()
    url = f"http://127.0.0.1:{port}/metrics"
    stop = threading.Event()
    cut = []

    def hung_up(c: socket.socket) -> bool:
        try:
            return c.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False  # open, nothing to read

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            try:
                for ch in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 100_000:
                    if stop.is_set():
                        return
                    c.send(bytes([ch]))
                    if hung_up(c):
                        break
                    time.sleep(0.5)
            except OSError:
                pass  # reset or EPIPE: the daemon hung up
            cut.append(True)

    def trickle_loop() -> None:
        while not stop.is_set():
            trickle()

    try:
        threads = [threading.Thread(target=trickle_loop, daemon=True) for _ in range(HTTP_WORKERS)]
        for t in threads:
            t.start()
        wait_for(lambda: len(cut) >= HTTP_WORKERS, "the daemon to hang up on the trickling clients")
        assert b"kvtier_connections" in wait_for(lambda: _scrape(url), "a scrape while they trickle")
    finally:
        stop.set()
        assert d.stop() == 0
