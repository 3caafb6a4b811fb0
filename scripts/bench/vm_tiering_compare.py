#!/usr/bin/env python3
"""The kernel's own tiering, measured on kvtier's guest workload (QEMU guest).

    .venv/bin/python scripts/bench/vm_tiering_compare.py [--seconds 30] [--json FILE]

On the host this boots the guest (scripts/vm/run.py) and runs itself there
with --in-guest; the guest writes JSON to the share and the host prints a
markdown table (the rows of docs/benchmarks.md, "Hotness sources").

Workload (the issue's): a 256 MiB pool in 2 MiB blocks, all of it moved to
the far node 1 at start; a thread keeps reading a 32 MiB hot set (16 blocks,
one byte per page); half-way through, the hot set moves to 16 other blocks.
Modes, each with a fresh workload process:

  none          numa_balancing=0, no DAMON: the control, nothing moves.
  numa_tiering  numa_balancing=2 (NUMA_BALANCING_MEMORY_TIERING) with node 1
                in a lower memory tier (HMAT), demotion_enabled=true.
  damos_paddr   two kdamonds with paddr ops, one per node's physical range:
                node 1 with migrate_hot -> node 0, node 0 with migrate_cold
                -> node 1 (vaddr DAMOS migrations are accepted but never
                applied on 6.12). Quota 256 MiB/s per scheme.
  kvtier_hints  kvtierd (its default config, DRAM target 96 MiB, the slow
                emulated CXL tier left out as in scripts/demo), the pool
                registered by pid, and the reader telling it of each block
                read after each pass: by default with a hint set declared
                per phase and one ``touch()`` per pass (``--hint-api set``),
                with ``--hint-api call`` as before by ``region.hint(ids)``
                per pass; ``--hint-api set call`` runs the mode once each.
  kvtier_damon  the same without hints: DAMON vaddr (and perf faults) only.

Measured every --sample-s (0.25 s): the fraction of the current hot set's
pages on node 0 (move_pages query), and about every second the pool bytes on
node 0; over the run: /proc/vmstat
migration counters (pgmigrate_success = pages moved by any migration,
pgpromote_success, numa_*), DAMOS sz_applied per scheme, and CPU seconds of
the workload process (numa_balancing's hinting faults are charged to it) and
of the kdamonds and of kvtierd. kvtierd's column is its steady state, from
the workload's start (its region registered) to the end; its start-up
(exec to the registration answered: imports, pyroute2's among them,
discovery, probes) is reported apart, as the kdamonds' start is not
counted either.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
# The kvtier of this checkout, in this process and in the kvtierd it starts
# (a copy of the tree can then be run while the tree itself changes).
sys.path.insert(0, str(REPO / "daemon"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "daemon"), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts" / "vm"))

import speed  # noqa: E402  (waits below are quiet-host seconds times the guest's slowness)
import guestjob  # noqa: E402

MiB = 1 << 20
POOL = 256 * MiB
BLOCK = 2 * MiB
HOT_BLOCKS = 16
PHASES = (0, 64)  # first hot block of each phase
DRAM, FAR = 0, 1
NUMA_BALANCING = "/proc/sys/kernel/numa_balancing"
DEMOTION_ENABLED = "/sys/kernel/mm/numa/demotion_enabled"
NODE_DIR = "/sys/devices/system/node"
MEMORY_BLOCK_SIZE = "/sys/devices/system/memory/block_size_bytes"
VMSTAT_KEYS = (
    "pgmigrate_success", "pgmigrate_fail", "pgpromote_success", "pgdemote_kswapd", "pgdemote_direct",
    "numa_hint_faults", "numa_pages_migrated", "numa_pte_updates",
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- guest side --------------------------------------------------------------------


def write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in VMSTAT_KEYS:
                out[k] = int(v)
    return out


def tlb_shootdowns() -> int:
    """TLB shootdown interrupts so far, all CPUs (/proc/interrupts' TLB row):
    a migration of pages another CPU has mapped in its TLB sends one per
    flush, so this tells a move that flushed page by page from one that
    batched (or ran on the reader's own CPU, as numa_balancing's does)."""
    with open("/proc/interrupts") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "TLB":
                return sum(int(x) for x in rest.split() if x.isdigit())
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads)."""
    f = read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def node_ranges(node: int) -> list[tuple[int, int]]:
    """Physical address ranges of a node's online memory blocks, merged."""
    bs = int(read(MEMORY_BLOCK_SIZE), 16)
    idx = sorted(int(n[len("memory"):]) for n in os.listdir(f"{NODE_DIR}/node{node}")
                 if n.startswith("memory") and n[len("memory"):].isdigit())
    out: list[list[int]] = []
    for i in idx:
        s, e = i * bs, (i + 1) * bs
        if out and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class DamosPaddr:
    """Two paddr kdamonds: hot pages of the far node up, cold ones of DRAM down."""

    def __init__(self):
        from kvtier.kernel.sources import damon as dm
        from kvtier.kernel.sysfs_io import SysfsIO

        self.dm = dm
        self.io = SysfsIO("/sys")
        self.pids: list[int] = []

    def start(self) -> None:
        dm, io = self.dm, self.io
        plans = [
            (FAR, "migrate_hot", DRAM, (2, dm.UINT_MAX), (0, dm.UINT_MAX)),
            # Cold: no access seen for 30 aggregation intervals (3 s).
            (DRAM, "migrate_cold", FAR, (0, 0), (30, dm.UINT_MAX)),
        ]
        io.write(dm.NR_KDAMONDS, len(plans))
        for k, (node, action, dst, acc, age) in enumerate(plans):
            kd = f"{dm.KDAMONDS}/{k}"
            ctx = f"{kd}/contexts/0"
            io.write(f"{kd}/contexts/nr_contexts", 1)
            io.write(f"{ctx}/operations", "paddr")
            io.write(f"{ctx}/monitoring_attrs/intervals/sample_us", 5000)
            io.write(f"{ctx}/monitoring_attrs/intervals/aggr_us", 100000)
            io.write(f"{ctx}/monitoring_attrs/intervals/update_us", 1000000)
            io.write(f"{ctx}/monitoring_attrs/nr_regions/min", 10)
            io.write(f"{ctx}/monitoring_attrs/nr_regions/max", 1000)
            ranges = node_ranges(node)
            io.write(f"{ctx}/targets/nr_targets", 1)
            io.write(f"{ctx}/targets/0/regions/nr_regions", len(ranges))
            for j, (s, e) in enumerate(ranges):
                io.write(f"{ctx}/targets/0/regions/{j}/start", s)
                io.write(f"{ctx}/targets/0/regions/{j}/end", e)
            sc = f"{ctx}/schemes/0"
            io.write(f"{ctx}/schemes/nr_schemes", 1)
            io.write(f"{sc}/action", action)
            io.write(f"{sc}/target_nid", dst)
            for name, (lo, hi) in (("sz", (dm.PAGE_SIZE, dm.ULONG_MAX)), ("nr_accesses", acc), ("age", age)):
                io.write(f"{sc}/access_pattern/{name}/min", lo)
                io.write(f"{sc}/access_pattern/{name}/max", hi)
            io.write(f"{sc}/quotas/reset_interval_ms", 1000)
            io.write(f"{sc}/quotas/bytes", 256 * MiB)
        for k in range(len(plans)):
            io.write(f"{dm.KDAMONDS}/{k}/state", "on")
            self.pids.append(int(io.read(f"{dm.KDAMONDS}/{k}/pid")))

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)

    def applied(self) -> dict[str, int]:
        out = {}
        for k, name in enumerate(("migrate_hot_bytes", "migrate_cold_bytes")):
            self.io.write(f"{self.dm.KDAMONDS}/{k}/state", "update_schemes_stats")
            out[name] = self.io.read_int(f"{self.dm.KDAMONDS}/{k}/contexts/0/schemes/0/stats/sz_applied")
        return out

    def stop(self) -> None:
        for k in range(len(self.pids)):
            self.io.write(f"{self.dm.KDAMONDS}/{k}/state", "off")
        self.io.write(self.dm.NR_KDAMONDS, 0)


