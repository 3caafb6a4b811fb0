"""Page access bits, for kernels without DAMON vaddr.

Each collect, per registered pid: read /proc/PID/pagemap for the pid's
ranges (PFNs need CAP_SYS_ADMIN), look up whether each present page was
accessed since the previous collect, reset, and report per block the
fraction of its pages that were accessed. Two kernel mechanisms, chosen by
experiment at probe time:

``page_idle``  /sys/kernel/mm/page_idle/bitmap (CONFIG_IDLE_PAGE_TRACKING):
    one bit per PFN; writing 1 marks a page idle (and clears its page-table
    accessed bits through rmap), reading walks rmap again, so a bit still set
    means "not accessed since marked". Precise, and touches only our pages.
``kpageflags`` /proc/kpageflags bit KPF_REFERENCED after /proc/PID/clear_refs
    ("1" clears the accessed bits and PG_referenced of the whole process).
    PG_referenced is a software flag: it is set by mark_page_accessed (file
    I/O) or when reclaim harvests a page's accessed bits, not by a plain
    load of a mapped anonymous page. So whether it works depends on the
    kernel and on memory pressure, hence the self-test.

The probe maps a few pages of its own, touches half after a reset, and
accepts a mechanism only if it sees exactly that half. What it found on the
development machines (docs/benchmarks.md, "Hotness sources"): neither the
6.18 host nor Debian's 6.12 kernel has page_idle (IDLE_PAGE_TRACKING off),
and KPF_REFERENCED stays clear for touched anonymous pages, so the source is
unavailable there and DAMON (guest) or perf faults (host) stand in. On the
guest kernel scripts/vm/build-kernel.sh builds (the same 6.12 source with
idle page tracking) page_idle passes, and kvtierd with this source alone
finds and promotes a decoder's hot set (tests/vm/test_accessbits_vm.py).
Like every accessed-bit sampler on x86 it sees a page read again only once
its translation left the TLB (a context switch, an eviction): a decoder
spinning alone on a core over a few MiB could read as idle.

Per-PFN files are read in runs: PFNs are sorted and coalesced into runs of
nearby frames (gaps up to ``MAX_GAP`` words are read through rather than
split), one pread per run.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from kvtier.blocks import BlockTable
from kvtier.errors import KvtierError, KvtierOSError, os_error
from kvtier.hotness import SOURCE_WEIGHTS
from kvtier.kernel.native import PAGE_SIZE
from kvtier.kernel.procfs import PM_PFN_MASK, PM_PRESENT, Pagemap, clear_refs
from kvtier.kernel.sources.base import Availability, BlockIndex, Observation, Source

PAGE_IDLE_BITMAP = "kernel/mm/page_idle/bitmap"  # below the sys root
KPAGEFLAGS = "kpageflags"  # below the proc root
KPF_REFERENCED = 2  # include/uapi/linux/kernel-page-flags.h
KPF_ANON = 12

MODE_PAGE_IDLE = "page_idle"
MODE_KPAGEFLAGS = "kpageflags"
MODES = (MODE_PAGE_IDLE, MODE_KPAGEFLAGS)

# A word read but not needed costs the kernel one page-flag lookup; a new
# pread costs a syscall plus Python overhead. scripts/bench/sources_overhead.py
# (by_gap; docs/benchmarks.md) on the 6.18 host, 256 MiB pool: gap 0 31-35 ms,
# 4 26-29, 16 17-26, 64 30-34, 256 33-40; one pread per page 65-70 ms. Gaps
# up to this many words are read through.
MAX_GAP = 16

SELFTEST_PAGES = 64
# madvise(2) advice (5.14+): fault pages in writable without touching them.
MADV_POPULATE_WRITE = 23


def runs(keys: np.ndarray, max_gap: int = MAX_GAP) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique keys -> (first key, key count) of runs whose inner gaps
    are at most ``max_gap``."""
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    k = keys.astype(np.int64)
    brk = np.flatnonzero(np.diff(k) > max_gap + 1) + 1
    firsts = np.concatenate(([0], brk))
    lasts = np.concatenate((brk - 1, [k.size - 1]))
    return k[firsts], k[lasts] - k[firsts] + 1


