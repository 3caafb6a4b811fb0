#!/usr/bin/env python3
"""What kvtierd costs at scale: 64 GiB to 1 TiB registered, idle and hinted.

    sudo .venv/bin/python scripts/bench/scale.py [--sizes 64G,1T] [--regions 1,100,1000]
        [--rates 0,10000,1000000] [--seconds 25] [--json FILE] [--daemon-path DIR]

Each cell (registered bytes x regions x hinted blocks per second) starts a
fresh kvtierd (its default config except: socket and metrics port in a
temporary directory, no state file, request limits raised so the hint rate
is not refused) and a workload process that

* maps the regions as sparse anonymous memory (MAP_PRIVATE | MAP_ANONYMOUS |
  MAP_NORESERVE), touching one byte every --touch-every bytes (default one
  4 KiB page per 64 MiB: a pool the engine has reserved but barely used);
* registers them itself, in --block blocks (default 2 MiB);
* has its connection's hint ring open from the first registration on (the
  client asks for it there since main ec01a07), so an idle cell has an open,
  empty ring, as an engine between requests has;
* hints at the cell's rate: every 50 ms, rate/20 random blocks of the
  regions in turn (at most 16 regions per round, so a round is at most 16
  messages), with the client library's own batching.

After --warmup seconds the benchmark samples, over --seconds of steady state:

* daemon CPU: utime + stime of kvtierd from /proc/PID/stat (all its threads),
  as % of one core; plus kdamond threads, if any appear while it runs;
* tick duration p50/p99: histogram_quantile over the daemon's own tick
  histogram (buckets of stats.TICK_BUCKETS), as Prometheus would compute it;
* residency measurement: worker seconds per second spent measuring (the
  daemon's residency_seconds_sum where it reports one, else its whole
  migration-job time, which on an idle host is all measurement) and per pass
  over the whole table (that rate times the time one pass takes);
* RSS: the fixed part is the daemon's VmRSS with the workload connected and
  one block registered, after 3 s (its measuring and collecting workers have
  run a job: threads, arenas, scratch); per block is (VmRSS at the end -
  that) / blocks; and between cells of the same regions and rate that differ
  in size, the growth of that per-block part over the blocks added (what a
  block costs at the margin);
* tick CPU p50/p99: the loop thread's CPU time per tick (thread_time), the
  wall time above less its waits for a CPU or the GIL;
* metrics scrape: median wall time of 5 GETs of /metrics;
* hint-to-table throughput (cells with rate 0 only): this process, as root,
  pipelines 65,536-block hint messages into the registered regions until
  --ingest block hints, then one synchronous call (every hint applied);
  block hints per wall second and per daemon CPU second.

--daemon-path runs the daemon from another source tree (PYTHONPATH), e.g. an
export of main, so the same benchmark gives the "before" row. The host is
shared: keep --seconds short and say so; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from kvtier.client import Client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_bench import cpu_seconds, machine, wait_ready  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
MAP_NORESERVE = 0x4000  # <sys/mman.h> on Linux (Python's mmap module does not export it)
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
ROUND_S = 0.05
MAX_REGIONS_PER_ROUND = 16


def size_of(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * UNITS[s[-1]]) if s and s[-1] in UNITS else int(s)


def fmt_size(n: int) -> str:
    for u in "TGMK":
        if n >= UNITS[u] and n % UNITS[u] == 0:
            return f"{n // UNITS[u]} {u}iB"
    return str(n)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_by_mapping(pid: int) -> dict[str, int]:
    """Resident bytes per mapping of /proc/PID/smaps: file mappings by path
    (code and data of the interpreter and libraries), [heap], and anonymous
    mappings by start address (the block table's reserved arrays, thread
    arenas, large numpy buffers)."""
    out: dict[str, int] = {}
    key = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if not parts[0].endswith(":"):
                key = parts[5] if len(parts) > 5 else "[anon " + parts[0].split("-")[0] + "]"
            elif parts[0] == "Rss:":
                out[key] = out.get(key, 0) + int(parts[1]) * 1024
    return out


def rss_growth(before: dict[str, int], after: dict[str, int], top: int = 6) -> list[tuple[str, int]]:
    """The mappings whose resident bytes grew most (bytes), largest first."""
    grew = [(k, after.get(k, 0) - before.get(k, 0)) for k in set(before) | set(after)]
    return sorted((g for g in grew if g[1] > 0), key=lambda g: -g[1])[:top]


def kdamond_cpu() -> dict[int, float]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                if not f.read().startswith("kdamond"):
                    continue
            out[int(d)] = cpu_seconds(int(d))
        except OSError:
            pass
    return out


def histogram_quantile(q: float, bounds: list[float], counts: list[int]) -> float | None:
    """Prometheus' histogram_quantile over non-cumulative bucket counts
    (last bucket = above every bound): linear within the bucket."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    acc = 0
    for i, c in enumerate(counts):
        if acc + c >= rank and c > 0:
            lo = bounds[i - 1] if i > 0 else 0.0
            if i >= len(bounds):
                return bounds[-1]  # above the top bound: report the bound
            return lo + (bounds[i] - lo) * (rank - acc) / c
        acc += c
    return bounds[-1]


