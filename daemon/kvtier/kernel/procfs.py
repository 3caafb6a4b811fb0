"""Everything kvtier reads from /proc/PID, parsed in exactly one place.

The proc root is a parameter so tests can point these readers at fixture
trees. Per-page data (pagemap) comes back as numpy arrays from one pread per
contiguous range: never a Python loop per page.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import numpy as np

from kvtier.errors import InvalidArgument, PermissionDenied, ProcessGone, RangeNotMapped, os_error
from kvtier.kernel.sysfs import parse_list

PROC_MAPS = "maps"
PROC_STAT = "stat"
PROC_STATUS = "status"
PROC_PAGEMAP = "pagemap"
PROC_CLEAR_REFS = "clear_refs"
PROC_CGROUP = "cgroup"
PROC_SMAPS = "smaps"

# /proc/PID/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)
PM_PFN_MASK = np.uint64((1 << 55) - 1)
PM_SOFT_DIRTY = np.uint64(1 << 55)
PM_EXCLUSIVE = np.uint64(1 << 56)
PM_FILE = np.uint64(1 << 61)
PM_SWAP = np.uint64(1 << 62)
PM_PRESENT = np.uint64(1 << 63)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str

    @property
    def shared(self) -> bool:
        return self.perms[3:4] == "s"

    @property
    def anonymous_private(self) -> bool:
        # Private anonymous memory: no backing file. "[heap]" is anonymous too;
        # "[stack]" is excluded because the kernel grows and shrinks it.
        return not self.shared and self.inode == 0 and self.path in ("", "[heap]")

    @property
    def shared_memory(self) -> bool:
        # MAP_SHARED|MAP_ANONYMOUS shows as "/dev/zero (deleted)", memfd as
        # "/memfd:name (deleted)", POSIX shm under /dev/shm, SysV as "/SYSV...".
        if not self.shared:
            return False
        p = self.path
        return (
            p.startswith("/dev/shm/")
            or p.startswith("/memfd:")
            or p.startswith("/SYSV")
            or p.startswith("/dev/zero")
            or p.startswith("/dev/hugepages/")
        )

    @property
    def kv_memory(self) -> bool:
        """Private anonymous or shared memory, whatever its protection now:
        what the daemon may move or page out for a region (the kernel
        judges MADV_PAGEOUT of a file's page cache by the caller's right to
        write the file, and the caller is the root daemon)."""
        return self.anonymous_private or self.shared_memory

    @property
    def kv_eligible(self) -> bool:
        """Memory a KV cache may be registered in: readable kv_memory."""
        return "r" in self.perms[:1] and self.kv_memory


def _pid_path(proc_root: str, pid: int, name: str) -> str:
    return os.path.join(proc_root, str(pid), name)


def _read_text(proc_root: str, pid: int, name: str) -> str:
    path = _pid_path(proc_root, pid, name)
    try:
        with open(path, "r") as f:
            return f.read()
    except FileNotFoundError:
        raise ProcessGone(errno.ESRCH, f"read {path}", "process does not exist") from None
    except PermissionError as e:
        raise PermissionDenied(e.errno, f"read {path}") from None
    except OSError as e:
        # Reading a dying process's files gives ESRCH; treat as gone.
        raise os_error(e.errno, f"read {path}") from None


def read_maps(pid: int, proc_root: str = "/proc") -> list[Mapping]:
    out = []
    for line in _read_text(proc_root, pid, PROC_MAPS).splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        out.append(
            Mapping(
                start=int(lo, 16),
                end=int(hi, 16),
                perms=parts[1],
                offset=int(parts[2], 16),
                inode=int(parts[4]),
                path=parts[5].strip() if len(parts) > 5 else "",
            )
        )
    return out


def check_range(maps: list[Mapping], start: int, length: int, *, kv_only: bool = True) -> None:
    """Raise RangeNotMapped unless [start, start+length) is covered by mappings.

    Adjacent mappings (the kernel splits a VMA when part of it is mbind'ed or
    madvised) may together cover the range; every piece must be private
    anonymous or shared memory (``kv_memory``), and with ``kv_only`` also
    readable (``kv_eligible``: what register accepts; a registered range
    its owner later mprotects is still moved).
    """
    if length <= 0:
        raise InvalidArgument(f"length must be positive, got {length}")
    end = start + length
    pos = start
    for m in maps:  # maps are sorted by address
        if m.end <= pos:
            continue
        if m.start > pos:
            break
        if not (m.kv_eligible if kv_only else m.kv_memory):
            raise RangeNotMapped(
                f"range 0x{start:x}+{length} overlaps mapping 0x{m.start:x}-0x{m.end:x} "
                f"({m.path or 'anonymous'} {m.perms}) which is not private anonymous or shared memory"
            )
        pos = m.end
        if pos >= end:
            return
    raise RangeNotMapped(f"range 0x{start:x}+{length} is not mapped (gap at 0x{pos:x})")


def read_locked_ranges(pid: int, proc_root: str = "/proc") -> list[tuple[int, int]]:
    """[start, end) of every mlock'ed mapping (VM_LOCKED: smaps VmFlags "lo").

    MADV_PAGEOUT refuses a locked mapping with EINVAL (can_madv_lru_vma), for
    the whole call. smaps makes the kernel walk every page of every mapping,
    so it is read only when /proc/PID/status says the process has locked
    memory at all (VmLck counts VM_LOCKED mappings' size, faulted or not).
    """
    if int((_status_field(pid, "VmLck", proc_root) or "0").split()[0]) == 0:
        return []
    out: list[tuple[int, int]] = []
    start = end = 0
    for line in _read_text(proc_root, pid, PROC_SMAPS).splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
        elif head == "VmFlags:" and "lo" in line.split()[1:]:
            out.append((start, end))
    return out


def read_start_time(pid: int, proc_root: str = "/proc") -> int:
    """Field 22 of /proc/PID/stat (start time in clock ticks): with the pid it
    identifies a process across pid reuse."""
    text = _read_text(proc_root, pid, PROC_STAT)
    # comm may contain spaces and parentheses; fields resume after the last ')'.
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[19])


def _status_field(pid: int, key: str, proc_root: str) -> str | None:
    """The value of one ``Key:`` line of /proc/PID/status, None if absent."""
    head = key + ":"
    for line in _read_text(proc_root, pid, PROC_STATUS).splitlines():
        if line.startswith(head):
            return line[len(head):].strip()
    return None


def read_uids(pid: int, proc_root: str = "/proc") -> tuple[int, int]:
    """(real uid, effective uid) from /proc/PID/status."""
    uid = _status_field(pid, "Uid", proc_root)
    if uid is None:
        raise ProcessGone(errno.ESRCH, f"read {_pid_path(proc_root, pid, PROC_STATUS)}", "no Uid line")
    f = uid.split()
    return int(f[0]), int(f[1])


def read_creds(pid: int, proc_root: str = "/proc") -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """What the kernel's ptrace access check looks at: the (real, effective,
    saved, filesystem) uids and gids from /proc/PID/status, and the owner
    (uid, gid) of that file: the process's effective ids while it is
    dumpable, root's once it is not (exec of a setuid or setgid program, a
    setuid() call, prctl(PR_SET_DUMPABLE, 0) as ssh-agent and gpg-agent do)."""
    path = _pid_path(proc_root, pid, PROC_STATUS)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ProcessGone(e.errno or errno.ESRCH, f"stat {path}", e.strerror or "") from None
    uid, gid = _status_field(pid, "Uid", proc_root), _status_field(pid, "Gid", proc_root)
    if uid is None or gid is None:
        raise ProcessGone(errno.ESRCH, f"read {path}", "no Uid or Gid line")
    return tuple(map(int, uid.split())), tuple(map(int, gid.split())), (st.st_uid, st.st_gid)


def read_swapped_bytes(pid: int, proc_root: str = "/proc") -> int:
    """Bytes of the process's private memory in swap (VmSwap of
    /proc/PID/status; 0 for a kernel thread or a process gone)."""
    v = _status_field(pid, "VmSwap", proc_root)
    return int(v.split()[0]) * 1024 if v else 0


def read_cpus_allowed(pid: int, proc_root: str = "/proc") -> list[int]:
    """CPUs the process may run on (Cpus_allowed_list of /proc/PID/status:
    its affinity mask, cpusets included)."""
    cpus = _status_field(pid, "Cpus_allowed_list", proc_root)
    return parse_list(cpus) if cpus is not None else []


def read_cgroup(pid: int, proc_root: str = "/proc") -> str:
    """The process's cgroup path: the unified (v2, "0::") hierarchy's, or on
    a v1-only system the memory controller's (what a memory daemon cares about)."""
    v1_memory = None
    for line in _read_text(proc_root, pid, PROC_CGROUP).splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            return path
        if "memory" in controllers.split(","):
            v1_memory = path
    return v1_memory or "/"


