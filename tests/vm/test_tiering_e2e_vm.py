"""kvtier end to end in the guest (issue 5, "Shown by"): a real kvtierd tiers a
256 MiB KV pool whose hot set shifts, checked from the kernel.

The workload is the one scripts/bench/vm_tiering_compare.py measures (its
constants are imported from there): a 256 MiB pool in 2 MiB blocks, all moved
to the far node 1 first, a thread reading a 32 MiB hot set (16 blocks) that
moves once to 16 other blocks. kvtierd gets a DRAM target of 64 MiB and a
far target of 128 MiB, so the pool fits in neither and its coldest part must
go to the guest's swap. The emulated CXL node 2 is left out of the tiers, as
the demo does (scripts/demo/driver.py plan_tiers: under TCG a move into it
runs at ~2.5 MiB/s).

Without hints, at registration DAMON has no samples yet, every block is
equally cold, and the first ticks page out an arbitrary part of the
over-target far tier, hot blocks included; MADV_PAGEOUT leaves a block that
is being read present. That used to mark the block unmovable at once and keep
the hot set out of DRAM for good (seen here: 0% of the hot set on node 0
after 60 ticks); the migrator now reports it as a retryable failure, and the
DAMON-only run keeps swap too (measured 8/49 and 11/47 ticks per phase).

DAMON's first dumps cover the pool with a few large regions that DAMON is
still splitting; crediting their counts to every block they cover put 11
never-read blocks in DRAM for good (fresh-clone CI, guest slowness 1.33).
The DAMON source now credits a block only from regions DAMON would keep and
only what two dumps in a row agree on: 9/9, 7/18 and 9/12 ticks per phase in
three runs (2026-12-02, guest slowness 1.5-2.2).

Placement is read from the kernel (move_pages status and pagemap through
kvtier.kernel.migrator residency), never from the daemon's view. Convergence is
counted in daemon ticks (its ``ticks_total``), not seconds: the limits below
are a 2-3x margin over what the guest measured on a quiet host, times the
guest's measured slowness (vmhelpers.scaled_count): on a busy host the
workload and DAMON get less done per tick.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vmhelpers import DRAM_NODE, FAR_NODE, GuestKvtierd, KVChild, block_ranges, scaled, scaled_count, slowness

from kvtier.kernel import topology
from kvtier.client import Client
from kvtier.kernel.migrator import Migrator

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vm_tiering_compare", REPO / "scripts/bench/vm_tiering_compare.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MiB = 1 << 20
POOL, BLOCK, HOT_BLOCKS, PHASES = bench.POOL, bench.BLOCK, bench.HOT_BLOCKS, bench.PHASES
NBLOCKS = POOL // BLOCK
DRAM_TARGET = 64 * MiB
FAR_TARGET = 128 * MiB  # with hints: the coldest 64+ MiB must go to swap
TICK_S = 0.5
# Ticks from a phase's start until >= 90% of its hot set is on node 0 and the
# cold blocks are placed (measured: see the commit message; these are ~2-3x).
HINT_TICKS = 30
DAMON_TICKS = 120
# Never-hot blocks allowed on node 0 once DRAM is above the policy's low
# watermark: none with hints; DAMON's regions span block boundaries, so a
# neighbour of the hot set can look warm to it.
COLD_IN_DRAM = {True: 0, False: 4}
# ...and below it, where the policy has no reason to demote anything (that
# room is free), at most this many: with hints, a fresh-clone CI run on a
# loaded host left 3 never-hot blocks back on node 0 after page-outs their
# pages came back from (DRAM at 19 of its 32 blocks, every hot block in);
# with DAMON only, also blocks that DAMON's regions credited while they still
# spanned the hot set's edge, promoted into free room: blocks 16 and 17 beside
# the first hot set (0-15) in 2 of the 6 phases of three runs on 2026-12-08,
# block 63 in one (`cold_in_dram` in tiering_e2e.jsonl; `explain`: 16 and 17
# promoted 0.5 s before, effective temperature 0.7-0.8 by then, under the
# promotion threshold 2.0), 6 in a fresh-clone CI run (ci30, 2026-12-07, guest
# slowness 2.72, DAMON backed off to a quarter of its sampling; which blocks
# was not recorded then, a failure now lists them with `explain`'s text).
COLD_LEFT = {True: 4, False: 8}


def low_watermark_blocks() -> int:
    """Blocks of DRAM's target below the shipped low watermark: the policy
    demotes cold blocks only down to it (room for allocations, never
    emptied on purpose while there is room), so a cold block that came to
    DRAM (a page-out its reader undid, a prefetch not read) may stay while
    the pool's DRAM use is under it."""
    from kvtier import config

    return int(config.from_dict({}).get("policy.low_wm") * DRAM_TARGET) // BLOCK
