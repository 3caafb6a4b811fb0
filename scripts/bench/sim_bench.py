#!/usr/bin/env python3
"""Speed of the simulator and of hint ingestion, on one core.

Two figures:
  sim      kvtier-sim replaying a 1 TiB KV pool in 2 MiB blocks (524288 block
           ids; DRAM 64 GiB + CXL 960 GiB) over ACCESSES access records through
           kvtier's policy (target: 10 million in < 120 s). The trace is
           generated first (not timed in the figure, reported separately).
  hints    Temperature.add_region_hints() throughput for batches of BATCH
           hints into the same 524288-block table (target >= 2 million/s),
           and the per-tick decay of all its temperatures.

    .venv/bin/python scripts/bench/sim_bench.py [--accesses 10000000] [--policy kvtier|all|a,b]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from kvtier.blocks import BlockTable
from kvtier.hotness import Temperature
from kvtier.sim.gen import generate
from kvtier.sim.model import GIB, SimConfig
from kvtier.sim.policies import POLICIES
from kvtier.sim.runner import simulate

BLOCK = 2 << 20
NBLOCKS = (1 << 40) // BLOCK  # 524288


def bench_hints(batch: int, repeat: int) -> float:
    t = BlockTable(NBLOCKS)
    t.add_region(1, 1, 0, NBLOCKS * BLOCK, BLOCK)
    h = Temperature(1.0)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, NBLOCKS, batch)
    counts = np.ones(batch, np.float32)
    h.add_region_hints(t, 1, idx, counts, 0.0)  # warm
    ts = []
    for i in range(repeat):
        t0 = time.perf_counter()
        h.add_region_hints(t, 1, idx, counts, float(i))
        ts.append(time.perf_counter() - t0)
    return batch / statistics.median(ts)  # median: the other engineers share the 2 cores


def bench_decay(repeat: int = 50) -> float:
    t = BlockTable(NBLOCKS)
    t.add_region(1, 1, 0, NBLOCKS * BLOCK, BLOCK)
    h = Temperature(1.0)
    h.decay(t, 0.0)
    t0 = time.perf_counter()
    for i in range(repeat):
        h.decay(t, float(i + 1))
    return (time.perf_counter() - t0) / repeat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--accesses", type=int, default=10_000_000)
    ap.add_argument("--policy", default="kvtier")
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    except OSError:
        pass
    print(f"# {platform.node()} {platform.machine()} python {platform.python_version()} numpy {np.__version__}, one core")
    print("| hint batch | hints/s (median batch) |")
    print("|---|---|")
    for batch in (1_000, 10_000, 100_000, 1_000_000):
        rate = bench_hints(batch, max(9, 2_000_000 // batch))
        print(f"| {batch} | {rate / 1e6:.1f} M |")
    print(f"\ndecay of all {NBLOCKS} temperatures (once per tick): {bench_decay() * 1e3:.2f} ms")
    if args.skip_sim:
        return 0
    t0 = time.perf_counter()
    # a serving load big enough to spread over the 1 TiB pool
    tr = generate(
        "chat",
        nblocks=NBLOCKS,
        max_accesses=args.accesses,
        max_batch=256,
        arrival_rate=8.0,
        think_mean_s=60.0,
        max_duration_s=1e9,
    )
    gen_s = time.perf_counter() - t0
    cfg = SimConfig().with_capacities([64, 960])
    live = np.cumsum(np.where(tr.op == 0, 1, np.where(tr.op == 2, -1, 0))).max()
    print()
    print("| policy | blocks | accesses | records | simulated s | ticks | peak live GiB | generate s | simulate s | dram hit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = list(POLICIES) if args.policy == "all" else args.policy.split(",")
    for name in names:
        r = simulate(tr, cfg, POLICIES[name]())
        print(
            f"| {r.policy} | {tr.nblocks} | {tr.accesses} | {len(tr)} | {r.sim_s:.0f} | {r.ticks} | "
            f"{live * BLOCK / GIB:.0f} | {gen_s:.1f} | {r.wall_s:.1f} | {r.fast_hit:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