def process_alive(pid: int, start_time: int | None = None, proc_root: str = "/proc") -> bool:
    try:
        st = read_start_time(pid, proc_root)
    except (ProcessGone, PermissionDenied, OSError):
        return False
    return start_time is None or st == start_time


class Pagemap:
    """An open /proc/PID/pagemap; reads entries for page ranges as uint64 arrays."""

    def __init__(self, pid: int, proc_root: str = "/proc"):
        path = _pid_path(proc_root, pid, PROC_PAGEMAP)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ProcessGone(errno.ESRCH, f"open {path}", "process does not exist") from None
        except OSError as e:
            raise os_error(e.errno, f"open {path}") from None
        self.path = path

    def read(self, start: int, npages: int, page_size: int) -> np.ndarray:
        """Entries for ``npages`` pages from virtual address ``start``."""
        out = np.empty(npages, dtype=np.uint64)
        want = npages * 8
        off = (start // page_size) * 8
        buf = memoryview(out).cast("B")
        got = 0
        while got < want:
            try:
                n = os.preadv(self.fd, [buf[got:]], off + got)
            except OSError as e:
                raise os_error(e.errno, f"read {self.path} at 0x{start:x}") from None
            if n == 0:
                raise os_error(errno.ESRCH, f"read {self.path}", "process exited")
            got += n
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Pagemap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def clear_refs(pid: int, proc_root: str = "/proc", what: str = "1") -> None:
    """Write /proc/PID/clear_refs ("1" clears referenced/accessed bits of all pages)."""
    path = _pid_path(proc_root, pid, PROC_CLEAR_REFS)
    try:
        with open(path, "w") as f:
            f.write(what)
    except FileNotFoundError:
        raise ProcessGone(errno.ESRCH, f"write {path}", "process does not exist") from None
    except OSError as e:
        raise os_error(e.errno, f"write {path}") from None