class PfnFile:
    """A file of one u64 per index (kpageflags: per PFN; page_idle bitmap:
    per 64 PFNs), read and written in coalesced runs."""

    def __init__(self, path: str, writable: bool = False, max_gap: int = MAX_GAP):
        self.path = path
        self.max_gap = max_gap
        try:
            self.fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError as e:
            raise os_error(e.errno, f"open {path}") from None
        self.syscalls = 0  # preads/pwrites done (for the benchmark)

    def read(self, idx: np.ndarray) -> np.ndarray:
        """Words at the given indices (any order, duplicates allowed).

        The per-run Python work is only the pread: the runs land in one
        buffer and every index is gathered from it in one numpy step.
        """
        uniq, inv = np.unique(np.asarray(idx, dtype=np.int64), return_inverse=True)
        if uniq.size == 0:
            return np.zeros(0, dtype=np.uint64)
        starts, counts = runs(uniq, self.max_gap)
        pread = self._pread
        words = np.frombuffer(b"".join([pread(c * 8, s * 8) for s, c in zip(starts.tolist(), counts.tolist())]),
                              dtype=np.uint64)
        run_of = np.searchsorted(starts, uniq, side="right") - 1
        base = np.concatenate(([0], np.cumsum(counts)[:-1]))
        return words[base[run_of] + uniq - starts[run_of]][inv]

    def write(self, idx: np.ndarray, words: np.ndarray) -> None:
        """Write ``words`` at sorted unique ``idx``; gaps inside a run are
        written as 0 (for page_idle a 0 bit changes nothing)."""
        idx = np.asarray(idx, dtype=np.int64)
        starts, counts = runs(idx, self.max_gap)
        for s, c in zip(starts.tolist(), counts.tolist()):
            buf = np.zeros(c, dtype=np.uint64)
            lo, hi = np.searchsorted(idx, [s, s + c])
            buf[idx[lo:hi] - s] = words[lo:hi]
            self._pwrite(buf.tobytes(), s * 8)

    def _pread(self, n: int, off: int) -> bytes:
        self.syscalls += 1
        try:
            buf = os.pread(self.fd, n, off)
        except OSError as e:
            raise os_error(e.errno, f"read {self.path} at {off}") from None
        if len(buf) != n:
            raise os_error(errno.EIO, f"read {self.path} at {off}", f"short read {len(buf)}/{n}")
        return buf

    def _pwrite(self, data: bytes, off: int) -> None:
        self.syscalls += 1
        try:
            os.pwrite(self.fd, data, off)
        except OSError as e:
            raise os_error(e.errno, f"write {self.path} at {off}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AccessBits:
    """The two mechanisms behind one interface: ``reset(pid, pfns)`` then,
    later, ``accessed(pfns)`` (bool per PFN)."""

    def __init__(self, mode: str, sys_root: str = "/sys", proc_root: str = "/proc"):
        if mode not in MODES:
            raise ValueError(f"access bits mode {mode!r} not in {MODES}")
        self.mode = mode
        self.proc_root = proc_root
        if mode == MODE_PAGE_IDLE:
            self.file = PfnFile(os.path.join(sys_root, PAGE_IDLE_BITMAP), writable=True)
        else:
            self.file = PfnFile(os.path.join(proc_root, KPAGEFLAGS))

    def reset(self, pid: int, pfns: np.ndarray) -> None:
        if self.mode == MODE_KPAGEFLAGS:
            clear_refs(pid, self.proc_root, "1")
            return
        pfns = np.unique(np.asarray(pfns, dtype=np.int64))
        if pfns.size == 0:
            return
        word = pfns >> 6
        bits = np.left_shift(np.uint64(1), (pfns & 63).astype(np.uint64))
        first = np.flatnonzero(np.concatenate(([True], word[1:] != word[:-1])))
        self.file.write(word[first], np.bitwise_or.reduceat(bits, first))

    def accessed(self, pfns: np.ndarray) -> np.ndarray:
        pfns = np.asarray(pfns, dtype=np.int64)
        if self.mode == MODE_KPAGEFLAGS:
            flags = self.file.read(pfns)
            return (flags >> np.uint64(KPF_REFERENCED)) & np.uint64(1) == 1
        words = self.file.read(pfns >> 6)
        idle = (words >> (pfns & 63).astype(np.uint64)) & np.uint64(1)
        return idle == 0

    def close(self) -> None:
        self.file.close()


def own_pfns(addr: int, npages: int, proc_root: str) -> np.ndarray:
    with Pagemap(os.getpid(), proc_root) as pm:
        e = pm.read(addr, npages, PAGE_SIZE)
    if not ((e & PM_PRESENT) != 0).all():
        raise KvtierOSError(errno.EFAULT, "self-test pagemap", "pages not present")
    pfn = (e & PM_PFN_MASK).astype(np.int64)
    if not pfn.any():
        raise KvtierOSError(errno.EPERM, "self-test pagemap", "PFNs read as 0: needs CAP_SYS_ADMIN")
    return pfn


def self_test(bits: AccessBits, proc_root: str, npages: int = SELFTEST_PAGES) -> tuple[int, int]:
    """Touch the first half of ``npages`` fresh pages after a reset; returns
    (touched pages seen accessed, untouched pages seen accessed).

    The pages are faulted in by MADV_POPULATE_WRITE, never touched before
    the reset: x86 does not flush the TLB when the accessed bit is cleared,
    and a load through a translation still cached sets no bit. Touched first
    by this thread, they read as idle after the reset although just read
    (seen in the guest on the idle kernel: 12/32 touched pages seen)."""
    buf = mmap.mmap(-1, npages * PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)
        try:
            buf.madvise(MADV_POPULATE_WRITE)
        except OSError:
            arr[::PAGE_SIZE] = 1  # before 5.14: fault every page in by a write
        addr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        pfn = own_pfns(addr, npages, proc_root)
        bits.reset(os.getpid(), pfn)
        half = npages // 2
        int(arr[: half * PAGE_SIZE : PAGE_SIZE].sum())  # read one byte per page
        seen = bits.accessed(own_pfns(addr, npages, proc_root))
        del arr
        return int(seen[:half].sum()), int(seen[half:].sum())
    finally:
        try:
            buf.close()
        except BufferError:
            pass  # a numpy view survived; the mapping goes with the object


class AccessBitSource(Source):
    name = "access_bits"

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", *, mode: str = "auto",
                 weight: float = SOURCE_WEIGHTS["access_bits"]):
        if mode != "auto" and mode not in MODES:
            raise ValueError(f"hotness.access_bits.mode: {mode!r} not in auto, {', '.join(MODES)}")
        self.sys_root = sys_root
        self.proc_root = proc_root
        self.want_mode = mode
        self.weight = weight
        self.bits: AccessBits | None = None
        self.index: BlockIndex | None = None
        self.armed: set[int] = set()  # pids whose pages were reset at least once

    # -- probe ----------------------------------------------------------------

    def probe(self) -> Availability:
        findings = []
        modes = MODES if self.want_mode == "auto" else (self.want_mode,)
        for mode in modes:
            why = self._try_mode(mode)
            if why is None:
                return Availability(True, f"access bits via {self._describe(mode)}")
            findings.append(why)
        return Availability(False, "; ".join(findings))

    def _describe(self, mode: str) -> str:
        if mode == MODE_PAGE_IDLE:
            return os.path.join(self.sys_root, PAGE_IDLE_BITMAP)
        return f"{os.path.join(self.proc_root, KPAGEFLAGS)} REFERENCED + clear_refs"

    def _try_mode(self, mode: str) -> str | None:
        where = self._describe(mode)
        path = where.split()[0]
        if not os.path.exists(path):
            extra = " (CONFIG_IDLE_PAGE_TRACKING)" if mode == MODE_PAGE_IDLE else ""
            return f"{path} absent{extra}"
        try:
            bits = AccessBits(mode, self.sys_root, self.proc_root)
        except KvtierOSError as e:
            return f"{where}: {e}"
        try:
            hit, false_hit = self_test(bits, self.proc_root)
        except KvtierError as e:
            bits.close()
            return f"{where}: self-test failed: {e}"
        half = SELFTEST_PAGES // 2
        if hit == half and false_hit == 0:
            self.bits = bits
            return None
        bits.close()
        return (
            f"{where} does not follow page-table accessed bits on this kernel "
            f"(self-test: {hit}/{half} touched and {false_hit}/{half} untouched pages seen accessed)"
        )

    # -- targets and collect --------------------------------------------------------

    def set_targets(self, table: BlockTable) -> None:
        self.index = BlockIndex(table)
        self.armed &= set(self.index.pids)

    def _pages(self, pid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(page addresses, present mask, PFNs) over the pid's merged ranges."""
        ranges = self.index.ranges(pid, PAGE_SIZE)
        addrs, entries = [], []
        with Pagemap(pid, self.proc_root) as pm:
            for s, e in ranges.tolist():
                n = (e - s) // PAGE_SIZE
                addrs.append(np.arange(s, e, PAGE_SIZE, dtype=np.uint64))
                entries.append(pm.read(s, n, PAGE_SIZE))
        if not addrs:
            z = np.zeros(0, dtype=np.uint64)
            return z, z.astype(bool), z.astype(np.int64)
        ent = np.concatenate(entries)
        present = (ent & PM_PRESENT) != 0
        return np.concatenate(addrs), present, (ent & PM_PFN_MASK).astype(np.int64)

    def collect(self, now: float) -> Observation:
        if self.bits is None or self.index is None:
            return self.empty()
        rows_l, counts_l = [], []
        for pid in self.index.pids:
            try:
                addrs, present, pfn = self._pages(pid)
                live = pfn[present]
                if pid in self.armed:
                    acc = np.zeros(addrs.size, dtype=np.int64)
                    acc[present] = self.bits.accessed(live)
                    rows, frac = self._per_block(pid, addrs, acc)
                    rows_l.append(rows)
                    counts_l.append(frac)
                self.bits.reset(pid, live)
                self.armed.add(pid)
            except KvtierOSError as e:
                if e.errno in (errno.ESRCH, errno.ENOENT):
                    self.armed.discard(pid)
                    continue  # exited; dropped at the next set_targets
                raise
        if not rows_l:
            return self.empty()
        return self.observation(np.concatenate(rows_l), np.concatenate(counts_l))

    def _per_block(self, pid: int, page_addr: np.ndarray, accessed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fraction of each block's pages accessed (pages straddling two
        blocks count for both)."""
        rows, bs, be = self.index.blocks(pid)
        cs = np.concatenate(([0], np.cumsum(accessed)))
        page = np.uint64(PAGE_SIZE)
        first = np.searchsorted(page_addr, (bs // page) * page, side="left")
        last = np.searchsorted(page_addr, be, side="left")
        n = np.maximum(last - first, 1)
        return rows, (cs[last] - cs[first]) / n

    def close(self) -> None:
        if self.bits is not None:
            self.bits.close()
            self.bits = None
