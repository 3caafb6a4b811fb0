#!/usr/bin/env python3
"""Cost of one Prometheus scrape of kvtierd's collector, by table size.

    .venv/bin/python scripts/bench/metrics_scrape.py [--sizes 10000,100000,1000000]

Builds a BlockTable of N 2 MiB blocks in N/1000 regions of 8 tenants (the
registry side is a plain object with what the collector reads of a
Registry: region names, tenants and its clock), random tiers, temperatures
and access times, and times ``generate_latest`` on the exporter's own
registry: the whole scrape as the HTTP thread runs it, without the socket.
Two collectors per size:

* "daemon": as kvtierd runs it, reading the sums its loop keeps
  (kvtier.summary); also timed: one tick's slice of that upkeep at the
  default ``metrics.summary_pass_s`` and a 1 s tick, and a whole pass;
* "standalone": a Collector without a summarizer, which sums the whole
  table at every scrape (what every scrape cost before).

Reports the median of --repeat runs of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from kvtier import metrics

from kvtier.kernel import topology
from kvtier.blocks import BlockTable
from kvtier.stats import DaemonStats
from kvtier.summary import BlockSummarizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_bench import machine  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "host-1node"
NOW = 10_000.0  # the registry clock's reading (monotonic seconds)


def build(nblocks: int, per_region: int = 1000) -> tuple[BlockTable, SimpleNamespace]:
    t = BlockTable(nblocks)
    regions = {}
    for r in range(1, max(1, nblocks // per_region) + 1):
        t.add_region(r, 1, r << 40, per_region * (2 << 20), 2 << 20, tenant=r % 8)
        regions[r] = SimpleNamespace(name=f"kv{r}", tenant=f"team{r % 8}")
    rng = np.random.default_rng(0)
    t.tier[:] = rng.integers(-1, 2, len(t))
    t.temp[:] = rng.exponential(5.0, len(t))
    t.last_access[:] = NOW - rng.exponential(60.0, len(t))
    return t, SimpleNamespace(regions=regions, tenants={f"team{i}": i for i in range(8)}, clock=lambda: NOW)


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    topo = topology.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"))
    print(f"# {machine()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| blocks | regions | scrape ms, daemon (median) | summary upkeep per 1 s tick ms | whole pass ms "
          "| scrape ms, standalone (median) | exposition bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in a.sizes.split(",")):
        table, reg = build(n)
        summ = BlockSummarizer(clock=reg.clock)
        daemon, alone = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
        daemon.register(metrics.Collector(DaemonStats(), reg, table, topo, summary=summ))
        alone.register(metrics.Collector(DaemonStats(), reg, table, topo))
        budget = metrics.summary_budget(n, 1.0, metrics.MetricsConfig().summary_pass_s)
        whole = median_s(lambda: summ.refresh(table, NOW), max(3, a.repeat // 3))
        tick = median_s(lambda: summ.advance(table, NOW, budget), a.repeat)
        summ.refresh(table, NOW)
        out = generate_latest(daemon)
        if out != generate_latest(alone):
            raise SystemExit(f"{n} blocks: the daemon's summary and a full pass disagree")
        d = median_s(lambda: generate_latest(daemon), a.repeat)
        s = median_s(lambda: generate_latest(alone), a.repeat)
        print(f"| {n} | {len(reg.regions)} | {1000 * d:.1f} | {1000 * tick:.1f} | {1000 * whole:.1f} "
              f"| {1000 * s:.1f} | {len(out)} |")


if __name__ == "__main__":
    main()
