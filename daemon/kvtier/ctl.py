"""kvtierctl: the operator's view of kvtierd.

    kvtierctl status | stats | tiers | regions [--pid P] | blocks REGION [--first N] [--count N]
    kvtierctl migrate REGION TIER [--blocks 0-15,40] [--pin] [--wait]
    kvtierctl measure REGION [--blocks 0-15,40]
    kvtierctl pin REGION [--tier T] [--blocks ...] | unpin REGION [--blocks ...]
    kvtierctl explain REGION BLOCK
    kvtierctl ages                (bytes by time since last access, per tier and tenant)
    kvtierctl topology            (no daemon needed: reads sysfs/procfs itself)
    kvtierctl top                 (live view)

Every command takes ``--json`` and then prints exactly the daemon's answer
(packed per-block arrays decoded to lists), so scripts never parse tables;
errors then are JSON on stdout too. ``regions`` and ``blocks`` follow the
daemon's pages: as a table each page is printed as it arrives; with --json
the pages are merged into one answer of the whole range. Exit status
(kvtier.cli): 0 ok, 1 the daemon refused, 2 usage, 3 daemon not reachable,
4 done in part (migrate: blocks that did not move or are not mapped); 141
when stdout closed early.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Iterator

import msgspec
import numpy as np

from kvtier import cli, protocol
from kvtier import top as top_mod
from kvtier.blocks import F_KEEP_DRAM, F_MANUAL_PIN, F_NEVER_SWAP, F_NOT_PRESENT, F_PREFILL_DONE, F_UNMOVABLE
from kvtier.client import Client, DaemonUnavailable, KvtierClientError

FLAG_LETTERS = ((F_UNMOVABLE, "U"), (F_KEEP_DRAM, "D"), (F_NEVER_SWAP, "S"), (F_PREFILL_DONE, "P"),
                (F_MANUAL_PIN, "M"), (F_NOT_PRESENT, "-"))
human = top_mod.human


def parse_blocks(spec: str | None) -> bytes | None:
    """"0-15,40,42" -> packed <u4 indices (inclusive ranges)."""
    if spec is None:
        return None
    out: list[np.ndarray] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad block list {spec!r}: use e.g. 0-15,40") from None
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"bad block range {part!r}")
        out.append(np.arange(a, b + 1, dtype=protocol.BLOCKS_DTYPE))
    return np.concatenate(out).tobytes() if out else b""


def decode_blocks(r: dict) -> dict:
    """A ``blocks``/``query`` answer with its packed arrays as lists."""
    out = dict(r)
    for key, dt in (("tiers", protocol.TIERS_DTYPE), ("temps", protocol.TEMPS_DTYPE), ("flags", protocol.FLAGS_DTYPE),
                    ("stuck", protocol.FLAGS_DTYPE),
                    ("last_access_age", protocol.TIMES_DTYPE)):
        if key in out:
            out[key] = np.frombuffer(out[key], dtype=dt).tolist()
    return out


def flag_string(f: int) -> str:
    return "".join(ch for bit, ch in FLAG_LETTERS if f & bit) or "."


def table(header: tuple[str, ...], rows: list[tuple]) -> str:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def tier_label(names: list[str], t: int) -> str:
    if 0 <= t < len(names):
        return names[t]
    return "unknown" if t == -1 else "mixed" if t == -2 else str(t)


def resolve_tier(client: Client, spec: str) -> int:
    if spec.isdigit():
        return int(spec)
    names = [t["name"] for t in client.request("tiers")["tiers"]]
    if spec in names:
        return names.index(spec)
    raise KvtierClientError("tier", "invalid_argument", f"no tier named {spec!r} (tiers: {', '.join(names)})")


# -- commands ---------------------------------------------------------------


def cmd_status(c: Client, a) -> tuple[Any, str]:
    s = c.request("status")
    e = s["engine"]
    lines = [
        f"kvtierd {s['server_version']} pid {s['pid']}, up {top_mod.duration(s['uptime_s'])}"
        + (" (dry run)" if e.get("dry_run") else ""),
        f"regions {s['regions']} of {s['processes']} processes, {s['blocks']} blocks, "
        f"{human(s['registered_bytes'])} registered; {s['connections']} client connections",
        f"tiers: {', '.join(e['tiers']) or 'none'}; migration running: {'yes' if e['job_running'] else 'no'}",
    ]
    if e.get("dry_run"):
        planned = e.get("dry_run_planned", {})

        def moves(key: str) -> str:
            return ", ".join(f"{p['src']} -> {p['dst']} {p['blocks']} blocks ({human(p['bytes'])})"
                             for p in planned.get(key, [])) or "nothing"
        lines.append(f"dry run, no page moved: the last plan would move {moves('last_plan')}; "
                     f"planned since start {moves('total')}")
    lines += [f"warning: {w}" for w in e.get("warnings", [])]
    return s, "\n".join(lines)


def cmd_stats(c: Client, a) -> tuple[Any, str]:
    s = c.request("stats")
    lines = []
    for k, v in s.items():
        if isinstance(v, dict) and "buckets" in v:
            v = f"count={v['count']} sum={v['sum']:.3f}s"
        elif isinstance(v, dict):
            v = ", ".join(f"{kk}={vv}" for kk, vv in v.items()) or "-"
        lines.append(f"{k:32s} {v}")
    return s, "\n".join(lines)


def cmd_tiers(c: Client, a) -> tuple[Any, str]:
    r = c.request("tiers")
    rows = [(t["index"], t["name"], t["kind"], ",".join(map(str, t["nodes"])) or "-", human(t["total"]),
             human(t["free"]), human(t["kvtier_bytes"]), t["kvtier_blocks"]) for t in r["tiers"]]
    return r, table(("TIER", "NAME", "KIND", "NODES", "TOTAL", "FREE", "KVTIER", "BLOCKS"), rows)


class Paged:
    """A command's answer that comes in pages: printed page by page as they
    arrive (table columns sized by the first page), or with --json merged
    into one document shaped like a single answer (``merge``)."""

    def __init__(self, header: tuple[str, ...], pages: Iterator[Any], rows: Callable[[Any], list[tuple]],
                 merge: Callable[[list[Any]], Any], legend: str = ""):
        self.header, self.pages, self.rows, self.merge, self.legend = header, pages, rows, merge, legend

    def lines(self) -> Iterator[str]:
        widths = None
        for page in self.pages:
            rows = [tuple(str(v) for v in r) for r in self.rows(page)]
            if widths is None:
                widths = [max(len(r[i]) for r in [self.header, *rows]) for i in range(len(self.header))]
                rows.insert(0, self.header)
            for r in rows:
                yield "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        if self.legend:
            yield self.legend

    def document(self) -> Any:
        return self.merge(list(self.pages))


def cmd_regions(c: Client, a) -> Paged:
    names = [t["name"] for t in c.request("tiers")["tiers"]]

    def rows(page: dict) -> list[tuple]:
        out = []
        for x in page["regions"]:
            by = ", ".join(f"{tier_label(names, int(t))}:{n}" for t, n in sorted(x["blocks_by_tier"].items()))
            # "client" registered it itself; "watch:RULE" adopted it (zero-integration mode).
            origin = f"watch:{x['adopted_by']}" if x.get("adopted_by") else "client"
            plc = x.get("placement")
            placed = (f"{plc['tier_name']}/node{plc['node']}" if plc else "-") + (" pinned" if x.get("pinned") else "")
            if x.get("placement_lost"):
                placed += f" ({x['placement_lost']} block(s) moved by the kernel)"
            out.append((x["id"], x["pid"], x["name"] or "-", x["tenant"] or "-", x["priority"], human(x["length"]),
                        human(x["block_size"]), x["nblocks"], by, ",".join(x["constraints"]) or "-", origin, placed))
        return out

    return Paged(("ID", "PID", "NAME", "TENANT", "PRIO", "SIZE", "BLOCK", "BLOCKS", "TIERS", "CONSTRAINTS",
                  "ORIGIN", "PLACED"),
                 c.pages("regions", **({"pid": a.pid} if a.pid else {})), rows,
                 lambda pages: {"regions": [x for p in pages for x in p["regions"]]})


def _merge_blocks(pages: list[dict]) -> dict:
    """Pages of one ``blocks`` range as the single answer of that range."""
    out = {k: v for k, v in pages[0].items() if k != "next"}
    for key in ("tiers", "temps", "flags", "stuck", "last_access_age"):
        if key in pages[0]:
            out[key] = [v for p in pages for v in p[key]]
    out["count"] = sum(p["count"] for p in pages)
    return out


def cmd_blocks(c: Client, a) -> Paged:
    pages = (decode_blocks(r) for r in c.pages("blocks", region=a.region, first=a.first,
                                                  **({"count": a.count} if a.count is not None else {})))

    def rows(r: dict) -> list[tuple]:
        names = r["tier_names"]
        # why an unmovable block is (a daemon without reasons sends none)
        why_names, why = r.get("stuck_names", []), r.get("stuck", [0] * len(r["tiers"]))
        return [(r["first"] + i, tier_label(names, t), f"{temp:.3g}", flag_string(f),
                 "never" if age == float("inf") else f"{age:.1f}s",
                 why_names[w] if f & F_UNMOVABLE and 0 < w < len(why_names) else "-")
                for i, (t, temp, f, age, w) in enumerate(zip(r["tiers"], r["temps"], r["flags"],
                                                             r["last_access_age"], why))]

    return Paged(("BLOCK", "TIER", "TEMP", "FLAGS", "LAST ACCESS", "UNMOVABLE"), pages, rows, _merge_blocks,
                 "flags: U unmovable, D keep_dram, S never_swap, P prefill done, M pinned, - not touched; "
                 "UNMOVABLE: locked (mlock), pinned (long-term pin), declared (registered pinned), failing")


def _block_ranges(ranges: list) -> str:
    return ",".join(str(f) if f == l else f"{f}-{l}" for f, l in ranges)


def migrate_report(r: dict, region: int, tier: str) -> str:
    """What a `migrate wait` answer says, in lines an operator reads."""
    lines = [f"region {region} to tier {tier}: {r['moved']} of {r['blocks'] + r['unmapped']} block(s) moved, "
             f"{r['pages_moved']} page(s), in {r['seconds']:.2f} s"
             + (f" after {r['attempts']} attempts ({r['retried']} block retries)" if r["attempts"] > 1 else "")
             + (" (dry run: nothing moved)" if r.get("dry_run") else "")]
    for key, what in (("already", "already there"), ("engine", "handed to the engine that owns them"),
                      ("planned", "planned (dry run)"), ("untouched", "never written (nothing to move)"),
                      ("gone", "unregistered meanwhile")):
        if r.get(key):
            lines.append(f"  {r[key]} block(s) {what}")
    if r["failed"]:
        lines.append(f"  {r['failed']} block(s) failed")
    for reason, pages in sorted(r["failed_pages"].items()):
        if reason != "UNMAPPED":
            lines.append(f"    {pages} page(s) {reason}")
    if r["unmapped"]:
        lines.append(f"  {r['unmapped']} block(s) not mapped (freed by their process): "
                     + (_block_ranges(r["unmapped_blocks"]) or "found during the move"))
    return "\n".join(lines)


def cmd_migrate(c: Client, a) -> tuple[Any, str]:
    tier = resolve_tier(c, a.tier)
    r = c.request("migrate", region=a.region, tier=tier, blocks=parse_blocks(a.blocks), wait=a.wait)
    if a.wait:
        text = migrate_report(r, a.region, a.tier)
    else:
        text = f"queued {r['queued']} block(s) of region {a.region} for tier {a.tier}"
        if r.get("dry_run"):
            text += " (dry run: planned and counted, nothing will move)"
        if r.get("unmapped"):
            text += (f"; {r['unmapped']} block(s) not mapped (freed by their process), not queued: "
                     + _block_ranges(r["unmapped_blocks"]))
    if a.pin:
        r["pinned"] = c.request("pin", region=a.region, tier=tier, blocks=parse_blocks(a.blocks))["blocks"]
        text += f"; pinned {r['pinned']}"
    return r, text


def cmd_measure(c: Client, a) -> tuple[Any, str]:
    r = c.request("measure", region=a.region, blocks=parse_blocks(a.blocks))
    return r, f"measuring {r['queued']} block(s) of region {a.region} page by page with the next ticks"


def cmd_pin(c: Client, a) -> tuple[Any, str]:
    tier = None if a.tier is None else resolve_tier(c, a.tier)
    r = c.request("pin", region=a.region, tier=tier, blocks=parse_blocks(a.blocks))
    return r, f"pinned {r['blocks']} block(s) of region {a.region}" + (f" to tier {a.tier}" if a.tier else "")


def cmd_unpin(c: Client, a) -> tuple[Any, str]:
    r = c.request("unpin", region=a.region, blocks=parse_blocks(a.blocks))
    return r, f"unpinned {r['blocks']} block(s) of region {a.region}"


def cmd_explain(c: Client, a) -> tuple[Any, str]:
    r = c.request("explain", region=a.region, block=a.block)
    return r, r["text"]


def cmd_ages(c: Client, a) -> tuple[Any, str]:
    """Bytes by time since last access, one row per (tier, tenant): how much
    of each tier is hot, lukewarm or forgotten (size DRAM by the first columns)."""
    r = c.request("ages")
    names = r["tier_names"]
    rows = []
    totals = [0] * len(r["buckets"])
    for x in r["rows"]:
        rows.append((tier_label(names, x["tier"]), x["tenant"] or "-", *(human(b) for b in x["bytes"]),
                     human(sum(x["bytes"]))))
        totals = [t + b for t, b in zip(totals, x["bytes"])]
    rows.append(("all", "", *(human(b) for b in totals), human(sum(totals))))
    return r, table(("TIER", "TENANT", *r["buckets"], "TOTAL"), rows) + \
        "\ncolumns: bytes by time since the block was last seen accessed (never seen: >10m)"


def cmd_topology(a) -> tuple[Any, str]:
    from kvtier.kernel import topology

    topo = topology.discover(a.sys_root, a.proc_root)
    return topo.to_dict(), topology.format_table(topo)


COMMANDS = {
    "status": cmd_status, "stats": cmd_stats, "tiers": cmd_tiers, "regions": cmd_regions,
    "blocks": cmd_blocks, "migrate": cmd_migrate, "measure": cmd_measure, "pin": cmd_pin, "unpin": cmd_unpin, "explain": cmd_explain,
    "ages": cmd_ages,
}


def _common(suppress: bool, parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    # The options work before or after the command. Subcommand copies must not
    # have defaults, or they would overwrite a value given before the command.
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p = parser_class(add_help=False)
    p.add_argument("--socket", default=d(None),
                   help="kvtierd socket (default $KVTIER_SOCKET or /run/kvtierd/kvtierd.sock)")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="print the answer as JSON (errors too: {\"error\": {...}} on stdout)")
    p.add_argument("--timeout", type=cli.positive_float, default=d(10.0), help="seconds to wait for the daemon")
    return p


def build_parser(parser_class: type[argparse.ArgumentParser] = cli.Parser) -> argparse.ArgumentParser:
    ap = parser_class(prog="kvtierctl", description="Inspect and steer kvtierd.",
                      epilog="exit status: 0 ok, 1 the daemon refused, 2 usage, 3 daemon not reachable, "
                             "4 done in part (migrate: some blocks did not move or are not mapped)",
                      parents=[_common(False, parser_class)])
    cli.add_version(ap)
    common = _common(True, parser_class)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=parser_class)
    sub.add_parser("status", parents=[common], help="daemon summary")
    sub.add_parser("stats", parents=[common], help="all counters")
    sub.add_parser("tiers", parents=[common], help="tiers with capacity and kvtier usage")
    p = sub.add_parser("regions", parents=[common], help="registered regions")
    p.add_argument("--pid", type=int)
    p = sub.add_parser("blocks", parents=[common], help="tier, temperature and flags of each block")
    p.add_argument("region", type=int)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int)
    p = sub.add_parser("migrate", parents=[common], help="move blocks to a tier now")
    p.add_argument("region", type=int)
    p.add_argument("tier", help="tier index or name")
    p.add_argument("--blocks", help="e.g. 0-15,40 (default: all)")
    p.add_argument("--pin", action="store_true", help="also pin them there so the policy leaves them")
    p.add_argument("--wait", action="store_true",
                   help="wait until the move is done (within --timeout) and print what moved and what did not, "
                        "per reason; exit 4 if some blocks did not move")
    p = sub.add_parser("measure", parents=[common],
                       help="re-measure where blocks' pages are, every page, now (outside the residency budget)")
    p.add_argument("region", type=int)
    p.add_argument("--blocks", help="e.g. 0-15,40 (default: all)")
    p = sub.add_parser("pin", parents=[common], help="keep blocks in a tier (default: where they are)")
    p.add_argument("region", type=int)
    p.add_argument("--tier")
    p.add_argument("--blocks")
    p = sub.add_parser("unpin", parents=[common], help="hand blocks back to the policy")
    p.add_argument("region", type=int)
    p.add_argument("--blocks")
    sub.add_parser("ages", parents=[common], help="bytes by time since last access, per tier and tenant")
    p = sub.add_parser("explain", parents=[common], help="why a block is where it is")
    p.add_argument("region", type=int)
    p.add_argument("block", type=int)
    p = sub.add_parser("topology", parents=[common], help="discover tiers locally (no daemon needed)")
    p.add_argument("--sys-root", default="/sys")
    p.add_argument("--proc-root", default="/proc")
    p = sub.add_parser("top", parents=[common], help="live view")
    top_mod.add_arguments(p)
    return ap


def _failure(e: BaseException) -> tuple[int, str, str, int, str]:
    """(exit status, code, message, errno, op) for what a command raised."""
    if isinstance(e, DaemonUnavailable):
        return cli.EXIT_UNAVAILABLE, e.code, e.message, e.errno, ""
    if isinstance(e, KvtierClientError):
        return cli.EXIT_REFUSED, e.code, f"{e.op}: {e.message}", e.errno, e.op
    if isinstance(e, TimeoutError):
        return cli.EXIT_UNAVAILABLE, "timeout", "kvtierd did not answer in time (see --timeout)", 0, ""
    if isinstance(e, ConnectionError):
        # EPIPE on send or ECONNRESET/EOF on receive, depending on timing:
        # either way the daemon went away (restart, crash) or dropped us.
        why = e.strerror or str(e)
        return cli.EXIT_UNAVAILABLE, "unavailable", f"kvtierd closed the connection ({why})", e.errno or 0, ""
    if isinstance(e, msgspec.MsgspecError):
        return cli.EXIT_REFUSED, "protocol_error", f"kvtierd sent an answer this kvtierctl cannot read: {e}", 0, ""
    assert isinstance(e, OSError)
    return cli.EXIT_REFUSED, "os_error", e.strerror or str(e), e.errno or 0, ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser(cli.parser_class(argv))
    a = ap.parse_args(argv)
    if a.cmd == "top":
        return top_mod.run(a)
    try:
        if a.cmd == "topology":
            data, text = cmd_topology(a)
        else:
            with Client(a.socket, timeout=a.timeout, reconnect_timeout=0, name="kvtierctl") as c:
                answer = COMMANDS[a.cmd](c, a)
                if isinstance(answer, Paged):
                    if a.json:
                        data, text = answer.document(), ""
                    else:
                        # Each page is printed before the next is asked for:
                        # a region of millions of blocks starts at once and
                        # is never held whole.
                        try:
                            for line in answer.lines():
                                print(cli.printable(line), flush=True)
                        except BrokenPipeError:
                            return cli.stdout_closed()
                        return 0
                else:
                    data, text = answer
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    except KeyboardInterrupt:
        return cli.EXIT_INTERRUPTED
    except (KvtierClientError, OSError, msgspec.MsgspecError) as e:
        status, code, message, err, op = _failure(e)
        cli.report(a.json, "kvtierctl", code, message, errno=err, op=op)
        return status
    try:
        if a.json:
            cli.emit_json(data)
        else:
            print(cli.printable(text), flush=True)
    except BrokenPipeError:
        return cli.stdout_closed()
    if a.cmd == "migrate" and (data.get("failed") or data.get("unmapped")):
        return cli.EXIT_PARTIAL
    return 0


if __name__ == "__main__":
    sys.exit(main())
