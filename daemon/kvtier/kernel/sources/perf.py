"""perf sampling: major faults (swapped blocks being touched) and load addresses.

Two sources share one ring-buffer reader:

- ``MajorFaultSource`` samples every major page fault of the registered
  processes (PERF_TYPE_SOFTWARE / PERF_COUNT_SW_PAGE_FAULTS_MAJ,
  sample_period 1, PERF_SAMPLE_TID|TIME|ADDR). For an anonymous KV pool a
  major fault is a swapped-out block being read again: the block is reported
  hot, and the next ``prefetch_blocks`` blocks of its region that are in
  swap are paged in ahead of the reader (an engine walking a sequence's
  blocks reads them in order; docs/benchmarks.md, "Prefetch on major
  faults").
  Works without a hardware PMU. Swap readahead hides some faults: pages the
  kernel read ahead come back through minor faults, which are not sampled.
- ``LoadSampleSource`` samples retired loads with their data address where
  the CPU has a precise PMU: Intel PEBS (MEM_INST_RETIRED.ALL_LOADS, raw
  event 0x81d0, precise_ip 2) or AMD IBS op (the ``ibs_op`` PMU type). This
  path is written against the documented interfaces but has not run on
  hardware yet (the development hosts have no PMU); its probe says so.

perf events opened for a pid follow one thread only, so each source opens
one event per thread of each registered process (refreshed from
/proc/PID/task every collect) with its own ring buffer: sharing one buffer
through PERF_EVENT_IOC_SET_OUTPUT is refused between per-thread events of
different tasks.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from kvtier.kernel import native
from kvtier.blocks import BlockTable
from kvtier.errors import KvtierOSError, PermissionDenied
from kvtier.hotness import SOURCE_WEIGHTS
from kvtier.kernel.sources.base import Availability, BlockIndex, Observation, Source

log = logging.getLogger("kvtier.kernel.sources.perf")

PERF_PARANOID = "sys/kernel/perf_event_paranoid"  # below the proc root
EVENT_SOURCE_DEVICES = "bus/event_source/devices"  # below the sys root
PMU_INTEL_AMD_CORE = ("cpu", "cpu_core")  # core PMU (cpu_core on hybrid Intel)
PMU_IBS_OP = "ibs_op"
PMU_TYPE = "type"

# ioctls from <linux/perf_event.h>: _IO('$', 0) and _IO('$', 1)
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_DISABLE = 0x2401

# struct perf_event_mmap_page offsets (stable ABI since 4.1)
MMAP_DATA_HEAD = 1024
MMAP_DATA_TAIL = 1032
MMAP_DATA_OFFSET = 1040
MMAP_DATA_SIZE = 1048

PERF_RECORD_LOST = 2
PERF_RECORD_SAMPLE = 9

SAMPLE_TYPE = native.PERF_SAMPLE_TID | native.PERF_SAMPLE_TIME | native.PERF_SAMPLE_ADDR
# A PERF_RECORD_SAMPLE with exactly TID|TIME|ADDR: header, then the fields in
# the kernel's fixed order (IP would come first, then TID, TIME, ADDR).
SAMPLE_DTYPE = np.dtype(
    [("type", "<u4"), ("misc", "<u2"), ("size", "<u2"), ("pid", "<u4"), ("tid", "<u4"), ("time", "<u8"), ("addr", "<u8")]
)
_HEADER = struct.Struct("<IHH")
_U64 = struct.Struct("<Q")

# Intel: MEM_INST_RETIRED.ALL_LOADS (event 0xd0, umask 0x81), PEBS-capable
# with the data linear address since Skylake.
INTEL_ALL_LOADS = 0x81D0


def parse_records(buf: bytes) -> tuple[np.ndarray, int]:
    """Samples (SAMPLE_DTYPE array) and the count of lost samples in ``buf``.

    The usual buffer holds only 32-byte samples: one frombuffer view. Any
    other record (LOST, THROTTLE...) makes it walk the headers.
    """
    n = len(buf)
    if n == 0:
        return np.zeros(0, dtype=SAMPLE_DTYPE), 0
    if n % SAMPLE_DTYPE.itemsize == 0:
        recs = np.frombuffer(buf, dtype=SAMPLE_DTYPE)
        if np.all(recs["type"] == PERF_RECORD_SAMPLE) and np.all(recs["size"] == SAMPLE_DTYPE.itemsize):
            return recs, 0
    offs = []
    lost = 0
    pos = 0
    while pos + _HEADER.size <= n:
        typ, _misc, size = _HEADER.unpack_from(buf, pos)
        if size < _HEADER.size or pos + size > n:
            break  # torn record: cannot happen below data_head; stop safely
        if typ == PERF_RECORD_SAMPLE and size == SAMPLE_DTYPE.itemsize:
            offs.append(pos)
        elif typ == PERF_RECORD_LOST:
            lost += _U64.unpack_from(buf, pos + _HEADER.size + 8)[0]  # after u64 id
        pos += size
    if not offs:
        return np.zeros(0, dtype=SAMPLE_DTYPE), lost
    mv = np.frombuffer(buf, dtype=np.uint8)
    idx = np.asarray(offs)[:, None] + np.arange(SAMPLE_DTYPE.itemsize)[None, :]
    return mv[idx].copy().view(SAMPLE_DTYPE).reshape(-1), lost


class PerfRing:
    """One perf event fd and its mmap'ed ring: 1 metadata page + 2^n data pages."""

    def __init__(self, fd: int, data_pages: int):
        if data_pages <= 0 or data_pages & (data_pages - 1):
            raise ValueError("data_pages must be a power of two")
        self.fd = fd
        page = native.PAGE_SIZE
        try:
            self.mm = mmap.mmap(fd, (1 + data_pages) * page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise KvtierOSError(e.errno, "mmap perf ring") from None
        off, size = struct.unpack_from("<QQ", self.mm, MMAP_DATA_OFFSET)
        # data_offset/data_size are 0 on kernels before 4.1: data follows page 0.
        self.data_offset = off or page
        self.data_size = size or data_pages * page

    def enable(self) -> None:
        fcntl.ioctl(self.fd, PERF_EVENT_IOC_ENABLE, 0)

    def read(self) -> tuple[np.ndarray, int]:
        """Consume everything the kernel wrote since the last read."""
        head = _U64.unpack_from(self.mm, MMAP_DATA_HEAD)[0]
        tail = _U64.unpack_from(self.mm, MMAP_DATA_TAIL)[0]
        # The kernel publishes data_head after writing the records (smp_wmb);
        # on x86 loads are not reordered with older loads, and the Python
        # steps between this load and the copy below are a compiler barrier.
        avail = head - tail
        if avail == 0:
            return np.zeros(0, dtype=SAMPLE_DTYPE), 0
        size = self.data_size
        avail = min(avail, size)
        start = tail % size
        base = self.data_offset
        first = min(avail, size - start)
        buf = self.mm[base + start : base + start + first]
        if first < avail:  # wrapped around the end of the ring
            buf += self.mm[base : base + avail - first]
        # Only now may the kernel reuse the space (smp_mb before the tail store).
        _U64.pack_into(self.mm, MMAP_DATA_TAIL, head)
        return parse_records(buf)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


@dataclass(frozen=True)
class PerfEvent:
    """What to open: perf_event_attr fields the wrapper takes."""

    type: int
    config: int
    sample_period: int
    precise_ip: int = 0


def _task_ids(proc_root: str, pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(os.path.join(proc_root, str(pid), "task")) if t.isdigit())
    except FileNotFoundError:
        return []


def _read_paranoid(proc_root: str) -> str:
    try:
        with open(os.path.join(proc_root, PERF_PARANOID)) as f:
            return f.read().strip()
    except OSError:
        return "?"


class _PerfSampler(Source):
    """Per-thread sampling of one event kind into per-block counts."""

    event: PerfEvent

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", *, ring_pages: int = 4,
                 weight: float = SOURCE_WEIGHTS["perf"]):
        self.sys_root = sys_root
        self.proc_root = proc_root
        self.ring_pages = ring_pages
        self.weight = weight
        self.index: BlockIndex | None = None
        self.rings: dict[tuple[int, int], PerfRing] = {}  # (pid, tid) -> ring
        self.exclude_kernel = False
        self.samples = 0  # totals, for metrics
        self.lost = 0
        self.unmatched = 0  # samples outside every block

    # -- opening ------------------------------------------------------------

    def _open(self, tid: int, event: PerfEvent) -> int:
        try:
            return native.perf_open(event.type, event.config, event.sample_period, SAMPLE_TYPE, tid,
                                    precise_ip=event.precise_ip, exclude_kernel=self.exclude_kernel)
        except PermissionDenied:
            if self.exclude_kernel:
                raise
            # Unprivileged (perf_event_paranoid >= 2): user-space faults only,
            # which is where an engine's reads of its KV pool fault anyway.
            self.exclude_kernel = True
            return native.perf_open(event.type, event.config, event.sample_period, SAMPLE_TYPE, tid,
                                    precise_ip=event.precise_ip, exclude_kernel=True)

    def _try_self(self, event: PerfEvent) -> Availability | None:
        """Open the event on this process once; None if that works."""
        if not native.HAS_PERF_EVENT_OPEN:
            return Availability(False, "perf_event_open not in this build's syscall table")
        try:
            fd = self._open(0, event)
        except KvtierOSError as e:
            why = f"perf_event_open: {e}"
            if isinstance(e, PermissionDenied):
                why += f" (perf_event_paranoid={_read_paranoid(self.proc_root)}; needs root or CAP_PERFMON)"
            return Availability(False, why)
        os.close(fd)
        return None

    def event_for(self) -> PerfEvent:
        return self.event

    # -- targets ------------------------------------------------------------

    def set_targets(self, table: BlockTable) -> None:
        self.index = BlockIndex(table)
        self._sync_threads(drain=False)

    def _sync_threads(self, drain: bool = True) -> list[tuple[int, np.ndarray]]:
        """Open events for new threads of registered pids, close those of
        threads gone (after reading what they left). Returns drained samples."""
        want: set[tuple[int, int]] = set()
        pids = self.index.pids if self.index is not None else []
        for pid in pids:
            want.update((pid, tid) for tid in _task_ids(self.proc_root, pid))
        out = []
        for key in sorted(set(self.rings) - want):
            ring = self.rings.pop(key)
            if drain:
                out.append((key[0], self._read(ring)))
            ring.close()
        event = self.event_for()
        for key in sorted(want - set(self.rings)):
            try:
                fd = self._open(key[1], event)
                ring = PerfRing(fd, self.ring_pages)
                ring.enable()
            except (KvtierOSError, OSError) as e:
                if getattr(e, "errno", None) != errno.ESRCH:  # thread exited meanwhile: normal
                    log.warning("perf: cannot sample thread %d of pid %d: %s", key[1], key[0], e)
                continue
            self.rings[key] = ring
        return out

    def _read(self, ring: PerfRing) -> np.ndarray:
        recs, lost = ring.read()
        self.lost += lost
        self.samples += len(recs)
        return recs["addr"]

    # -- collect --------------------------------------------------------------

    def fault_rows(self) -> np.ndarray:
        """Rows of every sample since the last call (duplicates kept)."""
        if self.index is None:
            return np.zeros(0, dtype=np.int64)
        per_pid: dict[int, list[np.ndarray]] = {}
        for pid, addrs in self._sync_threads():
            per_pid.setdefault(pid, []).append(addrs)
        for (pid, _tid), ring in self.rings.items():
            per_pid.setdefault(pid, []).append(self._read(ring))
        rows = []
        for pid, parts in per_pid.items():
            addrs = np.concatenate(parts)
            if addrs.size:
                r = self.index.lookup(pid, addrs)
                self.unmatched += int((r < 0).sum())
                rows.append(r[r >= 0])
        return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)

    def collect(self, now: float) -> Observation:
        rows = self.fault_rows()
        if rows.size == 0:
            return self.empty()
        uniq, counts = np.unique(rows, return_counts=True)
        return self.observation(uniq, counts.astype(np.float32), self.prefetch_for(uniq))

    def prefetch_for(self, rows: np.ndarray) -> np.ndarray | None:
        return None

    def events(self) -> dict[str, int]:
        return {"samples": self.samples, "lost": self.lost, "unmatched": self.unmatched}

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()


