"""Where the robustness benchmark's good client waits (robustness.py --trace).

Two sources, both on CLOCK_MONOTONIC (perf_counter) so they line up with
the good client's own send and receive times:

* ``SchedSampler``, a thread of the benchmark, reads every ~1 ms the
  cumulative run time and run-queue wait (/proc/PID/task/TID/schedstat) of
  each daemon thread, the good client and every attacker process;
* the daemon runs under loop_profile.py with KVTIER_TRACE_UID, which keeps
  every event-loop callback (with the loop thread's own run and run-queue
  wait), every turn of every connection, every request handled, and every
  read of the traced uid's connections.

``attribute`` splits each good request's round trip [send, answer read]
into: until the daemon read it, queued in the daemon (read to handler),
the handler, and after (the answer written until the client had it); and
for the time until the handler started, what the loop thread did
meanwhile: other connections' turns and reads (work "caused by another
connection"), the engine and timers, idle in epoll, and within those the
loop thread's run time, its wait for a CPU, and the rest (asleep inside a
callback: the GIL or a blocking call). Per-thread and per-process CPU from
the sampler says who held the CPUs (attackers, daemon workers, the good
client itself).
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import numpy as np


class SchedSampler:
    """Cumulative (run_ns, wait_ns) per named task, sampled every ``period``."""

    def __init__(self, period: float = 0.001):
        self.period = period
        self.tasks: dict[str, int] = {}  # name -> fd of its schedstat
        self.samples: dict[str, list[tuple[float, int, int]]] = {}
        self.daemon_pid = 0
        self._arrays: dict[str, np.ndarray] = {}  # samples as arrays, built on first use after stop()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sched-sampler")

    def watch(self, name: str, pid: int, tid: int | None = None) -> None:
        path = f"/proc/{pid}/task/{tid or pid}/schedstat"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        with self._lock:
            old = self.tasks.pop(name, None)
            if old is not None:
                os.close(old)
            self.tasks[name] = fd
            self.samples.setdefault(name, [])

    def watch_daemon(self, pid: int) -> None:
        self.daemon_pid = pid
        self._refresh_daemon()

    def _refresh_daemon(self) -> None:
        try:
            tids = os.listdir(f"/proc/{self.daemon_pid}/task")
        except OSError:
            return
        for tid in tids:
            name = f"daemon:{tid}"
            if name not in self.tasks:
                self.watch(name, self.daemon_pid, int(tid))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for fd in self.tasks.values():
            os.close(fd)

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            t = time.perf_counter()
            with self._lock:
                items = list(self.tasks.items())
            for name, fd in items:
                try:
                    run, wait, _ = os.pread(fd, 80, 0).split()
                except (OSError, ValueError):
                    continue  # the task exited
                self.samples[name].append((t, int(run), int(wait)))
            n += 1
            if self.daemon_pid and n % 50 == 0:
                self._refresh_daemon()
            time.sleep(self.period)

    def between(self, name: str, t0: float, t1: float) -> tuple[float, float]:
        """(run ms, run-queue wait ms) of task ``name`` over [t0, t1], from
        the samples just outside the interval (so at most ~1 ms too wide)."""
        a = self._arrays.get(name)
        if a is None:
            a = self._arrays[name] = np.array(self.samples.get(name) or [(0.0, 0, 0)], dtype=np.float64)
        i = max(0, int(np.searchsorted(a[:, 0], t0, side="right")) - 1)
        j = min(len(a) - 1, int(np.searchsorted(a[:, 0], t1, side="left")))
        return (a[j, 1] - a[i, 1]) / 1e6, (a[j, 2] - a[i, 2]) / 1e6


# Loop callbacks that are other connections' work: their reads (and the
# turns run in them), the run queue's turns (the good client never has a
# backlog), registrations written in steps, and accepting connections.
OTHERS = ("other conns", "turns (run queue)", "Stager._step", "BaseSelectorEventLoop._accept_connection")


def _category(key: str, conn: int, good: set[int]) -> str:
    if "uid=" in key:
        return "good conn" if conn in good else "other conns"
    if key.startswith("Server._run_one"):
        return "turns (run queue)"
    return key.split(" ")[0]


def attribute(trace: list[tuple[float, float]], prof: dict, sched: SchedSampler | None,
              threads: dict[str, str], top: int = 12) -> dict:
    """Per-request breakdown of the good client's slowest requests, and the
    totals over all of them (see the module docstring)."""
    good = {c for _, c, _ in prof["reads"]}
    reads = sorted(t for t, _, _ in prof["reads"])
    reqs = sorted((r for r in prof["requests"] if r[4] in good), key=lambda r: r[0])
    req_t0 = [r[0] for r in reqs]
    tl = sorted(prof["timeline"], key=lambda x: x[0])
    tl_t0 = [x[0] for x in tl]
    turns = sorted(prof["turns"], key=lambda x: x[0])
    turn_t0 = [x[0] for x in turns]
    rows = []
    for t0, dt in trace:
        t1 = t0 + dt
        k = bisect.bisect_left(req_t0, t0)
        if k >= len(reqs) or reqs[k][0] > t1:
            continue
        h0, h1, op = reqs[k][0], reqs[k][1], reqs[k][2]
        ri = bisect.bisect_left(reads, t0)
        tr = reads[ri] if ri < len(reads) and reads[ri] <= h0 else h0
        # what the loop did in [t0, h0]
        spent: dict[str, float] = {}
        run = wait = 0.0
        others = others_run = 0.0
        i = max(0, bisect.bisect_right(tl_t0, t0) - 1)
        busy = 0.0
        while i < len(tl) and tl[i][0] < h0:
            c0, w, r_ns, q_ns, key, conn = tl[i]
            ov = min(c0 + w, h0) - max(c0, t0)
            if ov > 0:
                frac = ov / w if w else 0.0
                cat = _category(key, conn, good)
                spent[cat] = spent.get(cat, 0.0) + ov * 1e3
                busy += ov
                run += r_ns * frac / 1e6
                wait += q_ns * frac / 1e6
                if cat in OTHERS:
                    others += ov * 1e3
                    others_run += r_ns * frac / 1e6
            i += 1
        # turns of other connections (queued or in their reads) in [t0, h0]
        other_turns = 0.0
        j = max(0, bisect.bisect_right(turn_t0, t0) - 1)
        while j < len(turns) and turns[j][0] < h0:
            a, b, uid, conn = turns[j]
            if conn not in good:
                other_turns += max(0.0, min(b, h0) - max(a, t0)) * 1e3
            j += 1
        row = {"t0": t0, "ms": dt * 1e3, "op": op, "until_read_ms": (tr - t0) * 1e3,
               "read_to_handler_ms": (h0 - tr) * 1e3, "handler_ms": (h1 - h0) * 1e3,
               "after_ms": (t1 - h1) * 1e3, "before_handler": {
                   "loop_idle_ms": (h0 - t0 - busy) * 1e3, "callbacks_ms": spent,
                   "other_conn_turns_ms": other_turns,
                   # the loop ran other connections' callbacks (of which on a CPU):
                   # what "caused by another connection" is
                   "other_conns_ms": others, "other_conns_run_ms": others_run,
                   "loop_run_ms": run, "loop_cpu_wait_ms": wait,
                   "loop_asleep_in_callback_ms": busy * 1e3 - run - wait}}
        if sched is not None:
            who = {}
            for name in sched.samples:
                r, q = sched.between(name, t0, t1)
                if r > 0.05 or q > 0.05:
                    who[threads.get(name, name)] = [round(r, 2), round(q, 2)]
            row["cpu_run_wait_ms"] = who
        rows.append(row)
    if not rows:
        return {}
    ms = np.array([r["ms"] for r in rows])
    caused = np.array([r["before_handler"]["other_conns_ms"] for r in rows])
    caused_run = np.array([r["before_handler"]["other_conns_run_ms"] for r in rows])
    host = np.array([r["before_handler"]["loop_idle_ms"] for r in rows])
    worst = sorted(rows, key=lambda r: -r["ms"])[:top]
    # the loop's longest callbacks in the phase, by kind: (wall, of which on a CPU)
    lo, hi = trace[0][0], trace[-1][0] + trace[-1][1]
    longest: dict[str, list[float]] = {}
    for c0, w, r_ns, q_ns, key, conn in tl[bisect.bisect_left(tl_t0, lo):bisect.bisect_right(tl_t0, hi)]:
        cat = _category(key, conn, good)
        cat = "other conns" if cat in OTHERS else cat
        if w * 1e3 > longest.get(cat, [0.0])[0]:
            longest[cat] = [round(w * 1e3, 2), round(r_ns / 1e6, 2)]
    # What the slowest 1 % waited on, in total: the loop running other
    # connections' work, the loop running anything else (the engine's tick,
    # timers), the loop not running (idle in epoll until woken and given a
    # CPU), the handler, and after the answer was written (the good client
    # waiting for a CPU to read it).
    tail = [r for r in rows if r["ms"] >= np.percentile(ms, 99)]
    tail_ms = {"requests": len(tail), "total": sum(r["ms"] for r in tail)}
    for r in tail:
        b = r["before_handler"]
        parts = {"other_conns": b["other_conns_ms"],
                 "loop_other_work": sum(b["callbacks_ms"].values()) - b["other_conns_ms"]
                 - b["callbacks_ms"].get("good conn", 0.0),
                 "loop_not_running": b["loop_idle_ms"], "handler": r["handler_ms"], "after_answer": r["after_ms"]}
        for k, v in parts.items():
            tail_ms[k] = tail_ms.get(k, 0.0) + v
    tail_ms = {k: round(v, 1) for k, v in tail_ms.items()}
    # Over the whole phase: each task's CPU and its wait for one (ms), so
    # the share of the 2 CPUs the daemon, the attackers and the good client
    # had is on record beside the latencies.
    phase_cpu = {}
    if sched is not None:
        for name in sched.samples:
            r, q = sched.between(name, lo, hi)
            if r > 1 or q > 1:
                phase_cpu[threads.get(name, name)] = [round(r, 1), round(q, 1)]
    return {
        "requests": len(rows),
        "seconds": round(hi - lo, 2),
        "cpu_run_wait_ms": phase_cpu,
        "p99_tail_ms": tail_ms,
        "longest_callback_ms": dict(sorted(longest.items(), key=lambda kv: -kv[1][0])[:6]),
        "p99_ms": float(np.percentile(ms, 99)),
        # what the p99 would be had no request waited behind another connection's work
        "p99_without_other_conns_ms": float(np.percentile(ms - caused, 99)),
        "max_other_conns_ms": float(caused.max()),
        "max_other_conns_run_ms": float(caused_run.max()),
        "over_1ms_other_conns": int((caused > 1).sum()),
        "over_100ms_other_conns": int((caused > 100).sum()),
        # requests over 100 ms and what they waited on: other connections'
        # work, or a loop with nothing to run (idle in epoll, or woken and
        # waiting for a CPU: the host's load, not the daemon's)
        "over_100ms": [{"ms": round(float(r["ms"]), 1), "other_conns_ms": round(float(c), 1),
                        "loop_idle_or_cpu_wait_ms": round(float(h), 1),
                        "good_client_cpu_wait_ms": r.get("cpu_run_wait_ms", {}).get("good", [0, 0])[1]}
                       for r, c, h in zip(rows, caused, host) if r["ms"] > 100],
        "sum_ms": {k: float(sum(r[k] for r in rows)) for k in
                   ("until_read_ms", "read_to_handler_ms", "handler_ms", "after_ms")},
        "worst": worst,
    }
