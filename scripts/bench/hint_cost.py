#!/usr/bin/env python3
"""What ``Region.hint()`` costs the engine that calls it, on the host.

    .venv/bin/python scripts/bench/hint_cost.py [--calls 200000] [--blocks 16] [--json out.json]

Starts a real kvtierd (temporary socket, metrics off, policy ticks at the
default 1 s so the daemon does its normal work) and registers a 256 MiB
anonymous mapping of this process in 2 MiB blocks. Then calls
``region.hint(ids)`` --calls times back to back with a --blocks-long
uint32 array of block ids the caller keeps (an engine's block table), the way the
guest comparison's workload does after every pass over its hot set, and
reports per call: mean wall time (everything included: the batch sends that
some calls make), p50 / p99 / max, thread CPU time per call, and how the
time splits between the calls that only queue and those that also send a
frame. Two more runs pass an int64 array and a Python list instead, and
two call ``hs.touch()`` of a hint set of the same blocks
(``region.hint_set(ids)``, declared once), through the ring and the socket,
and two time its ``flush()`` alone (after 32 touches each: the guest
workload's passes per hint_interval). --floors adds a ``time.monotonic()``
(a hint set's look at the clock).
The mean is
what the engine pays; the guest's TCG is roughly 50-100x slower per
interpreted instruction than this host.

The uint32 run is made twice: through the connection's shared-memory hint
ring (the client's default) and through the socket alone (a second
connection made with ``hint_ring=False``); the int64 and list runs use the
ring. --no-ring leaves the ring runs out.

--gap-us sleeps between calls, so batches go out every hint_interval
(0.2 s) as in the guest workload instead of every hint_batch entries.
--profile prints cProfile's top functions for the uint32 run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import mmap
import os
import pstats
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_bench import machine, start_daemon  # noqa: E402

from kvtier.client import Client, Region  # noqa: E402

POOL = 256 << 20
BLOCK = 2 << 20


class Floor:
    """Stand-ins for ``region.hint`` timed the same way: what a call that
    does nothing, keeps a reference, or copies the ids costs (the floor of
    any hint path in Python; ``frames_sent`` stays 0)."""

    def __init__(self, client, kind: str):
        self.client, self.kind, self.parts = client, kind, []

    def hint(self, ids) -> None:
        if self.kind == "append":
            self.parts.append(ids)
        elif self.kind == "tobytes":
            self.parts.append(ids.tobytes())
        elif self.kind == "clock":
            time.monotonic()  # what a hint set's look at the clock costs (a system call under HPET)
        if len(self.parts) > 4096:
            self.parts.clear()


def run(region, ids, calls: int, gap: float = 0.0) -> dict:
    """``region.hint(ids)`` timed per call."""
    return timed(region.hint, ids, calls, gap, region.client, len(ids))


def run_set(hs, calls: int, gap: float = 0.0) -> dict:
    """``hs.touch()`` timed the same way: the hint-set API, its blocks
    declared once (Region.hint_set)."""
    return timed(type(hs).touch, hs, calls, gap, hs.region.client, len(hs))


FLUSH_EVERY = 32  # touches per flush timed by run_flush: the guest workload's passes per hint_interval


def run_flush(hs, flushes: int, gap: float = 0.0) -> dict:
    """What one flush of a set costs: FLUSH_EVERY touches (not timed), then
    ``hs.flush()`` timed, ``flushes`` times."""
    return timed(_touch_and_flush, hs, flushes, gap, hs.region.client, len(hs))


def _touch_and_flush(hs) -> None:
    hs._base += FLUSH_EVERY  # as FLUSH_EVERY touch() calls that did not look at the clock (touches counts them)
    hs.flush()


def timed(call, arg, calls: int, gap: float, client, blocks: int) -> dict:
    frames0 = client._next_id
    wall = np.empty(calls)
    pc, tt = time.perf_counter, time.thread_time
    c0 = tt()
    t_all = pc()
    for i in range(calls):
        t0 = pc()
        call(arg)
        wall[i] = pc() - t0
        if gap:
            time.sleep(gap)
    t_all = pc() - t_all
    return summary(wall, t_all, tt() - c0, client._next_id - frames0, blocks)


def summary(wall: np.ndarray, t_all: float, cpu: float, frames: int, blocks: int) -> dict:
    calls = wall.size
    # The calls that sent a frame are the slowest ones; there are `frames` of them.
    slow = np.sort(wall)[-frames:] if frames else np.empty(0)
    us = 1e6
    return {
        "calls": calls, "blocks_per_call": int(blocks), "frames_sent": int(frames),
        "mean_us": float(wall.mean() * us), "p50_us": float(np.percentile(wall, 50) * us),
        "p99_us": float(np.percentile(wall, 99) * us), "max_us": float(wall.max() * us),
        "thread_cpu_us_per_call": float(cpu / calls * us),
        "loop_us_per_call": float(t_all / calls * us),
        "share_in_sending_calls": float(slow.sum() / wall.sum()) if frames else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="sleep between calls (the guest workload's pass takes ~1700 us): "
                         "batches are then sent by hint_interval, not by hint_batch")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--floors", action="store_true",
                    help="also time an empty call, a list append and a tobytes() copy the same way")
    ap.add_argument("--no-ring", action="store_true", help="only the socket path (as before the ring)")
    ap.add_argument("--json")
    a = ap.parse_args()
    buf = mmap.mmap(-1, POOL, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * POOL)
    out: dict = {"machine": machine(), "loadavg": os.getloadavg()}
    with tempfile.TemporaryDirectory() as wd:
        # (in the TCG guest kvtierd takes 10-40 s to start: its imports over 9p)
        p = start_daemon(wd, None, tick=1.0, ready_timeout=180.0)
        try:
            sock = os.path.join(wd, "kvtierd.sock")
            with Client(sock, hint_ring=not a.no_ring) as c, Client(sock, hint_ring=False) as plain:
                region = c.register(buf, block_size=BLOCK, name="hint_cost")
                # The same region through a connection without a ring.
                by_socket = Region(plain, {"region": region.id, "blocks": region.nblocks,
                                           "block_size": region.block_size}, region.start, region.length)
                plain._regions[region.id] = by_socket  # flushed with it
                ids = np.arange(8, 8 + a.blocks, dtype=np.uint32)  # protocol.BLOCKS_DTYPE
                run(region, ids, 2000)  # warm-up
                run(by_socket, ids, 2000)
                ring_set, socket_set = region.hint_set(ids), by_socket.hint_set(ids)
                run_set(ring_set, 2000)
                run_set(socket_set, 2000)
                c.flush()
                plain.flush()
                out["ring"] = c.ring is not None
                out["ring_error"] = str(c.ring_error) if c.ring_error else None
                gap = a.gap_us / 1e6
                out["gap_us"] = a.gap_us
                if c.ring is not None:
                    out["uint32 array, ring"] = run(region, ids, a.calls, gap)
                out["uint32 array, socket"] = run(by_socket, ids, a.calls, gap)
                if c.ring is not None:
                    out["hint set touch(), ring"] = run_set(ring_set, a.calls, gap)
                    out["hint set flush(), ring"] = run_flush(ring_set, a.calls // FLUSH_EVERY, gap)
                out["hint set touch(), socket"] = run_set(socket_set, a.calls, gap)
                out["hint set flush(), socket"] = run_flush(socket_set, a.calls // FLUSH_EVERY, gap)
                out["int64 array"] = run(region, ids.astype(np.int64), a.calls, gap)
                out["list"] = run(region, ids.tolist(), a.calls, gap)
                if a.floors:
                    for kind in ("empty", "append", "tobytes", "clock"):
                        out[f"floor: {kind}"] = run(Floor(c, kind), ids, a.calls, gap)
                errs = c.flush() + plain.flush()
                out["async_errors"] = len(errs)
                out["hints_dropped"] = c.hints_dropped + plain.hints_dropped
                out["ring_full_calls"] = c.ring.full if c.ring is not None else 0
                if a.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    run(region, ids, a.calls // 4, gap)
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                st = c.stats()
                out["daemon_hinted"] = st.get("block_hints_total")
                out["daemon_ring_entries"] = st.get("hint_ring_entries")
                region.unregister()
        finally:
            p.terminate()
            p.wait(10)
    print(f"# {out['machine']}; load average {' '.join(f'{x:.2f}' for x in out['loadavg'])}; "
          f"{a.gap_us:g} us between calls")
    print("| ids passed as | calls | blocks/call | frames sent | mean us | p50 us | p99 us | max us "
          "| thread CPU us/call | share of time in sending calls |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in [k for k in out if k.startswith(("uint32 array", "hint set", "int64 array", "list", "floor"))]:
        r = out[k]
        print(f"| {k} | {r['calls']} | {r['blocks_per_call']} | {r['frames_sent']} | {r['mean_us']:.2f} "
              f"| {r['p50_us']:.2f} | {r['p99_us']:.2f} | {r['max_us']:.0f} | {r['thread_cpu_us_per_call']:.2f} "
              f"| {100 * r['share_in_sending_calls']:.1f}% |")
    print(f"async errors {out['async_errors']}, hints dropped {out['hints_dropped']}, ring "
          f"{'on' if out['ring'] else 'off'} ({out['ring_full_calls']} calls found it full"
          f"{'; ' + out['ring_error'] if out['ring_error'] else ''}), daemon: {out['daemon_ring_entries']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
