"""Where the pages of shared memory are that the owner has not mapped.

Shared memory (MAP_SHARED anonymous, memfd, /dev/shm files, SysV segments:
shmem) keeps its pages in the object, not in the process's page tables.
When the kernel swaps such a page out it drops the page-table entry and puts
the swap entry in the object, so /proc/PID/pagemap shows the page exactly
like one never touched (no PM_SWAP) and move_pages answers -ENOENT. The
same holds for a page another process faulted in and this one has not.

The object itself tells. /proc/PID/map_files/START-END opens it (root:
CAP_SYS_ADMIN); then, per range of the file:
- lseek(SEEK_DATA/SEEK_HOLE) finds the holes: pages never written by anyone;
- cachestat(2) (Linux 6.5+) counts the pages in the page cache and the ones
  whose entry is a swap entry: the kernel's own Swap figure of smaps, pages
  still in the swap cache included;
- without cachestat (before 6.5, or under a seccomp filter that does not
  know it), the Swap line of /proc/self/smaps for a mapping of our own of
  each block's range, never touched: the same count. (mincore is no help:
  it counts a page still in the swap cache, as every page is right after a
  pageout to a disk, as resident.)
Unmapped data that is not in swap is ``cached``: in memory, mapped by some
other process or by none, on no node this process can move it from.

Only the pages the caller found unmapped are looked at, so a resident
region costs nothing here; per-block counts come from one cachestat per
block in one C call (or one smaps read), per-page masks from a few extents
(no loop per page).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import FeatureUnavailable, PermissionDenied
from kvtier.kernel import native, procmap
from kvtier.kernel.procfs import Mapping

# Set when cachestat is refused (kernel before 6.5, or a seccomp filter that
# does not know it): from then on our own smaps, without asking again each time.
_cachestat_missing = False


@dataclass
class SharedPages:
    """The unmapped shared-memory pages of a batch of blocks (a PageLayout)."""

    data: np.ndarray  # per page: shared memory, unmapped here, holding data (in memory or in swap)
    swapped: np.ndarray  # per block: pages of it in swap
    cached: np.ndarray  # per block: pages of it in memory but not mapped by the process
    unknown: np.ndarray  # per page: shared memory whose object could not be read
    errors: dict[str, int] = field(default_factory=dict)  # unknown pages by errno name

    @classmethod
    def none(cls, npages: int, nblocks: int) -> "SharedPages":
        z = np.zeros(npages, dtype=bool)
        return cls(z, np.zeros(nblocks, dtype=np.int64), np.zeros(nblocks, dtype=np.int64), z.copy())


def swappable_shared(m: Mapping) -> bool:
    """Shared memory the kernel may swap (hugetlbfs pages never are)."""
    return m.shared_memory and not m.path.startswith("/dev/hugepages/")


def _data_mask(fd: int, offset: int, npages: int, page_size: int) -> np.ndarray:
    """Per page of [offset, offset + npages pages) of the file: not a hole."""
    out = np.zeros(npages, dtype=bool)
    end = offset + npages * page_size
    pos = offset
    while pos < end:
        try:
            d = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                break
            raise
        if d >= end:
            break
        h = min(os.lseek(fd, d, os.SEEK_HOLE), end)
        out[(d - offset) // page_size : -(-(h - offset) // page_size)] = True
        pos = h
    return out


def shared_pages(pid: int, layout, mapped: np.ndarray, proc_root: str = "/proc",
                 page_size: int = native.PAGE_SIZE) -> SharedPages:
    """Where the shared-memory pages of ``layout`` that are not ``mapped``
    (per page: present, or a swap PTE, in the process) are.

    Pages of private memory are left alone (pagemap is exact for them).
    """
    nb = len(layout.pages)
    out = SharedPages.none(len(layout.addrs), nb)
    if mapped.all():
        return out
    ps = page_size
    for start, first, n in layout.runs:
        if mapped[first : first + n].all():
            continue
        for m in procmap.mappings(pid, start, n * ps, proc_root):
            if not swappable_shared(m):
                continue
            lo, hi = max(m.start, start), min(m.end, start + n * ps)
            i0, i1 = first + (lo - start) // ps, first + (hi - start) // ps
            if i1 <= i0 or mapped[i0:i1].all():
                continue
            path = os.path.join(proc_root, str(pid), "map_files", f"{m.start:x}-{m.end:x}")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                # EPERM without CAP_SYS_ADMIN; ENOENT if the mapping changed
                # since it was looked up: these pages' place is not known.
                name = errno.errorcode.get(e.errno, str(e.errno))
                out.unknown[i0:i1] |= ~mapped[i0:i1]
                out.errors[name] = out.errors.get(name, 0) + int((~mapped[i0:i1]).sum())
                continue
            try:
                off0 = m.offset + (lo - m.start)
                _piece(out, fd, layout, mapped, i0, i1, off0, ps)
            except OSError as e:
                name = errno.errorcode.get(e.errno, str(e.errno))
                out.unknown[i0:i1] |= ~mapped[i0:i1]
                out.errors[name] = out.errors.get(name, 0) + int((~mapped[i0:i1]).sum())
                out.data[i0:i1] = False
            finally:
                os.close(fd)
    return out


def _piece(out: SharedPages, fd: int, layout, mapped: np.ndarray, i0: int, i1: int, off0: int, ps: int) -> None:
    """Fill ``out`` for layout pages [i0, i1), file offset ``off0`` onwards."""
    global _cachestat_missing
    data = _data_mask(fd, off0, i1 - i0, ps) & ~mapped[i0:i1]
    out.data[i0:i1] = data
    if not data.any():
        return
    # The blocks this piece of the mapping holds, and each one's pages in it
    # (a block may straddle two mappings): [p0, p1) relative to i0.
    b0 = int(np.searchsorted(layout.first, i0, side="right")) - 1
    b1 = int(np.searchsorted(layout.first, i1 - 1, side="right"))
    blocks = np.arange(b0, b1)
    p0 = np.maximum(layout.first[blocks], i0) - i0
    p1 = np.minimum(layout.first[blocks] + layout.pages[blocks], i1) - i0
    cum_data = np.concatenate(([0], np.cumsum(data)))
    cum_mapped = np.concatenate(([0], np.cumsum(mapped[i0:i1])))
    has = cum_data[p1] > cum_data[p0]
    blocks, p0, p1 = blocks[has], p0[has], p1[has]
    if not _cachestat_missing:
        try:
            cache, evicted = native.cachestat_ranges(
                fd, off0 + p0.astype(np.uint64) * np.uint64(ps), (p1 - p0).astype(np.uint64) * np.uint64(ps))
        except (FeatureUnavailable, PermissionDenied):
            _cachestat_missing = True
        else:
            out.swapped[blocks] += evicted
            # The page cache holds this process's mapped pages too.
            out.cached[blocks] += np.maximum(cache - (cum_mapped[p1] - cum_mapped[p0]), 0)
            return
    # Without cachestat: our own mapping of each block's range, its smaps
    # Swap (mincore would count the swap cache as resident).
    swap = native.swap_of_ranges(fd, off0 + p0.astype(np.uint64) * np.uint64(ps),
                                 (p1 - p0).astype(np.uint64) * np.uint64(ps))
    out.swapped[blocks] += swap
    out.cached[blocks] += np.maximum(cum_data[p1] - cum_data[p0] - swap, 0)
