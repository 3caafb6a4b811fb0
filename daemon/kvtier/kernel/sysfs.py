"""Small readers for sysfs/procfs text files below an injectable root.

Every path is relative to a root directory ("/sys", "/proc", or a captured
fixture tree), so the same code runs on the real kernel and in unit tests.
A file that does not exist is a normal answer on Linux (features come and go
with kernel versions and configs), so the readers return ``None`` for it; any
other failure becomes a typed kvtier error carrying errno.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable

from kvtier.errors import KvtierOSError, os_error

# ---------------------------------------------------------------------------
# Kernel file names read by kvtier.kernel.topology, relative to the sysfs/procfs
# root. They live here (a module with no third-party imports) so that
# scripts/capture_fixtures.py copies exactly the files discovery reads, even
# when it runs under a bare system Python inside the QEMU guest.

# NUMA nodes (Documentation/ABI/stable/sysfs-devices-node)
NODE_DIR = "devices/system/node"
NODE_PREFIX = "node"  # nodeN
NODE_ONLINE = "online"
NODE_POSSIBLE = "possible"
NODE_HAS_CPU = "has_cpu"
NODE_HAS_MEMORY = "has_memory"
NODE_HAS_NORMAL_MEMORY = "has_normal_memory"
NODE_HAS_GENERIC_INITIATOR = "has_generic_initiator"
NODE_LIST_FILES = (
    NODE_ONLINE,
    NODE_POSSIBLE,
    NODE_HAS_CPU,
    NODE_HAS_MEMORY,
    NODE_HAS_NORMAL_MEMORY,
    NODE_HAS_GENERIC_INITIATOR,
)
NODE_CPULIST = "cpulist"
NODE_MEMINFO = "meminfo"
NODE_DISTANCE = "distance"
NODE_FILES = (NODE_CPULIST, NODE_MEMINFO, NODE_DISTANCE)
MEMINFO_TOTAL = "MemTotal"
MEMINFO_FREE = "MemFree"
# nodeN/memoryK links name the memory blocks onlined to the node.
MEMORY_BLOCK_PREFIX = "memory"
MEMORY_BLOCK_SIZE = "devices/system/memory/block_size_bytes"  # hex, no 0x

# HMAT performance of a memory target as seen from its best initiator
# (Documentation/admin-guide/mm/numaperf.rst). access1 counts CPU initiators
# only, access0 any initiator (GPUs, generic initiators). kvtier's readers are
# CPUs, so access1 is preferred and access0 is the fallback.
HMAT_ACCESS_CLASSES = ("access1", "access0")
HMAT_INITIATORS = "initiators"
HMAT_READ_LATENCY = "read_latency"  # nanoseconds
HMAT_WRITE_LATENCY = "write_latency"  # nanoseconds
HMAT_READ_BANDWIDTH = "read_bandwidth"  # MB/s
HMAT_WRITE_BANDWIDTH = "write_bandwidth"  # MB/s
HMAT_FILES = (HMAT_READ_LATENCY, HMAT_WRITE_LATENCY, HMAT_READ_BANDWIDTH, HMAT_WRITE_BANDWIDTH)

# Kernel memory tiers (Documentation/ABI/testing/sysfs-kernel-mm-memory-tiers):
# memory_tierN groups nodes of similar abstract distance; N grows with the
# distance, so a higher N is a slower tier. Absent before 6.1.
MEMTIER_DIR = "devices/virtual/memory_tiering"
MEMTIER_PREFIX = "memory_tier"
MEMTIER_NODELIST = "nodelist"

# CXL regions (Documentation/ABI/testing/sysfs-bus-cxl) and DAX devices
# (sysfs-bus-dax): a CXL RAM region is exposed as dax_regionK/daxK.J below
# its regionK device; bound to kmem, the dax device's memory is onlined to
# target_node.
CXL_DEVICES = "bus/cxl/devices"
CXL_REGION_PREFIX = "region"
CXL_REGION_RESOURCE = "resource"  # hex start of the host physical range
CXL_REGION_SIZE = "size"  # hex
CXL_REGION_MODE = "mode"  # ram | pmem
CXL_REGION_FILES = (CXL_REGION_RESOURCE, CXL_REGION_SIZE, CXL_REGION_MODE)
DAX_DEVICES = "bus/dax/devices"
DAX_TARGET_NODE = "target_node"
DAX_SIZE = "size"
DAX_FILES = (DAX_TARGET_NODE, DAX_SIZE)

# Block devices: /sys/block/<disk> (partitions are subdirectories holding a
# "partition" file), /sys/dev/block/MAJ:MIN links for st_dev lookups.
BLOCK_DIR = "block"
DEV_BLOCK_DIR = "dev/block"
BLOCK_DEV = "dev"  # "MAJ:MIN"
BLOCK_SIZE = "size"  # 512-byte sectors
BLOCK_ROTATIONAL = "queue/rotational"
BLOCK_DEVICE_LINK = "device"
BLOCK_PARTITION = "partition"
BLOCK_SLAVES = "slaves"  # dm/md: the devices underneath

# CPUs online, for kernels without NUMA sysfs
CPU_ONLINE = "devices/system/cpu/online"

# procfs
PROC_SWAPS = "swaps"
PROC_MEMINFO = "meminfo"

# A captured fixture tree is <dir>/sys + <dir>/proc + <dir>/FIXTURE_META. The
# metadata records what no file can hold, e.g. the st_dev of swap files.
FIXTURE_META = "fixture.json"

# Units the kernel prints after numbers in meminfo-style files.
_UNIT_BYTES = {"kB": 1024, "KB": 1024, "MB": 1024 * 1024, "GB": 1024**3}

# /proc/swaps escapes space, tab, newline and backslash in names as \ooo.
_OCTAL_ESC = re.compile(r"\\([0-7]{3})")

# Missing files and directories read as "absent", not as errors.
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ENXIO)


def path(root: str, *parts: str) -> str:
    """Join ``parts`` below ``root``; leading slashes in parts stay below it."""
    return os.path.join(root, *(p.lstrip("/") for p in parts))


def read_bytes(file: str) -> bytes:
    """The contents of a small kernel file through one fd and read(2), no
    file object: a text-mode open() builds a buffer and a decoder per file,
    2-3x the cost of the syscalls (the daemon reads several such files per
    tick, DAMON's collect four per region). A sysfs attribute is at most a
    page and answered by one read; a short read is the end."""
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
        if len(data) == 4096:
            parts = [data]
            while chunk := os.read(fd, 65536):
                parts.append(chunk)
            data = b"".join(parts)
    finally:
        os.close(fd)
    return data


def read_text(file: str) -> str | None:
    """The stripped contents of ``file``, or None if it does not exist."""
    try:
        return read_bytes(file).decode("utf-8", errors="replace").strip()
    except OSError as e:
        if e.errno in _ABSENT:
            return None
        raise os_error(e.errno or errno.EIO, f"read {file}") from e


def read_int(file: str, base: int = 10) -> int | None:
    """An integer file (``base=0`` accepts the kernel's 0x-prefixed hex)."""
    text = read_text(file)
    if text is None or text == "":
        return None
    try:
        return int(text.split()[0], base)
    except ValueError:
        raise KvtierOSError(errno.EINVAL, f"parse {file}", f"not an integer: {text[:40]!r}") from None


def parse_list(text: str) -> list[int]:
    """Parse a kernel cpulist/nodelist ("0-3,8,10-11") into sorted ints."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, _, hi = part.partition("-")
            # "0-7:2" strides exist in bitmap syntax but never in sysfs output.
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(part))
    return sorted(out)


def read_list(file: str) -> list[int] | None:
    text = read_text(file)
    return None if text is None else parse_list(text)


def read_meminfo(file: str, names: Iterable[str] | None = None) -> dict[str, int]:
    """A meminfo-style file as {field: bytes}; with ``names``, parsing stops
    once those are read (the tick reads two of a node file's ~35 lines,
    its first two: parsing the rest was most of the tick's topology refresh
    in the TCG guest).

    Handles both /proc/meminfo ("MemTotal:  123 kB") and the per-node files
    ("Node 0 MemTotal:  123 kB"). Fields without a unit (HugePages_Total)
    stay plain counts.
    """
    text = read_text(file)
    out: dict[str, int] = {}
    if text is None:
        return out
    want = None if names is None else set(names)
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        fields = rest.split()
        if not fields:
            continue
        name = key.split()[-1]
        try:
            value = int(fields[0])
        except ValueError:
            continue
        if len(fields) > 1:
            value *= _UNIT_BYTES.get(fields[1], 1)
        out[name] = value
        if want is not None:
            want.discard(name)
            if not want:
                break
    return out


def readlink(link: str) -> str | None:
    """The target of a symlink, or None if ``link`` is absent or not a link."""
    try:
        return os.readlink(link)
    except OSError as e:
        if e.errno in _ABSENT or e.errno == errno.EINVAL:
            return None
        raise os_error(e.errno or errno.EIO, f"readlink {link}") from e


def listdir(directory: str) -> list[str]:
    """Sorted entries of ``directory``; empty if it does not exist."""
    try:
        return sorted(os.listdir(directory))
    except OSError as e:
        if e.errno in _ABSENT:
            return []
        raise os_error(e.errno or errno.EIO, f"list {directory}") from e


def parse_swaps(text: str) -> list[tuple[str, str, int, int, int]]:
    """/proc/swaps as (path, type, size bytes, used bytes, priority) rows."""
    rows = []
    for line in text.splitlines()[1:]:  # the first line is the header
        fields = line.split()
        if len(fields) < 5:
            continue
        # Names hold no raw whitespace (it is escaped), but join anyway: the
        # last four fields are always type, size, used, priority (sizes in KiB).
        path = _OCTAL_ESC.sub(lambda m: chr(int(m.group(1), 8)), " ".join(fields[:-4]))
        typ, size, used, prio = fields[-4:]
        rows.append((path, typ, int(size) * 1024, int(used) * 1024, int(prio)))
    return rows