# At steady state DRAM and far hold at most their high watermark (0.98) of
# their target, so at least this much of the pool must be in swap.
MIN_SWAPPED = POOL - DRAM_TARGET - FAR_TARGET
SHARE = Path("/mnt/kvtier")  # scripts/vm/run.py's share, as tests/conftest.py names it


class Daemon(GuestKvtierd):
    """kvtierd with dram (node 0), far (node 1), and with hints swap."""

    def __init__(self, tmp: Path, hints: bool):
        mem = [t for t in topology.discover().tiers if t.kind not in (topology.KIND_SWAP, topology.KIND_CXL)]
        assert [list(t.nodes) for t in mem] == [[DRAM_NODE], [FAR_NODE]], mem
        tiers = ", ".join(f'{{ name = "{t.name}", nodes = {list(t.nodes)}, kind = "{t.kind}" }}' for t in mem)
        # Without hints DAMON vaddr is the only source: perf major-fault
        # samples (on by default) would otherwise also report swap-ins.
        others = "" if hints else "[hotness.perf_fault]\nenabled = false\n[hotness.perf]\nenabled = false\n"
        caps = f'"0" = {DRAM_TARGET}, "1" = {FAR_TARGET}'
        # The client is only for stats: the workload thread hints through its
        # own. A reply can wait for a tick that measures the whole pool: seen
        # over the client's default 10 s on a busy host.
        super().__init__(tmp, textwrap.dedent(f"""\
            [policy]
            capacity = {{ {caps} }}
            [topology]
            tiers = [{tiers}]
            swap = true
            """) + others, daemon={"tick_interval": TICK_S, "source_cpu_budget": cpu_budget()},
            name="test_tiering_e2e")


def cpu_budget() -> float:
    """The shipped daemon.source_cpu_budget for the work it stands for on a
    quiet host: under TCG the same collect costs `slowness` times the CPU
    (fresh-clone CI at host load 9: DAMON measured at 0.14-0.21 of a core,
    backed off to 1/64 and never told the cold blocks apart)."""
    from kvtier import config

    return config.from_dict({}).get("daemon.source_cpu_budget") * slowness()


class Workload:
    """The pool on the far node and a thread reading the current hot set."""

    def __init__(self, child: KVChild):
        self.child = child
        self.first = PHASES[0]
        self.region = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def hot(self, first: int | None = None) -> np.ndarray:
        first = self.first if first is None else first
        return np.arange(first, first + HOT_BLOCKS)

    def _run(self) -> None:
        while not self.stop.is_set():
            first = self.first
            self.child.ask(f"touch {first * BLOCK} {HOT_BLOCKS * BLOCK}")
            if self.region is not None:
                self.region.hint(self.hot(first))
            self.stop.wait(0.05)  # leave the guest's 2 vCPUs to the daemon

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=scaled(60))


def placement(child: KVChild) -> np.ndarray:
    """Rows: fraction of each block's pages on node 0, on node 1, in swap (from the kernel)."""
    starts, lengths = block_ranges(child, BLOCK)
    r = Migrator().residency(child.pid, starts, lengths)
    pages = r.pages.astype(float)
    return np.stack([r.node_pages[:, DRAM_NODE] / pages, r.node_pages[:, FAR_NODE] / pages, r.swapped / pages])


def explain_cold(kv: Client, region_id: int, blocks: np.ndarray) -> str:
    """The daemon's own account (``explain``) of the first never-hot blocks
    found in DRAM: what a failure needs to tell a wrong DAMON reading from a
    page-in that landed on node 0 or a policy that kept the block."""
    out = []
    for b in blocks[:3]:
        try:
            out.append(f"block {b}:\n{kv.request('explain', region=region_id, block=int(b))['text']}")
        except Exception as e:  # the failure report must not hide the failure
            out.append(f"block {b}: explain failed: {e!r}")
    return "\n".join(out)


