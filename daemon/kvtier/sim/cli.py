"""``kvtier-sim``: generate KV-block traces and replay them through tiering policies.

    kvtier-sim gen --preset chat -o chat.npz
    kvtier-sim run --preset chat                       # all policies, table on stdout
    kvtier-sim run --trace chat.npz --policy kvtier,lru --json
    kvtier-sim run --preset rag --config tiers.toml --plot out/
    kvtier-sim run --trace conversation_trace.jsonl --model llama-3-70b --dram-frac 0.1
    kvtier-sim run --preset chat --set policy.min_residence_s=2 --set hotness.tau_s=5

See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..cli import add_version
from ..errors import ConfigError, InvalidArgument, KvtierError
from ..policy import PolicyConfig
from .gen import PRESETS, generate
from .model import GIB, SimConfig, load_config
from .oracles import FeasibleOracle, belady_min
from .policies import DEFAULT_PREFETCH, POLICIES
from .requests import DEFAULT_DECODE_TPS, DEFAULT_MODEL, FORMATS, MODELS, RequestTrace
from .runner import Result, capacity_cost, simulate
from . import recording
from .trace import OP_ALLOC, OP_FREE, load

DEFAULT_DRAM_FRAC = 0.3  # of the trace's peak live bytes: DRAM holds under a third
DEFAULT_CXL_FRAC = 4.0  # CXL large enough for everything else
REFERENCES = ("feasible-oracle", "belady-min")
ALL = tuple(POLICIES) + REFERENCES


def peak_live_bytes(tr) -> int:
    if isinstance(tr, RequestTrace):  # the KV pool holds the whole footprint
        return tr.footprint_blocks * tr.block_bytes
    ops = np.where(tr.op == OP_ALLOC, 1, np.where(tr.op == OP_FREE, -1, 0))
    return int(np.cumsum(ops).max()) * tr.block_bytes if ops.size else tr.block_bytes


def sized_config(tr, args) -> SimConfig:
    rec = getattr(args, "recording", None)
    if rec is not None and not args.config:  # a kvtierd recording: its own tiers unless sizes are given
        cfg = rec.sim_config(args.dram_gib, args.cxl_gib, args.tick, args.migrator)
        return cfg.with_swap() if args.swap else cfg
    cfg = load_config(args.config) if args.config else SimConfig()
    if args.tick is not None:
        cfg = SimConfig(cfg.tiers, args.tick)
    if args.dram_gib is not None or args.cxl_gib is not None or not args.config:
        peak = peak_live_bytes(tr) / GIB
        dram = args.dram_gib if args.dram_gib is not None else peak * args.dram_frac
        if args.cxl_gib is not None:
            cxl = args.cxl_gib
        elif isinstance(tr, RequestTrace):
            # DRAM + CXL hold exactly the pool: the rest of the footprint, whole blocks
            cxl = (tr.nblocks - int(dram * GIB // tr.block_bytes)) * tr.block_bytes / GIB
        else:
            cxl = peak * DEFAULT_CXL_FRAC
        cfg = cfg.with_capacities([dram, cxl])
    if args.swap:
        cfg = cfg.with_swap()
    return cfg


def kvtier_settings(items: list[str] | None) -> tuple[PolicyConfig, float, float]:
    """The daemon's shipped [policy] and [hotness] settings, with ``--set``
    overrides validated by the daemon's own option table (kvtier.config)."""
    from .. import config
    from ..daemon import policy_config

    overrides = dict(config.parse_override(item) for item in items or [])
    bad = [k for k in overrides if k.split(".")[0] not in ("policy", "hotness")]
    if bad:
        raise ConfigError(f"--set {bad[0]}: kvtier-sim takes policy.KEY=VALUE or hotness.KEY=VALUE")
    cfg = config.load(None, overrides=overrides)
    return (policy_config(cfg, lambda name: int(name)), float(cfg.get("hotness.tau_s")),
            float(cfg.get("hotness.end_of_run")))


def make_policy(name: str, settings: tuple[PolicyConfig, float, float] | None = None, prefetch: bool = DEFAULT_PREFETCH):
    cls = POLICIES[name]
    if name == "kvtier":
        return cls(*settings, prefetch=prefetch) if settings else cls(prefetch=prefetch)
    return cls()


