#!/usr/bin/env python3
"""Runs one kvtier demo on this machine (the QEMU guest, or a NUMA host).

    scripts/demo/driver.py --out DIR [--duration S]

1. Writes the demo's kvtierd config: the defaults, plus per-tier capacity
   targets so that a 256 MiB KV pool does not simply fit in DRAM (the guest
   has 1 GiB of it); see ``demo_config``.
2. Turns the kernel's own NUMA balancing off for the run (restored at the
   end), so every page that moves is moved by kvtier.
3. Starts kvtierd, then the synthetic inference workload
   (scripts/demo/workload.py) with its pool first-touched on the slow
   memory nodes: the hot set starts outside DRAM and kvtier has to bring it up.
4. Passes the workload's one-line-per-second status through to stdout and
   to DIR/status.log (the host tails it while the guest runs).
5. Saves the daemon's last /metrics scrape, its log and the workload's
   timeline into DIR, stops the daemon, and exits with the workload's status.

The report (PNG + markdown) is drawn afterwards by scripts/demo/report.py
from DIR, on the host, where matplotlib does not have to run under TCG.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MIB = 1 << 20
NUMA_BALANCING = "/proc/sys/kernel/numa_balancing"
NODES = "/sys/devices/system/node"


def demo_config(sock: Path, state: Path, budgets: dict[int, int], order: list | None = None) -> str:
    """kvtierd's default config plus what the demo needs: a capacity target
    per memory tier (so the 256 MiB pool spills over the tiers and swap),
    a private socket and state file, and (``order``: [(name, nodes, kind)],
    see ``plan_tiers``) the memory tiers set explicitly."""
    caps = ", ".join(f'"{t}" = {b}' for t, b in sorted(budgets.items()))
    text = (
        "# kvtier demo: defaults, plus tier capacity targets sized to the demo's KV pool\n"
        "[daemon]\n"
        f'socket = "{sock}"\n'
        f'state_file = "{state}"\n'
        "[policy]\n"
        f"capacity = {{ {caps} }}\n"
    )
    if order:
        tiers = ", ".join(f'{{ name = "{n}", nodes = {list(nodes)}, kind = "{kind}" }}' for n, nodes, kind in order)
        text += ("# Memory tiers set for the demo (scripts/demo/driver.py plan_tiers says why).\n"
                 f"[topology]\ntiers = [{tiers}]\n")
    return text


def memory_nodes() -> tuple[list[int], list[int]]:
    """(nodes with CPUs, memory nodes without) from sysfs."""
    def read(name):
        try:
            return Path(NODES, name).read_text().strip()
        except OSError:
            return ""

    def expand(text):
        out = []
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
        return out

    mem = expand(read("has_memory") or read("online"))
    cpu = set(expand(read("has_cpu")))
    return [n for n in mem if n in cpu], [n for n in mem if n not in cpu]


def cpulist(node: int) -> set[int]:
    text = Path(NODES, f"node{node}", "cpulist").read_text().strip()
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def plan_tiers(a, cpu_nodes: list[int], slow_nodes: list[int]):
    """The memory tiers the demo runs with: (tiers [(name, nodes, kind)],
    whether they override discovery, CPUs to pin the workload to, a note).

    * Normally kvtierd's own discovery (the same call it makes at start).
    * In the QEMU guest, the emulated CXL node is left out unless
      --with-cxl: under TCG every access to it is a trip through QEMU's MMIO
      dispatch, so moving 32 MiB into it takes ~13 s against 0.2 s for a
      RAM-backed node, and any flow through it would stall the daemon's
      single migration job for longer than the demo lasts. With --with-cxl
      it goes last, below the far node.
    * On a multi-socket host without CPU-less memory, the other sockets'
      memory is the far tier of a workload pinned to the first socket's CPUs
      (remote DRAM is the slower memory for it).
    """
    from kvtier.kernel import topology

    if not slow_nodes:
        tiers = [("dram", [cpu_nodes[0]], "dram"), ("far0", cpu_nodes[1:], "far")]
        return (tiers, True, cpulist(cpu_nodes[0]),
                f"demo: no CPU-less memory here: node {cpu_nodes[0]} is DRAM for the workload pinned to its "
                f"CPUs, nodes {cpu_nodes[1:]} (remote sockets) are its far tier")
    mem = [(t.name, list(t.nodes), t.kind) for t in topology.discover().tiers if t.kind != topology.KIND_SWAP]
    cxl = [t for t in mem[1:] if t[2] == topology.KIND_CXL]
    if os.environ.get("KVTIER_IN_VM") != "1" or not cxl:
        return mem, False, None, ""
    tiers = mem[:1] + [t for t in mem[1:] if t[2] != topology.KIND_CXL] + (cxl if a.with_cxl else [])
    note = "" if a.with_cxl else (
        f"demo: CXL tier {', '.join(t[0] for t in cxl)} (node(s) {', '.join(str(n) for t in cxl for n in t[1])}) "
        "left out: QEMU emulates its accesses one by one under TCG (~2.5 MiB/s); --with-cxl keeps it")
    return tiers, True, None, note


class Tee:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.f.write(text + "\n")


def wait_for(pred, what: str, timeout: float, proc: subprocess.Popen, log: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"kvtierd exited with {proc.returncode} while waiting for {what}:\n"
                             + log.read_text()[-3000:])
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}:\n" + log.read_text()[-3000:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the timeline, logs, metrics")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of workload")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--dram-mib", type=int, default=96, help="DRAM tier capacity target")
    ap.add_argument("--far-mib", type=int, default=96, help="capacity target of each far-memory tier")
    # QEMU emulates CXL memory accesses one by one under TCG (~2.5 MiB/s for
    # move_pages into it against ~100 MiB/s for RAM-backed nodes), so the
    # guest's CXL tier gets a small target; on real hardware raise it.
    ap.add_argument("--cxl-mib", type=int, help="capacity target of each CXL tier "
                    "(default 16 in the QEMU guest, else --far-mib)")
    ap.add_argument("--with-cxl", action="store_true",
                    help="guest only: keep the (emulated, very slow) CXL tier, as the last memory tier")
    ap.add_argument("--run-dir", type=Path, default=Path("/run/kvtier-demo"))
    ap.add_argument("workload_args", nargs="*", help="extra arguments for workload.py (after --)")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("status.log", "timeline.jsonl", "summary.json", "metrics.txt", "kvtierd.log"):
        (out / stale).unlink(missing_ok=True)
    tee = Tee(out / "status.log")
    if os.geteuid() != 0:
        tee.line("demo: needs root (kvtierd moves another process's pages)")
        return 1
    cpu_nodes, slow_nodes = memory_nodes()
    if not slow_nodes and len(cpu_nodes) < 2:
        tee.line(f"demo: this machine has one memory node ({cpu_nodes}); nothing to tier between. "
                 "Run scripts/demo.sh without --host to use the QEMU guest.")
        return 1
    a.run_dir.mkdir(parents=True, exist_ok=True)
    sock, conf = a.run_dir / "kvtierd.sock", a.run_dir / "kvtierd.toml"
    mem_tiers, override, pin_cpus, note = plan_tiers(a, cpu_nodes, slow_nodes)
    if note:
        tee.line(note)
    in_vm = os.environ.get("KVTIER_IN_VM") == "1"
    cxl_mib = a.cxl_mib if a.cxl_mib is not None else (16 if in_vm else a.far_mib)
    mib = {"dram": a.dram_mib, "far": a.far_mib, "cxl": cxl_mib}
    budgets = {i: mib[kind] * MIB for i, (_, _, kind) in enumerate(mem_tiers)}
    # The pool starts in the slowest RAM-backed memory tier (far rather than
    # CXL: see --cxl-mib), on its first node.
    start_name, start_nodes, _ = ([t for t in mem_tiers[1:] if t[2] == "far"] or mem_tiers[1:])[-1]
    start_node = start_nodes[0]
    if os.environ.get("KVTIER_IN_VM") == "1":
        # The guest's init leaves loopback down; the metrics exporter listens on it.
        subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    conf.write_text(demo_config(sock, a.run_dir / "state.json", budgets, mem_tiers if override else None))

    old_nb = None
    try:
        old_nb = Path(NUMA_BALANCING).read_text().strip()
        Path(NUMA_BALANCING).write_text("0")
    except OSError:
        pass
    log = out / "kvtierd.log"
    logf = open(log, "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", str(conf)],
                              stdout=logf, stderr=subprocess.STDOUT)
    rc = 1
    try:
        metrics_url = wait_for(lambda: (m := re.search(r"metrics on (http://\S+/metrics)", log.read_text()))
                               and m.group(1), "kvtierd to start", 60, daemon, log)
        wait_for(sock.exists, "the control socket", 30, daemon, log)
        from kvtier.client import Client

        with Client(str(sock)) as c:
            tiers = c.request("tiers")["tiers"]
        tee.line("demo: kvtierd is up; tiers: " + ", ".join(
            f"{t['name']} ({t['kind']}, nodes {','.join(map(str, t['nodes'])) or '-'}, "
            f"target {budgets.get(t['index'], t['capacity']) // MIB} MiB)" for t in tiers))
        tee.line(f"demo: {a.pool_mib} MiB KV pool starts on node {start_node} ({start_name}); "
                 f"DRAM target {a.dram_mib} MiB; {a.duration:.0f} s of sessions")
        wl = subprocess.Popen(
            [sys.executable, "-u", str(HERE / "workload.py"), "--socket", str(sock),
             "--timeline", str(out / "timeline.jsonl"), "--summary", str(out / "summary.json"),
             "--duration", str(a.duration), "--pool-mib", str(a.pool_mib),
             "--start-node", str(start_node), *a.workload_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, pin_cpus)) if pin_cpus else None)
        for line in wl.stdout:
            tee.line(line.rstrip("\n"))
        rc = wl.wait()
        try:
            with urllib.request.urlopen(metrics_url, timeout=10) as r:
                (out / "metrics.txt").write_bytes(r.read())
        except OSError as e:
            tee.line(f"demo: could not save the final metrics scrape: {e}")
        meta = {"tiers": tiers, "budgets": {str(k): v for k, v in budgets.items()},
                "slow_nodes": slow_nodes, "duration_s": a.duration, "pool_mib": a.pool_mib,
                "in_vm": os.environ.get("KVTIER_IN_VM") == "1", "workload_rc": rc}
        (out / "run.json").write_text(json.dumps(meta, indent=1))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        logf.close()
        if old_nb is not None:
            try:
                Path(NUMA_BALANCING).write_text(old_nb)
            except OSError:
                pass
    tee.line(f"demo: workload exited {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
