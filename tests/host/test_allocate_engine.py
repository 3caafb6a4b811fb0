"""Engine-executed moves against the real kvtierd.

A test engine keeps its KV blocks in two pools it owns (a small DRAM pool and
a file on disk, the engine's own slow tier, as LMCache's disk backend is):
memory the kernel could not move if it were pinned. It registers them as one
mode-"engine" region; the daemon runs its policy over that region and sends
move requests over the engine's connection; the engine copies the blocks
and answers. The hot blocks end in the DRAM pool, every block's bytes are
intact, and moves still unanswered when the connection goes are dropped.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import waiting
from test_daemon import DaemonProc, workdir  # noqa: F401  (fixture)

from kvtier import protocol

pytestmark = pytest.mark.root

BLOCK = 64 << 10
NBLOCKS = 32
DRAM_SLOTS = 8
HOT = np.arange(20, 26)
wait_for = functools.partial(waiting.wait_for, timeout=30.0, interval=0.02)


class TwoPoolEngine:
    """Blocks live in a DRAM pool (few slots) or a disk pool (one per block)."""

    def __init__(self, path: str, dram_tier: int, slow_tier: int):
        self.dram = np.zeros((DRAM_SLOTS, BLOCK), dtype=np.uint8)
        self.disk = np.memmap(path, dtype=np.uint8, mode="w+", shape=(NBLOCKS, BLOCK))
        self.dram_tier, self.slow_tier = dram_tier, slow_tier
        self.where = np.full(NBLOCKS, slow_tier, dtype=np.int8)  # tier of each block
        self.slot = np.arange(NBLOCKS)  # slot in its pool
        self.free = list(range(DRAM_SLOTS))
        for b in range(NBLOCKS):
            self.disk[b] = self.pattern(b)
        for b in range(DRAM_SLOTS):  # the first blocks start in DRAM
            self._to_dram(b)
        self.calls: list[tuple[int, int, int]] = []
        self.wrong: list = []

    @staticmethod
    def pattern(b: int) -> np.ndarray:
        return np.random.default_rng(b).integers(0, 256, BLOCK, dtype=np.uint8)

    def read(self, b: int) -> np.ndarray:
        return self.dram[self.slot[b]] if self.where[b] == self.dram_tier else self.disk[self.slot[b]]

    def _to_dram(self, b: int) -> bool:
        if not self.free:
            return False
        s = self.free.pop()
        self.dram[s] = self.disk[self.slot[b]]
        self.where[b], self.slot[b] = self.dram_tier, s
        return True

    def _to_disk(self, b: int) -> bool:
        self.disk[b] = self.dram[self.slot[b]]
        self.free.append(int(self.slot[b]))
        self.where[b], self.slot[b] = self.slow_tier, b
        return True

    def on_move(self, blocks: np.ndarray, src: int, dst: int) -> np.ndarray:
        self.calls.append((int(blocks.size), src, dst))
        if not (self.where[blocks] == src).all():  # raised here it would only count as a failed move
            self.wrong.append((blocks.tolist(), src, dst))
            return np.zeros(blocks.size, dtype=bool)
        go = self._to_dram if dst == self.dram_tier else self._to_disk
        return np.array([go(int(b)) for b in blocks], dtype=bool)


def daemon_for_engines(workdir: str) -> DaemonProc:
    # tier 0 holds 8 blocks as far as the policy is concerned: above the
    # high watermark its coldest go down, hot ones may displace cold ones.
    return DaemonProc(workdir, extra_config=f"""
        [policy]
        capacity = {{0 = {DRAM_SLOTS * BLOCK}}}
        min_residence_s = 0.0
        """).start()


def test_hot_blocks_end_in_the_engines_dram_pool_with_data_intact(swapfile, workdir):
    d = daemon_for_engines(workdir)
    try:
        with d.client() as c:
            tiers = c.request("tiers")["tiers"]
            slow = next(t["index"] for t in tiers if t["kind"] == "swap")  # the engine's disk pool
            eng = TwoPoolEngine(os.path.join(workdir, "slow.pool"), 0, slow)
            where0 = eng.where.copy()
            region = c.register_engine(NBLOCKS, BLOCK, eng.where, eng.on_move, name="two-pools", tenant="t")
            # The daemon starts from what the engine says. A tick may already
            # have sent a move that the client serves while the query's answer
            # is on its way (eng.where changes first): blocks the engine moved
            # may show either tier, every other block the registered one.
            q = region.query()
            unmoved = eng.where == where0
            assert (q[unmoved] == where0[unmoved]).all(), (q, where0, eng.calls)

            def settled():
                region.hint(HOT, counts=np.full(HOT.size, 4))
                c.flush()
                c.poll()
                return (eng.where[HOT] == 0).all() and (region.query() == eng.where).all()

            wait_for(settled, "hot blocks in the DRAM pool, daemon and engine agreeing")
            assert eng.calls and any(dst == 0 for _, _, dst in eng.calls)
            assert not eng.wrong, f"moves from a tier the block was not in: {eng.wrong}"
            assert (eng.where == 0).sum() <= DRAM_SLOTS
            for b in range(NBLOCKS):
                assert np.array_equal(eng.read(b), eng.pattern(b)), f"block {b} corrupted by the moves"
            st = c.stats()
            promoted = st["migrations"].get(f"{slow}:0", 0)
            assert promoted >= HOT.size and st["engine_moves_sent_total"] >= promoted
            assert st["engine_move_seconds_hist"]["count"] >= 1
            # The daemon never measured or migrated pages for it: the engine
            # region's blocks have no F_NOT_PRESENT / F_STALE and no kernel failures.
            assert not any(k.endswith(":engine") for k in st["migration_failed_pages"])
            # A wrong answer is refused, and nothing is recorded for it.
            with pytest.raises(Exception) as e:
                c.call(protocol.MoveDone(move=10 ** 9, ok=b"\1"))
            assert "no pending move" in str(e.value)
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()


def test_pending_moves_are_dropped_when_the_engine_disconnects(swapfile, workdir):
    d = daemon_for_engines(workdir)
    try:
        with d.client() as observer:
            slow = next(t["index"] for t in observer.request("tiers")["tiers"] if t["kind"] == "swap")
            engine = d.client()
            calls = []
            # Twice the DRAM the policy allows, all in DRAM: it must demote.
            region = engine.register_engine(2 * DRAM_SLOTS, BLOCK, [0] * (2 * DRAM_SLOTS),
                                            lambda b, s, t: calls.append(b) or True)

            def pending():
                n = observer.status()["engine"]["engine_moves_pending"]
                return n if n else None

            sent = wait_for(pending, "demotions sent to the engine")  # the engine never polls
            engine.close_socket()  # the engine's connection goes; the process stays
            wait_for(lambda: observer.status()["engine"]["engine_moves_pending"] == 0, "pending moves dropped")
            st = observer.stats()
            # Every move sent was dropped, none answered: a tick may have sent
            # more between the read above and the close, so compare totals.
            assert st["engine_moves_dropped_total"] == st["engine_moves_sent_total"] >= sent
            assert st["migrations"].get(f"0:{slow}", 0) == 0  # nothing recorded without an answer
            blocks = observer.request("blocks", region=region.id)
            assert np.frombuffer(blocks["tiers"], dtype="i1").tolist() == [0] * (2 * DRAM_SLOTS)
            assert observer.status()["engine"]["engine_regions_attached"] == 0
            assert not calls
            # Reconnecting re-attaches the region (with its tiers) and the
            # moves are asked for again and served.
            assert engine.request("status")  # reconnects
            wait_for(lambda: engine.poll() or (region.query() == slow).sum() >= DRAM_SLOTS // 2,
                     "demotions served after the reconnect")
            assert calls
            engine.close()
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()


def test_a_hint_after_a_daemon_restart_reattaches_the_engine_region(swapfile, workdir):
    """The engine's first call after kvtierd restarted is a hint: the hint
    path reconnects without waiting (hello, then the engine regions'
    ``attach``, then the hints, no answer awaited). The re-adopted region
    must be attached to that connection, or the daemon has nobody to send
    its moves to and the engine region is never tiered again."""
    d = daemon_for_engines(workdir)
    try:
        engine = d.client(reconnect_timeout=30)
        calls = []
        region = engine.register_engine(2 * DRAM_SLOTS, BLOCK, [0] * (2 * DRAM_SLOTS),
                                        lambda b, s, t: calls.append(b) or True)
        engine.close_socket()  # no moves served before the restart
        assert d.stop() == 0
        d.start()
        with d.client() as observer:
            slow = next(t["index"] for t in observer.request("tiers")["tiers"] if t["kind"] == "swap")
            assert [r["id"] for r in observer.regions()] == [region.id]  # re-adopted
            assert observer.status()["engine"]["engine_regions_attached"] == 0
            region.hint([0])  # the engine's first call: the no-wait reconnect
            wait_for(lambda: observer.status()["engine"]["engine_regions_attached"] == 1,
                     "the region attached by the hint path's reconnect")
            # and the daemon's moves reach the engine over that connection
            wait_for(lambda: engine.poll() or len(calls) > 0, "a move served after the restart")
            wait_for(lambda: engine.poll() or (region.query() == slow).sum() >= DRAM_SLOTS // 2,
                     "demotions served after the restart")
        assert engine.flush() == []
        engine.close()
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()