def run_all(tr, cfg: SimConfig, names: list[str], settings=None, prefetch: bool = DEFAULT_PREFETCH) -> list[Result]:
    results = []
    for n in names:
        if n == "belady-min":
            results.append(belady_min(tr, cfg))
        elif n == "feasible-oracle":
            results.append(simulate(tr, cfg, FeasibleOracle()))
        else:
            results.append(simulate(tr, cfg, make_policy(n, settings, prefetch)))
    opt = next((r for r in results if r.policy == "feasible-oracle"), None)
    for r in results:
        if opt is not None and opt.fast_hit > 0:
            r.extra["of_oracle"] = r.fast_hit / opt.fast_hit
    return results


def format_table(results: list[Result], cost: dict | None = None) -> str:
    tiers = results[0].tiers
    pairs = sorted({k for r in results for k in r.migrated_bytes})
    head = ["policy"] + [f"hit {t}" for t in tiers] + ["of oracle", "mean us", "p99 us", "penalty"]
    head += [f"GiB {p}" for p in pairs] + ["wall s"]
    rows = []
    for r in results:
        row = [r.policy] + [f"{h:.4f}" for h in r.hit_ratio]
        ob = r.extra.get("of_oracle")
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


def _ranged(conv, ok, need: str):
    """An argparse type: ``conv(text)`` that passes ``ok``, else a usage error."""
    def parse(text: str):
        try:
            v = conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
        return v
    return parse


_positive = _ranged(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
_count = _ranged(int, lambda v: v >= 1, "a whole number >= 1")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier-sim", description=__doc__.split("\n\n")[0])
    add_version(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="generate a synthetic serving trace")
    g.add_argument("--preset", choices=sorted(PRESETS), default="chat")
    g.add_argument("--accesses", type=_count, help="access records to generate")
    g.add_argument("--nblocks", type=_count, help="KV pool size in blocks")
    g.add_argument("--seed", type=int)
    g.add_argument("-o", "--output", required=True, help=".npz or .csv")
    r = sub.add_parser("run", help="replay a trace through policies")
    workload = r.add_mutually_exclusive_group(required=True)
    workload.add_argument("--trace", help=".npz or .csv block trace, or .jsonl request trace (Mooncake, Qwen-Bailian)")
    workload.add_argument("--preset", choices=sorted(PRESETS))
    r.add_argument("--accesses", type=_count, help="with --preset: access records")
    r.add_argument("--seed", type=int)
    q = r.add_argument_group("request traces (.jsonl)")
    q.add_argument("--format", choices=FORMATS, default="auto")
    q.add_argument("--model", default=DEFAULT_MODEL, help=f"KV bytes per token of one of {', '.join(MODELS)}")
    q.add_argument("--kv-bytes-per-token", type=_count, help="instead of --model")
    q.add_argument("--block-tokens", type=_count, help="tokens per hash id (default: 512 mooncake, 16 bailian)")
    q.add_argument("--decode-tps", type=_positive, default=DEFAULT_DECODE_TPS, help="decode tokens/s per request")
    q.add_argument("--pool-blocks", type=_count, help="KV pool (prefix cache) in blocks (default: the footprint)")
    q.add_argument("--requests", type=_count, help="replay only the first N requests")
    r.add_argument("--policy", default="all", help=f"comma list of {','.join(ALL)} or 'all'")
    r.add_argument("--config", help="TOML tier model (see docs/simulator.md)")
    r.add_argument("--dram-gib", type=_positive)
    r.add_argument("--cxl-gib", type=_positive)
    r.add_argument("--dram-frac", type=_positive, default=DEFAULT_DRAM_FRAC,
                   help="DRAM as a fraction of peak live bytes (request traces: of the footprint)")
    r.add_argument("--swap", action="store_true", help="add an NVMe swap tier")
    r.add_argument("--tick", type=_positive, help="seconds per policy tick (a recording: instead of its recorded tick times)")
    r.add_argument("--migrator", choices=("recorded", "model"), default="recorded",
                   help="a kvtierd recording: replay its recorded migrator and tick clock (default) "
                        "or the tier model's per-tick migration budget")
    r.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="kvtier setting over the daemon's shipped default: policy.KEY (any PolicyConfig field) "
                        "or hotness.KEY (tau_s, end_of_run); repeatable")
    r.add_argument("--kvtier-prefetch", choices=("on", "off"), default="on" if DEFAULT_PREFETCH else "off",
                   help="request traces: kvtier's client prefetches each request's cached blocks at its arrival")
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


