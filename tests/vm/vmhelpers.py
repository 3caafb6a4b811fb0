"""Facts and helpers shared by the tests that run inside the QEMU guest.

The guest's shape is fixed by scripts/vm/run.py (node 0: CPUs + 1 GiB,
node 1: 1 GiB CPU-less, node 2: 256 MiB CXL region via dax kmem, swap on
/dev/nvme0n1). Imported by the guest tests as a plain module (tests/vm is on
sys.path under pytest's default import mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/kvchild.py

from kvchild import KVChild  # noqa: E402

SYS = Path("/sys")
NODE_DIR = SYS / "devices/system/node"
CXL_DEVICES = SYS / "bus/cxl/devices"
DAX_DEVICES = SYS / "bus/dax/devices"
MEMORY_TIERS = SYS / "devices/virtual/memory_tiering"
DAMON_ADMIN = SYS / "kernel/mm/damon/admin"

DRAM_NODE, FAR_NODE, CXL_NODE = 0, 1, 2
SWAP_DISK = "nvme0n1"
MiB = 1 << 20


def read(path: Path | str) -> str:
    return Path(path).read_text().strip()


def parse_list(text: str) -> list[int]:
    """Kernel cpu/node list syntax ("0-2,4") to ints; "" is empty."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def node_mem_total(node: int) -> int:
    """Bytes of MemTotal in the node's meminfo."""
    for line in read(NODE_DIR / f"node{node}/meminfo").splitlines():
        if "MemTotal:" in line:
            return int(line.split()[-2]) * 1024
    raise AssertionError(f"node{node}/meminfo has no MemTotal")


def numa_maps_nodes(pid: int, addr: int) -> dict[int, int]:
    """Pages per node of the mapping containing ``addr`` (/proc/PID/numa_maps)."""
    best: tuple[int, dict[int, int]] | None = None
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        parts = line.split()
        start = int(parts[0], 16)
        if start <= addr and (best is None or start > best[0]):
            nodes = {}
            for p in parts[2:]:
                k, _, v = p.partition("=")
                if k[:1] == "N" and k[1:].isdigit():
                    nodes[int(k[1:])] = int(v)
            best = (start, nodes)
    assert best is not None, f"no mapping at 0x{addr:x} in /proc/{pid}/numa_maps"
    return best[1]


def block_ranges(child: KVChild, block: int, first: int = 0, count: int | None = None):
    """(starts, lengths) uint64 arrays of ``count`` blocks of ``block`` bytes."""
    n = child.size // block
    count = n - first if count is None else count
    starts = np.uint64(child.addr) + np.arange(first, first + count, dtype=np.uint64) * np.uint64(block)
    return starts, np.full(count, block, dtype=np.uint64)
