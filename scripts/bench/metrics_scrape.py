#!/usr/bin/env python3
"""Cost of one Prometheus scrape of kvtierd's collector, by table size.

    .venv/bin/python scripts/bench/metrics_scrape.py [--sizes 10000,100000,1000000]

Builds a BlockTable of N 2 MiB blocks in N/1000 regions of 8 tenants (the
registry side is a plain object with the region names and tenants the
collector reads), random tiers and temperatures, and times
``generate_latest`` on the exporter's own registry: the whole scrape as the
HTTP thread runs it (column copies, numpy reductions, text encoding),
without the socket. Reports the median of --repeat scrapes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from kvtier import metrics

from kvtier.kernel import topology
from kvtier.blocks import BlockTable
from kvtier.stats import DaemonStats

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "host-1node"


def build(nblocks: int, per_region: int = 1000) -> tuple[BlockTable, SimpleNamespace]:
    t = BlockTable(nblocks)
    regions = {}
    for r in range(1, max(1, nblocks // per_region) + 1):
        t.add_region(r, 1, r << 40, per_region * (2 << 20), 2 << 20, tenant=r % 8)
        regions[r] = SimpleNamespace(name=f"kv{r}", tenant=f"team{r % 8}")
    rng = np.random.default_rng(0)
    t.tier[:] = rng.integers(-1, 2, len(t))
    t.temp[:] = rng.exponential(5.0, len(t))
    return t, SimpleNamespace(regions=regions, tenants={f"team{i}": i for i in range(8)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    topo = topology.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"))
    print("| blocks | regions | scrape ms (median) | exposition bytes |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in a.sizes.split(",")):
        table, reg = build(n)
        cr = CollectorRegistry(auto_describe=False)
        cr.register(metrics.Collector(DaemonStats(), reg, table, topo))
        out = generate_latest(cr)
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            generate_latest(cr)
            times.append(time.perf_counter() - t0)
        print(f"| {n} | {len(reg.regions)} | {1000 * statistics.median(times):.1f} | {len(out)} |")


if __name__ == "__main__":
    main()
