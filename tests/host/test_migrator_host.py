"""The migrator against the real kernel of this host (one NUMA node, swap file)."""

from __future__ import annotations

import errno
import multiprocessing
import os

import numpy as np
import pytest

from kvchild import KVChild
from kvtier.kernel import native, shmem
from kvtier.errors import InvalidArgument, PermissionDenied, ProcessGone, RangeNotMapped
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.procfs import PM_PRESENT, PM_SWAP, Pagemap

pytestmark = pytest.mark.root

MiB = 1 << 20
BLOCK = 2 * MiB


def blocks(child: KVChild, first: int = 0, count: int | None = None):
    n = child.size // BLOCK
    count = n - first if count is None else count
    starts = child.addr + np.arange(first, first + count, dtype=np.uint64) * np.uint64(BLOCK)
    return starts, np.full(count, BLOCK, dtype=np.uint64)


def pagemap_counts(pid: int, addr: int, size: int) -> tuple[int, int]:
    with Pagemap(pid) as pm:
        e = pm.read(addr, size // native.PAGE_SIZE, native.PAGE_SIZE)
    return int(((e & PM_PRESENT) != 0).sum()), int(((e & PM_SWAP) != 0).sum())


def test_pageout_half_and_back_keeps_bytes(swapfile):
    with KVChild(256 * MiB) as child:
        before = child.checksum()
        mig = Migrator()
        starts, lengths = blocks(child)
        res = mig.residency(child.pid, starts, lengths)
        assert res.node_pages[:, 0].sum() == 256 * MiB // native.PAGE_SIZE
        assert res.swapped.sum() == 0

        half_s, half_l = blocks(child, 0, 64)
        out = mig.pageout(child.pid, half_s, half_l)
        assert out.done == 128 * MiB // native.PAGE_SIZE, out.to_dict()
        assert out.block_ok.all()

        res = mig.residency(child.pid, starts, lengths)
        present, swapped = pagemap_counts(child.pid, child.addr, child.size)
        # Residency agrees with pagemap, page for page in total and per half.
        assert int(res.swapped.sum()) == swapped == 128 * MiB // native.PAGE_SIZE
        assert int(res.resident.sum()) == present
        assert (res.swapped[:64] == BLOCK // native.PAGE_SIZE).all()
        assert (res.swapped[64:] == 0).all()
        assert (res.dominant_node()[:64] == -1).all()

        back = mig.pagein(child.pid, half_s, half_l, 0)
        assert back.done == 128 * MiB // native.PAGE_SIZE, back.to_dict()
        assert back.block_ok.all()
        res = mig.residency(child.pid, starts, lengths)
        assert res.swapped.sum() == 0
        assert (res.dominant_node() == 0).all()
        assert child.checksum() == before


@pytest.fixture(params=["cachestat", "smaps"])
def shmem_count(request, monkeypatch):
    """Both ways kernel/shmem.py counts swapped shared memory: cachestat
    (6.5+), and our own smaps where cachestat is missing or filtered."""
    monkeypatch.setattr(shmem, "_cachestat_missing", request.param == "smaps")
    return request.param


@pytest.mark.parametrize("kind", ["--shared", "--memfd", "--shm-file"])
def test_shared_memory_goes_to_swap_and_really_comes_back(swapfile, kind, shmem_count):
    """MAP_SHARED anonymous (mmap.mmap(-1, n), the README's pool), memfd and
    a /dev/shm file: swapped shmem has no swap PTE. Before kernel/shmem.py its blocks read
    "never touched" once paged out, pageout counted 0 pages done and pagein
    read no page back yet reported success (Rss 0 / Swap 32 MiB after it)."""
    pages = 32 * MiB // native.PAGE_SIZE
    with KVChild(32 * MiB, kind) as child:
        before = child.checksum()
        mig = Migrator()
        starts, lengths = blocks(child)
        assert child.smaps_kib() == {"Rss": 32 * 1024, "Swap": 0}

        half_s, half_l = blocks(child, 0, 8)
        out = mig.pageout(child.pid, half_s, half_l)
        assert out.block_ok.all() and out.errors == {}, out.to_dict()
        assert out.done == pages // 2, out.to_dict()
        assert child.smaps_kib() == {"Rss": 16 * 1024, "Swap": 16 * 1024}
        res = mig.residency(child.pid, starts, lengths)
        per_block = BLOCK // native.PAGE_SIZE
        assert (res.swapped[:8] == per_block).all() and (res.swapped[8:] == 0).all(), res.to_dict()
        assert res.absent.sum() == 0 and res.cached.sum() == 0 and res.errors == {}
        assert (res.dominant_node()[:8] == -1).all() and (res.dominant_node()[8:] == 0).all()

        back = mig.pagein(child.pid, half_s, half_l, 0)
        assert back.block_ok.all() and back.errors == {}, back.to_dict()
        assert back.done == pages // 2
        # The kernel's view, not ours: every page mapped again, none in swap.
        assert child.smaps_kib() == {"Rss": 32 * 1024, "Swap": 0}
        res = mig.residency(child.pid, starts, lengths)
        assert res.swapped.sum() == 0 and (res.dominant_node() == 0).all()
        assert child.checksum() == before


def test_pagein_reports_pages_that_did_not_come_back(swapfile):
    """A pagein is checked against pagemap afterwards: pages still out are
    NOT_PAGED_IN and their blocks not ok (here: swapped out again between
    the touch and the check, by a pageout racing on another thread)."""
    with KVChild(8 * MiB, "--shared") as child:
        mig = Migrator()
        starts, lengths = blocks(child)
        assert mig.pageout(child.pid, starts, lengths).done == 8 * MiB // native.PAGE_SIZE
        real = mig._move_all

        def move_then_page_out_again(pid, addrs, node):
            status = real(pid, addrs, node)
            pidfd = native.pidfd_open(pid)
            try:
                native.process_madvise(pidfd, mig._iov(mig._layout(starts[:1], lengths[:1])), native.MADV_PAGEOUT)
            finally:
                os.close(pidfd)
            return status

        mig._move_all = move_then_page_out_again
        back = mig.pagein(child.pid, starts, lengths, 0)
        assert back.errors.get("NOT_PAGED_IN", 0) > 0, back.to_dict()
        assert not back.block_ok[0] and back.block_ok[1:].all()


def test_never_written_memory_is_untouched_not_a_failure(swapfile):
    """Memory only read is mapped to the shared zero page: move_pages says
    EFAULT. Before, such pages were residency errors (blocks tier -1 but
    not "never touched"), failed moves (EFAULT) and failed pageouts
    (NOT_PAGED_OUT), retried every tick."""
    half = 4 * MiB
    pages = half // native.PAGE_SIZE
    with KVChild(2 * half, "--sparse") as child:
        assert child.ask(f"write 0 {half} 7") == "ok"
        assert child.ask(f"touch {half} {half}").startswith("ok")  # read faults: zero page
        mig = Migrator()
        starts, lengths = blocks(child)
        with Pagemap(child.pid) as pm:
            e = pm.read(child.addr + half, pages, native.PAGE_SIZE)
        assert ((e & PM_PRESENT) != 0).all()  # mapped (to the zero page), not absent
        res = mig.residency(child.pid, starts, lengths)
        assert res.errors == {}, res.to_dict()
        assert (res.node_pages[:2, 0] == BLOCK // native.PAGE_SIZE).all() and res.absent[:2].sum() == 0
        assert (res.absent[2:] == BLOCK // native.PAGE_SIZE).all() and res.node_pages[2:].sum() == 0
        assert (res.dominant_node()[2:] == -1).all()

        mv = mig.move(child.pid, starts, lengths, 0)
        assert mv.errors == {} and mv.block_ok.all(), mv.to_dict()
        assert mv.done == pages
        out = mig.pageout(child.pid, starts, lengths)
        assert out.errors == {} and out.block_ok.all(), out.to_dict()
        assert out.done == pages
        back = mig.pagein(child.pid, starts, lengths, 0)
        assert back.errors == {} and back.block_ok.all(), back.to_dict()
        assert child.ask(f"touch 0 {half}") == f"ok {7 * pages}"


def test_move_to_local_node_reports_every_page():
    with KVChild(16 * MiB) as child:
        mig = Migrator()
        starts, lengths = blocks(child)
        r = mig.move(child.pid, starts, lengths, 0)
        assert r.done == r.pages == 16 * MiB // native.PAGE_SIZE
        assert r.block_ok.all() and not r.block_unmovable.any()
        assert r.errors == {}


def test_untouched_pages_are_absent_not_swapped():
    mig = Migrator()
    with KVChild(4 * MiB) as filled:
        assert mig.residency(filled.pid, *blocks(filled)).absent.sum() == 0
    with KVChild(4 * MiB, "--sparse") as sparse:
        res = mig.residency(sparse.pid, *blocks(sparse))
        assert res.absent.sum() == 4 * MiB // native.PAGE_SIZE
        assert res.swapped.sum() == 0
        assert (res.dominant_node() == -1).all()


def test_unknown_node_is_a_clear_error_and_nothing_moves():
    with KVChild(4 * MiB) as child:
        mig = Migrator()
        with pytest.raises(InvalidArgument, match="unknown NUMA node 7"):
            mig.move(child.pid, *blocks(child), 7)
        res = mig.residency(child.pid, *blocks(child))
        assert (res.dominant_node() == 0).all()


def test_exited_pid_is_process_gone():
    child = KVChild(2 * MiB)
    starts, lengths = blocks(child)
    pid = child.pid
    child.close()
    mig = Migrator()
    for call in (
        lambda: mig.residency(pid, starts, lengths),
        lambda: mig.move(pid, starts, lengths, 0),
        lambda: mig.pageout(pid, starts, lengths),
    ):
        with pytest.raises(ProcessGone):
            call()


def test_unmapped_range_is_refused_before_acting(swapfile):
    with KVChild(4 * MiB) as child:
        mig = Migrator()
        bad = np.array([4096], dtype=np.uint64)
        with pytest.raises(RangeNotMapped):
            mig.move(child.pid, bad, BLOCK, 0)
        # A range running past the end of the pool is refused whole.
        with pytest.raises(RangeNotMapped):
            mig.pageout(child.pid, np.array([child.addr], dtype=np.uint64), child.size + BLOCK)
        _, swapped = pagemap_counts(child.pid, child.addr, child.size)
        assert swapped == 0


def _as_nobody(pid, starts, lengths, q):
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    try:
        Migrator().residency(pid, starts, lengths)
        q.put("allowed")
    except PermissionDenied as e:
        q.put(f"denied {e.errno}")
    except Exception as e:  # report anything else to the test
        q.put(f"other {type(e).__name__}: {e}")


def test_other_users_process_without_privilege_is_denied():
    with KVChild(2 * MiB) as child:
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_as_nobody, args=(child.pid, *blocks(child), q))
        p.start()
        p.join(30)
        answer = q.get(timeout=5)
        assert answer.startswith("denied"), answer
        # The child is untouched and still serving.
        assert child.ask("touch 0 4096").startswith("ok")


def test_dry_run_records_and_does_not_act(swapfile):
    with KVChild(4 * MiB) as child:
        mig = Migrator(dry_run=True)
        starts, lengths = blocks(child)
        mig.pageout(child.pid, starts, lengths)
        mig.move(child.pid, starts, lengths, 0)
        mig.pagein(child.pid, starts, lengths, 0)
        assert [r["op"] for r in mig.record] == ["pageout", "move_pages", "pagein"]
        assert all(r["pages"] == 4 * MiB // native.PAGE_SIZE for r in mig.record)
        _, swapped = pagemap_counts(child.pid, child.addr, child.size)
        assert swapped == 0


def test_a_page_faulted_in_while_measured_is_not_read_as_never_touched(swapfile):
    """A measurement reads each page's node (move_pages), then pagemap. A
    page its owner faults back in from swap between the two reads is "no
    page" in the first and present in the second. Fails without the
    re-query: such blocks were measured never touched (2,430 of 16,384 in
    a host test whose owner read its pool back while the daemon measured).
    The owner's read is made to land exactly between the two reads."""
    with KVChild(8 * MiB) as child:
        starts, lengths = blocks(child)
        mig = Migrator()
        assert mig.pageout(child.pid, starts, lengths).block_ok.all()
        assert pagemap_counts(child.pid, child.addr, child.size)[1] == child.size // native.PAGE_SIZE

        class Between(Migrator):
            def _status(self, pid, addrs, out=None):
                status = super()._status(pid, addrs, out)
                assert (status == -errno.ENOENT).all()  # all in swap when asked
                assert child.ask(f"touch 0 {child.size}").startswith("ok ")  # the owner reads it back now
                return status

        res = Between().residency(child.pid, starts, lengths)
        assert pagemap_counts(child.pid, child.addr, child.size) == (child.size // native.PAGE_SIZE, 0)
        assert (res.node_pages[:, 0] == BLOCK // native.PAGE_SIZE).all(), res.node_pages[:, 0]
        assert res.absent.sum() == 0 and res.swapped.sum() == 0
