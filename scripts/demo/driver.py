#!/usr/bin/env python3
"""Runs the kvtier demo on this machine (the QEMU guest, or a NUMA host).

    scripts/demo/driver.py --out DIR [--duration S] [--modes kvtier,numa_balancing,none]

The same workload (same seed, same pool, same start node, same free DRAM)
runs once per mode, one after the other, each result in DIR/<mode>/:

* ``kvtier``: kvtierd with its default config and the demo's tier targets,
  numa_balancing=0, the workload registering its pool and sending hints;
* ``numa_balancing``: no kvtierd; the kernel's own memory tiering
  (numa_balancing=2, demotion_enabled=1);
* ``none``: no kvtierd, numa_balancing=0: where the pages start is where
  they stay (the control).

DRAM is really scarce in every mode, not only as kvtier's target: once the
workload has set up its pool (on the start node), the driver takes all of
node 0's free memory but ``--dram-mib`` plus ``--slack-mib`` (the kernel's
reserve) into a locked, node-0-bound allocation, so the kernel's own
tiering, and the first touch of new blocks in every mode, face the same
room as kvtier (its DRAM target is ``--dram-mib``).

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
   timeline into DIR/<mode>, stops the daemon, and exits non-zero if any
   mode's workload failed.

The report (PNG + markdown) is drawn afterwards by scripts/demo/report.py
from DIR, on the host, where matplotlib does not have to run under TCG.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import workload  # noqa: E402  (scripts/demo/workload.py: the node's zone counters, read one way)
MIB = 1 << 20
NUMA_BALANCING = "/proc/sys/kernel/numa_balancing"
DEMOTION_ENABLED = "/sys/kernel/mm/numa/demotion_enabled"
NODES = "/sys/devices/system/node"
DROP_CACHES = "/proc/sys/vm/drop_caches"
MODES = ("kvtier", "numa_balancing", "none")
# numa_balancing values: 0 off, 2 NUMA_BALANCING_MEMORY_TIERING (promote hot
# pages from lower memory tiers, demote through kswapd).
MODE_NUMA_BALANCING = {"kvtier": "0", "numa_balancing": "2", "none": "0"}
# Demotion in reclaim (kswapd moving cold pages to a lower tier) is the
# kernel's tiering too: on for numa_balancing, the boot's value otherwise
# (the baseline after numa_balancing ran with it on).
MODE_DEMOTION = {"numa_balancing": "1"}


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


def node_free_bytes(node: int) -> int:
    for line in Path(NODES, f"node{node}", "meminfo").read_text().splitlines():
        if "MemFree:" in line:
            return int(line.split()[-2]) * 1024
    raise RuntimeError(f"node {node}: no MemFree in meminfo")


def node_watermarks(node: int, zoneinfo: str = "/proc/zoneinfo") -> dict[str, int]:
    """The node's min, low and high watermarks, each summed over its zones, in bytes."""
    return {k: v for k, v in workload.node_zone_pages(node, zoneinfo).items() if k != "pcp"}


def node_reserve_bytes(node: int, zoneinfo: str = "/proc/zoneinfo") -> int:
    """The node's high watermarks summed over its zones: memory kswapd keeps
    free, which the pool cannot have in any mode (0 if not found)."""
    return node_watermarks(node, zoneinfo)["high"]


# DramHog: free memory beyond ``keep`` it leaves, and how often it grows to get there.
HOG_TOLERANCE = 2 * MIB
HOG_ROUNDS = 8
# ... and during the run (DramHog.hold): a block counts in the tier of most
# of its pages, so the pool's DRAM bytes are off by up to a block per block
# being moved.
HOLD_TOLERANCE = 8 * MIB