def wait_phase(d: Daemon, w: Workload, limit: int, ever_hot: np.ndarray, report: list, hints: bool,
               kv: Client, region_id: int) -> None:
    """Poll until the phase's hot set is >= 90% on node 0 and the cold blocks
    are placed (not in DRAM; with hints, the never-hot ones filling swap), or
    ``limit`` ticks."""
    t0 = d.ticks()
    hot = w.hot()
    never = np.setdiff1d(np.arange(NBLOCKS), ever_hot)
    hot_at = None
    while True:
        n = d.ticks() - t0
        dram, far, swap = placement(w.child)
        hot_frac = dram[hot].mean()
        if hot_at is None and hot_frac >= 0.9:
            hot_at = n
        # Cold (never-hot) blocks are not in DRAM, swap holds what neither
        # memory tier has room for, and only never-hot blocks are in it.
        cold = (dram[never] >= 0.5).sum()
        cold_ok = cold <= COLD_IN_DRAM[hints] or (cold <= COLD_LEFT[hints] and (dram >= 0.5).sum() <= low_watermark_blocks())
        swap_ok = (not hints or swap.sum() * BLOCK >= MIN_SWAPPED) and swap[ever_hot].max() < 0.5
        if hot_at is not None and cold_ok and swap_ok:
            report.append({"hot90_ticks": hot_at, "settled_ticks": n,
                           "cold_in_dram": never[dram[never] >= 0.5].tolist()})
            return
        if n > limit:
            in_dram = never[dram[never] >= 0.5]
            raise AssertionError(
                f"not converged in {limit} ticks (hot90 at {hot_at}): hot on node 0 {hot_frac:.0%}, "
                f"never-hot blocks with most pages on node 0 {len(in_dram)} {in_dram.tolist()} "
                f"(blocks on node 0 {int((dram >= 0.5).sum())}, low watermark {low_watermark_blocks()}), "
                f"swapped {swap.sum() * BLOCK / MiB:.0f} MiB, ever-hot blocks swapped "
                f"{int((swap[ever_hot] >= 0.5).sum())}; {explain_cold(kv, region_id, in_dram)}\n"
                f"kvtierd log:\n{d.log.read_text()[-2000:]}")
        time.sleep(TICK_S)


def run(tmp_path: Path, hints: bool, limit: int) -> list:
    bench.write(bench.NUMA_BALANCING, 0)  # every page that moves is moved by kvtier
    report: list = []
    with KVChild(POOL) as child:
        before = child.checksum()
        starts, lengths = block_ranges(child, BLOCK)
        Migrator().move(child.pid, starts, lengths, FAR_NODE)
        assert placement(child)[1].mean() > 0.99
        d = Daemon(tmp_path, hints)
        w = Workload(child)
        kv = Client(str(d.sock), name="test_tiering_e2e workload", timeout=scaled(60))
        try:
            region = kv.register(addr=child.addr, length=POOL, block_size=BLOCK, pid=child.pid, name="pool")
            w.region = region if hints else None
            w.thread.start()
            wait_phase(d, w, limit, w.hot(PHASES[0]), report, hints, kv, region.id)
            w.first = PHASES[1]
            wait_phase(d, w, limit, np.concatenate([w.hot(PHASES[0]), w.hot(PHASES[1])]), report, hints, kv,
                       region.id)
            w.close()
            region.unregister()
        finally:
            w.close()
            kv.close()
            d.stop()
        assert child.checksum() == before
    # The ticks measured, next to results.jsonl on the host (scripts/vm share).
    if SHARE.is_dir():
        with open(SHARE / "tiering_e2e.jsonl", "a") as f:
            f.write(json.dumps({"hints": hints, "phases": report}) + "\n")
    return report


def test_hints_bring_each_hot_set_into_dram(tmp_path):
    run(tmp_path, hints=True, limit=scaled_count(HINT_TICKS))


def test_damon_alone_converges(tmp_path):
    run(tmp_path, hints=False, limit=scaled_count(DAMON_TICKS))
