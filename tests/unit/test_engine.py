"""The engine's tick over a fake kernel: what it plans, moves, records, refunds.

Real pieces everywhere except at the kernel boundary: the real Registry,
BlockTable, Temperature, policy and the topology of the one-node host
fixture (dram + swap). The migrator is ``FakeKernel``, a page-exact model of
where each page of a fake process is (node, swap, never touched) that obeys
move_pages / MADV_PAGEOUT / swap-in the way the real one reports them, and
can be told to leave pages behind, pin them, fail a call or hold it half
done. The hotness source is a fake that returns the observations it is
given. Each test exists because a one-line edit to engine.py survives every
other test (the edit is named in the test's docstring).
"""

from __future__ import annotations

import asyncio
import math
import errno
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier import engine as engine_mod
from kvtier import policy as pol
from kvtier.blocks import F_NOT_PRESENT, F_STALE, F_UNMOVABLE, STUCK_LOCKED, STUCK_NONE, STUCK_PINNED, BlockTable
from kvtier.engine import OPERATOR_ATTEMPTS, Engine
from kvtier.errors import RangeNotMapped, os_error
from kvtier.hotness import Temperature
from kvtier.kernel import topology as topo_mod
from kvtier.kernel.migrator import MoveResult, Residency, page_layout
from kvtier.kernel.sources.base import Availability, Observation
from kvtier.registry import Limits, NotFound, Registry
from kvtier.stats import DaemonStats

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "host-1node"
PAGE = 4096
BLOCK = 2 << 20
PPB = BLOCK // PAGE  # pages per block
PID = 4242
BASE = 0x7F0000000000
ABSENT, SWAP = -1, -2  # FakeKernel page locations besides a node number
DRAM, SWAP_TIER = 0, 1  # tier indices of the fixture topology


