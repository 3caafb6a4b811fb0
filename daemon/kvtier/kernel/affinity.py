"""What placement at allocation needs from the kernel: where the caller runs
and which nodes can hold long-term pinned pages.

- The caller's CPUs: ``Cpus_allowed_list`` in /proc/PID/status (its cpuset
  and sched_setaffinity mask together), so a pool lands near the CPUs that
  will read it, not near the daemon's.
- ZONE_MOVABLE: before a long-term pin (FOLL_LONGTERM: CUDA host
  registration, RDMA, io_uring fixed buffers) the kernel migrates pages out
  of ZONE_MOVABLE. CXL memory onlined by dax kmem is usually movable, so a
  pinned pool placed there would silently end up in DRAM. The kernel's node
  state ``has_normal_memory`` (N_NORMAL_MEMORY) lists the nodes with memory
  in a zone that is not movable; a node with memory but absent from it has
  movable memory only.
"""

from __future__ import annotations

import errno
import os

from kvtier.errors import ProcessGone
from kvtier.kernel import sysfs

STATUS_CPUS_ALLOWED = "Cpus_allowed_list"


def caller_cpus(pid: int, proc_root: str = "/proc") -> tuple[int, ...]:
    """CPUs ``pid`` may run on; ProcessGone if it does not exist."""
    path = os.path.join(proc_root, str(pid), "status")
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == STATUS_CPUS_ALLOWED:
                    return tuple(sysfs.parse_list(value.strip()))
    except FileNotFoundError:
        raise ProcessGone(errno.ESRCH, f"read {path}", "process does not exist") from None
    return ()


def movable_only_nodes(sys_root: str = "/sys") -> frozenset[int]:
    """Nodes whose memory is all ZONE_MOVABLE (empty when the kernel does not
    say: then no node is refused on that ground)."""
    base = os.path.join(sys_root, sysfs.NODE_DIR)
    with_memory = sysfs.read_list(os.path.join(base, sysfs.NODE_HAS_MEMORY))
    normal = sysfs.read_list(os.path.join(base, sysfs.NODE_HAS_NORMAL_MEMORY))
    if with_memory is None or normal is None:
        return frozenset()
    return frozenset(set(with_memory) - set(normal))