class MajorFaultSource(_PerfSampler):
    name = "perf_fault"
    event = PerfEvent(native.PERF_TYPE_SOFTWARE, native.PERF_COUNT_SW_PAGE_FAULTS_MAJ, 1)

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", *, prefetch_blocks: int = 4, **kw):
        super().__init__(sys_root, proc_root, **kw)
        self.prefetch_blocks = prefetch_blocks

    def probe(self) -> Availability:
        bad = self._try_self(self.event)
        return bad or Availability(True, "software major-fault samples with addresses")

    def prefetch_for(self, rows: np.ndarray) -> np.ndarray | None:
        if self.index is None or self.prefetch_blocks <= 0:
            return None
        return self.index.neighbours(rows, self.prefetch_blocks)


class LoadSampleSource(_PerfSampler):
    """Precise load-address sampling (PEBS/IBS). Unverified on hardware."""

    name = "perf"

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", *, sample_period: int = 10007, **kw):
        super().__init__(sys_root, proc_root, **kw)
        self.sample_period = sample_period
        self.event: PerfEvent | None = None  # type: ignore[assignment]

    def pmu_event(self) -> tuple[PerfEvent | None, str]:
        """The load event this machine's PMU offers, or None and why not."""
        devs_dir = os.path.join(self.sys_root, EVENT_SOURCE_DEVICES)
        try:
            devs = sorted(os.listdir(devs_dir))
        except OSError:
            devs = []
        if PMU_IBS_OP in devs:
            try:
                with open(os.path.join(devs_dir, PMU_IBS_OP, PMU_TYPE)) as f:
                    typ = int(f.read())
            except (OSError, ValueError) as e:
                return None, f"{devs_dir}/{PMU_IBS_OP}/type unreadable: {e}"
            # IBS op periods count in units of 16 ops.
            return PerfEvent(typ, 0, max(0x10, self.sample_period & ~0xF)), "AMD IBS op"
        if any(d in devs for d in PMU_INTEL_AMD_CORE):
            return PerfEvent(native.PERF_TYPE_RAW, INTEL_ALL_LOADS, self.sample_period, precise_ip=2), "Intel PEBS"
        return None, f"no PEBS/IBS: PMU absent ({devs_dir} has: {' '.join(devs) or 'nothing'})"

    def probe(self) -> Availability:
        event, what = self.pmu_event()
        if event is None:
            return Availability(False, what)
        bad = self._try_self(event)
        if bad is not None:
            return Availability(False, f"{what}: {bad.reason}")
        self.event = event
        return Availability(True, f"{what} load-address samples (unverified on hardware)")

    def event_for(self) -> PerfEvent:
        if self.event is None:
            raise KvtierOSError(errno.ENODEV, "perf load sampling", "probe() found no PMU event")
        return self.event