class Kvtierd:
    """kvtierd in a private run directory, as scripts/demo/driver.py runs it."""

    DRAM_TARGET = 96 * MiB

    def __init__(self, log_level: str = "info", overrides: tuple[str, ...] = ()):
        from kvtier.kernel import topology

        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-cmp-"))
        self.sock = self.dir / "kvtierd.sock"
        # Under TCG the emulated CXL device moves ~2.5 MiB/s: leave it out.
        tiers = [t for t in topology.discover().tiers
                 if t.kind not in (topology.KIND_SWAP, topology.KIND_CXL)]
        order = ", ".join(f'{{ name = "{t.name}", nodes = {list(t.nodes)} }}' for t in tiers)
        conf = self.dir / "kvtierd.toml"
        conf.write_text(
            "[daemon]\n"
            f'socket = "{self.sock}"\n'
            'state_file = ""\n'
            f'log_level = "{log_level}"\n'
            "[policy]\n"
            f'capacity = {{ "0" = {self.DRAM_TARGET} }}\n'
            f"[topology]\ntiers = [{order}]\n"
        )
        self.log = open(self.dir / "kvtierd.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", str(conf),
                                      *(a for kv in overrides for a in ("-s", kv))],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60 * speed.current()
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kvtierd did not start:\n" + (self.dir / "kvtierd.log").read_text()[-3000:])
            time.sleep(0.1)

    def spy(self, out: Path) -> None:
        """Sample its stacks with py-spy (collapsed stacks, thread ids, 50 Hz,
        without pausing it) until stop(): where its CPU goes."""
        exe = Path(sys.executable).parent / "py-spy"
        self.spy_proc = subprocess.Popen([str(exe), "record", "--pid", str(self.proc.pid), "--format", "raw",
                                          "--rate", "50", "--threads", "--nonblocking", "--output", str(out)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def sources(self) -> dict:
        from kvtier.client import Client

        with Client(str(self.sock), timeout=60 * speed.current()) as c:
            return c.request("status").get("engine", {}).get("sources", {})

    def stop(self) -> str:
        """Stop it; returns its whole log."""
        spy = getattr(self, "spy_proc", None)
        if spy is not None:
            spy.send_signal(2)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60 * speed.current())
        self.proc.send_signal(15)
        try:
            self.proc.wait(timeout=60 * speed.current())
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return (self.dir / "kvtierd.log").read_text()


log_dir: Path | None = None  # (guest) where each kvtierd's whole log is written: the share
py_spy = False  # (guest) --py-spy: profile each kvtierd into log_dir
daemon_set: tuple[str, ...] = ()  # (guest) --daemon-set: config overrides for every kvtierd


def _noop(ids) -> None:
    """What hint() is compared with: a call that does nothing."""


HINT_APIS = ("set", "call")  # Region.hint_set + touch() per pass / Region.hint(ids) per pass


def run_mode(mode: str, seconds: float, log_level: str = "info", sample_s: float = 0.25,
             hint_api: str = "set", overrides: tuple[str, ...] = ()) -> dict:
    from kvchild import KVChild
    from kvtier.kernel import native

    page = native.PAGE_SIZE
    tag = mode + ("-call" if mode == "kvtier_hints" and hint_api == "call" else "")  # names its log files
    tag += "".join(f"-{kv}" for kv in overrides)
    write(NUMA_BALANCING, 0)
    child = KVChild(POOL)
    damos = None
    daemon = client = None
    try:
        addrs = child.addr + np.arange(POOL // page, dtype=np.uint64) * np.uint64(page)
        t0 = time.monotonic()
        st = native.move_pages(child.pid, addrs, FAR)
        setup_s = time.monotonic() - t0
        on_far = float((st == FAR).mean())
        hot = {"first": PHASES[0]}

        def hot_addrs(first):
            lo = first * BLOCK // page
            return addrs[lo : lo + HOT_BLOCKS * BLOCK // page]

        stop = threading.Event()
        rounds = [0]
        hint_s = [0.0]  # the workload's time inside region.hint(): what hinting costs the engine
        noop_s = [0.0]  # ... and inside an empty function call timed the same way
        clock_s = [0.0]  # ... and between two clock reads with nothing between them: the
        # timing's own cost, in every timed interval above (the net figures subtract it)
        calls_s: list[float] = []  # each pass's hint call (hint() or touch()), to see where hint_s went
        kinds: list[int] = []  # (set API) what each touch did: 0 counted, 1 looked at the clock, 2 flushed
        noops_s: list[float] = []  # ... and its empty call
        declare_s: list[float] = []  # (set API) hint_set() and replace(), once a phase (in hint_s too)
        hot_ids: dict[int, np.ndarray] = {}
        first_hint: list[float] = []  # when the workload first hinted each phase's hot set (s from start)
        loop_s = [0.0]

        region = None
        if mode.startswith("kvtier"):
            from kvtier.client import Client

            daemon = Kvtierd(log_level, daemon_set + overrides)
            registering = time.time()
            if py_spy and log_dir is not None:
                daemon.spy(log_dir / f"kvtierd-{tag}.pyspy.txt")
            client = Client(str(daemon.sock), name="vm_tiering_compare", timeout=60 * speed.current())
            region = client.register(addr=child.addr, length=POOL, block_size=BLOCK, pid=child.pid,
                                     name="pool")
        hints = mode == "kvtier_hints"
        hint_set = [None]  # (set API) the hot set's blocks, declared at the first pass, replaced per phase
        set_first = [None]  # the phase's first hot block the set holds
        per_call = hint_api == "call"

        def touch():
            t_start = time.perf_counter()
            while not stop.is_set():
                first = hot["first"]
                child.ask(f"touch {first * BLOCK} {HOT_BLOCKS * BLOCK}")
                if hints:
                    # The hot set's block ids as the engine's block table
                    # holds them (uint32, the protocol's type), built once
                    # per phase outside the timed call.
                    ids = hot_ids.get(first)
                    if ids is None:
                        ids = hot_ids[first] = np.arange(first, first + HOT_BLOCKS, dtype=np.uint32)
                        first_hint.append(round(time.monotonic() - start, 3))  # once per phase
                    if per_call:
                        call, arg = region.hint, ids
                    else:
                        # The set API: the set changes once a phase (that
                        # call timed with the touches: it is part of what
                        # hinting costs), then one touch() per pass.
                        if set_first[0] != first:
                            h0 = time.perf_counter()
                            if hint_set[0] is None:
                                hint_set[0] = region.hint_set(ids)
                            else:
                                hint_set[0].replace(ids)
                            declare_s.append(time.perf_counter() - h0)
                            hint_s[0] += declare_s[-1]
                            set_first[0] = first
                        call, arg = type(hint_set[0]).touch, hint_set[0]  # call(arg) is hs.touch()
                    # The floors of this measurement: a call of a Python
                    # function that does nothing, and nothing (two clock
                    # reads in a row: what timing an interval adds to it,
                    # a clock read being a system call in this guest), each
                    # timed the same way; the three take turns at each
                    # position in the pass, so none gets the warmer caches
                    # or the first read after the reader's round trip.
                    turn = rounds[0] % 3
                    hs = hint_set[0]
                    if hs is not None and not per_call:  # read outside the timed calls
                        left, sent = hs._left, hs._due_at
                    if turn == 0:
                        h0 = time.perf_counter()
                        call(arg)
                        h1 = time.perf_counter()
                        _noop(ids)
                        h2 = time.perf_counter()
                        h3 = time.perf_counter()
                        c, n, z = h1 - h0, h2 - h1, h3 - h2
                    elif turn == 1:
                        h0 = time.perf_counter()
                        _noop(ids)
                        h1 = time.perf_counter()
                        h2 = time.perf_counter()
                        call(arg)
                        h3 = time.perf_counter()
                        c, n, z = h3 - h2, h1 - h0, h2 - h1
                    else:
                        h0 = time.perf_counter()
                        h1 = time.perf_counter()
                        call(arg)
                        h2 = time.perf_counter()
                        _noop(ids)
                        h3 = time.perf_counter()
                        c, n, z = h2 - h1, h3 - h2, h1 - h0
                    hint_s[0] += c
                    noop_s[0] += n
                    clock_s[0] += z
                    calls_s.append(c)
                    if hs is not None and not per_call:
                        kinds.append(2 if hs._due_at != sent else int(left <= 1))
                    noops_s.append(n)
                rounds[0] += 1
            loop_s[0] = time.perf_counter() - t_start

        demotion_old = read(DEMOTION_ENABLED) if os.path.exists(DEMOTION_ENABLED) else None
        if mode == "numa_tiering":
            if demotion_old is not None:
                write(DEMOTION_ENABLED, "true")
            write(NUMA_BALANCING, 2)
        elif mode == "damos_paddr":
            damos = DamosPaddr()
            damos.start()
        vm0, cpu0, tlb0 = vmstat(), cpu_seconds(child.pid), tlb_shootdowns()
        kcpu0 = damos.cpu() if damos else (cpu_seconds(daemon.proc.pid) if daemon else 0.0)
        th = threading.Thread(target=touch, daemon=True)
        series = []
        pool_every = max(1, round(1.0 / sample_s))
        wall_start = time.time()  # the daemon log's clock: where t = 0 is in it
        start = time.monotonic()
        th.start()
        switched = False
        while True:
            now = time.monotonic() - start
            if now >= seconds:
                break
            if not switched and now >= seconds / 2:
                hot["first"] = PHASES[1]
                switched = True
            hs = native.move_pages(child.pid, hot_addrs(hot["first"]), None)
            point = {"t": round(now, 2), "phase": int(switched), "hot_on_dram": round(float((hs == DRAM).mean()), 4)}
            if len(series) % pool_every == 0:  # the whole pool's query costs 8x the hot set's
                ps = native.move_pages(child.pid, addrs, None)
                point["pool_mib_on_dram"] = round(float((ps == DRAM).sum()) * page / MiB, 1)
            series.append(point)
            time.sleep(max(0.0, sample_s - (time.monotonic() - start - now)))
        stop.set()
        th.join(timeout=60 * speed.current())
        vm1, cpu1, tlb1 = vmstat(), cpu_seconds(child.pid), tlb_shootdowns()
        extra = {}
        if damos:
            extra = damos.applied()
            extra["kdamond_cpu_s"] = round(damos.cpu() - kcpu0, 2)
        if daemon:
            extra["register_at_s"] = round(registering - wall_start, 3)
            extra["kvtierd_cpu_s"] = round(cpu_seconds(daemon.proc.pid) - kcpu0, 2)
            extra["kvtierd_start_cpu_s"] = round(kcpu0, 2)  # exec to registration: not in the column
            extra["sources"] = daemon.sources()
            # what the daemon itself accounted to its kdamond(s), stopped ones included
            kd_status = extra["sources"].get("damon", {}).get("kernel_cpu_s")
            # kvtierd's DAMON source starts its kdamond at registration: all
            # of that kernel thread's CPU time belongs to this run.
            from kvtier.kernel.sysfs_io import SysfsIO

            io = SysfsIO("/sys")  # retries EBUSY: kvtierd's DAMON commands hold the sysfs lock
            kd = "kernel/mm/damon/admin/kdamonds/0/pid"
            if io.exists(kd) and io.read_int(kd) > 0:
                extra["kdamond_cpu_s"] = round(cpu_seconds(io.read_int(kd)), 2)
            if kd_status is not None:
                extra["kdamond_cpu_s"] = round(max(extra.get("kdamond_cpu_s", 0.0), kd_status), 2)
        if mode == "numa_tiering":
            write(NUMA_BALANCING, 0)
            if demotion_old is not None:
                write(DEMOTION_ENABLED, demotion_old)
        delta = {k: vm1.get(k, 0) - vm0.get(k, 0) for k in VMSTAT_KEYS}
        return {
            "mode": mode,
            **({"overrides": list(overrides)} if overrides else {}),
            **({"hint_api": hint_api} if hints else {}),
            "wall_start": wall_start,
            "setup_move_s": round(setup_s, 2),
            "pool_on_far_at_start": round(on_far, 4),
            "touch_rounds": rounds[0],
            "first_hint_s": first_hint,
            "hint_call_s": round(hint_s[0], 3),
            "hint_share": round(hint_s[0] / loop_s[0], 5) if loop_s[0] > 0 else None,
            "noop_call_s": round(noop_s[0], 3),
            "noop_share": round(noop_s[0] / loop_s[0], 5) if loop_s[0] > 0 else None,
            "clock_pair_s": round(clock_s[0], 3),
            "clock_share": round(clock_s[0] / loop_s[0], 5) if loop_s[0] > 0 else None,
            # the engine's time in the hint calls: as timed, less the timing's own cost per call
            "hint_share_net": round((hint_s[0] - clock_s[0]) / loop_s[0], 5) if loop_s[0] > 0 and hints else None,
            "noop_share_net": round((noop_s[0] - clock_s[0]) / loop_s[0], 5) if loop_s[0] > 0 and hints else None,
            **(call_spread(calls_s, declare_s) if calls_s else {}),
            **({"touch_kinds": touch_kinds(calls_s, kinds)} if kinds else {}),
            **({"noop_spread": call_spread(noops_s, [])} if noops_s else {}),
            "series": series,
            "vmstat": delta,
            "migrated_mib": round(delta["pgmigrate_success"] * page / MiB, 1),
            "tlb_shootdowns": tlb1 - tlb0,
            "workload_cpu_s": round(cpu1 - cpu0, 2),
            **extra,
        }
    finally:
        if damos:
            try:
                damos.stop()
            except OSError:
                pass
        if client:
            try:
                region.unregister()
                client.close()
            except Exception as e:  # the run's numbers are already taken
                print(f"{mode}: unregister failed: {e}", flush=True)
        if daemon:
            text = daemon.stop()
            print(f"{mode}: kvtierd log tail:\n{text[-2000:]}", flush=True)
            if log_dir is not None:
                (log_dir / f"kvtierd-{tag}.log").write_text(text)
        write(NUMA_BALANCING, 0)
        child.close()


def touch_kinds(calls_s: list[float], kinds: list[int]) -> dict:
    """The touches' time by what they did: only counted down, looked at
    the clock (and did not flush), flushed the set: calls, seconds, p50 us."""
    c, k = np.asarray(calls_s[-len(kinds):]), np.asarray(kinds)
    out = {}
    for code, name in enumerate(("counted", "looked", "flushed")):
        x = c[k == code]
        out[name] = {"calls": int(x.size), "s": round(float(x.sum()), 4),
                     "p50_us": round(float(np.median(x)) * 1e6, 1) if x.size else None}
    return out


def call_spread(calls_s: list[float], declare_s: list[float]) -> dict:
    """Where the workload's time in hint calls went: the first call (it
    sends at once; until registering asked for the hint ring it also paid
    that round trip), the set's declarations, the slowest 1 % of the rest,
    and the rest's median."""
    c = np.asarray(calls_s)
    rest = np.sort(c[1:])
    top = rest[-max(1, rest.size // 100):] if rest.size else rest
    return {"first_call_s": round(float(c[0]), 4), "declare_s": round(float(sum(declare_s)), 4),
            "slowest_1pct_s": round(float(top.sum()), 4), "others_s": round(float(rest.sum() - top.sum()), 4),
            "p50_us": round(float(np.median(c)) * 1e6, 1), "p99_us": round(float(np.percentile(c, 99)) * 1e6, 1),
            "max_us": round(float(c.max()) * 1e6)}


def guest_main(args) -> None:
    out = {"kernel": os.uname().release, "seconds": args.seconds, "pool_mib": POOL // MiB,
           "hot_mib": HOT_BLOCKS * BLOCK // MiB, "modes": []}
    global log_dir, py_spy, daemon_set
    log_dir = Path(args.out).parent
    py_spy = args.py_spy
    daemon_set = tuple(args.daemon_set)
    for spec in args.modes:
        mode, *overrides = spec.split("/")
        for api in (args.hint_api if mode == "kvtier_hints" else ["set"]):
            out["modes"].append(run_mode(mode, args.seconds, args.daemon_log_level, args.sample_s, api,
                                         tuple(overrides)))
            print(f"{spec}: done", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


# -- host side -------------------------------------------------------------------------


def time_to(series: list[dict], phase: int, frac: float) -> float | None:
    """Seconds from the phase start until the hot set is ``frac`` on DRAM."""
    pts = [p for p in series if p["phase"] == phase]
    if not pts:
        return None
    t0 = pts[0]["t"]
    for p in pts:
        if p["hot_on_dram"] >= frac:
            return round(p["t"] - t0, 2)
    return None


def ratio(m: dict, damos: dict | None) -> str:
    """kvtierd's CPU plus the kdamond it ran, over DAMOS paddr's kdamonds' (same run)."""
    if "kvtierd_cpu_s" not in m or not damos or not damos.get("kdamond_cpu_s"):
        return "-"
    own = m["kvtierd_cpu_s"] + m.get("kdamond_cpu_s", 0.0)
    return f"{own:.2f} s = {own / damos['kdamond_cpu_s']:.2f}x"


def hint_cost(m: dict) -> str:
    if not m.get("hint_call_s") or m.get("hint_share") is None:
        return "-"
    floor = f" (empty call: {m['noop_share']:.2%})" if m.get("noop_share") is not None else ""
    spread = ""
    if "first_call_s" in m:
        declared = f", declaring the set {m['declare_s']:.3f} s" if m.get("hint_api") == "set" else ""
        spread = (f"; first call {m['first_call_s']:.3f} s{declared}, slowest 1 % of the others "
                  f"{m['slowest_1pct_s']:.3f} s, the rest {m['others_s']:.3f} s (p50 {m['p50_us']:.0f} us)")
        if "noop_spread" in m:
            n = m["noop_spread"]
            spread += (f"; empty call: slowest 1 % {n['slowest_1pct_s']:.3f} s, the rest {n['others_s']:.3f} s "
                       f"(p50 {n['p50_us']:.0f} us)")
    net = ""
    if m.get("hint_share_net") is not None:
        net = (f"; less the clock reads' own {m['clock_share']:.2%}: {m['hint_share_net']:.2%} "
               f"(empty call {m['noop_share_net']:.2%})")
    return f"{m['hint_call_s']:.2f} s = {m['hint_share']:.2%}{floor}{net}{spread}"


def table(res: dict) -> str:
    lines = [
        "| mode | hot set on DRAM at end of phase 1 / 2 | time to 90% (phase 1 / 2) | migrated MiB "
        "| promote / hint faults | workload CPU s | kdamond CPU s | kvtierd CPU s | kvtier + its kdamond "
        "/ DAMOS kdamonds | workload time in hint() |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    damos = next((m for m in res["modes"] if m["mode"] == "damos_paddr"), None)
    for m in res["modes"]:
        s = m["series"]
        end = [max((p for p in s if p["phase"] == ph), key=lambda p: p["t"], default=None) for ph in (0, 1)]
        ends = " / ".join("-" if e is None else f"{e['hot_on_dram']:.0%}" for e in end)
        tt = " / ".join("never" if x is None else f"{x} s" for x in (time_to(s, 0, 0.9), time_to(s, 1, 0.9)))
        v = m["vmstat"]
        mig = f"{m['migrated_mib']}"
        if "migrate_hot_bytes" in m:
            mig += f" (hot {m['migrate_hot_bytes'] / MiB:.0f} up, cold {m['migrate_cold_bytes'] / MiB:.0f} down)"
        label = m["mode"] + (" (hint per call)" if m.get("hint_api") == "call" else "")
        label += "".join(f" {kv}" for kv in m.get("overrides", ()))
        lines.append(
            f"| {label} | {ends} | {tt} | {mig} | {v['pgpromote_success']} / {v['numa_hint_faults']} "
            f"| {m['workload_cpu_s']} | {m.get('kdamond_cpu_s', '-')} | {m.get('kvtierd_cpu_s', '-')} "
            f"| {ratio(m, damos)} | {hint_cost(m)} |"
        )
    return "\n".join(lines)


def host_main(args) -> None:
    runs = len(args.modes) + (len(args.hint_api) - 1 if "kvtier_hints" in args.modes else 0)
    res = guestjob.run(Path(__file__).resolve(), ["--seconds", str(args.seconds), "--modes", *args.modes,
                                                  "--daemon-log-level", args.daemon_log_level,
                                                  "--sample-s", str(args.sample_s),
                                                  "--hint-api", *args.hint_api,
                                                  *(["--py-spy"] if args.py_spy else []),
                                                  *(a for kv in args.daemon_set for a in ("--daemon-set", kv))],
                       "tiering.json", timeout=120 + runs * (args.seconds + 60), save=args.json)
    print(f"kernel {res['kernel']}, pool {res['pool_mib']} MiB on node 1 at start, hot set {res['hot_mib']} MiB, "
          f"{res['seconds']} s per mode, hot set moves at half time")
    print(table(res))
    tlb = [f"{m['mode']} {m['tlb_shootdowns']} ({m['tlb_shootdowns'] / max(1, m['vmstat']['pgmigrate_success']):.2f} "
           f"per page migrated)" for m in res["modes"] if "tlb_shootdowns" in m]
    if tlb:
        print(f"TLB shootdowns during the run: {', '.join(tlb)}")
    starts = [f"{m['mode']} {m['kvtierd_start_cpu_s']} s" for m in res["modes"] if "kvtierd_start_cpu_s" in m]
    if starts:
        print(f"kvtierd start-up CPU (exec to registration, not in the kvtierd column): {', '.join(starts)}")
    print(f"guest share (kvtierd logs): {res['share']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="run length per mode")
    ap.add_argument("--modes", nargs="+",
                    default=["none", "numa_tiering", "damos_paddr", "kvtier_hints", "kvtier_damon"],
                    help="modes in the order run, repeats allowed; a kvtier mode may carry kvtierd config "
                         "overrides of its own after slashes (kvtier_hints/daemon.move_threads=1)"),
    ap.add_argument("--hint-api", nargs="+", choices=HINT_APIS, default=["set"],
                    help="how kvtier_hints tells kvtierd of each pass: set = Region.hint_set, one touch() "
                         "per pass; call = region.hint(ids) per pass (before hint sets); both: the mode runs "
                         "once each")
    ap.add_argument("--sample-s", type=float, default=0.25,
                    help="seconds between samples of the hot set's placement (the pool's: about every second)")
    ap.add_argument("--daemon-log-level", default="info", choices=("debug", "info", "warning"),
                    help="kvtierd's log level (debug: its job and plan events, to see where a phase's time goes)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvtierd config override for the kvtier modes (kvtierd -s), repeatable")
    ap.add_argument("--py-spy", action="store_true",
                    help="profile each kvtierd with py-spy (collapsed stacks in the guest share)")
    guestjob.add_args(ap)
    args = ap.parse_args()
    if args.in_guest:
        guest_main(args)
    else:
        host_main(args)


if __name__ == "__main__":
    main()
