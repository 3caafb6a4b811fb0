#!/usr/bin/env python3
"""Protocol benchmark: register round trip and hint ingestion rate of kvtierd.

Starts a real kvtierd (temporary socket and state file, metrics off) pinned
to one CPU, and drives it from this process pinned to another:

* register round trip: register + unregister of a touched 64 MiB anonymous
  mapping (2 MiB blocks), one at a time; latency of each call, p50/p99/max.
  Includes everything the daemon does: SO_PEERCRED, /proc/PID/stat + maps,
  pidfd_open, BlockTable insert, the (debounced) state write.
* hint ingestion: pipelined hint messages of BATCH block indices (uint32,
  uniformly random over a 1M-block region) until TOTAL block hints, then one
  synchronous call so every hint has been applied to the temperatures.
  Reported as block-hints/s of wall time and per daemon CPU second (the
  daemon's utime+stime from /proc, i.e. on one core).

    sudo .venv/bin/python scripts/bench/protocol_bench.py [--json out.json]

Needs root only to read the daemon's /proc/PID/stat when run as another
user; otherwise any user can run it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvtier.client import Client

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}"


def start_daemon(workdir: str, cpu: int | None, rt: bool = False, tick: float = 3600.0,
                 ready_timeout: float = 30.0) -> subprocess.Popen:
    sock = os.path.join(workdir, "kvtierd.sock")
    cfg = os.path.join(workdir, "kvtierd.toml")
    with open(cfg, "w") as f:
        f.write(f'[daemon]\nsocket = "{sock}"\nstate_file = "{workdir}/state.json"\n'
                # No migration work competes with the protocol path in this benchmark.
                f"tick_interval = {tick}\n"
                "[limits]\nrequests_per_second = 1e9\nrequest_burst = 1000000000\n"
                "max_blocks_per_region = 4194304\n[metrics]\nenabled = false\n")
    cmd = [sys.executable, "-m", "kvtier.daemon", "-c", cfg]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    if rt:
        cmd = ["chrt", "-f", "50"] + cmd
    p = subprocess.Popen(cmd, stderr=open(os.path.join(workdir, "log"), "w"))
    return wait_ready(p, sock, os.path.join(workdir, "log"), ready_timeout)


def wait_ready(p: subprocess.Popen, sock: str, log: str, timeout: float = 30.0) -> subprocess.Popen:
    """Wait until the daemon answers on ``sock``; exit with its log if it dies first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            Client(sock, reconnect_timeout=0).close()
            return p
        except Exception:
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvtierd did not start: {open(log).read()}")
            time.sleep(0.05)


def bench_register(c: Client, n: int) -> dict:
    buf = mmap.mmap(-1, 64 << 20)
    buf.write(b"\1" * len(buf))
    reg, unreg = np.empty(n), np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        r = c.register(buf, block_size=2 << 20, name="bench")
        t1 = time.perf_counter()
        r.unregister()
        t2 = time.perf_counter()
        reg[i], unreg[i] = t1 - t0, t2 - t1
    us = lambda a, q: float(np.percentile(a, q) * 1e6)  # noqa: E731
    return {"n": n, "register_p50_us": us(reg, 50), "register_p99_us": us(reg, 99),
            "register_max_us": float(reg.max() * 1e6),
            "unregister_p50_us": us(unreg, 50), "unregister_p99_us": us(unreg, 99)}


def bench_register_while_migrating(c: Client, mib: int, rounds: int = 4, timeout: float = 300.0) -> dict | None:
    """Register round trips, back to back, while the worker thread moves a
    ``mib`` MiB region DRAM -> swap -> DRAM ``rounds`` times: is the loop
    thread still responsive while migrations run?"""
    tiers = c.request("tiers")["tiers"]
    swap = next((t["index"] for t in tiers if t["kind"] == "swap"), None)
    if swap is None:
        return None
    # Private anonymous memory, like most KV caches (swapped shmem is invisible in pagemap).
    ballast = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ballast.write(b"\2" * len(ballast))
    buf = mmap.mmap(-1, 64 << 20)
    buf.write(b"\1" * len(buf))
    st0 = c.stats()
    lat = []
    moves = 0
    deadline = time.monotonic() + timeout
    with c.register(ballast, block_size=2 << 20, name="ballast") as b:
        target = swap
        c.request("migrate", region=b.id, tier=target)
        while moves < 2 * rounds and time.monotonic() < deadline:
            if len(lat) % 20 == 0 and (b.query() == target).all():  # arrived: send it back
                moves += 1
                target = 0 if target == swap else swap
                c.request("migrate", region=b.id, tier=target)
            t0 = time.perf_counter()
            r = c.register(buf, block_size=2 << 20)
            lat.append(time.perf_counter() - t0)
            r.unregister()
    st1 = c.stats()
    moved = sum(st1["migrated_bytes"].values()) - sum(st0["migrated_bytes"].values())
    busy = st1["migration_seconds_sum"] - st0["migration_seconds_sum"]
    a = np.array(lat)
    return {"n": len(lat), "ballast_mib": mib, "moves": moves, "register_p50_us": float(np.percentile(a, 50) * 1e6),
            "register_p99_us": float(np.percentile(a, 99) * 1e6), "register_max_us": float(a.max() * 1e6),
            "migrated_mib": moved / 2**20, "worker_busy_s": busy}