class DramHog:
    """Locked memory bound to one node: leaves ``keep`` bytes free there
    (within ``HOG_TOLERANCE``), so every mode competes for the same scarce
    DRAM. Locked pages are unevictable, so the kernel's tiering cannot demote
    the hog to make room.

    Faulting the hog in makes the kernel reclaim (page cache, slab) as it
    goes, so one allocation sized by MemFree left 151-179 MiB free where 149
    was asked, a different amount per mode: the hog grows by what is still
    free beyond ``keep`` until it is within the tolerance (``HOG_ROUNDS``)."""

    def __init__(self, node: int, keep: int):
        self.node, self.keep = node, keep
        self.bufs: list[mmap.mmap] = []
        self.size = 0
        for _ in range(HOG_ROUNDS):
            extra = (node_free_bytes(node) - keep) // mmap.PAGESIZE * mmap.PAGESIZE
            if extra <= HOG_TOLERANCE:
                break
            self._grow(extra)

    def _grow(self, size: int) -> None:
        from kvtier.kernel import native

        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bufs.append(buf)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        native.mbind(addr, size, native.MPOL_BIND, [self.node])
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
            raise OSError(ctypes.get_errno(), "mlock of the DRAM hog")  # mlock also faults every page in
        self.size += size

    def hold(self, pool_dram: int, free: int) -> int:
        """Keep node memory that frees up during the run away from the pool:
        the pool's bytes in DRAM plus the node's MemFree (``pool_dram`` and
        ``free``, measured together by the workload) may not exceed ``keep``
        by more than HOLD_TOLERANCE; the hog grows by any excess (it never
        shrinks). MemFree, the kernel's own measure for its watermarks,
        leaves out the free pages in the per-CPU lists (``pcp`` in the
        timeline; 4-54 MiB in the guest): pages freed go there first and
        reach MemFree later, and a pool that takes them without MemFree
        falling is held back here too. (Counting them as free instead left
        MemFree below the low watermark and kswapd demoting the pool in the
        numa_balancing=2 run.) In the guest the free memory rose by up to 24 MiB in
        the first second of a numa_balancing=2 run (by 0-7 in the others),
        and the kernel's pool took it: 140 MiB of DRAM at peak from 150 MiB
        free. Returns the bytes grown."""
        extra = (free + pool_dram - self.keep) // mmap.PAGESIZE * mmap.PAGESIZE
        if extra <= HOLD_TOLERANCE:
            return 0
        self._grow(extra)
        return extra

    def close(self) -> None:
        for buf in self.bufs:
            buf.close()
        self.bufs.clear()


def last_record(path: Path, tail: int = 1 << 18) -> dict | None:
    """The last complete JSON line of a timeline the workload is writing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail))
            lines = f.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1]):  # the part after the last newline may be half written
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


class HogKeeper(threading.Thread):
    """Once a second while the workload runs: ``DramHog.hold`` with the
    pool's DRAM bytes and the node's free memory from the workload's latest
    timeline record (one taken after a growth of the hog)."""

    def __init__(self, hog: DramHog, timeline: Path, dram: str):
        super().__init__(daemon=True)
        self.hog, self.timeline, self.dram = hog, timeline, dram
        self.stop = threading.Event()
        self.grown = 0

    def run(self) -> None:
        seen, skip = -1.0, 0
        while not self.stop.wait(1.0):
            rec = last_record(self.timeline)
            if rec is None or rec["t"] <= seen or "free" not in rec.get("dram_node", {}):
                continue
            seen = rec["t"]
            if skip:  # may have been measured before the last growth
                skip -= 1
                continue
            grown = self.hog.hold(int(rec.get("pool_bytes", {}).get(self.dram, 0)), int(rec["dram_node"]["free"]))
            self.grown += grown
            skip = 1 if grown else 0


def write_knob(path: str, value: str) -> str | None:
    """Set a sysctl/sysfs knob; returns the old value (None if absent)."""
    try:
        old = Path(path).read_text().strip()
        Path(path).write_text(value)
        return old
    except OSError:
        return None


class Tee:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.f.write(text + "\n")


def wait_for(pred, what: str, timeout: float, proc: subprocess.Popen, log: Path):
    """``timeout`` in a quiet host's seconds, times the guest's slowness
    (scripts/vm/speed.py; 1 outside the guest): a loaded TCG guest took over
    60 s from kvtierd's socket to its metrics exporter."""
    sys.path.insert(0, str(REPO / "scripts" / "vm"))
    import speed

    end = time.monotonic() + timeout * speed.current()
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
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma list of {', '.join(MODES)}, run in this order (kvtier first gives the "
                         "baselines the daemon's tier list)")
    ap.add_argument("--slack-mib", type=int,
                    help="node-0 memory left free beyond --dram-mib once the workload is set up (default: the "
                         "node's high watermarks, which no allocation may use, plus 4 MiB for the processes): "
                         "the pool's first-touch allocations get about kvtier's target in every mode")
    ap.add_argument("workload_args", nargs="*", help="extra arguments for workload.py (after --)")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"demo: unknown mode(s) {', '.join(bad) or '(none)'}; known: {', '.join(MODES)}", file=sys.stderr)
        return 2
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "status.log").unlink(missing_ok=True)
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
    old_demotion = Path(DEMOTION_ENABLED).read_text().strip() if Path(DEMOTION_ENABLED).exists() else None
    plan = Plan(a, tee, mem_tiers, override, pin_cpus, budgets, start_name, start_nodes[0], slow_nodes, in_vm,
                old_demotion)
    if in_vm:
        # The guest's init leaves loopback down; the metrics exporter listens on it.
        subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    old_nb = Path(NUMA_BALANCING).read_text().strip() if Path(NUMA_BALANCING).exists() else None
    rcs = {}
    try:
        for mode in modes:
            rcs[mode] = run_mode(plan, mode, out / mode)
    finally:
        if old_nb is not None:
            write_knob(NUMA_BALANCING, old_nb)
        if old_demotion is not None:
            write_knob(DEMOTION_ENABLED, old_demotion)
    (out / "modes.json").write_text(json.dumps({"modes": modes, "workload_rc": rcs}, indent=1))
    rc = max(rcs.values())
    tee.line(f"demo: workload exited {rc} ({', '.join(f'{m} {r}' for m, r in rcs.items())})")
    return rc