def open_trace(args):
    if args.preset:
        return generate(args.preset, **_gen_overrides(args))
    if Path(args.trace).suffix in (".jsonl", ".json"):
        return RequestTrace(
            args.trace, args.format, args.model, args.kv_bytes_per_token, args.block_tokens, args.decode_tps,
            args.pool_blocks, args.requests,
        )
    if recording.is_recording(args.trace):
        args.recording = recording.load(args.trace)
        return args.recording.trace
    return load(args.trace)


def describe(tr) -> str:
    if isinstance(tr, RequestTrace):
        return (f"{tr.requests_n} requests ({tr.fmt}) over {tr.duration:.0f}s, model {tr.model} "
                f"({tr.kv_bytes} B/token), {tr.block_tokens}-token blocks of {tr.block_bytes / (1 << 20):.0f} MiB, "
                f"decode {tr.decode_tps:g} tokens/s, footprint {tr.footprint_blocks} blocks")
    return f"{tr.accesses} accesses over {tr.duration:.0f}s"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "gen":
            tr = generate(args.preset, **_gen_overrides(args))
            tr.save(args.output)
            print(f"{args.output}: {len(tr)} records, {tr.accesses} accesses, {tr.duration:.0f}s, {tr.nblocks} blocks")
            return 0
        names = list(ALL) if args.policy == "all" else [p.strip() for p in args.policy.split(",")]
        bad = [n for n in names if n not in ALL]
        if bad:
            print(f"kvtier-sim: unknown policy {', '.join(bad)} (known: {', '.join(ALL)})", file=sys.stderr)
            return 2
        tr = open_trace(args)
        rec = getattr(args, "recording", None)
        # A recording replays with its recorded policy; --set changes it.
        settings = kvtier_settings(args.set) if args.set or rec is None else rec.settings()
        label = Path(args.trace).stem if args.trace else args.preset
        cfg = sized_config(tr, args)
        results = run_all(tr, cfg, names, settings, args.kvtier_prefetch == "on")
        if not any(sum(r.served) > 0 for r in results):
            # every hit ratio would be 0/0: a table of zeros compares nothing
            raise InvalidArgument(f"{label}: the trace reads no block (no decode step, no prompt block): "
                                  "nothing to compare")
        cost = capacity_cost(tr, cfg)
        if args.json:
            doc = {
                "trace": label,
                "source": describe(tr),
                "tiers": [asdict(t) for t in cfg.tiers],
                "kvtier_settings": {"prefetch": args.kvtier_prefetch == "on",
                                    "policy": asdict(settings[0]), "hotness": {"tau_s": settings[1],
                                                                                  "end_of_run": settings[2]}},
                "results": [{k: v for k, v in asdict(r).items() if k != "timeline"} for r in results],
                "capacity_cost": cost,
            }
            if rec is not None:
                doc["recording"] = {"files": rec.files, "live_fast_hit": rec.live_fast_hit,
                                    "hinted_accesses": rec.hinted_accesses,
                                    "machine": rec.machine_doc() if cfg.machine is not None else None}
            print(json.dumps(doc, indent=2, default=str))
        else:
            gib = ", ".join(f"{t.name} {t.capacity_bytes / GIB:.1f} GiB" for t in cfg.tiers)
            print(f"trace {label}: {describe(tr)}; {gib}")
            print(format_table(results, cost))
            if rec is not None:
                print(rec.summary())
        if args.plot:
            for p in plot(results, Path(args.plot), label):
                print(f"wrote {p}", file=sys.stderr)
        return 0
    except (KvtierError, OSError) as e:
        print(f"kvtier-sim: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
