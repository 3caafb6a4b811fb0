"""``kvtierctl top``: a live view of tiers, regions and migrations.

Every interval it asks the daemon for ``status``, ``stats``, ``tiers`` and
``regions`` (four requests on one connection) and redraws the screen in
place. Rates (migrated bytes per second per tier pair, the hint hit ratio
per tier) are differences between two consecutive samples, so the first
frame shows totals only.

``render(sample, prev, width, height)`` is a pure function from two
samples (plain dicts, as the daemon returns them) to screen lines; the
tests feed it captured samples. ``run`` does the I/O: the terminal is put
in the alternate screen while running and restored on every exit path,
Ctrl-C included, so the shell prompt comes back where it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any, Callable, TextIO

from kvtier import cli

Sample = dict[str, Any]

# ANSI: alternate screen on/off, cursor home, erase to end of line / screen.
ALT_ON, ALT_OFF = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME, EOL, EOS = "\x1b[H", "\x1b[K", "\x1b[J"
ARROW = "→"


def gather(client: Any, clock: Callable[[], float] = time.monotonic) -> Sample:
    """One sample from the daemon: its answers plus the time they were taken."""
    return {
        "t": clock(),
        "status": client.request("status"),
        "stats": client.request("stats"),
        "tiers": client.request("tiers")["tiers"],
        "regions": list(client.regions()),
    }


# ---------------------------------------------------------------------------
# formatting helpers


def human(n: float | None, unit: str = "B") -> str:
    if n is None:
        return "-"
    n = float(n)
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.1f} {prefix}{unit}"
        n /= 1024
    return f"{n:.1f} Ti{unit}"  # pragma: no cover - loop always returns


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def duration(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h}:{m:02d}:{s:02d}"


def _pairs(counter: dict[str, float]) -> dict[tuple[int, ...], float]:
    """DaemonStats.to_dict() keys "0:1" / "0:1:EBUSY" back to tuples."""
    out = {}
    for k, v in (counter or {}).items():
        parts = tuple(int(p) if p.lstrip("-").isdigit() else p for p in str(k).split(":"))
        out[parts] = v
    return out


def _delta(cur: dict, prev: dict | None) -> dict:
    if prev is None:
        return {}
    return {k: v - prev.get(k, 0) for k, v in cur.items() if v - prev.get(k, 0) > 0}


def tier_label(names: list[str], t: int) -> str:
    if 0 <= t < len(names):
        return names[t]
    return {-1: "unknown", -2: "mixed"}.get(t, str(t))


def hit_ratios(stats: dict, prev_stats: dict | None) -> dict[int, float] | None:
    """Fraction of hinted block accesses per tier since the previous sample
    (since start on the first frame); None when the daemon does not count
    them (``hint_tier_blocks`` missing from its stats)."""
    cur = stats.get("hint_tier_blocks")
    if cur is None:
        return None
    cur = {int(k): v for k, v in cur.items()}
    if prev_stats is not None and prev_stats.get("hint_tier_blocks") is not None:
        prev = {int(k): v for k, v in prev_stats["hint_tier_blocks"].items()}
        d = {k: v - prev.get(k, 0) for k, v in cur.items()}
        if sum(d.values()) > 0:
            cur = d
    total = sum(cur.values())
    return {k: v / total for k, v in cur.items()} if total else {}


def region_heat(r: dict) -> float:
    """Mean block temperature: comparable across regions of different size."""
    return float(r.get("temp_sum", 0.0)) / max(1, int(r.get("nblocks", 1)))


def region_fast_share(r: dict) -> float | None:
    by = {int(k): v for k, v in (r.get("blocks_by_tier") or {}).items()}
    n = sum(by.values())
    return by.get(0, 0) / n if n else None


# ---------------------------------------------------------------------------
# the screen


def render(sample: Sample, prev: Sample | None = None, width: int = 100, height: int = 40) -> list[str]:
    """Screen lines for one sample; ``prev`` (the previous sample) gives rates."""
    st, stats = sample["status"], sample["stats"]
    pstats = prev["stats"] if prev else None
    dt = sample["t"] - prev["t"] if prev else 0.0
    tiers = sample["tiers"]
    names = [t["name"] for t in tiers]
    eng = st.get("engine", {})
    lines: list[str] = []

    flags = []
    if eng.get("dry_run"):
        flags.append("DRY RUN")
    if eng.get("job_running"):
        flags.append("migrating")
    tick_ms = 1000 * float(stats.get("tick_seconds_last", 0.0))
    lines.append(
        f"kvtierd {st.get('server_version', '?')} pid {st.get('pid', '?')}  up {duration(st.get('uptime_s', 0))}"
        f"  regions {st.get('regions', 0)}  clients {st.get('processes', 0)}  blocks {st.get('blocks', 0)}"
        f"  registered {human(st.get('registered_bytes', 0))}"
    )
    lines.append(
        f"ticks {stats.get('ticks_total', 0)}  last tick {tick_ms:.1f} ms  errors {stats.get('tick_errors_total', 0)}"
        f"  hints {stats.get('block_hints_total', 0)}" + (f"  [{', '.join(flags)}]" if flags else "")
    )
    lines.append("")

    # -- tiers
    hits = hit_ratios(stats, pstats)
    lines.append(f"{'TIER':<8} {'KIND':<5} {'NODES':<6} {'CAPACITY':>10} {'FREE':>10} {'KV USED':>10} "
                 f"{'BLOCKS':>7} {'FILL':>6} {'HIT':>6}  ")
    for t in tiers:
        cap = t.get("capacity") or 0
        fill = t.get("kvtier_bytes", 0) / cap if cap else None
        hit = None if hits is None else hits.get(t["index"], 0.0)
        nodes = ",".join(str(n) for n in t.get("nodes", [])) or "-"
        lines.append(f"{t['name']:<8} {t['kind']:<5} {nodes:<6} {human(cap):>10} {human(t.get('free')):>10} "
                     f"{human(t.get('kvtier_bytes', 0)):>10} {t.get('kvtier_blocks', 0):>7} {pct(fill):>6} "
                     f"{pct(hit):>6}  {_bar(fill, 16)}")
    if hits is None:
        lines.append("  (hit ratio: this daemon does not count hint hits per tier)")
    lines.append("")

    # -- migrations
    moved = _pairs(stats.get("migrated_bytes", {}))
    fails = _pairs(stats.get("migration_failed_pages", {}))
    rate = _delta(moved, _pairs(pstats.get("migrated_bytes", {})) if pstats else None)
    fail_rate = _delta(fails, _pairs(pstats.get("migration_failed_pages", {})) if pstats else None)
    lines.append("MIGRATIONS" + (f" (last {dt:.1f} s)" if prev else " (totals; rates from the next frame)"))
    if not moved and not fails:
        lines.append("  none yet")
    for key in sorted(moved, key=lambda k: -moved[k]):
        src, dst = key[0], key[1]
        r = f"{human(rate.get(key, 0) / dt)}/s" if prev and dt > 0 else ""
        lines.append(f"  {tier_label(names, src):>8} {ARROW} {tier_label(names, dst):<8} {r:>12}   "
                     f"total {human(moved[key])}")
    for key in sorted(fails, key=lambda k: -fails[k]):
        src, dst, why = key[0], key[1], key[2] if len(key) > 2 else "?"
        new = fail_rate.get(key, 0)
        lines.append(f"  failed {tier_label(names, src)} {ARROW} {tier_label(names, dst)} {why}: {fails[key]}"
                     + (f" (+{new})" if new else ""))
    lines.append("")

    # -- regions: as many of the hottest and coldest as the screen holds
    regions = sorted(sample["regions"], key=region_heat, reverse=True)
    room = max(1, (height - len(lines) - 4) // 2)
    head = f"  {'ID':>4} {'NAME':<16} {'TENANT':<10} {'PID':>7} {'SIZE':>10} {'HEAT':>8} {'IN ' + (names[0] if names else 'T0'):>8}"
    if len(regions) <= 2 * room:
        sections = [("REGIONS, hottest first", regions)]
    else:
        sections = [("HOTTEST REGIONS", regions[:room]), ("COLDEST REGIONS", regions[::-1][:room])]
    for title, rows in sections:
        if not rows:
            continue
        lines.append(title)
        lines.append(head)
        for r in rows:
            name, tenant = (cli.printable(str(r.get(k, ""))) for k in ("name", "tenant"))
            lines.append(f"  {r['id']:>4} {name[:16]:<16} {tenant[:10]:<10} "
                         f"{r.get('pid', 0):>7} {human(r.get('length', 0)):>10} {region_heat(r):>8.2f} "
                         f"{pct(region_fast_share(r)):>8}")
    if not regions:
        lines.append("no regions registered")
    warnings = eng.get("warnings") or []
    for w in warnings[: max(0, height - len(lines) - 1)]:
        lines.append(f"! {cli.printable(str(w))}")
    return [ln[:width] for ln in lines[:height]]


def _bar(frac: float | None, width: int) -> str:
    if frac is None:
        return ""
    n = max(0, min(width, round(frac * width)))
    return "[" + "#" * n + "." * (width - n) + "]"


# ---------------------------------------------------------------------------
# the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--interval", type=cli.positive_float, default=1.0,
                        help="seconds between refreshes (default 1)")
    parser.add_argument("--count", type=cli.nonneg_int, default=0,
                        help="stop after this many frames (0 = until Ctrl-C)")
    parser.add_argument("--once", action="store_true", help="print one frame without redrawing and exit")
    if not any("--socket" in a.option_strings for a in parser._actions):
        parser.add_argument("--socket", help="kvtierd socket (default $KVTIER_SOCKET or /run/kvtierd/kvtierd.sock)")
    if not any("--json" in a.option_strings for a in parser._actions):
        parser.add_argument("--json", action="store_true", help="one JSON sample per line instead of a screen")


def run(args: argparse.Namespace, out: TextIO | None = None,
        connect: Callable[[str | None], Any] | None = None) -> int:
    """Draw until Ctrl-C (or ``--count`` frames). Exit status as kvtierctl's
    (kvtier.cli): 0 on a clean exit, 3 when the daemon cannot be reached at
    the start, 1 when it refuses. With ``--json`` every frame is the raw
    sample as one JSON line (the daemon's four answers plus the time), for
    scripts that want a time series without parsing the screen."""
    out = out or sys.stdout
    as_json = bool(getattr(args, "json", False))
    if connect is None:
        from kvtier.client import Client

        def connect(path):
            return Client(path, name="kvtierctl top", timeout=getattr(args, "timeout", 10.0),
                          reconnect_timeout=0.0)

    from kvtier.client import DaemonUnavailable, KvtierClientError

    try:
        client = connect(getattr(args, "socket", None))
    except (KvtierClientError, OSError) as e:
        unreachable = isinstance(e, (DaemonUnavailable, OSError))
        cli.report(as_json, "kvtierctl top", getattr(e, "code", "unavailable"), getattr(e, "message", str(e)),
                   errno=getattr(e, "errno", 0) or 0)
        return cli.EXIT_UNAVAILABLE if unreachable else cli.EXIT_REFUSED
    live = not args.once and not as_json and out.isatty()
    frames = 1 if args.once else args.count
    prev: Sample | None = None
    drawn = 0
    interrupted = False
    try:
        if live:
            out.write(ALT_ON)
        while True:
            size = shutil.get_terminal_size((100, 40))
            try:
                sample = gather(client)
                lines = ([json.dumps(cli.jsonable(sample), default=str)] if as_json
                         else render(sample, prev, size.columns, size.lines if live else 1000))
                prev = sample
            except (KvtierClientError, OSError) as e:
                lines = ([json.dumps({"error": {"code": "unavailable", "message": str(e)}})] if as_json
                         else [f"kvtierctl top: daemon unavailable: {e}", "retrying..."])
                prev = None
                client.close_socket()  # the next gather() reconnects
            if live:
                out.write(HOME + "".join(f"{ln}{EOL}\n" for ln in lines) + EOS)
            else:
                out.write("\n".join(lines) + "\n")
            out.flush()
            drawn += 1
            if frames and drawn >= frames:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        # Ctrl-C may land between a request and its answer: the stream is
        # then mid-frame, and draining it (what close() does) could wait
        # for an answer that no longer lines up. Drop the connection.
        interrupted = True
        return 0
    except BrokenPipeError:  # kvtierctl top | head
        live = False
        return cli.stdout_closed()
    finally:
        if live:
            out.write(ALT_OFF)
            out.flush()
        if interrupted:
            client.close_socket()
        else:
            client.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = cli.parser_class(argv)(prog="kvtierctl top", description="Live view of kvtierd.")
    cli.add_version(ap)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
