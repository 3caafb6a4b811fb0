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

With KVTIER_TRACE_UID=N in the environment it also keeps a timeline
(robustness.py --trace): every callback with its start, wall time, and the
loop thread's run and run-queue wait from /proc/thread-self/schedstat (so
wall = run + waiting for a CPU + asleep, and asleep inside a callback is
waiting for the GIL or a blocking call), every request handled (start, end,
op, uid, connection), every read of a connection of uid N, and the daemon's
threads by native id and name.
"""

from __future__ import annotations

import asyncio.events
import collections
import json
import os
import sys
import threading
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


def _conn_of(cb) -> int:
    owner = getattr(cb, "__self__", None)
    proto = getattr(owner, "_protocol", owner)
    peer = getattr(proto, "peer", None)
    return id(peer) if peer is not None else 0


def install(out_path: str) -> None:
    wall: dict[str, list[float]] = collections.defaultdict(list)
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    slow: list[tuple[float, str, float, float]] = []
    orig = asyncio.events.Handle._run
    trace_uid = os.environ.get("KVTIER_TRACE_UID")
    timeline: list[tuple] = []  # (t0, wall_s, run_ns, wait_ns, key, conn)
    requests: list[tuple] = []  # (t0, t1, op, uid, conn)
    reads: list[tuple] = []  # (t, conn, nbytes) for uid trace_uid
    turns: list[tuple] = []  # (t0, t1, uid, conn): one connection's turn, in data_received or queued
    sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY) if trace_uid is not None else -1

    thread_names: dict[int, str] = {}
    if trace_uid is not None:
        # named at start: pool threads may have exited by the time we dump
        bootstrap = threading.Thread._bootstrap_inner

        def named_bootstrap(self):
            thread_names[threading.get_native_id()] = self.name
            return bootstrap(self)

        threading.Thread._bootstrap_inner = named_bootstrap

    def _sched() -> tuple[int, int]:
        run, wait, _ = os.pread(sched_fd, 80, 0).split()
        return int(run), int(wait)

    def _run(self):
        cb = self._callback  # read first: a handle cancelled while it runs has None here afterwards
        t0, c0 = time.perf_counter(), time.thread_time()
        if sched_fd >= 0:
            r0, q0 = _sched()
        try:
            return orig(self)
        finally:
            w, c = time.perf_counter() - t0, time.thread_time() - c0
            key = _name(cb)
            wall[key].append(w)
            cpu[key].append(c)
            if w > 0.001:
                slow.append((t0, key, w * 1e3, c * 1e3))
            if sched_fd >= 0:
                r1, q1 = _sched()
                timeline.append((t0, w, r1 - r0, q1 - q0, key, _conn_of(cb)))

    asyncio.events.Handle._run = _run

    # The cyclic garbage collector runs inside whatever callback allocates
    # when a generation fills: every collection on the loop thread over
    # 0.2 ms (start, ms, generation, objects collected).
    import gc

    collections_: list[tuple[float, float, int, int]] = []
    gc_start = [0.0]
    loop_ident = threading.main_thread().ident

    def on_gc(phase, info):
        if threading.get_ident() != loop_ident:
            return
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            ms = (time.perf_counter() - gc_start[0]) * 1e3
            if ms > 0.2:
                collections_.append((gc_start[0], ms, info["generation"], info["collected"]))

    gc.callbacks.append(on_gc)

    # Which request a slow callback was serving: ops over 1 ms, by op and uid.
    from kvtier import server

    handle = server.ControlAPI.handle
    slow_ops: list[tuple[float, str, int, float, float]] = []

    def timed_handle(self, peer, req):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return handle(self, peer, req)
        finally:
            t1 = time.perf_counter()
            w = t1 - t0
            if w > 0.001:
                slow_ops.append((t0, req.__struct_config__.tag, peer.uid, w * 1e3, (time.thread_time() - c0) * 1e3))
            if sched_fd >= 0:
                requests.append((t0, t1, req.__struct_config__.tag, peer.uid, id(peer)))

    server.ControlAPI.handle = timed_handle

    if trace_uid is not None:
        want = int(trace_uid)
        data_received = server.Connection.data_received

        def traced_data_received(self, data):
            if self.peer is not None and self.peer.uid == want:
                reads.append((time.perf_counter(), id(self.peer), len(data)))
            return data_received(self, data)

        server.Connection.data_received = traced_data_received
        turn = server.Connection._turn

        def traced_turn(self, queued=True):
            t0 = time.perf_counter()
            try:
                return turn(self, queued)
            finally:
                if self.peer is not None:
                    turns.append((t0, time.perf_counter(), self.peer.uid, id(self.peer)))

        server.Connection._turn = traced_turn

    # KVTIER_PROFILE_SLOW=MS: cProfile each engine tick, summary refresh and
    # request handler; keep the profiles of calls over MS milliseconds (the
    # functions they spent their time in, written as OUT.json.NAME.txt).
    slow_profiles: dict[str, "pstats.Stats"] = {}
    slow_ms = float(os.environ.get("KVTIER_PROFILE_SLOW", "0"))
    if slow_ms:
        import cProfile
        import functools
        import pstats
        from kvtier import daemon as daemon_mod, engine as engine_mod

        def profiled(name_of, fn):
            @functools.wraps(fn)
            def wrapper(*args, **kw):
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                try:
                    return fn(*args, **kw)
                finally:
                    prof.disable()
                    if (time.perf_counter() - t0) * 1e3 > slow_ms:
                        name = name_of(args)
                        if name in slow_profiles:
                            slow_profiles[name].add(prof)
                        else:
                            slow_profiles[name] = pstats.Stats(prof)
            return wrapper

        engine_mod.Engine.tick = profiled(lambda a: "tick", engine_mod.Engine.tick)
        daemon_mod.Daemon._summarize = profiled(lambda a: "summarize", daemon_mod.Daemon._summarize)
        server.ControlAPI.handle = profiled(lambda a: "op_" + a[2].__struct_config__.tag, server.ControlAPI.handle)

    def dump() -> None:
        import io
        for name, st in slow_profiles.items():
            buf = io.StringIO()
            st.stream = buf
            st.sort_stats("cumulative").print_stats(40)
            with open(f"{out_path}.{name}.txt", "w") as f:
                f.write(buf.getvalue())
        rows = {}
        for k, ws in wall.items():
            w = np.array(ws) * 1e3
            c = np.array(cpu[k]) * 1e3
            rows[k] = {"n": int(w.size), "wall_ms_total": float(w.sum()), "cpu_ms_total": float(c.sum()),
                       "wall_p99_ms": float(np.percentile(w, 99)), "wall_max_ms": float(w.max()),
                       "cpu_max_ms": float(c.max()),
                       "over_ms": {str(e): int((w > e).sum()) for e in EDGES_MS if (w > e).any()}}
        out = {"callbacks": dict(sorted(rows.items(), key=lambda kv: -kv[1]["wall_ms_total"])),
               "slow": slow, "slow_ops": slow_ops, "gc": collections_}
        if sched_fd >= 0:
            out.update(timeline=timeline, requests=requests, reads=reads, turns=turns, loop_tid=threading.main_thread().native_id,
                       threads={**thread_names, **{t.native_id: t.name for t in threading.enumerate()}})
        with open(out_path, "w") as f:
            json.dump(out, f, indent=None if sched_fd >= 0 else 1)

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
