"""``kvtier-sim``: generate KV-block traces and replay them through tiering policies.

    kvtier-sim gen --preset chat -o chat.npz
    kvtier-sim run --preset chat                       # all policies, table on stdout
    kvtier-sim run --trace chat.npz --policy kvtier,lru --json
    kvtier-sim run --preset rag --config tiers.toml --plot out/

See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import KvtierError
from .gen import PRESETS, generate
from .model import GIB, SimConfig, load_config
from .policies import POLICIES
from .runner import Result, capacity_cost, simulate
from .trace import OP_ALLOC, OP_FREE, Trace, load

DEFAULT_DRAM_FRAC = 0.3  # of the trace's peak live bytes: DRAM holds under a third
DEFAULT_CXL_FRAC = 4.0  # CXL large enough for everything else


def peak_live_bytes(tr: Trace) -> int:
    ops = np.where(tr.op == OP_ALLOC, 1, np.where(tr.op == OP_FREE, -1, 0))
    return int(np.cumsum(ops).max()) * tr.block_bytes if ops.size else tr.block_bytes


def sized_config(tr: Trace, args) -> SimConfig:
    cfg = load_config(args.config) if args.config else SimConfig()
    if args.tick:
        cfg = SimConfig(cfg.tiers, args.tick)
    if args.dram_gib is not None or args.cxl_gib is not None or not args.config:
        peak = peak_live_bytes(tr) / GIB
        dram = args.dram_gib if args.dram_gib is not None else peak * args.dram_frac
        cxl = args.cxl_gib if args.cxl_gib is not None else peak * DEFAULT_CXL_FRAC
        cfg = cfg.with_capacities([dram, cxl])
    if args.swap:
        cfg = cfg.with_swap()
    return cfg


def make_policy(name: str, tau: float | None):
    cls = POLICIES[name]
    if name == "kvtier" and tau is not None:
        return cls(tau_s=tau)
    return cls()


def run_all(tr: Trace, cfg: SimConfig, names: list[str], tau: float | None = None) -> list[Result]:
    results = [simulate(tr, cfg, make_policy(n, tau)) for n in names]
    opt = next((r for r in results if r.policy == "belady"), None)
    for r in results:
        if opt is not None and opt.fast_hit > 0:
            r.extra["of_belady"] = r.fast_hit / opt.fast_hit
    return results


def format_table(results: list[Result], cost: dict | None = None) -> str:
    tiers = results[0].tiers
    pairs = sorted({k for r in results for k in r.migrated_bytes})
    head = ["policy"] + [f"hit {t}" for t in tiers] + ["of belady", "mean us", "p99 us", "penalty"]
    head += [f"GiB {p}" for p in pairs] + ["wall s"]
    rows = []
    for r in results:
        row = [r.policy] + [f"{h:.4f}" for h in r.hit_ratio]
        ob = r.extra.get("of_belady")
        row += [f"{ob:.3f}" if ob is not None else "-", f"{r.mean_ns / 1e3:.1f}", f"{r.p99_ns / 1e3:.1f}"]
        row += [f"{100 * r.decode_penalty:.1f}%"] + [f"{r.migrated_bytes.get(p, 0) / GIB:.1f}" for p in pairs]
        row += [f"{r.wall_s:.1f}"]
        rows.append(row)
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x[i].ljust(w[i]) for i in range(len(head))) for x in rows]
    if cost:
        d, t = cost["dram_only"], cost["tiered"]
        lines.append(
            f"sequence footprint {cost['seq_gib']:.2f} GiB; DRAM only: {d['max_seqs']} seqs, "
            f"${d['usd_per_seq']:.2f}/seq; {'+'.join(t['tiers'])}: {t['max_seqs']} seqs, ${t['usd_per_seq']:.2f}/seq"
        )
    return "\n".join(lines)


def plot(results: list[Result], outdir: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    names = [r.policy for r in results]
    out = []
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    ax[0].bar(names, [r.fast_hit for r in results], color="tab:blue")
    ax[0].set_ylim(0, 1)
    ax[0].set_title(f"{results[0].tiers[0]} hit ratio")
    ax[1].bar(names, [sum(r.migrated_bytes.values()) / GIB for r in results], color="tab:orange")
    ax[1].set_title("migrated GiB")
    ax[2].bar(names, [r.mean_ns / 1e3 for r in results], color="tab:green")
    ax[2].set_title("mean block read, us")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle(label)
    out.append(_save(plt, fig, outdir / f"{label}.png"))

    # fast-tier hit ratio over time, over a 10-tick window
    fig, ax = plt.subplots(figsize=(10, 4))
    for r in results:
        if r.timeline is None:
            continue
        fast, total = r.timeline
        w = np.ones(10)
        num, den = np.convolve(fast, w, "same"), np.convolve(total, w, "same")
        x = np.arange(fast.size) * (r.sim_s / max(r.ticks, 1))
        ax.plot(x, np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0), label=r.policy)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel(f"{results[0].tiers[0]} hit ratio (10-tick window)")
    ax.set_ylim(0, 1.02)
    ax.legend(ncol=3, fontsize="small")
    ax.set_title(label)
    out.append(_save(plt, fig, outdir / f"{label}-timeline.png"))
    return out


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier-sim", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="generate a synthetic serving trace")
    g.add_argument("--preset", choices=sorted(PRESETS), default="chat")
    g.add_argument("--accesses", type=int, help="access records to generate")
    g.add_argument("--nblocks", type=int, help="KV pool size in blocks")
    g.add_argument("--seed", type=int)
    g.add_argument("-o", "--output", required=True, help=".npz or .csv")
    r = sub.add_parser("run", help="replay a trace through policies")
    workload = r.add_mutually_exclusive_group(required=True)
    workload.add_argument("--trace", help=".npz or .csv trace file")
    workload.add_argument("--preset", choices=sorted(PRESETS))
    r.add_argument("--accesses", type=int, help="with --preset: access records")
    r.add_argument("--seed", type=int)
    r.add_argument("--policy", default="all", help=f"comma list of {','.join(POLICIES)} or 'all'")
    r.add_argument("--config", help="TOML tier model (see docs/simulator.md)")
    r.add_argument("--dram-gib", type=float)
    r.add_argument("--cxl-gib", type=float)
    r.add_argument("--dram-frac", type=float, default=DEFAULT_DRAM_FRAC, help="DRAM as a fraction of peak live bytes")
    r.add_argument("--swap", action="store_true", help="add an NVMe swap tier")
    r.add_argument("--tick", type=float, help="seconds per policy tick")
    r.add_argument("--tau", type=float, help="kvtier temperature time constant, seconds")
    r.add_argument("--json", action="store_true", help="JSON instead of a table")
    r.add_argument("--plot", help="directory for PNG plots")
    return ap


def _gen_overrides(args) -> dict:
    kw = {}
    if getattr(args, "accesses", None):
        kw["max_accesses"] = args.accesses
    if getattr(args, "nblocks", None):
        kw["nblocks"] = args.nblocks
    if getattr(args, "seed", None) is not None:
        kw["seed"] = args.seed
    return kw


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "gen":
            tr = generate(args.preset, **_gen_overrides(args))
            tr.save(args.output)
            print(f"{args.output}: {len(tr)} records, {tr.accesses} accesses, {tr.duration:.0f}s, {tr.nblocks} blocks")
            return 0
        tr = load(args.trace) if args.trace else generate(args.preset, **_gen_overrides(args))
        label = Path(args.trace).stem if args.trace else args.preset
        names = list(POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
        bad = [n for n in names if n not in POLICIES]
        if bad:
            print(f"kvtier-sim: unknown policy {', '.join(bad)}", file=sys.stderr)
            return 2
        cfg = sized_config(tr, args)
        results = run_all(tr, cfg, names, args.tau)
        cost = capacity_cost(tr, cfg)
        if args.json:
            doc = {
                "trace": label,
                "accesses": tr.accesses,
                "tiers": [asdict(t) for t in cfg.tiers],
                "results": [{k: v for k, v in asdict(r).items() if k != "timeline"} for r in results],
                "capacity_cost": cost,
            }
            print(json.dumps(doc, indent=2))
        else:
            gib = ", ".join(f"{t.name} {t.capacity_bytes / GIB:.1f} GiB" for t in cfg.tiers)
            print(f"trace {label}: {tr.accesses} accesses over {tr.duration:.0f}s; {gib}")
            print(format_table(results, cost))
        if args.plot:
            for p in plot(results, Path(args.plot), label):
                print(f"wrote {p}", file=sys.stderr)
        return 0
    except (KvtierError, OSError) as e:
        print(f"kvtier-sim: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
