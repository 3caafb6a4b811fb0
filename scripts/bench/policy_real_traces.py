#!/usr/bin/env python3
"""kvtier against every baseline and both references on the in-repo Mooncake
traces (and the synthetic presets), with the daemon's shipped defaults.

Grid: trace x model x DRAM share of the footprint (the rest of the footprint
on CXL); in every cell each policy's DRAM hit ratio (reads from DRAM / all
reads) and bytes moved. Machine model: kvtier-sim's defaults (DRAM 100 ns /
40 GB/s, CXL 250 ns / 20 GB/s, one migrator at 4 GB/s, 1 s ticks); decode at
--decode-tps tokens/s per request.

    .venv/bin/python scripts/bench/policy_real_traces.py                # full grid, markdown on stdout
    .venv/bin/python scripts/bench/policy_real_traces.py --traces synthetic --models llama-3-8b --fracs 0.1
    .venv/bin/python scripts/bench/policy_real_traces.py --presets      # the synthetic presets too

Exit status 1 if a check fails: in every cell kvtier >= every baseline,
kvtier >= 0.97 x feasible-oracle, kvtier bytes moved <= LRU's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvtier.sim.cli import kvtier_settings
from kvtier.sim.gen import generate
from kvtier.sim.model import GIB, SimConfig
from kvtier.sim.oracles import FeasibleOracle, belady_min
from kvtier.sim.policies import DEFAULT_PREFETCH, POLICIES
from kvtier.sim.requests import RequestTrace
from kvtier.sim.runner import simulate

ROOT = Path(__file__).resolve().parents[2]
TRACES = {
    "conversation": ROOT / "tests/data/mooncake/conversation_trace.jsonl",
    "synthetic": ROOT / "tests/data/mooncake/synthetic_trace.jsonl",
}
BASELINES = ("lru", "lfu", "kernel", "damos")
NAMES = ("kvtier",) + BASELINES + ("feasible-oracle", "belady-min")
PRESET_DRAM_FRAC = 0.3  # kvtier-sim's default for block traces (of peak live bytes)


def run_policy(source, cfg, name: str, settings, prefetch: bool = DEFAULT_PREFETCH):
    if name == "feasible-oracle":
        return simulate(source, cfg, FeasibleOracle())
    if name == "belady-min":
        return belady_min(source, cfg)
    if name == "kvtier":
        return simulate(source, cfg, POLICIES["kvtier"](*settings, prefetch=prefetch))
    return simulate(source, cfg, POLICIES[name]())


def cell(job: tuple) -> dict:
    kind, name, model, frac, decode_tps, sets, prefetch = job
    settings = kvtier_settings(sets)
    if kind == "trace":
        src = RequestTrace(TRACES[name], model=model, decode_tps=decode_tps)
        dram = int(src.footprint_blocks * frac)
        cfg = SimConfig().with_capacities([dram * src.block_bytes / GIB, (src.nblocks - dram) * src.block_bytes / GIB])
        label = f"{name} | {model} | {frac:.0%}"
    else:
        from kvtier.sim.cli import peak_live_bytes

        src = generate(name)
        peak = peak_live_bytes(src) / GIB
        cfg = SimConfig().with_capacities([peak * frac, peak * 4.0])
        label = f"preset {name} | 2 MiB blocks | {frac:.0%} of peak"
    out = {"label": label, "results": {}}
    for n in NAMES:
        t0 = time.perf_counter()
        r = run_policy(src, cfg, n, settings, prefetch)
        out["results"][n] = {"hit": r.fast_hit, "moved": sum(r.migrated_bytes.values()), "s": time.perf_counter() - t0}
    return out


def check(row: dict) -> list[str]:
    res = row["results"]
    k = res["kvtier"]
    bad = [f"below {b}" for b in BASELINES if k["hit"] < res[b]["hit"]]
    if k["hit"] < 0.97 * res["feasible-oracle"]["hit"]:
        bad.append(f"{k['hit'] / res['feasible-oracle']['hit']:.1%} of the oracle")
    if k["moved"] > res["lru"]["moved"]:
        bad.append("moves more than lru")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--models", default="llama-3-8b,llama-3-70b")
    ap.add_argument("--fracs", default="0.1,0.25,0.5")
    ap.add_argument("--decode-tps", type=float, default=30.0)
    ap.add_argument("--presets", action="store_true", help="also the synthetic presets chat, rag, bursty")
    ap.add_argument("--only-presets", action="store_true")
    ap.add_argument("--set", action="append", help="kvtier setting over the shipped default (as kvtier-sim --set)")
    ap.add_argument("--kvtier-prefetch", choices=("on", "off"), default="on" if DEFAULT_PREFETCH else "off",
                    help="kvtier's client prefetches each request's cached blocks at its arrival (kvtier-sim's default: off)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    fracs = [float(f) for f in args.fracs.split(",")]
    jobs = []
    if not args.only_presets:
        for tr in args.traces.split(","):
            for model in args.models.split(","):
                for f in fracs:
                    jobs.append(("trace", tr, model, f, args.decode_tps, args.set, args.kvtier_prefetch == "on"))
    if args.presets or args.only_presets:
        for p in ("chat", "rag", "bursty"):
            jobs.append(("preset", p, "", PRESET_DRAM_FRAC, args.decode_tps, args.set, args.kvtier_prefetch == "on"))
    t0 = time.perf_counter()
    head = ["trace", "model", "DRAM"] + list(NAMES) + ["GiB moved: kvtier", "lru", "oracle", "check"]
    print(f"DRAM hit ratio (read-weighted); decode {args.decode_tps:g} tokens/s per request, 1 s ticks, one migrator "
          f"at 4 GB/s; DRAM = share of the footprint, the rest on CXL; kvtier with the daemon's shipped defaults"
          f"{' + ' + ', '.join(args.set) if args.set else ''}, prefetch at arrival {args.kvtier_prefetch}")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    failed = 0
    rows = []
    with ProcessPoolExecutor(args.jobs) as ex:
        for row in ex.map(cell, jobs):  # in grid order, each printed as soon as it is done
            rows.append(row)
            res = row["results"]
            bad = check(row)
            failed += bool(bad)
            cells = row["label"].split(" | ") + [f"{res[n]['hit']:.4f}" for n in NAMES]
            cells += [f"{res[n]['moved'] / GIB:,.0f}" for n in ("kvtier", "lru", "feasible-oracle")]
            cells.append("ok" if not bad else "; ".join(bad))
            print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\n{len(rows) - failed}/{len(rows)} cells pass; {time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
