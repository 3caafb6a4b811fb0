"""Whole-region ops on a huge region must not hold kvtierd's loop (issue 12:
one client never slows the others). Real daemon run as root, a real
``nobody`` client over the real unix socket with a 4 Mi-block region (16 GiB
of untouched address space in 4 KiB blocks, within the default limits).

Before the fix one ~30-byte request naming no ``blocks`` (phase, pin,
release, measure...) made the loop work for hundreds of ms to seconds in
one go, and every other client's request waited all that time. Now such an
op runs OP_STEP_BLOCKS blocks per loop iteration: the other client is
answered between the steps. Not a timed assertion on an absolute speed:
the longest wait of the other client's answers is compared with the op's
own duration, measured in the same run.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import msgspec
import pytest

from kvtier import protocol

from test_attacks import _connect, raw_call
from test_daemon import DROP, PY, DaemonProc, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

NBLOCKS = 4 << 20

# As nobody: maps NBLOCKS untouched 4 KiB pages, registers them, says the
# region; then per stdin line (a request without id and region) sends it
# on the region and says when it was sent and answered (CLOCK_MONOTONIC,
# the same clock as the test's) and the answer.
ATTACKER = DROP + r"""
import json, mmap, socket, time, msgspec
from kvtier import protocol
from kvtier.client import buffer_address
sock_path, nblocks = sys.argv[1], int(sys.argv[2])
drop(65534, 65534)
buf = mmap.mmap(-1, nblocks * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)  # MAP_NORESERVE
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
reader = protocol.FrameReader(1 << 30)
def call(req):
    s.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    out = []
    while not out:
        out += reader.feed(s.recv(1 << 20))
    return protocol.decode_response(out[0])
r = call({"op": "register", "id": 1, "start": buffer_address(buf)[0], "length": nblocks * 4096, "block_size": 4096})
assert r.ok, r
region = r.result["region"]
print(json.dumps({"region": region}), flush=True)
for i, line in enumerate(sys.stdin):
    req = {**json.loads(line), "id": i + 2, "region": region}
    t0 = time.monotonic()
    r = call(req)
    t1 = time.monotonic()
    print(json.dumps({"t0": t0, "t1": t1, "ok": r.ok, "result": r.result if r.ok else str(r.error)}), flush=True)
"""

OPS = [
    {"op": "phase", "phase": "free"},
    {"op": "phase", "phase": "discard"},
    {"op": "pin"},
    {"op": "unpin"},
    {"op": "release"},
    {"op": "prefetch"},
    {"op": "measure"},
]


class Watcher(threading.Thread):
    """Root's own connection asking ``stats`` back to back; the times its
    answers arrive."""

    def __init__(self, sock: str):
        super().__init__(daemon=True)
        self.s = _connect(sock)
        self.answers: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        reader = protocol.FrameReader(1 << 30)
        i = 0
        while not self.stop.is_set():
            i += 1
            r = raw_call(self.s, reader, {"op": "stats", "id": i})
            assert r.ok, r
            self.answers.append(time.monotonic())

    def longest_wait(self, t0: float, t1: float) -> float:
        """The longest time in [t0, t1] without an answer."""
        inside = [t for t in self.answers if t0 < t < t1]
        edges = [t0, *inside, t1]
        return max(b - a for a, b in zip(edges, edges[1:]))


def test_whole_region_ops_on_a_huge_region_do_not_hold_other_clients(workdir):
    d = DaemonProc(workdir, args=("--set", "daemon.tick_interval=1.0")).start()
    attacker = watcher = None
    try:
        attacker = subprocess.Popen([PY, "-c", ATTACKER, d.sock, str(NBLOCKS)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = attacker.stdout.readline()
        assert line, f"the attacker died (rc={attacker.poll()})"
        watcher = Watcher(d.sock)
        watcher.start()
        time.sleep(0.2)
        seen = {}
        for op in OPS:
            # The best of three: a gap can also be this busy host preempting
            # the daemon; an op holding the loop makes every try's gap its
            # whole duration.
            ratios = []
            for _ in range(3):
                attacker.stdin.write(json.dumps(op) + "\n")
                attacker.stdin.flush()
                got = json.loads(attacker.stdout.readline())
                assert got["ok"], (op, got)
                took = got["t1"] - got["t0"]
                wait = watcher.longest_wait(got["t0"], got["t1"])
                ratios.append((wait / took, wait, took))
                if wait < took / 4:
                    break
            seen[json.dumps(op)] = (got["result"], min(ratios))
        bad = {k: v for k, v in seen.items() if v[1][0] >= 0.25}
        assert not bad, f"another client waited a quarter of the op or more (ratio, wait s, op s): {bad}"
        # Same answers as before the steps: every block counted once.
        assert seen[json.dumps(OPS[0])][0] == {"blocks": NBLOCKS}
        assert seen[json.dumps({"op": "pin"})][0] == {"blocks": NBLOCKS}
        assert seen[json.dumps({"op": "measure"})][0] == {"queued": NBLOCKS}
        rel = seen[json.dumps({"op": "release"})][0]
        assert sum(rel.values()) == NBLOCKS, rel
        print({k: (round(v[1][1], 4), round(v[1][2], 4)) for k, v in seen.items()})
    finally:
        if watcher is not None:
            watcher.stop.set()
            watcher.join(timeout=30)
        if attacker is not None:
            attacker.kill()
            attacker.wait()
        assert d.stop() == 0
        log = d.read_log()
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