class FakeKernel:
    """Where each page of one fake process is, and the migrator's answers.

    ``stuck``: page addresses MADV_PAGEOUT skips (NOT_PAGED_OUT), as the
    real migrator reports them: pages of this process alone are evidence
    of a pin or a read at that moment (STUCK_PINNED), ``shared`` ones (a
    forked sharer maps them too) are not;
    ``pinned``: page addresses move_pages answers -EBUSY for;
    ``fail``: op name -> errno raised for the whole call;
    ``hold``: op name -> Event the op waits on after doing its work (so a
    test can look at the engine while the move is half done; "residency"
    holds only the measuring thread's);
    ``read``: pages a reader keeps reading: a pageout of them succeeds, and
    by the next call they are back on node 0 (faulted in by the reader);
    ``unmap(first, n)``: pages no longer mapped (freed by the process):
    move_pages answers -EFAULT for them, and a move or pageout over any of
    them is refused whole (RangeNotMapped), as the real migrator does.
    """

    dry_run = False
    page_size = PAGE

    def __init__(self, npages: int):
        self.loc = np.zeros(npages, dtype=np.int64)  # every page on node 0
        self.mapped = np.ones(npages, dtype=bool)
        self.read = np.zeros(npages, dtype=bool)  # pages a reader keeps reading (see comes_back)
        self.back: np.ndarray | None = None  # paged-out pages its reader faults in before the next call
        self.stuck: set[int] = set()
        self.shared: set[int] = set()
        self.stuck_calls = 1 << 30  # how many more pageouts skip the stuck pages
        self.pinned: set[int] = set()
        self.fail: dict[str, int] = {}
        self.hold: dict[str, threading.Event] = {}
        self.calls: list[tuple[str, list[int]]] = []  # (op, first block index of each block)

    def _pages(self, starts, lengths):
        lay = page_layout(np.asarray(starts, dtype=np.uint64), lengths, PAGE)
        return lay, ((lay.addrs - np.uint64(BASE)) // np.uint64(PAGE)).astype(np.int64)

    def _faults(self) -> None:
        """The reader touched what was paged out under it since the last call."""
        if self.back is not None:
            self.loc[self.back] = 0
            self.back = None

    def _enter(self, op: str, pid: int, starts, lengths=None) -> None:
        assert pid == PID
        self._faults()
        self.calls.append((op, [int(s - BASE) // BLOCK for s in np.asarray(starts, dtype=np.uint64)]))
        if op in self.fail:
            raise os_error(self.fail[op], f"{op} pid={pid}")
        if lengths is not None and not self.mapped[self._pages(starts, lengths)[1]].all():
            raise RangeNotMapped(f"{op}: range not mapped")

    def unmap(self, first_page: int, n: int) -> None:
        self.mapped[first_page : first_page + n] = False
        self.loc[first_page : first_page + n] = ABSENT

    def mapped_blocks(self, pid, starts, lengths):
        lay, idx = self._pages(starts, lengths)
        return lay.per_block(~self.mapped[idx]) == 0

    def _leave(self, op: str) -> None:
        ev = self.hold.get(op)
        if ev is not None:
            assert ev.wait(10), f"{op} held for 10 s"

    def query_nodes(self, pid, addrs):
        self._faults()
        idx = ((np.asarray(addrs, dtype=np.uint64) - np.uint64(BASE)) // np.uint64(PAGE)).astype(np.int64)
        loc = self.loc[idx]
        return np.where(~self.mapped[idx], -errno.EFAULT,
                        np.where(loc >= 0, loc, -errno.ENOENT)).astype(np.int32)

    def residency(self, pid, starts, lengths):
        self._faults()
        lay, idx = self._pages(starts, lengths)
        loc = self.loc[idx]
        node_pages = lay.per_block(loc == 0)[:, None]
        unmapped = ~self.mapped[idx]
        errors = {"EFAULT": int(unmapped.sum())} if unmapped.any() else {}
        res = Residency(node_pages, lay.per_block(loc == SWAP), lay.per_block((loc == ABSENT) & ~unmapped),
                        errors, lay.pages)
        if threading.current_thread().name.startswith("kvtier-measure"):
            self._leave("residency")  # held: the answer is as it was when asked
        return res

    def _move_result(self, op, target, lay, idx, node):
        busy = np.isin(lay.addrs, np.fromiter(self.pinned, dtype=np.uint64, count=len(self.pinned)))
        present = self.loc[idx] >= 0
        untouched = lay.per_block(self.loc[idx] != ABSENT) == 0
        self.loc[idx[present & ~busy]] = node
        bad = present & busy
        errors = {"EBUSY": int(bad.sum())} if bad.any() else {}
        ok = lay.per_block(bad) == 0
        return MoveResult(op, target, len(idx), int((present & ~busy).sum()), errors, ok, ~ok, page_size=PAGE,
                          block_untouched=untouched, block_done=lay.per_block(present & ~busy))

    def move(self, pid, starts, lengths, node):
        self._enter("move", pid, starts, lengths)
        lay, idx = self._pages(starts, lengths)
        res = self._move_result("move", f"node {node}", lay, idx, node)
        self._leave("move")
        return res

    def pagein(self, pid, starts, lengths, node):
        self._enter("pagein", pid, starts, lengths)
        lay, idx = self._pages(starts, lengths)
        swapped = self.loc[idx] == SWAP
        self.loc[idx[swapped]] = node
        res = self._move_result("pagein", f"node {node}", lay, idx, node)
        self._leave("pagein")
        return res

    def pageout(self, pid, starts, lengths):
        self._enter("pageout", pid, starts, lengths)
        lay, idx = self._pages(starts, lengths)
        skip = np.isin(lay.addrs, np.fromiter(self.stuck, dtype=np.uint64, count=len(self.stuck)))
        if self.stuck_calls <= 0:
            skip[:] = False
        self.stuck_calls -= 1
        present = self.loc[idx] >= 0
        untouched = lay.per_block(self.loc[idx] != ABSENT) == 0
        self.loc[idx[present & ~skip]] = SWAP
        self.back = idx[present & ~skip & self.read[idx]]
        left = present & skip
        errors = {"NOT_PAGED_OUT": int(left.sum())} if left.any() else {}
        ok = lay.per_block(left) == 0
        alone = left & ~np.isin(lay.addrs, np.fromiter(self.shared, dtype=np.uint64, count=len(self.shared)))
        res = MoveResult("pageout", "swap", len(idx), int((present & ~skip).sum()), errors, ok,
                         np.zeros(len(ok), dtype=bool), page_size=PAGE, block_untouched=untouched,
                         block_done=lay.per_block(self.loc[idx] == SWAP),
                         block_reason=np.where(lay.per_block(alone) > 0, STUCK_PINNED, STUCK_NONE).astype(np.uint8))
        self._leave("pageout")
        return res

    # test helpers
    def block_pages(self, block: int, first: int = 0, n: int = PPB) -> set[int]:
        return {BASE + (block * PPB + first + i) * PAGE for i in range(n)}

    def where(self, block: int) -> np.ndarray:
        return self.loc[block * PPB : (block + 1) * PPB]


class FakeProcesses:
    """The registry's view of processes: PID is alive and maps [BASE, BASE + n)
    (less what the kernel was told to unmap)."""

    def __init__(self, nbytes: int, kernel: FakeKernel):
        self.nbytes = nbytes
        self.kernel = kernel
        self.ids = (0, 0)  # (ruid, euid) of PID

    def mapped_blocks(self, pid, starts, lengths):
        return self.kernel.mapped_blocks(pid, starts, lengths)

    def start_time(self, pid):
        return 1

    def check_range(self, pid, start, length):
        assert BASE <= start and start + length <= BASE + self.nbytes

    def alive(self, pid, start_time):
        return True

    def uids(self, pid):
        return self.ids


class FakeSource:
    """A hotness source that returns what the test queued (rows as at set_targets)."""

    name = "fake"

    def __init__(self):
        self.queue: list[Observation] = []
        self.targets = 0
        self.calls = 0
        self.hold: threading.Event | None = None

    def set_targets(self, table, rows=None):
        self.targets += 1

    def collect(self, now):
        self.calls += 1
        if self.hold is not None:
            assert self.hold.wait(10)
        return self.queue.pop(0) if self.queue else Observation("fake")

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Rig:
    def __init__(self, blocks: int, cfg: pol.PolicyConfig):
        self.clock = Clock()
        self.table = BlockTable()
        self.stats = DaemonStats()
        temp = Temperature(30.0)
        self.kernel = FakeKernel(blocks * PPB * 3)  # room for more regions after the first
        self.registry = Registry(self.table, Limits(), self.stats, temp, FakeProcesses(3 * blocks * BLOCK, self.kernel),
                                 clock=self.clock)
        topo = topo_mod.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"))
        topo.refresh_free = lambda: None  # the fixture's meminfo never changes
        self.source = FakeSource()
        self.loop = asyncio.new_event_loop()
        self.engine = Engine(self.table, self.registry, topo, self.kernel, temp, cfg, self.stats, self.loop,
                             sources=[self.source], availability={"fake": Availability(True)},
                             clock=self.clock, seed=1)
        self.region = self.registry.add(PID, BASE, blocks * BLOCK, BLOCK, name="kv").id

    def rows(self, region: int | None = None) -> slice:
        s = self.table.slices[self.region if region is None else region]
        return slice(s.start, s.stop)

    def tiers(self, region: int | None = None) -> list[int]:
        return self.table.tier[self.rows(region)].tolist()

    def hint(self, blocks, count=50, region: int | None = None) -> None:
        self.registry.hint(self.region if region is None else region, np.asarray(blocks, dtype=np.uint32),
                           np.full(len(blocks), count, dtype=np.uint32))

    def tick(self, n: int = 1, dt: float = 0.5) -> None:
        """n ticks, each with every job it started finished and applied."""
        async def go():
            for _ in range(n):
                self.clock.now += dt
                self.engine.tick()
                while self.engine.future is not None:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0)

        self.loop.run_until_complete(go())
        assert self.stats.tick_errors_total == 0

    def tick_until(self, done, dt: float = 0.5) -> None:
        """Ticks (without waiting for held jobs) until ``done()``."""
        async def go():
            for _ in range(200):
                if done():
                    return
                self.clock.now += dt
                self.engine.tick()
                await asyncio.sleep(0.005)
            raise AssertionError("condition not reached in 200 ticks")

        self.loop.run_until_complete(go())

    def settle(self) -> None:
        """Every block measured (the rotating sample places them, the full
        measurement follows)."""
        self.tick(3)
        assert (self.table.tier >= 0).all()

    def close(self):
        for ev in self.kernel.hold.values():
            ev.set()
        if self.source.hold is not None:
            self.source.hold.set()
        self.engine.shutdown()
        self.loop.close()


def cfg(**kw) -> pol.PolicyConfig:
    base = dict(capacity={DRAM: 8 * BLOCK}, min_residence_s=0.0)
    base.update(kw)
    return pol.PolicyConfig(**base)


@pytest.fixture
def rig():
    rigs = []

    def make(blocks: int = 8, **kw) -> Rig:
        r = Rig(blocks, cfg(**kw))
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.close()


def test_cold_blocks_go_to_swap_and_are_counted(rig):
    """Baseline: 16 blocks against a DRAM budget of 8 (low watermark 0.85 ->
    6 stay), the hinted ones stay."""
    r = rig(16)
    r.hint([0, 1, 2])
    r.settle()
    r.tick(2)
    assert r.tiers()[:3] == [DRAM] * 3
    assert r.tiers().count(DRAM) == 6 and r.tiers().count(SWAP_TIER) == 10
    assert (r.kernel.loc.reshape(-1, PPB)[:16] == SWAP).all(axis=1).sum() == 10
    assert r.stats.migrations[(DRAM, SWAP_TIER)] == 10
    assert r.stats.migrated_bytes[(DRAM, SWAP_TIER)] == 10 * BLOCK


def test_status_says_since_when_the_newest_plan_is_all_moved(rig):
    """The demo's DRAM bound starts at the newest plan whose moves are done
    (``plan_settled_age_s``). Kills: counting a plan as done when its job is
    handed to the mover (its demotions not made yet), or not counting it
    when the job finishes."""
    r = rig(16)
    r.kernel.hold["pageout"] = threading.Event()
    r.tick_until(lambda: r.kernel.calls and r.kernel.calls[-1][0] == "pageout")
    job = r.engine.mover.job
    assert job.planned_at is not None  # the demotions of a tick's plan, held in the kernel
    r.clock.now += 3.0
    r.engine.tick()  # skipped: the mover is busy
    age = r.engine.status()["plan_settled_age_s"]
    assert age is None or age > r.clock.now - job.planned_at  # an earlier, empty plan at most
    r.kernel.hold["pageout"].set()
    r.tick()
    assert r.engine.status()["plan_settled_age_s"] == pytest.approx(r.clock.now - job.planned_at)
    assert r.tiers().count(DRAM) == 6  # that plan's demotions are made


def test_observations_heat_their_blocks(rig):
    """Kills: `_finish_collect` discarding the observations (no
    temperature.add), or adding them at the wrong rows."""
    r = rig(8)
    r.settle()
    r.source.queue.append(Observation("fake", np.array([2, 5]), np.array([4.0, 1.0], dtype=np.float32), 0.5))
    r.tick()
    temp = r.table.temp[r.rows()]
    assert temp[2] == pytest.approx(2.0) and temp[5] == pytest.approx(0.5)
    assert np.count_nonzero(temp) == 2


def test_observations_follow_their_blocks_when_rows_shift(rig):
    """Kills: using an observation's rows as they are after a region was
    removed mid-collect (they name the rows the source was targeted at)."""
    r = rig(4)
    second = r.registry.add(PID, BASE + 4 * BLOCK, 4 * BLOCK, BLOCK, name="kv2").id
    r.settle()
    r.source.hold = threading.Event()
    first_row_of_second = r.table.slices[second].start
    r.source.queue.append(Observation("fake", np.array([first_row_of_second + 1]),
                                      np.array([8.0], dtype=np.float32), 1.0))
    r.tick_until(lambda: r.engine.collector.busy)
    r.registry.remove(r.region)  # the second region's rows shift down by 4
    r.source.hold.set()
    r.tick()
    temp = r.table.temp[r.rows(second)]
    assert temp.tolist() == pytest.approx([0.0, 8.0, 0.0, 0.0])


def test_operator_moves_are_made_and_counted(rig):
    """Kills: dropping `self.manual` before the move job is built, or not
    queueing in request_move."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})  # the policy itself moves nothing
    r.settle()
    rows = np.arange(r.rows().start + 2, r.rows().start + 5)
    assert r.engine.request_move(rows, SWAP_TIER).blocks == 3
    r.tick()
    assert ("pageout", [2, 3, 4]) in r.kernel.calls
    assert r.tiers() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert (r.kernel.where(3) == SWAP).all()
    assert r.stats.migrations[(DRAM, SWAP_TIER)] == 3
    assert r.engine.status()["manual_moves_pending"] == 0


def _run_until(r: Rig, done) -> None:
    """Run the event loop, no tick, until ``done()``."""
    async def go():
        for _ in range(2000):
            if done():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("condition not reached without a tick")

    r.loop.run_until_complete(go())


def test_operator_moves_go_in_batches_one_job_after_another(rig, monkeypatch):
    """Kills: a job taking every queued operator move at once (a whole 1
    Mi-block region's migrate was one job: 1.4 s of the loop to build it),
    the next batch waiting for the next tick instead of following the job
    that ends, or a ticket reporting before its request has added its last
    part (a large migrate adds them a loop iteration at a time)."""
    monkeypatch.setattr(engine_mod, "MANUAL_JOB_BLOCKS", 3)
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    s = r.rows()
    ticks = r.stats.ticks_total
    ticket = r.engine.open_move(s, SWAP_TIER, wait=True)
    r.engine.add_move(ticket, np.arange(s.start, s.start + 4))
    pageouts = lambda: [blocks for op, blocks in r.kernel.calls if op == "pageout"]  # noqa: E731
    _run_until(r, lambda: len(pageouts()) == 2 and not r.engine.mover.busy)
    assert pageouts() == [[0, 1, 2], [3]]
    assert not ticket.future.done()  # its request may add more
    r.engine.add_move(ticket, np.arange(s.start + 4, s.stop))
    r.engine.close_move(ticket)
    _run_until(r, ticket.future.done)
    assert pageouts() == [[0, 1, 2], [3], [4, 5, 6], [7]]
    rep = ticket.future.result()
    assert (rep["blocks"], rep["moved"], rep["failed"]) == (8, 8, 0)
    assert r.tiers() == [SWAP_TIER] * 8
    assert r.stats.ticks_total == ticks  # all of it between ticks


def test_a_full_remeasurement_runs_in_bounded_jobs_one_after_another(rig, monkeypatch):
    """Kills: one measuring job for every stale block (a `measure` of a 1
    Mi-block region built a 1 Mi-page job: 1.5 s of the loop), or the next
    job waiting for the next tick instead of following the one that ends."""
    monkeypatch.setattr(engine_mod, "URGENT_JOB_PAGES", 2 * PPB)
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.loc[: 8 * PPB] = SWAP  # all of it went out behind the table's back
    scans, full, ticks = r.stats.residency_scans_total, r.stats.residency_full_blocks_total, r.stats.ticks_total
    assert r.engine.request_measure(r.rows()) == 8
    _run_until(r, lambda: r.stats.residency_full_blocks_total - full >= 8 and not r.engine.measurer.busy)
    assert r.stats.residency_scans_total - scans == 4  # 2 blocks of pages a job
    assert r.tiers() == [SWAP_TIER] * 8
    assert r.stats.ticks_total == ticks


def test_explain_on_its_own_thread_says_what_explain_says(rig):
    """Kills: explain_soon explaining another row than the region's block,
    or losing what the engine adds to the policy's account."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    other = r.registry.add(PID, BASE + 8 * BLOCK, 4 * BLOCK, BLOCK, name="other").id
    r.settle()
    fut = r.engine.explain_soon(other, 2)
    _run_until(r, fut.done)
    assert fut.result() == r.engine.explain(r.rows(other).start + 2)
    assert f"region {other} index 2," in fut.result()


def test_a_block_never_written_is_not_moved_nor_failed(rig):
    """Kills: `_finish_move` recording a block the migrator found untouched
    (no page written: nothing moved) in the tier it was sent to, or
    counting it as migrated."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.where(3)[:] = ABSENT  # its pages went (MADV_DONTNEED by the engine, say)
    r.engine.request_move(np.arange(r.rows().start + 2, r.rows().start + 5), SWAP_TIER)
    r.tick()
    assert r.tiers() == [0, 0, 1, -1, 1, 0, 0, 0]
    assert r.table.flags[r.rows().start + 3] & F_NOT_PRESENT
    assert r.stats.migrations[(DRAM, SWAP_TIER)] == 2
    assert not r.stats.migration_failed_pages
    assert r.table.fail_count[r.rows()].sum() == 0
    # never planned while untouched: the next ticks make no call for it
    r.kernel.calls.clear()
    r.tick(3)
    assert all(3 not in blocks for _, blocks in r.kernel.calls)


def test_failed_moves_give_their_tokens_back(rig):
    """Kills: skipping `pol.refund` in `_finish_move` (a failed move would
    spend the bandwidth budget it never used)."""
    r = rig(8, capacity={DRAM: 2 * BLOCK}, demote_mbps=4.0, burst_s=1.0)  # 2 blocks of tokens
    r.kernel.fail["pageout"] = errno.EAGAIN
    r.hint([0])
    for _ in range(5):
        r.tick()
        if r.kernel.calls:
            break
    (op, blocks), = r.kernel.calls
    assert op == "pageout" and len(blocks) == 2  # the whole bucket was planned
    assert r.stats.migration_failed_pages[(DRAM, SWAP_TIER, "EAGAIN")] == 2 * PPB  # pages
    # nothing refilled since the plan (refill happens when planning): all back
    assert r.engine.pstate.demote_tokens == pytest.approx(4 << 20)


def test_a_partial_pageout_is_a_failure_and_the_block_is_remeasured(rig):
    """Kills: `_run_move` taking every block of a pageout as ok (ignoring
    block_ok), and `_finish_move` not marking failed blocks stale. The block
    whose pageout left pages behind is where most of them went (swap), so
    the hot blocks stay in DRAM (the test_metrics 0.667 flake)."""
    r = rig(16, capacity={DRAM: 4 * BLOCK})  # low watermark: 3 blocks stay
    r.kernel.stuck = r.kernel.block_pages(15, n=4)
    r.hint([0, 1, 2])
    r.settle()
    assert r.stats.migration_failed_pages[(DRAM, SWAP_TIER, "NOT_PAGED_OUT")] == 4
    row15 = r.rows().start + 15
    assert r.table.fail_count[row15] == 1 and r.table.retry_at[row15] > r.clock.now
    assert r.stats.migrations[(DRAM, SWAP_TIER)] == 12, r.kernel.calls  # block 15 is not counted as moved
    r.tick(2)
    assert r.tiers()[15] == SWAP_TIER and not r.table.flags[row15] & F_STALE
    assert r.tiers() == [DRAM] * 3 + [SWAP_TIER] * 13


def test_an_older_measurement_does_not_undo_a_failed_moves_remeasure(rig):
    """Kills: not stamping last_move on a block re-measured after a failed
    move: a measurement taken before the move, applied after it, put the
    block back in its old tier."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.hold["residency"] = threading.Event()
    scans = r.stats.residency_scans_total
    r.engine.request_measure()
    r.tick_until(lambda: r.engine.measurer.busy)  # it has seen block 2 in DRAM
    r.kernel.stuck = r.kernel.block_pages(2, n=4)
    r.engine.request_move(np.array([r.rows().start + 2]), SWAP_TIER)
    r.tick_until(lambda: r.kernel.calls and not r.engine.mover.busy)
    assert r.tiers()[2] == SWAP_TIER  # re-measured by the mover: most pages are in swap
    r.kernel.hold["residency"].set()
    r.tick_until(lambda: r.stats.residency_scans_total > scans and not r.engine.measurer.busy)
    assert r.tiers()[2] == SWAP_TIER


def test_pinned_pages_make_a_block_unmovable(rig):
    """Kills: `_run_move` dropping block_unmovable (a pinned block would be
    retried with backoff forever instead of flagged)."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.loc[: 8 * PPB] = SWAP  # all in swap: measure says so
    r.engine.request_measure()
    r.tick()
    assert r.tiers() == [SWAP_TIER] * 8
    r.kernel.pinned = r.kernel.block_pages(1, n=1)
    r.kernel.loc[PPB] = 0  # that page stayed in DRAM (pinned) while the rest went out
    r.hint([0, 1])
    r.tick(2)
    row1 = r.rows().start + 1
    assert r.table.flags[row1] & F_UNMOVABLE
    assert r.tiers()[0] == DRAM
    assert r.stats.migration_failed_pages[(SWAP_TIER, DRAM, "EBUSY")] == 1


def test_pinned_reason_reaches_the_table(rig):
    """Kills: `_run_move` or `_finish_move` dropping the migrator's
    block_reason (every unmovable block would read "pinned"/"failing"
    whatever the kernel said)."""
    r = rig(4, capacity={DRAM: 64 * BLOCK}, unmovable_after=1)
    r.settle()
    r.kernel.stuck = r.kernel.block_pages(2, n=1)
    real = r.kernel.pageout

    def pageout(pid, starts, lengths):
        res = real(pid, starts, lengths)
        res.block_reason = np.where(res.block_ok, 0, STUCK_LOCKED).astype(np.uint8)
        return res

    r.kernel.pageout = pageout
    r.engine.request_move(np.arange(r.rows().start, r.rows().stop), SWAP_TIER)
    r.tick(2)
    row = r.rows().start + 2
    assert r.table.flags[row] & F_UNMOVABLE and r.table.stuck[row] == STUCK_LOCKED
    assert "unmovable: locked" in r.engine.explain(row)


def test_an_allocated_pool_the_kernel_moved_is_reported(rig):
    """Kills: check_placement not run after a full measurement, counting
    blocks kvtier moved itself, or not clearing when they come back. (A
    long-term pin migrates pages out of ZONE_MOVABLE: the pool placed on
    the CXL node lands elsewhere; here the placement says tier 1 and the
    pages are on node 0.)"""
    r = rig(4, capacity={DRAM: 64 * BLOCK})
    rid = r.registry.add(PID, BASE + 4 * BLOCK, 4 * BLOCK, BLOCK, name="pool",
                         placement={"tier": SWAP_TIER, "tier_name": "swap", "node": 0, "reason": "test"}).id
    r.engine.request_measure()
    r.tick()
    reg = r.registry.regions[rid]
    assert r.tiers(rid) == [DRAM] * 4
    assert reg.placement_lost == 4 and r.stats.blocks_placement_lost == 4
    assert reg.to_dict()["placement_lost"] == 4
    assert "placement lost" in r.engine.explain(r.rows(rid).start)
    r.table.last_move[r.rows(rid).start] = r.clock.now  # kvtier moved block 0 itself
    r.engine.check_placement([rid])
    assert reg.placement_lost == 3
    r.kernel.loc[4 * PPB : 8 * PPB] = SWAP  # back where they were placed
    r.engine.request_measure()
    r.tick()
    assert reg.placement_lost == 0 and r.stats.blocks_placement_lost == 0


def test_a_measurement_never_overrides_a_move_in_flight(rig):
    """Kills: `_finish_measure` applying a measurement of blocks whose move
    is still running. The measurement caught the pages already back in
    DRAM and said "tier 0" before the move was recorded: the block looked
    paged in with no migration counted (test_metrics' phase 2 flake)."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.loc[: 8 * PPB] = SWAP
    r.engine.request_measure()
    r.tick()
    assert r.tiers() == [SWAP_TIER] * 8
    r.kernel.hold["pagein"] = threading.Event()
    r.hint([3], count=100)
    r.tick_until(lambda: r.kernel.calls and r.kernel.calls[-1][0] == "pagein")
    assert (r.kernel.where(3) == 0).all()  # the pages are in, the move not yet recorded
    full = r.stats.residency_full_blocks_total
    r.engine.request_measure()
    r.tick_until(lambda: r.stats.residency_full_blocks_total >= full + 8)
    assert r.tiers()[3] == SWAP_TIER  # still what the engine knew before the move
    r.kernel.hold["pagein"].set()
    r.tick()
    assert r.tiers()[3] == DRAM
    assert r.stats.migrations[(SWAP_TIER, DRAM)] == 1


def test_move_results_land_on_their_blocks_when_rows_shift(rig):
    """Kills: `_finish_move` writing results at the rows the job was built
    with (a region removed meanwhile shifts every later row)."""
    r = rig(4, capacity={DRAM: 64 * BLOCK})
    second = r.registry.add(PID, BASE + 4 * BLOCK, 4 * BLOCK, BLOCK, name="kv2").id
    third = r.registry.add(PID, BASE + 8 * BLOCK, 4 * BLOCK, BLOCK, name="kv3").id
    r.settle()
    r.kernel.hold["pageout"] = threading.Event()
    rows = np.arange(r.table.slices[third].start + 1, r.table.slices[third].start + 3)
    r.engine.request_move(rows, SWAP_TIER)
    r.tick_until(lambda: r.engine.mover.busy)
    r.registry.remove(r.region)  # the later regions' rows shift down by 4
    r.kernel.hold["pageout"].set()
    r.tick()
    assert r.tiers(second) == [DRAM] * 4
    assert r.tiers(third) == [DRAM, SWAP_TIER, SWAP_TIER, DRAM]
    assert r.stats.migrations[(DRAM, SWAP_TIER)] == 2


# -- memory that goes away, operator moves followed to their end (issue 13 items 4, 5; 12.10)


def _report(r: Rig, ticket) -> dict:
    """Tick until the ticket's future has the report."""
    r.tick_until(lambda: ticket.future.done())
    return ticket.future.result()


def test_a_region_whose_memory_is_gone_is_dropped_with_its_reason(rig):
    """Kills: the engine ignoring EFAULT in its measurements (the region
    stayed registered at tier -1 forever, counted against the limits), or
    dropping without telling why: the owner's next request names it."""
    r = rig(8)
    other = r.registry.add(PID, BASE + 8 * BLOCK, 4 * BLOCK, BLOCK, name="kept").id
    r.settle()
    r.kernel.unmap(0, 8 * PPB)  # the owner freed its first pool
    r.engine.request_measure()
    r.tick(2)
    assert r.region not in r.registry.regions and other in r.registry.regions
    assert r.stats.regions_dropped_unmapped_total == 1
    with pytest.raises(NotFound, match=r"no longer mapped in pid 4242"):
        r.registry.get(r.region)
    # the kept region's rows moved down with their state: each block's tier is where its pages are
    assert r.tiers(other) == [DRAM if (r.kernel.where(8 + b) == 0).all() else SWAP_TIER for b in range(4)]
    assert -1 not in r.tiers(other)


def test_a_region_gone_in_a_setuid_exec_is_dropped_for_the_uid_change(rig):
    """exec of a setuid program gives the process a new address space that
    is empty until the program is mapped: a mapping check then found
    nobody's region unmapped and gave that as the reason (seen once in CI),
    hiding from the owner and the operator that the process now runs as
    root. Kills: drop_unmapped not looking at the process's uids first."""
    r = rig(8)
    procs = r.registry.processes
    procs.ids = (65534, 65534)
    mine = r.registry.add(PID, BASE + 8 * BLOCK, 4 * BLOCK, BLOCK, name="nobody's", owner_uid=65534).id
    r.settle()
    procs.ids = (65534, 0)  # the setuid exec: ruid kept, euid root
    r.kernel.unmap(8 * PPB, 4 * PPB)  # and nothing of the old image mapped yet
    r.engine.check_mapping([mine])
    with pytest.raises(NotFound, match=r"now runs as uid 65534/0 .*setuid"):
        r.registry.get(mine)
    assert r.stats.regions_dropped_uid_total == 1 and r.stats.regions_dropped_unmapped_total == 0
    assert r.region in r.registry.regions  # root's region of the same process stays


def test_a_partly_unmapped_region_is_moved_where_mapped_and_reported(rig):
    """Kills: `_run_move` handing the whole batch to the migrator (refused
    whole: the mapped blocks did not move either, "queued" and nothing
    else), or not reporting the unmapped blocks to the operator."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.unmap(6 * PPB, 2 * PPB)  # blocks 6 and 7 freed
    ticket = r.engine.request_move(np.arange(r.rows().start, r.rows().stop), SWAP_TIER, wait=True)
    rep = _report(r, ticket)
    assert (rep["moved"], rep["unmapped"], rep["failed"]) == (6, 2, 0)
    assert rep["pages_moved"] == 6 * PPB and rep["failed_pages"] == {"UNMAPPED": 2 * PPB}
    assert r.tiers()[:6] == [SWAP_TIER] * 6
    r.tick(2)
    assert r.tiers()[6:] == [-1, -1]  # not placed, and never planned again
    assert r.registry.regions[r.region].unmapped_blocks == 2 and r.stats.blocks_unmapped == 2


def test_an_operator_pageout_retries_pages_skipped_for_a_passing_reason(rig):
    """Kills: operator moves never retried (a pageout of a cache under
    decode put 42 % in swap and said nothing), and a report that counts
    the skipped pages of the attempt that was retried as failed."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.stuck = r.kernel.block_pages(3, n=8)
    r.kernel.stuck_calls = 1  # read during the first pageout only
    ticket = r.engine.request_move(np.arange(r.rows().start, r.rows().stop), SWAP_TIER, wait=True)
    rep = _report(r, ticket)
    assert (rep["moved"], rep["failed"], rep["attempts"], rep["retried"]) == (8, 0, 2, 1)
    assert rep["failed_pages"] == {} and rep["pages_moved"] == 8 * PPB
    assert (r.kernel.loc[: 8 * PPB] == SWAP).all()
    assert r.stats.migration_failed_pages[(DRAM, SWAP_TIER, "NOT_PAGED_OUT")] == 8  # the kernel's count


def test_an_operator_pageout_its_reader_holds_is_no_return(rig):
    """Kills: `_moved_back` taking an operator's pageout the reader held
    (most of block 2 skipped, this process's pages) as the daemon's own
    return: the operator's move retries and reports its pages; the policy
    is not barred from paging the block out for return_backoff_s."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.stuck = r.kernel.block_pages(2, n=PPB - 8)
    ticket = r.engine.request_move(np.arange(r.rows().start, r.rows().stop), SWAP_TIER, wait=True)
    assert _report(r, ticket)["failed_pages"] == {"NOT_PAGED_OUT": PPB - 8}
    assert r.stats.pageout_returns_total == 0 and r.table.returns[r.rows().start + 2] == 0


def test_operator_retries_are_bounded_and_the_last_attempt_is_reported(rig):
    """Kills: retrying without bound, or reporting every attempt's skipped
    pages (3 x 4) instead of what is still not in swap (4)."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.stuck = r.kernel.block_pages(5, n=4)
    ticket = r.engine.request_move(np.arange(r.rows().start, r.rows().stop), SWAP_TIER, wait=True)
    rep = _report(r, ticket)
    assert (rep["moved"], rep["failed"], rep["attempts"]) == (7, 1, OPERATOR_ATTEMPTS)
    assert rep["failed_pages"] == {"NOT_PAGED_OUT": 4} and rep["pages_moved"] == 8 * PPB - 4
    assert [op for op, _ in r.kernel.calls].count("pageout") == OPERATOR_ATTEMPTS
    assert r.engine.tickets == {} and r.engine.manual == []


def test_fault_prefetch_pages_in_the_swapped_blocks_ahead(rig):
    """Kills: `_finish_collect` ignoring an observation's prefetch rows (the
    blocks after one that took major faults stay in swap until the reader
    faults on each of them), or prefetching blocks that are not in swap."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})  # the policy itself moves nothing
    r.settle()
    rows = r.rows()
    r.engine.request_move(np.arange(rows.start + 2, rows.stop), SWAP_TIER)
    r.tick()
    assert r.tiers() == [DRAM] * 2 + [SWAP_TIER] * 6
    r.tick(12)  # 6 s: paged out longer than return_window_s ago, so a prefetch of them is no return
    r.kernel.calls.clear()
    # a fault in block 2; the source names blocks 3, 4 (in swap) and 1 (in DRAM)
    r.source.queue.append(Observation("fake", np.array([rows.start + 2]), np.array([1.0], dtype=np.float32), 1.0,
                                      np.array([rows.start + 1, rows.start + 3, rows.start + 4])))
    r.tick(2)
    assert any(op == "pagein" and {3, 4} <= set(blocks) for op, blocks in r.kernel.calls), r.kernel.calls
    assert r.tiers()[3:] == [DRAM] * 2 + [SWAP_TIER] * 3  # (block 2 itself is the policy's to decide)
    assert (r.kernel.where(3) == 0).all() and (r.kernel.where(5) == SWAP).all()
    assert r.stats.fault_prefetch_blocks_total == 2
    assert r.stats.pageout_returns_total == 0


def test_sources_replaced_by_a_reload_wait_for_the_collect_in_flight(rig):
    """Kills: `set_sources` swapping (and closing) the sources while the
    collector thread still runs one of them, or keeping the old source's
    pace for a new object of the same name."""
    r = rig(4)
    r.settle()
    old = r.source
    closed = []
    old.close = lambda: closed.append("old")
    old.hold = threading.Event()
    r.tick_until(lambda: r.engine.collector.busy)
    r.engine.pace["fake"].slowdown = 8
    new = FakeSource()
    r.engine.set_sources([new], {"fake": Availability(True)})
    assert closed == [] and r.engine.sources == [old]  # the collect in flight owns the old one
    old.hold.set()
    new.queue.append(Observation("fake", np.array([r.rows().start + 1]), np.array([4.0], dtype=np.float32), 1.0))
    r.tick(3)
    assert closed == ["old"] and r.engine.sources == [new] and new.targets >= 1
    assert r.engine.pace["fake"].slowdown == 1
    assert r.table.temp[r.rows()][1] > 0


def test_reads_a_source_has_not_confirmed_are_collected_again_before_the_next_tick(rig):
    """DAMON credits a block only once two dumps agree, so with one collect
    a tick a hot set moved to a lower tier waited two ticks for its
    promotion. Kills: no follow-up collect; a follow-up asking for another
    (a collect loop); a follow-up for pending blocks already in DRAM."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.loc[: 4 * PPB] = SWAP
    r.engine.request_measure()
    r.tick()
    assert r.tiers() == [SWAP_TIER] * 4 + [DRAM] * 4
    rows = r.rows()

    def settle_loop():
        async def go():
            for _ in range(50):
                await asyncio.sleep(0.002)
                while r.engine.future is not None:
                    await asyncio.sleep(0.001)
        r.loop.run_until_complete(go())

    one = np.array([rows.start + 2])
    # the tick's dump saw block 2 (in swap) read, not credited yet; the next one agrees
    r.source.queue.append(Observation("fake", pending=one))
    r.source.queue.append(Observation("fake", one, np.array([3.0], dtype=np.float32), 1.0, pending=one))
    calls = r.source.calls
    r.tick()
    settle_loop()
    assert r.source.calls == calls + 2  # the follow-up came before any tick, and asked for no other
    assert r.stats.source_follow_ups_total == 1
    assert r.table.temp[rows.start + 2] > 0
    # pending reads of a block in DRAM: nothing waits on them
    r.source.queue.append(Observation("fake", pending=np.array([rows.start + 6])))
    r.tick()
    settle_loop()
    assert r.source.calls == calls + 3 and r.stats.source_follow_ups_total == 1


def test_a_registration_is_handed_to_the_sources_before_the_next_tick(rig):
    """DAMON's first dumps of a new range credit nothing while it splits
    it, so a source targeted only at the next tick gave a new pool's hot set
    a tick more to wait. Kills: no retarget at registration. A burst
    retargets once (_retarget's generation check; the queued flag only
    spares timers)."""
    r = rig(4)
    r.settle()
    before = r.source.targets
    for k in range(3):  # a burst: one retarget for all three
        rid = r.registry.add(PID, BASE + (4 + 2 * k) * BLOCK, 2 * BLOCK, BLOCK, name=f"kv{k}").id
        r.engine.registered(rid)  # the daemon wires registry.on_added to it

    async def wait():
        await asyncio.sleep(3 * engine_mod.RETARGET_COALESCE_S)

    r.loop.run_until_complete(wait())
    assert r.source.targets == before + 1


def test_a_returned_block_of_an_owner_that_hints_loses_its_swap_bar_once_its_reads_end(rig):
    """Kills: the bar kept for the whole backoff after the owner's hints
    of the block stopped (the next hot set waited 30 s for its room); the
    bar lifted for a region nobody hints (its reader is seen only by its
    faults) or for a block still read."""
    r = rig(4)
    other = r.registry.add(PID, BASE + 4 * BLOCK, 4 * BLOCK, BLOCK, name="unhinted").id
    r.settle()
    r.hint([3])  # the owner of the first region hints
    t, now = r.table, r.clock.now
    a, b = r.rows().start, r.table.slices[other].start
    rows = np.array([a, a + 1, b])
    r.engine._returned(rows, np.zeros(rows.size, dtype=np.uint8))  # as a measurement finding them back does
    assert t.returns[rows].tolist() == [1, 1, 1] and (t.retry_at[rows] > now).all()
    t.temp[rows] = 0.0
    t.temp[a + 1] = 5.0  # still read
    r.tick()
    assert t.returns[rows].tolist() == [0, 1, 1]
    assert t.retry_at[a] == -np.inf and (t.retry_at[[a + 1, b]] > r.clock.now).all()


def test_a_follow_up_collect_is_paced_over_the_tick_not_over_its_own_interval(rig):
    """Kills: a follow-up's cost judged over the fraction of a tick since
    the collect before it (every follow-up backed the source off in the
    guest), and a follow-up's cost left out of the share."""
    r = rig(4)
    eng, src = r.engine, r.source
    eng.source_cpu_budget = 0.1
    p = eng.pace["fake"]
    eng._pace(src, (0.0, None), 10.0)
    eng._pace(src, (0.03, None), 10.2, True)  # 0.15 of a core over its own 0.2 s
    assert p.slowdown == 1
    eng._pace(src, (0.01, None), 11.0)
    assert p.slowdown == 1 and p.share == pytest.approx(0.04)  # both collects over the second
    eng._pace(src, (0.05, None), 11.2, True)
    eng._pace(src, (0.08, None), 12.0)
    assert p.share == pytest.approx(0.13) and p.slowdown == 2

# -- thrash: a block paged out under its reader comes straight back (issue 13 item 6)


def test_blocks_that_come_straight_back_are_not_paged_out_again_and_again(rig):
    """A tenant quota of 4 blocks with swap the only tier below DRAM, and a
    reader on all 8 blocks: every pageout succeeds and the reader faults
    the pages straight back. Kills: the engine believing its pageouts
    (it showed 4 blocks in DRAM while the kernel had 8) and paging the same
    hot blocks out again every few ticks (206 times in 20 s on a host).
    With the fix each block that came back is counted and backed off, and
    the table says what the kernel says."""
    r = rig(8, capacity={DRAM: 64 * BLOCK}, tenant_dram_quota={0: 4 * BLOCK})
    r.kernel.read[: 8 * PPB] = True
    r.settle()

    def pageouts():
        return sum(len(b) for op, b in r.kernel.calls if op == "pageout")

    for _ in range(40):  # 20 s of ticks, every block read and hinted all along
        r.hint(range(8))
        r.tick()
    r.kernel._faults()
    in_dram = (r.kernel.loc[: 8 * PPB].reshape(8, PPB) == 0).all(axis=1)
    assert in_dram.all()  # the reader keeps them in
    assert r.tiers() == [DRAM] * 8  # and the daemon knows it
    assert pageouts() <= 8, r.kernel.calls  # each block tried once, not again and again
    assert r.stats.pageout_returns_total == pageouts()
    rows = r.table.retry_at[r.rows()]
    assert (rows > r.clock.now).sum() == pageouts()  # backed off from pageout


def _pageouts(r: Rig) -> list[int]:
    """Pageouts per block, in the order of the kernel's calls."""
    out = [0] * 8
    for op, blocks in r.kernel.calls:
        if op == "pageout":
            for b in blocks:
                out[b] += 1
    return out


def test_a_pageout_its_reader_holds_in_part_is_backed_off_as_a_return(rig):
    """The reader touches a few pages of each block while MADV_PAGEOUT runs
    (the kernel skips them: NOT_PAGED_OUT, this process's pages alone) and
    faults the rest straight back. Kills: `_moved_back` not taking such a
    pageout as a return (it was a failure only, retried after backoff_base_s
    while the reader went on: the host test saw 22 pageouts of 16 blocks in
    10 s); and taking shared pages (the forked sharer's skip, no sign of
    use) as one. Faked: which pages a reader touches during the syscall
    is the kernel's race, never the same twice on a real one."""
    r = rig(8, capacity={DRAM: 64 * BLOCK}, tenant_dram_quota={0: 4 * BLOCK})
    r.kernel.read[: 8 * PPB] = True
    for b in range(8):
        r.kernel.stuck |= r.kernel.block_pages(b, n=3)
    r.kernel.shared = r.kernel.block_pages(7, n=3)  # block 7's skipped pages are shared: a failure only
    r.settle()
    for _ in range(40):  # 20 s of ticks, every block read and hinted all along
        r.hint(range(8))
        r.tick()
    out = _pageouts(r)
    assert sum(out[:7]) == sum(1 for n in out[:7] if n) and sum(out[:7]) > 0, r.kernel.calls  # once each
    rows = r.rows()
    held = [b for b in range(7) if out[b]]
    assert r.stats.pageout_returns_total == len(held)
    assert (r.table.retry_at[rows][held] > r.clock.now).all()  # return_backoff_s (30 s) after 20 s, not 1 s
    # still a failure (a pin must end unmovable in time): barred from every move, not from swap only
    assert (r.table.fail_count[rows][held] == 1).all() and (r.table.returns[rows][held] == 0).all()
    assert r.stats.migration_failed_pages[(DRAM, SWAP_TIER, "NOT_PAGED_OUT")] == 3 * sum(out)
    if out[7]:  # the shared skip is no return: retried with the failure backoff
        assert out[7] > 1


def test_a_pinned_block_whose_pageouts_look_held_still_ends_unmovable(rig):
    """A long-term pin looks like a reader to one pageout (this process's
    pages left behind); an operator pins the region to swap, so the policy
    wants it there on every tick. Kills: `_finish_move` marking a held
    pageout as a return (``returns`` set): the policy then took the block
    for one barred from swap only, out of backoff, and re-probed it on
    every tick, unmovable or not (tests/host/test_unmovable_host.py: 14
    pageouts for 3)."""
    r = rig(8, capacity={DRAM: 64 * BLOCK}, unmovable_after=3, return_backoff_s=1.0, unmovable_reprobe_s=600.0)
    r.kernel.stuck = r.kernel.block_pages(0, n=PPB - 4)  # pinned: most of block 0 stays
    r.settle()
    r.registry.pin(r.region, None, SWAP_TIER)
    for _ in range(40):  # 20 s: 3 tries 1 s and 2 s apart, then unmovable
        r.tick()
    assert _pageouts(r) == [3] + [1] * 7, r.kernel.calls
    row = r.rows().start
    assert r.table.flags[row] & F_UNMOVABLE and r.table.stuck[row] == STUCK_PINNED
    assert r.tiers() == [DRAM] + [SWAP_TIER] * 7


def test_a_block_prefetched_back_right_after_its_pageout_is_a_return(rig):
    """The fault prefetch pages in blocks the quota just paged out (their
    reader faulted on the block before them): the daemon brought them back
    itself, so no measurement ever sees them return. Kills: `_moved_back`
    not taking such a pagein as a return: the quota paged the same blocks
    out again after every prefetch (one block 6 times in 1 s on the host)."""
    r = rig(8, capacity={DRAM: 64 * BLOCK}, tenant_dram_quota={0: 4 * BLOCK})
    r.settle()
    rows = r.rows()
    for _ in range(20):  # 10 s of ticks; each one the reader faults, its source names the swapped blocks
        swapped = np.flatnonzero(r.table.tier[rows] == SWAP_TIER) + rows.start
        if swapped.size:
            r.source.queue.append(Observation("fake", swapped[:1], np.array([1.0], dtype=np.float32), 1.0,
                                              swapped))
        r.hint(range(8))
        r.tick()
    out = _pageouts(r)
    assert r.stats.fault_prefetch_blocks_total > 0
    assert max(out) == 1, (out, r.kernel.calls)  # once each, not after every prefetch
    assert r.stats.pageout_returns_total == sum(out)
    back = [b for b in range(8) if out[b]]
    assert (r.table.returns[rows][back] == 1).all() and (r.table.retry_at[rows][back] > r.clock.now).all()


def test_a_prefetch_into_a_full_dram_moves_only_its_room_and_leaves_the_rest_to_the_plan(rig):
    """Kills: a prefetch that queues (and pays promote tokens for) blocks
    beyond DRAM's room below the promote limit, which move_pages would
    refuse with ENOMEM while the plan's promotions go without tokens; or a
    deferred block the next plan does not bring to DRAM."""
    r = rig(16)
    r.settle()
    r.tick(2)  # 16 blocks against a DRAM budget of 8: the cold ones went to swap
    swapped = [b for b, t in enumerate(r.tiers()) if t == SWAP_TIER][:4]
    assert len(swapped) == 4
    rows = np.asarray(swapped, dtype=np.int64) + r.rows().start
    room = r.engine._dram_room()
    assert room < 4 * BLOCK  # DRAM cannot take all four without a demotion first
    tokens = r.engine.pstate.promote_tokens
    r.kernel.calls.clear()
    ans = r.engine.schedule(rows, "prefetch")
    assert ans["queued"] * BLOCK <= max(room, 0.0) < (ans["queued"] + 1) * BLOCK
    assert ans["queued"] + ans["deferred"] == 4 and ans["already"] == ans["skipped"] == 0
    r.loop.run_until_complete(asyncio.sleep(0.05))  # the loop's next turn: the mover takes what was queued
    while r.engine.mover.busy:
        r.loop.run_until_complete(asyncio.sleep(0.005))
    paged_in = sum(len(b) for op, b in r.kernel.calls if op == "pagein")
    assert paged_in == ans["queued"]
    # tokens only for what moved (the bucket may have refilled a little in between)
    assert tokens - r.engine.pstate.promote_tokens <= ans["queued"] * BLOCK + 1
    # The request reads them (its hints): the next plan promotes them, demoting
    # colder residents for room. (The prefetch's mark alone decays below
    # promote_temp by the first tick: it keeps them from being demoted only.)
    r.hint(swapped)
    r.tick(3)
    assert all(r.tiers()[b] == DRAM for b in swapped), r.tiers()


def test_unanswered_engine_promotions_hold_their_room_in_dram(rig):
    """An engine-mode region's moves wait for its owner's answer; until then
    the table still counts the blocks in their source tier. CI on a loaded
    host saw the daemon send a second batch of promotions into DRAM room
    the first had taken, and the engine, its DRAM pool full, refused them
    (test_allocate_engine: failed engine moves). Kills: tier_states (the
    plan's and the hinted promotion's view of DRAM) not counting the bytes
    of sent, unanswered moves at their destination."""
    r = rig(1, capacity={DRAM: 4 * BLOCK}, high_wm=1.0, low_wm=0.5)
    tiers = np.full(16, SWAP_TIER, dtype=np.int8)
    eng = r.registry.add(PID, BASE + BLOCK, 16 * BLOCK, BLOCK, name="pools", engine_tiers=tiers).id
    sent = []
    r.engine.engine_moves.attach(eng, object(), lambda kind, msg: sent.append(msg))
    rows = np.arange(r.table.slices[eng].start, r.table.slices[eng].stop)
    for _ in range(6):  # every block hot, in the engine's slow pool; no owner answers
        r.hint(np.arange(16), count=50, region=eng)
        r.tick()
    up = [m for m in sent if m["dst"] == DRAM]
    asked = sum(len(m["blocks"]) // 4 for m in up)
    kernel_dram = int((r.table.tier[r.rows()] == DRAM).sum())
    assert up, "no promotion was sent to the owner"
    assert asked + kernel_dram <= 4, (asked, kernel_dram, [len(m["blocks"]) // 4 for m in up])
    assert (r.table.tier[rows] == SWAP_TIER).all()  # nothing counted moved before the owner answers


def test_a_first_look_measures_every_block_in_steps_of_the_measuring_thread(rig, monkeypatch):
    """The sampled windows are made, asked and counted by the measuring
    thread WINDOW_CHUNK blocks at a time (the loop builds none). Kills: a
    step that measures only its first chunk, a window taken from the wrong
    rows of the job, or pages counted against the wrong tier (one node
    here: DRAM, and swap, which no window can tell)."""
    monkeypatch.setattr(engine_mod, "WINDOW_CHUNK", 3)
    r = rig(8)
    kinds = [DRAM, SWAP_TIER, DRAM, DRAM, SWAP_TIER, SWAP_TIER, DRAM, SWAP_TIER]
    for b, k in enumerate(kinds):
        r.kernel.loc[(8 + b) * PPB:(9 + b) * PPB] = SWAP if k == SWAP_TIER else 0
    rid = r.registry.add(PID, BASE + 8 * BLOCK, 8 * BLOCK, BLOCK, name="second").id
    scans = r.stats.residency_scans_total
    r.engine.registered(rid)

    async def first_look():
        for _ in range(200):
            await asyncio.sleep(0.002)
            if r.stats.residency_scans_total > scans and r.engine.future is None:
                return

    r.loop.run_until_complete(first_look())
    assert r.stats.residency_full_blocks_total == 0  # windows, not whole blocks
    # a window tells a node's pages; swapped ones are unknown until measured whole
    assert r.tiers(rid) == [DRAM if k == DRAM else -1 for k in kinds]


def test_a_block_whose_measurement_a_move_overlapped_is_measured_again(rig):
    """An operator's full measurement is running when a move of one of its
    blocks ends: its result for that block is older than the move and
    dropped, and the block keeps the stale mark the request gave it, so
    the next tick measures it again. Kills: `_finish_measure` clearing the
    stale mark of blocks whose result it dropped (the block would read
    what the move left until the rotating sample came round: minutes at
    1 Mi blocks), or applying the older result over the move's."""
    r = rig(8, capacity={DRAM: 64 * BLOCK})
    r.settle()
    r.kernel.loc[3 * PPB : 4 * PPB] = SWAP
    r.engine.request_measure()
    r.tick()
    assert r.tiers()[3] == SWAP_TIER
    r.kernel.hold["residency"] = threading.Event()
    scans = r.stats.residency_scans_total
    r.engine.request_measure()
    r.tick_until(lambda: r.engine.measurer.busy)  # it has seen block 3 in swap
    r.engine.request_move(np.array([r.rows().start + 3]), DRAM)
    r.tick_until(lambda: r.kernel.calls and not r.engine.mover.busy and r.tiers()[3] == DRAM)
    r.kernel.loc[3 * PPB : 4 * PPB] = SWAP  # reclaimed again meanwhile
    r.kernel.hold["residency"].set()
    r.tick_until(lambda: r.stats.residency_scans_total > scans and not r.engine.measurer.busy)
    assert r.tiers()[3] == DRAM  # the dropped result did not undo the move
    r.tick(2)
    assert r.tiers()[3] == SWAP_TIER  # measured again: where the kernel has it


def test_a_backed_off_source_starts_runs_as_old_as_its_looks(rig):
    """A source the CPU budget backed off to one collect in k ticks credits
    each collect with what it saw then; a block its collect sees for the
    first time starts a run k ticks old (hotness.Temperature.add, span), so
    it ranks by the rate those looks give. Kills: the span left out (a run
    one tick old: DAMON's neighbours of a hot set, seen once, ranked k times
    above the hot set)."""
    r = rig(4)
    r.settle()
    eng = r.engine
    p = eng.pace["fake"]
    p.slowdown, p.skip = 4, 0
    row = r.rows().start + 1
    r.source.queue.append(Observation("fake", np.array([row]), np.array([2.0], dtype=np.float32), 1.0))
    calls = r.source.calls
    r.tick()
    assert r.source.calls == calls + 1
    h = eng.temperature
    assert r.table.fresh[row] == pytest.approx(math.exp(-4 * h.interval / h.tau_s), rel=1e-4)
