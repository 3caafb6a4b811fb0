"""A large move is cut into parts moved by several threads at once
(Migrator._move_all): every page in exactly one call, the calls side by side,
small moves in one call. move_pages itself is replaced at the native edge;
the range check runs for real against this process's own mapping."""

import mmap
import os
import threading

import numpy as np
import pytest

from kvtier.kernel import migrator as migrator_mod
from kvtier.kernel import native
from kvtier.kernel.migrator import MIN_PART_PAGES, Migrator

P = native.PAGE_SIZE


class FakeMovePages:
    """move_pages that puts every page on the node asked and records each
    call's pages and thread; with ``meet`` threads, each moving call waits
    at a barrier until that many are inside at once (a move whose parts run
    one after another breaks the barrier)."""

    def __init__(self, meet: int = 0):
        self.calls: list[tuple[int, np.ndarray]] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(meet, timeout=30) if meet > 1 else None

    def __call__(self, pid, addrs, nodes, flags=native.MPOL_MF_MOVE, status=None):
        if status is None:
            status = np.empty(len(addrs), dtype=np.int32)
        if nodes is not None:
            with self.lock:
                self.calls.append((threading.get_ident(), np.array(addrs)))
            if self.barrier is not None:
                self.barrier.wait()
        status[:] = 0 if nodes is None else nodes
        return status


@pytest.fixture
def pool():
    """A mapping of this process, every page written (so none is untouched)."""
    n = 4 * MIN_PART_PAGES
    buf = mmap.mmap(-1, n * P)
    buf.write(b"x" * (n * P))
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    yield addr, n
    buf.close()


def test_large_move_runs_its_parts_at_once_each_page_once(pool, monkeypatch):
    addr, n = pool
    fake = FakeMovePages(meet=2)
    monkeypatch.setattr(migrator_mod.native, "move_pages", fake)
    mig = Migrator(max_node=0, move_threads=2)
    res = mig.move(os.getpid(), np.array([addr], dtype=np.uint64), n * P, 0)
    assert res.done == n and res.block_ok.all()
    assert len(fake.calls) == 2 and len({tid for tid, _ in fake.calls}) == 2
    moved = np.sort(np.concatenate([a for _, a in fake.calls]))
    assert moved.tolist() == [addr + i * P for i in range(n)]  # every page, once


def test_parts_respect_batch_pages_and_thread_count():
    mig = Migrator(max_node=0, move_threads=3, batch_pages=2 * MIN_PART_PAGES)
    parts = mig._parts(12 * MIN_PART_PAGES)
    assert parts[0][0] == 0 and parts[-1][1] == 12 * MIN_PART_PAGES
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no overlap
    assert all(hi - lo <= 2 * MIN_PART_PAGES for lo, hi in parts)
    assert len(parts) == 6  # 3 parts of 4 x MIN_PART_PAGES, each in 2 calls


def test_small_move_is_one_call(pool, monkeypatch):
    addr, _ = pool
    fake = FakeMovePages()
    monkeypatch.setattr(migrator_mod.native, "move_pages", fake)
    mig = Migrator(max_node=0, move_threads=4)
    n = 2 * MIN_PART_PAGES - 1  # not enough for two parts of MIN_PART_PAGES
    res = mig.move(os.getpid(), np.array([addr], dtype=np.uint64), n * P, 0)
    assert res.done == n and len(fake.calls) == 1


def test_one_thread_when_configured(pool, monkeypatch):
    addr, n = pool
    fake = FakeMovePages()
    monkeypatch.setattr(migrator_mod.native, "move_pages", fake)
    mig = Migrator(max_node=0, move_threads=1)
    res = mig.move(os.getpid(), np.array([addr], dtype=np.uint64), n * P, 0)
    assert res.done == n and len(fake.calls) == 1