def bench_hints(c: Client, daemon_pid: int, batch: int, total: int, nblocks: int = 1 << 20) -> dict:
    # 1M blocks of 4 KiB over a 4 GiB reservation; untouched pages cost nothing.
    buf = mmap.mmap(-1, nblocks * 4096)
    rng = np.random.default_rng(1)
    with c.register(buf, block_size=4096, name="hints") as r:
        msgs = [rng.integers(0, nblocks, batch, dtype=np.uint32) for _ in range(16)]
        c.hint_batch = batch  # each hint() call becomes exactly one message
        sent = 0
        cpu0 = cpu_seconds(daemon_pid)
        t0 = time.perf_counter()
        i = 0
        while sent < total:
            r.hint(msgs[i & 15])
            sent += batch
            i += 1
        errs = c.flush()  # waits for every answer: all hints applied
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(daemon_pid) - cpu0
        assert not errs, errs
        applied = c.stats()["block_hints_total"]
    return {"batch": batch, "block_hints": sent, "messages": i, "wall_s": wall, "daemon_cpu_s": cpu,
            "hints_per_s_wall": sent / wall, "hints_per_daemon_cpu_s": sent / cpu if cpu > 0 else None,
            "applied_total": applied}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--registers", type=int, default=2000)
    ap.add_argument("--hints", type=int, default=50_000_000, help="block hints per batch size")
    ap.add_argument("--batches", default="256,4096,65536")
    ap.add_argument("--json", help="write results here too")
    ap.add_argument("--migrating", type=int, default=0, metavar="MIB",
                    help="also time registers while MIB MiB move DRAM<->swap (needs a swap device)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin daemon and client to separate CPUs")
    ap.add_argument("--rt", action="store_true",
                    help="run daemon and client SCHED_FIFO 50 (root): measures kvtier, not noisy neighbours")
    a = ap.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as wd:
        d = start_daemon(wd, 0 if pin else None, a.rt)
        if pin:
            os.sched_setaffinity(0, {1})
        if a.rt:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
        try:
            c = Client(os.path.join(wd, "kvtierd.sock"), hint_interval=1e9)
            bench_register(c, 200)  # warm up: imports, allocator, page cache
            res = {"machine": machine(), "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                   "pinned": pin, "sched_fifo": a.rt, "loadavg": os.getloadavg(), "register": bench_register(c, a.registers), "hints": []}
            for b in (int(x) for x in a.batches.split(",")):
                res["hints"].append(bench_hints(c, d.pid, b, a.hints))
            c.close()
        finally:
            d.terminate()
            d.wait(20)
        if a.migrating:
            # A second daemon that ticks (manual moves run with the tick).
            d = start_daemon(wd, 0 if pin else None, a.rt, tick=0.05)
            try:
                c = Client(os.path.join(wd, "kvtierd.sock"), hint_interval=1e9)
                res["register_while_migrating"] = bench_register_while_migrating(c, a.migrating)
                c.close()
            finally:
                d.terminate()
                d.wait(20)
    r = res["register"]
    print(f"machine: {res['machine']}  (daemon on CPU 0, client on CPU 1: {pin}; SCHED_FIFO: {a.rt}); "
          f"load average before: {res['loadavg'][0]:.2f}")
    print(f"register round trip over {r['n']}: p50 {r['register_p50_us']:.0f} us, "
          f"p99 {r['register_p99_us']:.0f} us, max {r['register_max_us']:.0f} us; "
          f"unregister p50 {r['unregister_p50_us']:.0f} us, p99 {r['unregister_p99_us']:.0f} us")
    print("| batch (blocks/msg) | block hints | wall s | block-hints/s (wall) | daemon CPU s | block-hints per daemon CPU-s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for h in res["hints"]:
        print(f"| {h['batch']} | {h['block_hints']:,} | {h['wall_s']:.2f} | {h['hints_per_s_wall'] / 1e6:.1f} M | "
              f"{h['daemon_cpu_s']:.2f} | {(h['hints_per_daemon_cpu_s'] or 0) / 1e6:.1f} M |")
    m = res.get("register_while_migrating", "skip")
    if m is None:
        print("register while migrating: skipped (no swap device: swapon one first)")
    elif m != "skip":
        print(f"register round trip ({m['n']} of them) while the worker moved {m['migrated_mib']:.0f} MiB DRAM<->swap "
              f"(worker busy {m['worker_busy_s']:.1f} s): p50 {m['register_p50_us']:.0f} us, "
              f"p99 {m['register_p99_us']:.0f} us, max {m['register_max_us']:.0f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