def hist_counts(h: dict) -> tuple[list[float], list[int]]:
    """The stats op's {"buckets": {le: cumulative}} back to bounds + per-bucket counts."""
    items = sorted(((float("inf") if k == "+Inf" else float(k)), v) for k, v in h["buckets"].items())
    bounds = [b for b, _ in items if b != float("inf")]
    cum = [v for _, v in items]
    return bounds, [cum[0]] + [cum[i] - cum[i - 1] for i in range(1, len(cum))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the workload process -----------------------------------------------------------


def child(a: argparse.Namespace) -> int:
    """Map, touch, register, then hint at the rate until SIGTERM; report on exit."""
    per = a.total // a.nregions
    block = a.block
    per -= per % block
    bufs, regions = [], []
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    c = Client(a.socket, hint_interval=ROUND_S)
    # One block first, so the daemon's workers start (they start with their
    # first job) and the measuring side can take the fixed part of the RSS.
    probe = mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe[0] = 1
    c.register(probe, block_size=block, name="probe")
    print(json.dumps({"probe": True}), flush=True)
    sys.stdin.readline()
    for i in range(a.nregions):
        m = mmap.mmap(-1, per, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        np.frombuffer(m, dtype=np.uint8)[:: a.touch_every] = 1
        bufs.append(m)
        regions.append(c.register(m, block_size=block, name=f"scale{i}"))
    print(json.dumps({"ready": True, "blocks": sum(r.nblocks for r in regions),
                      "regions": [r.id for r in regions]}), flush=True)
    rng = np.random.default_rng(7)
    per_round = int(a.rate * ROUND_S)
    hint_s = 0.0
    hinted = 0
    k = 0
    t_start = time.monotonic()
    next_round = t_start
    while not stop:
        if per_round:
            nr = min(len(regions), MAX_REGIONS_PER_ROUND)
            each = max(1, per_round // nr)
            for j in range(nr):
                r = regions[(k + j) % len(regions)]
                blocks = rng.integers(0, r.nblocks, each, dtype=np.uint32)
                t0 = time.perf_counter()
                r.hint(blocks)
                hint_s += time.perf_counter() - t0
                hinted += each
            k += nr
        next_round += ROUND_S
        time.sleep(max(0.0, next_round - time.monotonic()))
    wall = time.monotonic() - t_start
    errs = c.flush()
    print(json.dumps({"hinted": hinted, "hint_call_s": hint_s, "wall_s": wall, "errors": len(errs)}), flush=True)
    c.close()
    return 0


# -- the measuring side ---------------------------------------------------------------


def start_daemon(wd: str, port: int, daemon_path: str | None, extra: str, sets: list[str]) -> subprocess.Popen:
    sock = os.path.join(wd, "kvtierd.sock")
    cfg = os.path.join(wd, "kvtierd.toml")
    with open(cfg, "w") as f:
        f.write(f'[daemon]\nsocket = "{sock}"\nstate_file = ""\n'
                "[limits]\nrequests_per_second = 1e9\nrequest_burst = 1000000000\n"
                "max_blocks_per_region = 4194304\nmax_blocks_total = 16777216\n"
                f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n' + extra)
    env = dict(os.environ)
    if daemon_path:
        env["PYTHONPATH"] = os.path.join(daemon_path, "daemon")
    p = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", cfg, *(f"--set={s}" for s in sets)], env=env,
                         stderr=open(os.path.join(wd, "log"), "w"))
    return wait_ready(p, sock, os.path.join(wd, "log"))


def scrape_ms(port: int, n: int = 5) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), size


def ingest(c: Client, daemon_pid: int, regions: list[int], nblocks_each: int, total: int) -> dict:
    """Pipelined 65,536-block hints from this (root) process into the regions."""
    rng = np.random.default_rng(3)
    batch = 65536
    msgs = [rng.integers(0, nblocks_each, batch, dtype=np.uint32) for _ in range(8)]
    c.hint_batch = batch
    handles = []
    for rid in regions[:16]:
        from kvtier.client import Region

        handles.append(Region(c, {"region": rid, "blocks": nblocks_each, "block_size": 0}, 0, 0))
    sent, i = 0, 0
    cpu0 = cpu_seconds(daemon_pid)
    t0 = time.perf_counter()
    while sent < total:
        handles[i % len(handles)].hint(msgs[i & 7])
        sent += batch
        i += 1
    errs = c.flush()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(daemon_pid) - cpu0
    return {"block_hints": sent, "wall_s": wall, "daemon_cpu_s": cpu, "errors": [str(e) for e in errs[:3]],
            "per_wall_s": sent / wall, "per_cpu_s": sent / cpu if cpu > 0 else None}


def run_cell(a: argparse.Namespace, total: int, nregions: int, rate: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-scale-") as wd:
        port = free_port()
        others = set(kdamond_cpu())  # kdamonds of other users of this host are not ours
        d = start_daemon(wd, port, a.daemon_path, a.daemon_config, a.set)
        sock = os.path.join(wd, "kvtierd.sock")
        w = None
        try:
            w = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child", "--socket", sock, "--total", str(total),
                 "--nregions", str(nregions), "--block", str(a.block), "--touch-every", str(a.touch_every),
                 "--rate", str(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if not json.loads(w.stdout.readline() or "{}").get("probe"):
                raise SystemExit("workload did not start")
            time.sleep(3.0)  # a few ticks: the measuring and collecting workers have run a job
            rss0 = rss_bytes(d.pid)  # the fixed part: threads, arenas, scratch, one block
            anon0, file0, maps0 = rss_bytes(d.pid, "RssAnon"), rss_bytes(d.pid, "RssFile"), rss_by_mapping(d.pid)
            w.stdin.write("go\n")
            w.stdin.flush()
            ready = json.loads(w.stdout.readline() or "{}")
            if not ready.get("ready"):
                raise SystemExit("workload did not start")
            c = Client(sock, hint_interval=1e9)
            time.sleep(a.warmup)
            s0, cpu0, kd0, t0 = c.stats(), cpu_seconds(d.pid), kdamond_cpu(), time.monotonic()
            time.sleep(a.seconds)
            s1, cpu1, kd1, t1 = c.stats(), cpu_seconds(d.pid), kdamond_cpu(), time.monotonic()
            rss1 = rss_bytes(d.pid)
            anon1, file1, maps1 = rss_bytes(d.pid, "RssAnon"), rss_bytes(d.pid, "RssFile"), rss_by_mapping(d.pid)
            wall = t1 - t0
            bounds, c1 = hist_counts(s1["tick_seconds_hist"])
            _, c0 = hist_counts(s0["tick_seconds_hist"])
            dc = [x - y for x, y in zip(c1, c0)]
            q = lambda p: histogram_quantile(p, bounds, dc)  # noqa: E731
            qc = lambda p: None  # noqa: E731
            if "tick_cpu_seconds_hist" in s1:  # the loop thread's CPU in the tick (not in older daemons)
                _, cc1 = hist_counts(s1["tick_cpu_seconds_hist"])
                _, cc0 = hist_counts(s0["tick_cpu_seconds_hist"])
                dcc = [x - y for x, y in zip(cc1, cc0)]
                qc = lambda p: histogram_quantile(p, bounds, dcc)  # noqa: E731
            kd = sum(kd1[p] - kd0.get(p, kd1[p]) for p in kd1 if p not in others)
            if "residency_seconds_sum" in s1:
                meas = s1["residency_seconds_sum"] - s0["residency_seconds_sum"]
                # one pass = the rotating sample visiting every block once
                looked = s1["residency_blocks_total"] - s0["residency_blocks_total"]
                pass_s = s1.get("residency_pass_seconds") or (ready["blocks"] * wall / looked if looked else None)
                meas_kind = "residency"
            else:
                meas = s1["migration_seconds_sum"] - s0["migration_seconds_sum"]
                pass_s = s1.get("residency_interval", 10.0)
                meas_kind = "worker job"
            blocks = ready["blocks"]
            res = {
                "total": total, "regions": nregions, "rate": rate, "blocks": blocks, "seconds": wall,
                "daemon_cpu_pct": 100 * (cpu1 - cpu0) / wall, "kdamond_cpu_pct": 100 * kd / wall,
                "ticks": sum(dc), "tick_p50_ms": (q(0.5) or 0) * 1000, "tick_p99_ms": (q(0.99) or 0) * 1000,
                "tick_cpu_p50_ms": (qc(0.5) or 0) * 1000, "tick_cpu_p99_ms": (qc(0.99) or 0) * 1000,
                "load_average": os.getloadavg()[0],
                "ticks_skipped_busy": s1["ticks_skipped_busy"] - s0["ticks_skipped_busy"],
                "measure_s_per_s": meas / wall, "measure_kind": meas_kind,
                "measure_s_per_pass": (meas / wall) * pass_s if pass_s else None, "pass_s": pass_s,
                "rss_bytes": rss1, "rss_fixed_bytes": rss0, "rss_per_block": (rss1 - rss0) / blocks,
                # the growth split: anonymous memory (the table, arenas, buffers) per block, and
                # file pages (library code run for the first time) that no block adds to
                "rss_anon_per_block": (anon1 - anon0) / blocks, "rss_file_growth_bytes": file1 - file0,
                "rss_growth_by_mapping": rss_growth(maps0, maps1),
                "hints_applied": s1["block_hints_total"] - s0["block_hints_total"],
                # swap turned on or off, a node on- or offlined (by other users of
                # the host) while the cell ran: the daemon then re-measures every
                # block in full, so the cell measured that, not its workload
                "topology_events": sum(s1.get("topology_events", {}).values())
                - sum(s0.get("topology_events", {}).values()),
            }
            res["scrape_ms"], res["scrape_bytes"] = scrape_ms(port)
            if rate == 0 and a.ingest:
                res["ingest"] = ingest(c, d.pid, ready["regions"], blocks // nregions, a.ingest)
            c.close()
            w.send_signal(signal.SIGTERM)
            out = w.stdout.readline()
            w.wait(30)
            if out:
                res["workload"] = json.loads(out)
        finally:
            if w is not None and w.poll() is None:
                w.kill()
            d.terminate()
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()
        return res


def rss_slopes(results: list[dict]) -> list[dict]:
    """The daemon's RSS growth per block between consecutive sizes of cells
    with the same regions and rate: what one more block costs, without the
    fixed part (and without the part of it a small cell's blocks share)."""
    out = []
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["regions"], r["rate"]), []).append(r)
    for (nregions, rate), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["blocks"])
        for lo, hi in zip(rs, rs[1:]):
            db = hi["blocks"] - lo["blocks"]
            if db <= 0:
                continue
            grown = (hi["rss_bytes"] - hi["rss_fixed_bytes"]) - (lo["rss_bytes"] - lo["rss_fixed_bytes"])
            out.append({"regions": nregions, "rate": rate, "from": lo["total"], "to": hi["total"], "blocks": db,
                        "bytes": grown, "per_block": grown / db})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64G,1T")
    ap.add_argument("--regions", default="1,100,1000")
    ap.add_argument("--rates", default="0,10000,1000000")
    ap.add_argument("--cells", help="explicit cells SIZE:REGIONS:RATE,... instead of the cartesian product")
    ap.add_argument("--block", type=size_of, default=2 << 20)
    ap.add_argument("--touch-every", type=size_of, default=64 << 20)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--ingest", type=int, default=10_000_000, help="block hints in the ingestion test (0: skip)")
    ap.add_argument("-s", "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config key for the daemon (kvtierd --set), repeatable")
    ap.add_argument("--daemon-path", help="source tree whose daemon/ to run (e.g. an export of main)")
    ap.add_argument("--daemon-config", default="", help="extra TOML appended to the daemon's config")
    ap.add_argument("--json")
    # the workload process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nregions", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.cells:
        cells = [(size_of(s), int(r), int(h)) for s, r, h in (c.split(":") for c in a.cells.split(","))]
    else:
        cells = [(size_of(s), int(r), int(h)) for s in a.sizes.split(",") for r in a.regions.split(",")
                 for h in a.rates.split(",")]
    print(f"# {machine()}; load average {os.getloadavg()[0]:.2f}; daemon from "
          f"{a.daemon_path or 'this tree'}; {a.warmup:g} s warm-up, {a.seconds:g} s measured per cell; "
          f"block {fmt_size(a.block)}, one page touched per {fmt_size(a.touch_every)}")
    print("| registered | regions | blocks | hinted/s | load | daemon CPU % | kdamond % | tick p50 / p99 ms "
          "| tick CPU p50 / p99 ms | skipped | measure s/s | measure s/pass | fixed RSS MiB | RSS B/block "
          "| of it anon B/block, file KiB | scrape ms | ingest M/s (wall, per CPU-s) | topology changes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    results = []
    for total, nregions, rate in cells:
        r = run_cell(a, total, nregions, rate)
        results.append(r)
        ing = r.get("ingest")
        ing_s = f"{ing['per_wall_s'] / 1e6:.1f}, {(ing['per_cpu_s'] or 0) / 1e6:.1f}" if ing else ""
        mp = r["measure_s_per_pass"]
        print(f"| {fmt_size(total)} | {nregions} | {r['blocks']} | {rate} | {r['load_average']:.1f} | "
              f"{r['daemon_cpu_pct']:.1f} | {r['kdamond_cpu_pct']:.1f} | "
              f"{r['tick_p50_ms']:.1f} / {r['tick_p99_ms']:.1f} | {r['tick_cpu_p50_ms']:.1f} / {r['tick_cpu_p99_ms']:.1f} | "
              f"{r['ticks_skipped_busy']} | {r['measure_s_per_s']:.3f} | {'' if mp is None else f'{mp:.2f}'} | "
              f"{r['rss_fixed_bytes'] / (1 << 20):.1f} | {r['rss_per_block']:.0f} | "
              f"{r['rss_anon_per_block']:.0f}, {r['rss_file_growth_bytes'] / 1024:.0f} | {r['scrape_ms']:.1f} | {ing_s} | "
              f"{r['topology_events']} |",
              flush=True)
    slopes = rss_slopes(results)
    if slopes:
        print("\nRSS per block between sizes (same regions and rate): the marginal cost of a block")
        print("| regions | hinted/s | from | to | blocks added | RSS added MiB | bytes per block |")
        print("|---:|---:|---|---|---:|---:|---:|")
        for x in slopes:
            print(f"| {x['regions']} | {x['rate']} | {fmt_size(x['from'])} | {fmt_size(x['to'])} | {x['blocks']} | "
                  f"{x['bytes'] / (1 << 20):.1f} | {x['per_block']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "argv": sys.argv, "results": results, "rss_slopes": slopes}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