@dataclass
class Plan:
    """What every mode of one demo run shares."""

    a: argparse.Namespace
    tee: Tee
    mem_tiers: list
    override: bool
    pin_cpus: set[int] | None
    budgets: dict[int, int]
    start_name: str
    start_node: int
    slow_nodes: list[int]
    in_vm: bool
    demotion_default: str | None = None  # demotion_enabled as the boot had it
    tiers: list[dict] | None = None  # the daemon's tier list, once a kvtier run has seen it


def fallback_tiers(plan: Plan) -> list[dict]:
    """The tier list for baseline runs when no kvtier run came first: the
    demo's memory tiers as kvtierd would report them, then swap."""
    from kvtier.kernel import topology

    tiers = [{"index": i, "name": n, "kind": k, "nodes": list(nodes)} for i, (n, nodes, k) in enumerate(plan.mem_tiers)]
    swap = [t for t in topology.discover().tiers if t.kind == topology.KIND_SWAP]
    for t in swap[:1]:
        tiers.append({"index": len(tiers), "name": t.name, "kind": t.kind, "nodes": []})
    return tiers


def run_mode(plan: Plan, mode: str, out: Path) -> int:
    a, tee = plan.a, plan.tee
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("timeline.jsonl", "summary.json", "metrics.txt", "kvtierd.log", "run.json"):
        (out / stale).unlink(missing_ok=True)
    write_knob(NUMA_BALANCING, MODE_NUMA_BALANCING[mode])
    demotion = MODE_DEMOTION.get(mode, plan.demotion_default)
    if demotion is not None:
        write_knob(DEMOTION_ENABLED, demotion)
    sock, conf = a.run_dir / "kvtierd.sock", a.run_dir / "kvtierd.toml"
    daemon = logf = hog = free_at_go = keeper = None
    metrics_url = None
    log = out / "kvtierd.log"
    rc = 1
    try:
        if mode == "kvtier":
            conf.write_text(demo_config(sock, a.run_dir / "state.json", plan.budgets,
                                        plan.mem_tiers if plan.override else None))
            (a.run_dir / "state.json").unlink(missing_ok=True)
            logf = open(log, "wb")
            daemon = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", str(conf)],
                                      stdout=logf, stderr=subprocess.STDOUT)
            metrics_url = wait_for(lambda: (m := re.search(r"metrics on (http://\S+/metrics)", log.read_text()))
                                   and m.group(1), "kvtierd to start", 60, daemon, log)
            wait_for(sock.exists, "the control socket", 30, daemon, log)
            from kvtier.client import Client

            with Client(str(sock)) as c:
                plan.tiers = c.request("tiers")["tiers"]
            tee.line("demo[kvtier]: kvtierd is up; tiers: " + ", ".join(
                f"{t['name']} ({t['kind']}, nodes {','.join(map(str, t['nodes'])) or '-'}, "
                f"target {plan.budgets.get(t['index'], t['capacity']) // MIB} MiB)" for t in plan.tiers))
        tiers = plan.tiers or fallback_tiers(plan)
        (out / "tiers.json").write_text(json.dumps(tiers))
        dram_node = tiers[0]["nodes"][0]
        slack = a.slack_mib * MIB if a.slack_mib is not None else node_reserve_bytes(dram_node) + 4 * MIB
        cmd = [sys.executable, "-u", str(HERE / "workload.py"),
               "--timeline", str(out / "timeline.jsonl"), "--summary", str(out / "summary.json"),
               "--duration", str(a.duration), "--pool-mib", str(a.pool_mib),
               "--start-node", str(plan.start_node), "--wait-go", *a.workload_args]
        cmd += ["--socket", str(sock)] if mode == "kvtier" else ["--no-daemon", "--tiers-json", str(out / "tiers.json")]
        wl = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=(lambda: os.sched_setaffinity(0, plan.pin_cpus)) if plan.pin_cpus else None)
        for line in wl.stdout:
            tee.line(f"[{mode}] " + line.rstrip("\n"))
            if line.startswith("workload: ready"):
                # The workload's interpreter and its pool (moved to the start
                # node) are in place: only now is node 0 cut down to the DRAM
                # the run may use, so the pool gets the same DRAM in every
                # mode (first-touch placement of new blocks included).
                # Clean page cache and reclaimable slab first: the kernel would
                # reclaim them for the pool's first touches (the baselines' pools reached 134
                # MiB of DRAM against a 96 MiB target when the hog left it).
                os.sync()
                write_knob(DROP_CACHES, "3")
                hog = DramHog(dram_node, a.dram_mib * MIB + slack)
                free_at_go = node_free_bytes(dram_node)
                keeper = HogKeeper(hog, out / "timeline.jsonl", tiers[0]["name"])
                keeper.start()
                tee.line(f"demo[{mode}]: {a.pool_mib} MiB KV pool starts on node {plan.start_node} "
                         f"({plan.start_name}); node {dram_node} has {free_at_go // MIB} MiB free "
                         f"(DRAM target {a.dram_mib} MiB); numa_balancing={MODE_NUMA_BALANCING[mode]}; "
                         f"{a.duration:.0f} s of sessions")
                wl.stdin.write("go\n")
                wl.stdin.flush()
                break
        for line in wl.stdout:
            tee.line(f"[{mode}] " + line.rstrip("\n"))
        rc = wl.wait()
        if keeper is not None:
            keeper.stop.set()
            keeper.join()
        if metrics_url:
            try:
                with urllib.request.urlopen(metrics_url, timeout=10) as r:
                    (out / "metrics.txt").write_bytes(r.read())
            except OSError as e:
                tee.line(f"demo: could not save the final metrics scrape: {e}")
        meta = {"mode": mode, "tiers": tiers, "budgets": {str(k): v for k, v in plan.budgets.items()},
                "slow_nodes": plan.slow_nodes, "duration_s": a.duration, "pool_mib": a.pool_mib,
                "dram_free_mib": (a.dram_mib * MIB + slack) // MIB, "numa_balancing": MODE_NUMA_BALANCING[mode],
                "in_vm": plan.in_vm, "workload_rc": rc, "dram_watermarks": node_watermarks(dram_node),
                "dram_free_at_start": free_at_go, "dram_hog_grown": keeper.grown if keeper else 0}
        (out / "run.json").write_text(json.dumps(meta, indent=1))
    finally:
        if keeper is not None:
            keeper.stop.set()
            keeper.join()
        if hog is not None:
            hog.close()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if logf is not None:
            logf.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
