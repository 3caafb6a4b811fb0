#!/usr/bin/env python3
"""Run kvtierd with every event-loop callback timed: where a client waits.

    python scripts/bench/loop_profile.py OUT.json -- <kvtierd arguments>

Wraps asyncio's Handle._run (every ready callback: socket reads, turns,
timers, task steps) and records, per callback name and peer uid, the count
and the wall and thread-CPU time each took, every callback over 1 ms with its perf_counter start time
(to line up with a client's slow requests), and every request whose
handler took over 1 ms with its op and uid. A callback whose wall time is
far above its CPU time was waiting for the GIL (a daemon thread held it) or
for a CPU (the host is busy); one whose CPU time is long is work done on the
loop that every other client waits behind. Written to OUT.json when the
daemon exits (SIGTERM). robustness.py --loop-profile uses it.
"""

from __future__ import annotations

import asyncio.events
import collections
import json
import sys
import time

import numpy as np

EDGES_MS = (0.1, 0.5, 1, 2, 5, 10, 20, 50, 100)


def _name(cb) -> str:
    owner = getattr(cb, "__self__", None)
    name = getattr(cb, "__qualname__", None) or type(cb).__name__
    uid = None
    proto = getattr(owner, "_protocol", owner)
    peer = getattr(proto, "peer", None)
    if peer is not None:
        uid = peer.uid
    if name.endswith("_read_ready") or name.endswith("_read_ready__data_received") or name.endswith("_write_ready"):
        name = f"{type(owner).__name__}.{cb.__name__}"
    return name if uid is None else f"{name} uid={uid}"


def install(out_path: str) -> None:
    wall: dict[str, list[float]] = collections.defaultdict(list)
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    slow: list[tuple[float, str, float, float]] = []
    orig = asyncio.events.Handle._run

    def _run(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return orig(self)
        finally:
            w, c = time.perf_counter() - t0, time.thread_time() - c0
            key = _name(self._callback)
            wall[key].append(w)
            cpu[key].append(c)
            if w > 0.001:
                slow.append((t0, key, w * 1e3, c * 1e3))

    asyncio.events.Handle._run = _run

    # Which request a slow callback was serving: ops over 1 ms, by op and uid.
    from kvtier import server

    handle = server.ControlAPI.handle
    slow_ops: list[tuple[float, str, int, float, float]] = []

    def timed_handle(self, peer, req):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return handle(self, peer, req)
        finally:
            w = time.perf_counter() - t0
            if w > 0.001:
                slow_ops.append((t0, req.__struct_config__.tag, peer.uid, w * 1e3, (time.thread_time() - c0) * 1e3))

    server.ControlAPI.handle = timed_handle

    def dump() -> None:
        rows = {}
        for k, ws in wall.items():
            w = np.array(ws) * 1e3
            c = np.array(cpu[k]) * 1e3
            rows[k] = {"n": int(w.size), "wall_ms_total": float(w.sum()), "cpu_ms_total": float(c.sum()),
                       "wall_p99_ms": float(np.percentile(w, 99)), "wall_max_ms": float(w.max()),
                       "cpu_max_ms": float(c.max()),
                       "over_ms": {str(e): int((w > e).sum()) for e in EDGES_MS if (w > e).any()}}
        with open(out_path, "w") as f:
            json.dump({"callbacks": dict(sorted(rows.items(), key=lambda kv: -kv[1]["wall_ms_total"])),
                       "slow": slow, "slow_ops": slow_ops}, f, indent=1)

    import atexit
    atexit.register(dump)


def main() -> int:
    out, sep, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--", __doc__
    install(out)
    from kvtier import daemon
    return daemon.main(rest)


if __name__ == "__main__":
    sys.exit(main())
