"""kvtierd's newer ops and paths attacked by an unprivileged local user
(staged registration, scheduler hints, engine-mode moves): real daemon run
as root, a real ``nobody`` client over the real unix socket. Each test is
the regression test of one defect found; on the code before its fix it
fails (the commit that added it says how).
"""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from kvtier import protocol

from test_attacks import _connect, protocol_addr, raw_call
from test_daemon import DEADLINE, DROP, NOBODY, ChildClient, DaemonProc, PY, wait_for, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

# As nobody: maps ``n`` large untouched ranges and sends a register of each
# on a connection of its own. With "close" it closes those connections at
# once (the answers are never read); else it keeps them, and on "count"
# says how many answers have arrived so far, on "read" reads them all.
STAGER = DROP + r"""
import json, mmap, select, socket, msgspec
from kvtier import protocol
from kvtier.client import buffer_address
sock_path, n, nblocks, close = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "close"
drop(65534, 65534)
bufs = [mmap.mmap(-1, nblocks * 4096) for _ in range(n)]
socks = []
for i, b in enumerate(bufs):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(protocol.frame(msgspec.msgpack.encode(
        {"op": "register", "id": i + 1, "start": buffer_address(b)[0], "length": nblocks * 4096,
         "block_size": 4096})))
    socks.append(s)
if close:
    for s in socks:
        s.close()
print(json.dumps({"sent": n}), flush=True)
for line in sys.stdin:
    if line.strip() == "count":
        ready = [s for s in socks if select.select([s], [], [], 0)[0]]
        print(json.dumps({"answered": len(ready)}), flush=True)
    elif line.strip() == "read":
        res = []
        for s in socks:
            r, out = protocol.FrameReader(1 << 20), []
            while not out:
                out += r.feed(s.recv(1 << 16))
            res.append(protocol.decode_response(out[0]).ok)
        print(json.dumps({"ok": res}), flush=True)
"""


def _status(sock: str) -> dict:
    s = _connect(sock)
    try:
        return raw_call(s, protocol.FrameReader(1 << 30), {"op": "status", "id": 1}).result
    finally:
        s.close()


def test_staged_registers_of_closed_connections_are_dropped_and_uids_take_turns(workdir):
    """A large register is written a step per loop turn, one at a time, in
    arrival order. Before the fix a user could (a) send large registers and
    close the connections at once: every one was still written and added
    (8 regions nobody asked for any more, counted against the limits and
    taking the loop's steps), and (b) keep 8 such registers queued so that
    root's large register, sent after them, was answered after all 8. Now
    the registrations of a closed connection are dropped and uids take
    turns: root's waits for at most the one being written."""
    nblocks = 1 << 18  # 32 steps each
    d = DaemonProc(workdir).start()
    import mmap

    closed = kept = None
    mine = mmap.mmap(-1, nblocks * 4096)
    try:
        closed = subprocess.Popen([PY, "-c", STAGER, d.sock, "8", str(nblocks), "close"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(closed.stdout.readline())["sent"] == 8
        kept = subprocess.Popen([PY, "-c", STAGER, d.sock, "8", str(nblocks), "keep"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(kept.stdout.readline())["sent"] == 8
        s = _connect(d.sock)
        r = raw_call(s, protocol.FrameReader(1 << 30),
                     {"op": "register", "id": 9, "start": protocol_addr(mine), "length": nblocks * 4096,
                      "block_size": 4096})
        assert r.ok and r.result["blocks"] == nblocks, r
        kept.stdin.write("count\n")
        kept.stdin.flush()
        ahead = json.loads(kept.stdout.readline())["answered"]
        assert ahead <= 2, f"root's register was answered after {ahead} of another uid's 8 queued before it"
        kept.stdin.write("read\n")
        kept.stdin.flush()
        assert json.loads(kept.stdout.readline())["ok"] == [True] * 8
        st = _status(d.sock)
        # root's + the 8 kept; none of the 8 whose client closed the connection
        assert st["regions"] == 9, st
        assert st["blocks"] == 9 * nblocks, st
        s.close()
    finally:
        for p in (closed, kept):
            if p is not None:
                p.kill()
                p.wait()
        mine.close()
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()


def test_a_region_larger_than_the_recording_file_keeps_the_recorder_bounded(workdir):
    """With [record] on, each new file repeats every live block. Before the
    fix, once those lines alone exceeded record.max_bytes the repeat itself
    rotated the file, which repeated them again: a nobody's register of
    4,096 blocks (16 MiB of untouched memory) hit RecursionError inside the
    registry (internal_error, a Traceback in the log, the region half added).
    Now a file rotates only when it also holds as much new as repeated:
    every request answers, and the files stay few and bounded."""
    rec = os.path.join(workdir, "rec")
    d = DaemonProc(workdir, f'[record]\nenabled = true\ndir = "{rec}"\nmax_bytes = 4096\nfiles = 3\n').start()
    try:
        with ChildClient(d.sock, size=16 << 20, block_size=4096, user=NOBODY) as child:
            r = child("register")
            assert "error" not in r, r
            for i in range(20):
                assert child("hint", blocks=list(range(i * 200, i * 200 + 200)))["errors"] == []
            assert len(child("query")["tiers"]) == 4096
            assert child("unregister") == {"ok": True}
        st = _status(d.sock)
        assert st["regions"] == 0 and st["blocks"] == 0, st
        names = sorted(os.listdir(rec))
        assert names == ["kvtier.csv", "kvtier.csv.1", "kvtier.csv.2"][:len(names)], names
        sizes = [os.path.getsize(os.path.join(rec, n)) for n in names]
        # 4,096 live blocks are ~0.3 MB of lines: a file holds at most about
        # twice that (the repeat and as much new), not one rotation per write.
        assert max(sizes) < 2 << 20, sizes
    finally:
        assert d.stop() == 0
        log = d.read_log()
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
