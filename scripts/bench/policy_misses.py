#!/usr/bin/env python3
"""Where a policy's slow-tier reads come from, on one cell of the policy grid
(scripts/bench/policy_real_traces.py): the oracle-gap diagnosis.

Every read served from a slower tier is put in one class, by the block's
history since its run started (its allocation, or the tick a request took
it from the prefix cache, phase ``active``):

- ``new``: allocated in this tick and placed on a slower tier (DRAM full);
- ``taken``: a cached block in the tick a request takes it (no policy that
  acts between ticks can have moved it for these reads, unless it knew);
- ``demoted``: demoted since its run started, read again;
- ``landed``: allocated earlier on a slower tier, not promoted since;
- ``taken-later``: taken earlier from the cache while on a slower tier, not promoted since.

Each is a share of all reads; the DRAM hit ratio is 1 minus their sum. Also
promotions, and those of blocks demoted within the minute before (ping-pong).
kvtier runs here without its prefetch at arrival (``--kvtier-prefetch
off``): the classes take a block's tier at the tick's end for all its reads,
which a move inside the tick breaks; `taken` is what the prefetch is for.

    .venv/bin/python scripts/bench/policy_misses.py --trace synthetic --model llama-3-8b --frac 0.1 --requests 1500
    .venv/bin/python scripts/bench/policy_misses.py --preset chat --policies kvtier,lru
    .venv/bin/python scripts/bench/policy_misses.py --trace tests/data/bailian/small.jsonl --model qwen2-7b --frac 0.1
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.sim.cli import peak_live_bytes
from kvtier.sim.gen import generate
from kvtier.sim.model import GIB, SimConfig
from kvtier.sim.oracles import FeasibleOracle
from kvtier.sim.policies import POLICIES
from kvtier.sim.requests import RequestTrace
from kvtier.sim.runner import simulate

from policy_real_traces import PRESET_DRAM_FRAC, TRACES

PINGPONG_S = 60
CLASSES = ("new", "taken", "demoted", "landed", "taken-later")


def instrumented(pol):
    """The policy, its hooks wrapped to classify the reads the engine serves."""
    cls = type(pol)

    class Counted(cls):
        def attach(self, eng):
            super().attach(eng)
            n = eng.n
            self.born = np.full(n, -1)
            self.taken = np.full(n, -(10 ** 9))
            self.demoted = np.full(n, -(10 ** 9))
            self.slow_now = np.zeros(n)
            self.slow_cls = np.zeros(n, np.int64)
            self.by = np.zeros(len(CLASSES))  # reads per class, in CLASSES order
            self.total = 0.0
            self.promos = self.pingpong = 0

        def place(self, rows):
            d = super().place(rows)
            self.born[rows] = self.eng.k
            return d

        def observe(self, rows, counts, times, now):
            k = self.eng.k
            if rows.size:
                slow = self.eng.tier[rows] > 0
                self.total += float(counts.sum())
                r, c = rows[slow], counts[slow]
                new = self.born[r] == k
                start = np.maximum(self.born[r], self.taken[r])
                dem = ~new & (self.demoted[r] >= start)
                landed = ~new & ~dem & (self.born[r] >= self.taken[r])
                cls = np.select([new, dem, landed], [0, 2, 3], 4)
                self.slow_now[:] = 0.0
                self.slow_now[r] = c
                self.slow_cls[r] = cls
                np.add.at(self.by, cls, c)
            super().observe(rows, counts, times, now)

        def lifecycle(self, acquired, released, now):
            super().lifecycle(acquired, released, now)
            # the lifecycle of a tick comes after its reads: the reads of a
            # block taken in this tick move to "taken" from where observe put them
            a = acquired[self.slow_now[acquired] > 0]
            np.add.at(self.by, self.slow_cls[a], -self.slow_now[a])
            self.by[1] += float(self.slow_now[a].sum())
            self.slow_now[a] = 0.0
            self.taken[acquired] = self.eng.k

        def moved(self, rows, dst, ok, now):
            super().moved(rows, dst, ok, now)
            k = self.eng.k
            r, d = np.asarray(rows)[ok], np.asarray(dst)[ok]
            up = r[d == 0]
            self.promos += int(up.size)
            self.pingpong += int((self.demoted[up] >= k - PINGPONG_S / self.eng.tick_s).sum())
            self.demoted[r[d > 0]] = k

    Counted.name = cls.name
    pol.__class__ = Counted
    return pol


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", metavar="NAME|PATH",
                    help=f"request trace: {', '.join(sorted(TRACES))} (the in-repo Mooncake traces) or a .jsonl path "
                         "(Mooncake or Qwen-Bailian, as kvtier-sim reads it)")
    ap.add_argument("--block-tokens", type=int, help="tokens per hash id (default: the format's)")
    ap.add_argument("--preset", choices=("chat", "rag", "bursty"))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--frac", type=float, default=0.25, help="DRAM share of the footprint (request traces)")
    ap.add_argument("--requests", type=int, help="only the first N requests")
    ap.add_argument("--policies", default="kvtier,lru,feasible-oracle")
    args = ap.parse_args()
    if args.preset:
        src = generate(args.preset)
        peak = peak_live_bytes(src) / GIB
        cfg = SimConfig().with_capacities([peak * PRESET_DRAM_FRAC, peak * 4.0])
    else:
        path = TRACES.get(args.trace or "conversation") or Path(args.trace)
        if not path.is_file():
            ap.error(f"--trace {args.trace}: neither {' nor '.join(sorted(TRACES))} nor a file")
        src = RequestTrace(path, model=args.model, block_tokens=args.block_tokens, limit=args.requests)
        dram = int(src.footprint_blocks * args.frac)
        cfg = SimConfig().with_capacities([dram * src.block_bytes / GIB, (src.nblocks - dram) * src.block_bytes / GIB])
    print("| policy | DRAM hit | " + " | ".join(CLASSES) + " | GiB moved | promotions | of them ping-pong |")
    print("|---" * 10 + "|")
    for name in args.policies.split(","):
        if name == "feasible-oracle":
            p = instrumented(FeasibleOracle())
        else:
            p = instrumented(POLICIES[name](prefetch=False) if name == "kvtier" else POLICIES[name]())
        r = simulate(src, cfg, p)
        tot = p.total or 1.0
        shares = " | ".join(f"{v / tot:.4f}" for v in p.by)
        print(f"| {name} | {r.fast_hit:.4f} | {shares} | {sum(r.migrated_bytes.values()) / GIB:,.0f} | "
              f"{p.promos:,} | {p.pingpong:,} |", flush=True)


if __name__ == "__main__":
    main()
