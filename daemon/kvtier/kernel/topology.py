"""Memory tiers of this machine: which NUMA nodes are DRAM, far memory, CXL,
and which swap devices sit below them, in the order kvtier should fill them.

``discover()`` reads sysfs/procfs below injectable roots (the real ``/sys``
and ``/proc`` or a captured fixture tree) and returns a ``Topology``: an
ordered list of ``Tier`` objects whose indices are the tier numbers stored in
``BlockTable.tier`` (0 = DRAM, the fastest).

Classification
--------------
* A memory node with CPUs is DRAM. All of them form tier 0: kvtier places KV
  blocks for a CPU reader and leaves socket-locality to the migrator.
* A CPU-less memory node is far memory. It is CXL when either
  (a) a DAX device whose ``target_node`` is the node sits below a CXL region
      in the device tree (``/sys/bus/dax/devices/daxK.J`` links to
      ``.../regionK/dax_regionK/daxK.J`` and ``/sys/bus/cxl/devices/regionK``
      exists). This is how a region created with ``cxl create-region`` and
      onlined through dax kmem appears (the QEMU guest, most hot-added
      expanders); or
  (b) one of the node's memory blocks lies inside the host physical range
      (``resource``/``size``) of a CXL region. This catches memory the
      firmware already onlined as ordinary System RAM, where no DAX device
      exists but the CXL driver still enumerates the region.
  Anything else is plain far memory (a CPU-less NUMA node, emulated or
  firmware-described). The kernel has no single "this node is CXL" flag;
  both rules use only the device tree, never the node's speed.
* CPU-less nodes with equal (kind, memory tier, HMAT latency, SLIT distance)
  share a tier, so symmetric per-socket expanders form one tier.

Ordering
--------
DRAM first. Far tiers are sorted by, in this order: the kernel memory tier
(``memory_tierN``, higher N = higher abstract distance = slower), the HMAT
read latency, the SLIT distance from the nearest CPU node, kind (plain far
memory before CXL when nothing else tells them apart). A missing
value sorts after any known one. Each tier records in ``order_source`` which
of these put it after the tier before it. Swap is one tier, last; its devices
are listed NVMe first (the tier is marked ``nvme`` when any device is).

Overrides (``discover(overrides=...)``) replace the discovered order, kinds,
names and capacities; see ``validate_overrides`` for the schema.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from kvtier.kernel import procfs, sysfs
from kvtier.blocks import TIER_UNKNOWN
from kvtier.errors import ConfigError, InvalidArgument, KvtierError, KvtierOSError

KIND_DRAM = "dram"
KIND_FAR = "far"
KIND_CXL = "cxl"
KIND_SWAP = "swap"
KIND_CPU_ONLY = "cpu-only"  # a node with CPUs and no memory: never a tier
MEMORY_KINDS = (KIND_DRAM, KIND_FAR, KIND_CXL)
# what refresh_free reads of a node's meminfo every tick
_TICK_FIELDS = (sysfs.MEMINFO_TOTAL, sysfs.MEMINFO_FREE)

# order_source values: what placed a tier after the one before it.
SRC_CPUS = "cpus"
SRC_MEMTIER = "memory_tier"
SRC_HMAT = "hmat"
SRC_SLIT = "slit"
SRC_KIND = "kind"
SRC_NODE = "node"
SRC_SWAP = "swap"
SRC_CONFIG = "config"

SWAP_FILE = "file"
SWAP_PARTITION = "partition"

_NODE_RE = re.compile(rf"^{sysfs.NODE_PREFIX}(\d+)$")
_MEMTIER_RE = re.compile(rf"^{sysfs.MEMTIER_PREFIX}(\d+)$")
_BLOCK_RE = re.compile(rf"^{sysfs.MEMORY_BLOCK_PREFIX}(\d+)$")
_REGION_RE = re.compile(rf"^{sysfs.CXL_REGION_PREFIX}(\d+)$")
_TIER_INT8_MAX = int(np.iinfo(np.int8).max)


# ---------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class Perf:
    """HMAT performance of a memory node for its best initiator."""

    access_class: str
    read_latency_ns: int | None
    write_latency_ns: int | None
    read_bandwidth_mbps: int | None
    write_bandwidth_mbps: int | None


@dataclass
class NodeInfo:
    node: int
    kind: str
    cpus: tuple[int, ...]
    total: int
    free: int
    distances: dict[int, int]
    memory_tier: int | None
    perf: Perf | None
    cxl: str | None  # evidence for the CXL classification, e.g. "dax0.0 in region0"
    slit_from_cpu: int | None = None  # SLIT distance from the nearest CPU node
    initiators: tuple[int, ...] = ()  # HMAT: the nodes whose CPUs reach it best (access0/initiators/nodeN)
    meminfo_path: str = field(repr=False, default="")


@dataclass
class SwapDevice:
    path: str
    type: str  # SWAP_FILE | SWAP_PARTITION
    size: int  # bytes
    used: int  # bytes
    priority: int
    block: str | None  # kernel block device holding it (nvme0n1p2, dm-0, vda)
    disk: str | None  # whole disk of ``block`` (nvme0n1, dm-0, vda)
    transport: str | None  # nvme | zram | dm | md | loop | virtio | other
    nvme: bool
    rotational: bool | None


@dataclass
class Tier:
    index: int
    name: str
    kind: str
    nodes: tuple[int, ...]
    total: int
    free: int
    capacity: int  # bytes kvtier may fill; total unless a config caps it
    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None
    order_source: str = ""
    notes: list[str] = field(default_factory=list)
    swap_devices: tuple[SwapDevice, ...] = ()
    nvme: bool = False
    capacity_limit: int | None = None  # configured cap, kept for refresh_free


@dataclass
class Topology:
    tiers: list[Tier]
    nodes: dict[int, NodeInfo]
    swap_devices: list[SwapDevice]
    node_to_tier: dict[int, int]
    sys_root: str
    proc_root: str
    warnings: list[str] = field(default_factory=list)
    unassigned_nodes: tuple[int, ...] = ()
    signature: tuple[str | None, ...] = ()  # node lists at discovery (see changed_on_disk)
    swap_lost: int = 0  # swap devices seen swapped off since discovery (refresh_free)

    def changed_on_disk(self) -> bool:
        """Did a node come or go, or gain or lose all of its memory, since
        discovery? Two small sysfs reads: cheap enough for every tick, the
        fallback when no uevent socket tells (kernel/uevents.py)."""
        return node_signature(self.sys_root) != self.signature

    def memory_tier_map(self) -> dict[int, int]:
        """node -> the kernel memory tier id read at discovery (nodes in none left out)."""
        return {n: i.memory_tier for n, i in self.nodes.items() if i.memory_tier is not None}

    def tier_for_node(self, node: int) -> Tier:
        """The tier holding ``node``; InvalidArgument if no tier does."""
        try:
            return self.tiers[self.node_to_tier[node]]
        except KeyError:
            raise InvalidArgument(f"node {node} belongs to no tier") from None

    @property
    def swap_tier(self) -> Tier | None:
        last = self.tiers[-1] if self.tiers else None
        return last if last is not None and last.kind == KIND_SWAP else None

    def node_tier_lut(self) -> np.ndarray:
        """int8 array: node id -> tier index, -1 (TIER_UNKNOWN) for no tier.

        Lets the migrator turn a whole move_pages status array into tiers in
        one numpy indexing step (negative statuses must be masked first).
        """
        size = max(self.nodes, default=-1) + 1
        lut = np.full(max(size, 1), TIER_UNKNOWN, dtype=np.int8)
        for node, tier in self.node_to_tier.items():
            lut[node] = tier
        return lut

    def refresh_free(self) -> list[int]:
        """Re-read free/used (and node totals, which memory hot-plug changes)
        for every tier; cheap enough for every tick: one small file per node
        and /proc/swaps. Swap devices added or removed since discover() are
        not picked up (rediscover on a hot-plug event). Returns free bytes per
        tier."""
        for info in self.nodes.values():
            if info.kind == KIND_CPU_ONLY or not info.meminfo_path:
                continue
            mi = sysfs.read_meminfo(info.meminfo_path, _TICK_FIELDS)
            info.total = mi.get(sysfs.MEMINFO_TOTAL, info.total)
            info.free = mi.get(sysfs.MEMINFO_FREE, info.free)
        if self.swap_devices:
            current = {s.path: s for s in read_swaps(self.proc_root)}
            for dev in self.swap_devices:
                now = current.get(dev.path)
                if now is None and dev.size:
                    # swapoff brought its pages back into memory: what was
                    # measured in swap must be measured again
                    self.swap_lost += 1
                # A device swapped off since discovery holds nothing usable.
                dev.size, dev.used = (now.size, now.used) if now else (0, 0)
        for t in self.tiers:
            _fill_capacity(t, self)
        return [t.free for t in self.tiers]

    def nearest_node(self, tier_idx: int, cpus: Iterable[int] | None) -> tuple[int, str]:
        """The node of a tier to place a process's block on, and why.

        In a tier of several nodes (two CXL expanders, each socket's far
        memory) a block goes to the node nearest the CPUs the process may run
        on, so its KV stays within its socket's or switch's domain instead of
        crossing the inter-socket link on every read: first a node whose
        HMAT best initiators include one of the process's CPU nodes, then the
        smallest SLIT distance from them, then the most free memory. Without
        CPUs (unknown) the node with the most free memory, as before.
        """
        t = self.tiers[tier_idx]
        if len(t.nodes) == 1:
            return t.nodes[0], f"node {t.nodes[0]}: the tier's only node"
        cpu_set = set(cpus or ())
        cpu_nodes = sorted(n for n, info in self.nodes.items() if cpu_set & set(info.cpus))
        if not cpu_nodes:
            best = max(t.nodes, key=lambda n: self.nodes[n].free)
            return best, f"node {best}: most free memory of nodes {list(t.nodes)} (process CPUs unknown)"

        def slit(n: int) -> int:
            return min(self.nodes[c].distances.get(n, 255) for c in cpu_nodes)

        def hmat(n: int) -> bool:
            return bool(set(self.nodes[n].initiators) & set(cpu_nodes))

        best = min(t.nodes, key=lambda n: (not hmat(n), slit(n), -self.nodes[n].free, n))
        others = ", ".join(f"{n} SLIT {slit(n)}" for n in t.nodes if n != best)
        return best, (f"node {best}: nearest to the process's CPU node(s) {cpu_nodes} "
                      f"(SLIT {slit(best)}{', HMAT best initiator' if hmat(best) else ''}; {others})")

    def node_for(self, tier_idx: int, pid: int) -> tuple[int, str]:
        """``nearest_node`` for a process, from its allowed CPUs
        (/proc/PID/status); one small read, only for tiers of several nodes."""
        cpus = None
        if len(self.tiers[tier_idx].nodes) > 1:
            try:
                cpus = procfs.read_cpus_allowed(pid, self.proc_root)
            except (KvtierError, OSError):
                cpus = None  # gone or unreadable: fall back to free memory
        return self.nearest_node(tier_idx, cpus)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (kvtierctl topology --json)."""
        nodes = []
        for n in sorted(self.nodes.values(), key=lambda i: i.node):
            nodes.append(
                {
                    "node": n.node,
                    "kind": n.kind,
                    "cpus": list(n.cpus),
                    "total": n.total,
                    "free": n.free,
                    "distances": {str(a): d for a, d in sorted(n.distances.items())},
                    "memory_tier": n.memory_tier,
                    "perf": asdict(n.perf) if n.perf else None,
                    "cxl": n.cxl,
                    "slit_from_cpu": n.slit_from_cpu,
                    "tier": self.node_to_tier.get(n.node),
                }
            )
        tiers = []
        for t in self.tiers:
            d = asdict(t)
            d["nodes"] = list(t.nodes)
            d["swap_devices"] = [asdict(s) for s in t.swap_devices]
            tiers.append(d)
        return {
            "sys_root": self.sys_root,
            "proc_root": self.proc_root,
            "tiers": tiers,
            "nodes": nodes,
            "swap_devices": [asdict(s) for s in self.swap_devices],
            "node_to_tier": {str(n): t for n, t in sorted(self.node_to_tier.items())},
            "unassigned_nodes": list(self.unassigned_nodes),
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------
# readers (every file discovery reads goes through these)


def _node_path(sys_root: str, *parts: str) -> str:
    return sysfs.path(sys_root, sysfs.NODE_DIR, *parts)


def _read_perf(node_dir: str) -> Perf | None:
    for access in sysfs.HMAT_ACCESS_CLASSES:
        base = os.path.join(node_dir, access, sysfs.HMAT_INITIATORS)
        vals = [sysfs.read_int(os.path.join(base, f)) for f in sysfs.HMAT_FILES]
        if any(v is not None for v in vals):
            # The kernel prints 0 for a value HMAT did not provide.
            vals = [v if v else None for v in vals]
            return Perf(access, *vals)
    return None


def _read_initiators(node_dir: str) -> tuple[int, ...]:
    """Nodes listed (as nodeN links) in access0/initiators: the CPU nodes
    HMAT names as this memory's best initiators."""
    base = os.path.join(node_dir, "access0", sysfs.HMAT_INITIATORS)
    return tuple(sorted(int(m.group(1)) for m in map(_NODE_RE.match, sysfs.listdir(base)) if m))


def _read_memory_tiers(sys_root: str) -> dict[int, int] | None:
    """node -> kernel memory tier id, or None when the kernel has no tiers."""
    base = sysfs.path(sys_root, sysfs.MEMTIER_DIR)
    if not os.path.isdir(base):
        return None
    out: dict[int, int] = {}
    for name in sysfs.listdir(base):
        m = _MEMTIER_RE.match(name)
        if not m:
            continue
        for node in sysfs.read_list(os.path.join(base, name, sysfs.MEMTIER_NODELIST)) or []:
            out[node] = int(m.group(1))
    return out


def _link_components(link: str) -> list[str]:
    """Path components of a symlink's target, normalised without resolving
    (fixture trees hold the link but not always everything it points into)."""
    target = sysfs.readlink(link)
    if target is None:
        return []
    full = os.path.normpath(os.path.join(os.path.dirname(link), target))
    return full.split(os.sep)


def _cxl_regions(sys_root: str) -> dict[str, tuple[int, int] | None]:
    """CXL region name -> (start, size) of its host physical range, or None
    when unknown (a region still being assembled prints -1/0)."""
    base = sysfs.path(sys_root, sysfs.CXL_DEVICES)
    out: dict[str, tuple[int, int] | None] = {}
    for name in sysfs.listdir(base):
        if not _REGION_RE.match(name):
            continue
        try:
            start = sysfs.read_int(os.path.join(base, name, sysfs.CXL_REGION_RESOURCE), 16)
            size = sysfs.read_int(os.path.join(base, name, sysfs.CXL_REGION_SIZE), 16)
        except KvtierOSError:
            start = size = None
        out[name] = (start, size) if start is not None and size else None
    return out


def _cxl_evidence(sys_root: str, memory_nodes: Iterable[int]) -> dict[int, str]:
    """node -> why it is CXL, for CPU-less memory nodes (rules in the module doc)."""
    regions = _cxl_regions(sys_root)
    if not regions:
        return {}
    wanted = set(memory_nodes)
    out: dict[int, str] = {}
    # Rule (a): a DAX device below a CXL region, onlined to the node.
    dax_base = sysfs.path(sys_root, sysfs.DAX_DEVICES)
    for dax in sysfs.listdir(dax_base):
        node = sysfs.read_int(os.path.join(dax_base, dax, sysfs.DAX_TARGET_NODE))
        if node not in wanted or node in out:
            continue
        for comp in _link_components(os.path.join(dax_base, dax)):
            if comp in regions:
                out[node] = f"{dax} in {comp}"
                break
    # Rule (b): a memory block of the node inside a region's physical range.
    block_size = sysfs.read_int(sysfs.path(sys_root, sysfs.MEMORY_BLOCK_SIZE), 16)
    ranges = [(n, r) for n, r in regions.items() if r is not None]
    if block_size and ranges:
        for node in sorted(wanted - set(out)):
            for entry in sysfs.listdir(_node_path(sys_root, f"{sysfs.NODE_PREFIX}{node}")):
                m = _BLOCK_RE.match(entry)
                if not m:
                    continue
                addr = int(m.group(1)) * block_size
                hit = next((n for n, (s, z) in ranges if s <= addr < s + z), None)
                if hit:
                    out[node] = f"{entry} in {hit}"
                    break
    return out


def _read_nodes(sys_root: str, proc_root: str, warnings: list[str]) -> dict[int, NodeInfo]:
    base = _node_path(sys_root)
    if not os.path.isdir(base):
        # CONFIG_NUMA=n kernels have no node directory: the machine is one
        # DRAM node whose memory /proc/meminfo describes.
        warnings.append(f"{base} absent (kernel without NUMA): one DRAM node assumed")
        meminfo = sysfs.path(proc_root, sysfs.PROC_MEMINFO)
        mi = sysfs.read_meminfo(meminfo)
        cpus = tuple(sysfs.read_list(sysfs.path(sys_root, sysfs.CPU_ONLINE)) or ())
        info = NodeInfo(0, KIND_DRAM, cpus, mi.get(sysfs.MEMINFO_TOTAL, 0), mi.get(sysfs.MEMINFO_FREE, 0),
                        {0: 10}, None, None, None, meminfo_path=meminfo)
        return {0: info}
    online = sysfs.read_list(os.path.join(base, sysfs.NODE_ONLINE))
    if online is None:
        online = sorted(int(m.group(1)) for m in map(_NODE_RE.match, sysfs.listdir(base)) if m)
    has_memory = sysfs.read_list(os.path.join(base, sysfs.NODE_HAS_MEMORY))
    has_cpu = sysfs.read_list(os.path.join(base, sysfs.NODE_HAS_CPU))
    nodes: dict[int, NodeInfo] = {}
    for node in online:
        ndir = os.path.join(base, f"{sysfs.NODE_PREFIX}{node}")
        cpus = tuple(sysfs.read_list(os.path.join(ndir, sysfs.NODE_CPULIST)) or ())
        meminfo = os.path.join(ndir, sysfs.NODE_MEMINFO)
        mi = sysfs.read_meminfo(meminfo)
        total, free = mi.get(sysfs.MEMINFO_TOTAL, 0), mi.get(sysfs.MEMINFO_FREE, 0)
        dist_row = (sysfs.read_text(os.path.join(ndir, sysfs.NODE_DISTANCE)) or "").split()
        # The distance file lists one entry per online node, in node order.
        distances = {other: int(d) for other, d in zip(online, dist_row)}
        with_cpu = bool(cpus) if has_cpu is None else node in has_cpu
        with_mem = total > 0 if has_memory is None else node in has_memory
        if with_mem:
            kind = KIND_DRAM if with_cpu else KIND_FAR
        elif with_cpu:
            kind = KIND_CPU_ONLY
        else:
            continue  # neither CPUs nor memory (e.g. a generic initiator)
        nodes[node] = NodeInfo(node, kind, cpus, total, free, distances, None,
                               _read_perf(ndir), None, meminfo_path=meminfo, initiators=_read_initiators(ndir))
    return nodes


def read_swaps(proc_root: str = "/proc") -> list[SwapDevice]:
    """Active swap areas from /proc/swaps, unresolved: ``block``, ``disk``
    and ``transport`` are filled in by discover()."""
    text = sysfs.read_text(sysfs.path(proc_root, sysfs.PROC_SWAPS)) or ""
    return [SwapDevice(p, t, size, used, prio, None, None, None, False, None)
            for p, t, size, used, prio in sysfs.parse_swaps(text)]


def _is_real_root(sys_root: str, proc_root: str) -> bool:
    return os.path.realpath(sys_root) == "/sys" and os.path.realpath(proc_root) == "/proc"


def _fixture_meta(sys_root: str) -> dict[str, Any]:
    meta = os.path.join(os.path.dirname(os.path.normpath(os.path.abspath(sys_root))), sysfs.FIXTURE_META)
    try:
        with open(meta, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise KvtierOSError(errno.EINVAL, f"read {meta}", str(e)) from None


def _file_device(path: str, sys_root: str, real: bool, meta: Mapping[str, Any]) -> str | None:
    """Block device name holding swap file ``path``, via st_dev ->
    /sys/dev/block/MAJ:MIN. On a fixture tree st_dev comes from the capture's
    metadata, since the file itself is not there to stat."""
    if real:
        try:
            st = os.stat(path)
        except OSError:
            return None
        majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    else:
        majmin = meta.get("swap_files", {}).get(path)
        if not majmin:
            return None
    # Major 0 is an anonymous device (btrfs, overlay, tmpfs): no block device.
    if majmin.startswith("0:"):
        return None
    target = sysfs.readlink(sysfs.path(sys_root, sysfs.DEV_BLOCK_DIR, majmin))
    return os.path.basename(target) if target else None


def _disk_of(sys_root: str, name: str) -> str | None:
    """The /sys/block disk that is or holds block device ``name``."""
    base = sysfs.path(sys_root, sysfs.BLOCK_DIR)
    if os.path.isdir(os.path.join(base, name)):
        return name
    for disk in sysfs.listdir(base):
        if os.path.exists(os.path.join(base, disk, name, sysfs.BLOCK_PARTITION)):
            return disk
    return None


def _transport(sys_root: str, disk: str, depth: int = 0) -> tuple[str, bool]:
    """(transport, is NVMe) of a /sys/block disk. Device-mapper and md disks
    count as NVMe when every device underneath them does."""
    ddir = sysfs.path(sys_root, sysfs.BLOCK_DIR, disk)
    if disk.startswith(("dm-", "md")):
        slaves = sysfs.listdir(os.path.join(ddir, sysfs.BLOCK_SLAVES))
        under = [_disk_of(sys_root, s) for s in slaves]
        nvme = bool(under) and depth < 4 and all(
            u is not None and _transport(sys_root, u, depth + 1)[1] for u in under
        )
        return ("dm" if disk.startswith("dm-") else "md"), nvme
    comps = _link_components(os.path.join(ddir, sysfs.BLOCK_DEVICE_LINK))
    # The namespace's device link points at the controller (.../nvme/nvme0);
    # the name prefix covers fixture trees that lack the link.
    if disk.startswith("nvme") or any(re.match(r"^nvme\d+$", c) for c in comps):
        return "nvme", True
    for prefix in ("zram", "loop"):
        if disk.startswith(prefix):
            return prefix, False
    if any(c.startswith("virtio") for c in comps):
        return "virtio", False
    return "other", False


def _resolve_swap(dev: SwapDevice, sys_root: str, real: bool, meta: Mapping[str, Any]) -> None:
    if dev.type == SWAP_PARTITION:
        block = os.path.basename(dev.path)
    else:
        block = _file_device(dev.path, sys_root, real, meta)
    disk = _disk_of(sys_root, block) if block else None
    if disk is None:
        return
    dev.block, dev.disk = block, disk
    dev.transport, dev.nvme = _transport(sys_root, disk)
    rot = sysfs.read_int(sysfs.path(sys_root, sysfs.BLOCK_DIR, disk, sysfs.BLOCK_ROTATIONAL))
    dev.rotational = None if rot is None else bool(rot)


# ---------------------------------------------------------------------------
# ordering


def _slit_from_cpu(info: NodeInfo, nodes: Mapping[int, NodeInfo]) -> int | None:
    cpu_nodes = [n for n in nodes.values() if n.cpus]
    dists = [c.distances[info.node] for c in cpu_nodes if info.node in c.distances]
    return min(dists) if dists else None


def _order_key(info: NodeInfo) -> tuple:
    inf = math.inf
    lat = info.perf.read_latency_ns if info.perf else None
    return (
        inf if info.memory_tier is None else info.memory_tier,
        inf if lat is None else lat,
        inf if info.slit_from_cpu is None else info.slit_from_cpu,
        0 if info.kind == KIND_FAR else 1,
    )


_KEY_SOURCES = (SRC_MEMTIER, SRC_HMAT, SRC_SLIT, SRC_KIND)
_KEY_FORMATS = {
    SRC_MEMTIER: "memory_tier {cur} > {prev}",
    SRC_HMAT: "HMAT read latency {cur}ns > {prev}ns",
    SRC_SLIT: "SLIT distance {cur} > {prev}",
}
_KIND_DRAM_RANK = -1  # DRAM's place in the kind component, ahead of far (0) and cxl (1)


def _explain(prev: tuple, cur: tuple) -> tuple[str, str]:
    """Which order-key component puts ``cur`` after ``prev``: (source, note)."""
    for order_source, a, b in zip(_KEY_SOURCES, prev, cur):
        if a == b:
            continue
        if order_source == SRC_KIND:
            what = "CPU-less memory after DRAM" if a == _KIND_DRAM_RANK else "CXL after plain far memory"
            return order_source, f"{what} (no measurement separates them)"
        shown = ["unknown" if v == math.inf else v for v in (a, b)]
        return order_source, _KEY_FORMATS[order_source].format(prev=shown[0], cur=shown[1])
    raise AssertionError("tiers are grouped by key, so neighbours differ")


def _group_tiers(nodes: Mapping[int, NodeInfo]) -> list[tuple[str, list[NodeInfo], str, str]]:
    """(kind, nodes, order_source, note) per memory tier, fastest first."""
    dram = [n for n in nodes.values() if n.kind == KIND_DRAM]
    far = [n for n in nodes.values() if n.kind in (KIND_FAR, KIND_CXL)]
    groups: dict[tuple, list[NodeInfo]] = {}
    for n in sorted(far, key=lambda i: i.node):
        groups.setdefault(_order_key(n), []).append(n)
    out: list[tuple[str, list[NodeInfo], str, str]] = []
    prev: tuple | None = None
    if dram:
        out.append((KIND_DRAM, sorted(dram, key=lambda i: i.node), SRC_CPUS, "nodes with CPUs"))
        # DRAM's own key, so the first far tier says what makes it slower.
        prev = min(_order_key(n)[:3] for n in dram) + (_KIND_DRAM_RANK,)
    for key in sorted(groups):
        members = groups[key]
        order_source, note = (_explain(prev, key) if prev is not None
                              else (SRC_NODE, "fastest memory found (no DRAM node)"))
        out.append((members[0].kind, members, order_source, note))
        prev = key
    return out


def _fill_capacity(t: Tier, topo: Topology) -> None:
    if t.kind == KIND_SWAP:
        t.total = sum(s.size for s in t.swap_devices)
        t.free = sum(max(s.size - s.used, 0) for s in t.swap_devices)
    else:
        t.total = sum(topo.nodes[n].total for n in t.nodes)
        t.free = sum(topo.nodes[n].free for n in t.nodes)
    t.capacity = t.total if t.capacity_limit is None else min(t.capacity_limit, t.total)


def _fill_perf(t: Tier, members: list[NodeInfo]) -> None:
    # A tier is as slow as its slowest node: worst latency, lowest bandwidth.
    perfs = [n.perf for n in members if n.perf]

    def worst(attr: str, pick) -> int | None:
        vals = [getattr(p, attr) for p in perfs if getattr(p, attr) is not None]
        return pick(vals) if vals else None

    t.read_latency_ns = worst("read_latency_ns", max)
    t.write_latency_ns = worst("write_latency_ns", max)
    t.read_bandwidth_mbps = worst("read_bandwidth_mbps", min)
    t.write_bandwidth_mbps = worst("write_bandwidth_mbps", min)


# ---------------------------------------------------------------------------
# overrides

_TIER_KEYS = {"name", "nodes", "kind", "capacity"}
_SWAP_KEYS = {"name", "capacity", "enabled"}
_TOP_KEYS = {"tiers", "swap"}


def _check_capacity(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: capacity must be a non-negative integer of bytes, got {value!r}")
    return value


def _check_name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not re.match(r"^[A-Za-z0-9_.-]{1,32}$", value):
        raise ConfigError(f"{key}: tier name must be 1-32 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def validate_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check the shape of a topology override and return it normalised.

    Schema (every key optional)::

        {"tiers": [{"name": "dram", "nodes": [0], "kind": "dram",
                    "capacity": 1 << 34}, ...],
         "swap": true | false | {"enabled": bool, "name": str, "capacity": int}}

    ``tiers`` replaces the discovered memory tiers, in order (the first must
    be DRAM: tier 0 is DRAM everywhere in kvtier). ``kind`` defaults to the
    discovered kind of the nodes; ``capacity`` (bytes) caps what kvtier fills.
    Memory nodes listed in no tier are left unused. ``swap: false`` drops the
    swap tier. Needs no kernel access, so the config loader can call it before
    the loop starts; node existence is checked by discover(). Raises
    ConfigError naming the offending key.
    """
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"topology: expected a mapping, got {type(overrides).__name__}")
    for key in overrides:
        if key not in _TOP_KEYS:
            raise ConfigError(f"topology.{key}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    out: dict[str, Any] = {}
    if "tiers" in overrides:
        tiers = overrides["tiers"]
        if not isinstance(tiers, list) or not tiers:
            raise ConfigError("tiers: must be a non-empty list of tiers")
        seen_nodes: dict[int, str] = {}
        names: set[str] = set()
        norm = []
        for i, spec in enumerate(tiers):
            where = f"tiers[{i}]"
            if not isinstance(spec, Mapping):
                raise ConfigError(f"{where}: must be a mapping with name and nodes")
            for key in spec:
                if key not in _TIER_KEYS:
                    raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(_TIER_KEYS))})")
            for key in ("name", "nodes"):
                if key not in spec:
                    raise ConfigError(f"{where}.{key}: required")
            name = _check_name(spec["name"], f"{where}.name")
            if name in names or name == KIND_SWAP:
                raise ConfigError(f"{where}.name: {name!r} is used twice or reserved for swap")
            names.add(name)
            nodes = spec["nodes"]
            if (
                not isinstance(nodes, list)
                or not nodes
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nodes)
            ):
                raise ConfigError(f"{where}.nodes: must be a non-empty list of node numbers, got {nodes!r}")
            for n in nodes:
                if n in seen_nodes:
                    raise ConfigError(f"{where}.nodes: node {n} is already in tier {seen_nodes[n]!r}")
                seen_nodes[n] = name
            t = {"name": name, "nodes": sorted(nodes)}
            if "kind" in spec:
                if spec["kind"] not in MEMORY_KINDS:
                    raise ConfigError(f"{where}.kind: must be one of {', '.join(MEMORY_KINDS)}, got {spec['kind']!r}")
                t["kind"] = spec["kind"]
            if "capacity" in spec:
                t["capacity"] = _check_capacity(spec["capacity"], f"{where}.capacity")
            norm.append(t)
        if norm[0].get("kind", KIND_DRAM) != KIND_DRAM:
            raise ConfigError("tiers[0].kind: the first tier must be dram (tier 0 is DRAM)")
        if len(norm) > _TIER_INT8_MAX:
            raise ConfigError(f"tiers: at most {_TIER_INT8_MAX} tiers")
        out["tiers"] = norm
    if "swap" in overrides:
        swap = overrides["swap"]
        if isinstance(swap, bool):
            swap = {"enabled": swap}
        if not isinstance(swap, Mapping):
            raise ConfigError(f"swap: must be true, false or a mapping, got {swap!r}")
        for key in swap:
            if key not in _SWAP_KEYS:
                raise ConfigError(f"swap.{key}: unknown key (known: {', '.join(sorted(_SWAP_KEYS))})")
        norm_swap: dict[str, Any] = {"enabled": swap.get("enabled", True)}
        if not isinstance(norm_swap["enabled"], bool):
            raise ConfigError(f"swap.enabled: must be true or false, got {norm_swap['enabled']!r}")
        if "name" in swap:
            norm_swap["name"] = _check_name(swap["name"], "swap.name")
            if "tiers" in out and norm_swap["name"] in {t["name"] for t in out["tiers"]}:
                raise ConfigError(f"swap.name: {norm_swap['name']!r} is already a memory tier's name")
        if "capacity" in swap:
            norm_swap["capacity"] = _check_capacity(swap["capacity"], "swap.capacity")
        out["swap"] = norm_swap
    return out


def _override_groups(
    spec: list[dict[str, Any]], nodes: Mapping[int, NodeInfo], warnings: list[str] | None = None,
    kept: list[dict[str, Any]] | None = None,
) -> list[tuple[str, list[NodeInfo], str, str]]:
    """``warnings`` given (re-discovery after hot-plug): a configured node
    that went offline is left out with a warning instead of refusing the
    config, and a tier left without nodes is dropped (tier 0 never is)."""
    out = []
    for i, t in enumerate(spec):
        members = []
        for n in t["nodes"]:
            info = nodes.get(n)
            if (info is None or info.kind == KIND_CPU_ONLY) and warnings is not None:
                warnings.append(f"tiers[{i}] ({t['name']}): node {n} is offline, left out until it returns")
                continue
            if info is None or info.kind == KIND_CPU_ONLY:
                have = ", ".join(str(m) for m, x in sorted(nodes.items()) if x.kind != KIND_CPU_ONLY)
                raise ConfigError(f"tiers[{i}].nodes: node {n} is not an online memory node (have {have})")
            members.append(info)
        if not members and i > 0:
            continue
        if kept is not None:
            kept.append(t)
        kinds = {m.kind for m in members}
        kind = t.get("kind")
        if kind is None:
            if len(kinds) > 1:
                raise ConfigError(
                    f"tiers[{i}].kind: nodes {t['nodes']} have different kinds ({', '.join(sorted(kinds))}); set kind"
                )
            kind = kinds.pop()
        if i == 0 and kind != KIND_DRAM:
            raise ConfigError(f"tiers[0].kind: the first tier must be dram, nodes {t['nodes']} are {kind}")
        out.append((kind, members, SRC_CONFIG, "order from config"))
    return out


# ---------------------------------------------------------------------------
# discovery


def discover(
    sys_root: str = "/sys",
    proc_root: str = "/proc",
    overrides: Mapping[str, Any] | None = None,
    *,
    hotplug: bool = False,
    memory_tiers: Mapping[int, int] | None = None,
) -> Topology:
    """Read the machine's memory tiers below ``sys_root``/``proc_root``.

    ``overrides`` follows ``validate_overrides``; ConfigError names the bad
    key. Missing optional kernel features (memory tiers, HMAT, CXL, swap)
    degrade to warnings in ``Topology.warnings``. ``hotplug``: a
    re-discovery after memory went offline, where a configured node that is
    gone is a warning (its tier shrinks or goes), not a config error.

    ``memory_tiers``: node -> kernel memory tier id to use instead of
    reading ``memory_tiering/memory_tierN/nodelist`` (a node missing from it
    has none). While memory goes offline that read can deadlock the kernel
    (6.12, seen in the guest): the offline holds ``memory_tier_lock`` while it
    unregisters a memory tier that lost its last node, and waits for the
    readers of that tier's ``nodelist`` to leave; a reader inside
    ``nodelist_show`` waits for ``memory_tier_lock``. Both stay in D state for
    good, the reader being kvtierd's event loop. A re-discovery after memory
    went away passes the tiers it knew (``Topology.memory_tier_map``).
    """
    ov = validate_overrides(overrides)
    warnings: list[str] = []
    nodes = _read_nodes(sys_root, proc_root, warnings)

    memtiers = _read_memory_tiers(sys_root) if memory_tiers is None else dict(memory_tiers)
    if memtiers is None:
        warnings.append("kernel memory tiers absent (no memory_tiering in sysfs): ordering by HMAT/SLIT")
    for info in nodes.values():
        info.memory_tier = (memtiers or {}).get(info.node)
        info.slit_from_cpu = _slit_from_cpu(info, nodes)
    far = [n.node for n in nodes.values() if n.kind == KIND_FAR]
    for node, why in _cxl_evidence(sys_root, far).items():
        nodes[node].kind, nodes[node].cxl = KIND_CXL, why
    if far and not any(n.perf for n in nodes.values()):
        warnings.append("no HMAT performance data (node*/access*/initiators): far tiers ordered without latencies")
    if not any(n.kind == KIND_DRAM for n in nodes.values()):
        warnings.append("no memory node has CPUs: tier 0 is not DRAM")

    topo = Topology([], nodes, [], {}, sys_root, proc_root, warnings, signature=node_signature(sys_root))
    specs: list[dict[str, Any]] | None = None
    if "tiers" in ov:
        specs = []
        groups = _override_groups(ov["tiers"], nodes, warnings if hotplug else None, specs)
    else:
        groups = _group_tiers(nodes)
    _add_memory_tiers(topo, groups, specs)

    real = _is_real_root(sys_root, proc_root)
    meta = {} if real else _fixture_meta(sys_root)
    swaps = read_swaps(proc_root)
    for dev in swaps:
        _resolve_swap(dev, sys_root, real, meta)
    # NVMe first, then SSD before spinning disk, then the kernel's own order.
    swaps.sort(key=lambda s: (not s.nvme, s.rotational is not False, -s.priority))
    topo.swap_devices = swaps
    _add_swap_tier(topo, ov.get("swap", {"enabled": True}))
    for t in topo.tiers:
        _fill_capacity(t, topo)
    return topo


def _add_memory_tiers(
    topo: Topology, groups: list[tuple[str, list[NodeInfo], str, str]], specs: list[dict[str, Any]] | None
) -> None:
    counters: dict[str, int] = {}
    for i, (kind, members, order_source, note) in enumerate(groups):
        spec = specs[i] if specs else {}
        n = counters.get(kind, 0)
        counters[kind] = n + 1
        # "dram" for the first DRAM tier, then far0, cxl0, far1... by kind.
        name = spec.get("name") or (KIND_DRAM if kind == KIND_DRAM and n == 0 else f"{kind}{n}")
        tier = Tier(i, name, kind, tuple(m.node for m in members), 0, 0, 0, order_source=order_source,
                    capacity_limit=spec.get("capacity"))
        tier.notes.append(note)
        tier.notes.extend(f"cxl: {m.cxl}" for m in members if m.cxl)
        if tier.capacity_limit is not None:
            tier.notes.append(f"capacity capped at {_human(tier.capacity_limit)}")
        _fill_perf(tier, members)
        topo.tiers.append(tier)
        topo.node_to_tier.update((m.node, i) for m in members)
    topo.unassigned_nodes = tuple(
        sorted(n for n, x in topo.nodes.items() if x.kind != KIND_CPU_ONLY and n not in topo.node_to_tier)
    )
    if topo.unassigned_nodes:
        topo.warnings.append(f"memory nodes in no tier (config): {list(topo.unassigned_nodes)}")


def _add_swap_tier(topo: Topology, spec: Mapping[str, Any]) -> None:
    swaps = topo.swap_devices
    if spec.get("name") in {t.name for t in topo.tiers}:
        raise ConfigError(f"swap.name: {spec['name']!r} is already a memory tier's name")
    if not swaps:
        topo.warnings.append("no active swap device (/proc/swaps): no swap tier")
        return
    if not spec["enabled"]:
        return
    t = Tier(len(topo.tiers), spec.get("name", KIND_SWAP), KIND_SWAP, (), 0, 0, 0,
             order_source=SRC_SWAP, swap_devices=tuple(swaps), nvme=any(s.nvme for s in swaps),
             capacity_limit=spec.get("capacity"))
    t.notes.append("swap is always last")
    t.notes.extend(_swap_note(s) for s in swaps)
    if t.nvme:
        # The kernel, not kvtier, picks the swap device: highest priority first.
        best_nvme = max(s.priority for s in swaps if s.nvme)
        slower = [s.path for s in swaps if not s.nvme and s.priority > best_nvme]
        if slower:
            topo.warnings.append(f"swap {', '.join(slower)} has a higher priority than the NVMe swap: "
                                 "the kernel pages out to it first")
    if t.capacity_limit is not None:
        t.notes.append(f"capacity capped at {_human(t.capacity_limit)}")
    topo.tiers.append(t)


def _swap_note(s: SwapDevice) -> str:
    where = s.disk or "unknown device"
    if s.block and s.disk and s.block != s.disk:
        where = f"{s.block} on {s.disk}"
    flags = [s.transport or "unknown"]
    if s.rotational:
        flags.append("rotational")
    return f"{s.type} {s.path} ({where}, {', '.join(flags)}, prio {s.priority})"


# ---------------------------------------------------------------------------
# presentation


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n}B"


def _pair(a: int | None, b: int | None, fmt) -> str:
    if a is None and b is None:
        return "-"
    return f"{fmt(a)}/{fmt(b)}"


def format_table(topology: Topology) -> str:
    """An aligned text table of the tiers (kvtierctl topology)."""
    def num(v):
        return "?" if v is None else str(v)

    def gbps(v):
        return "?" if v is None else f"{v / 1000:.1f}"

    header = ("TIER", "NAME", "KIND", "NODES", "TOTAL", "FREE", "LATENCY r/w ns", "BW r/w GB/s", "NOTES")
    rows = []
    for t in topology.tiers:
        nodes = ",".join(str(n) for n in t.nodes) or "-"
        notes = list(t.notes)
        if t.nvme:
            notes.insert(0, "nvme")
        rows.append(
            (
                str(t.index),
                t.name,
                t.kind,
                nodes,
                _human(t.total),
                _human(t.free),
                _pair(t.read_latency_ns, t.write_latency_ns, num),
                _pair(t.read_bandwidth_mbps, t.write_bandwidth_mbps, gbps),
                "; ".join(notes),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths)]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    for w in topology.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# re-discovery (memory hot-plug: kernel/uevents.py)


def node_signature(sys_root: str) -> tuple[str | None, ...]:
    """The kernel's online and has_memory node lists, as text: they change
    when a NUMA node is hot-added or removed or its last memory block goes
    offline (the node then stays online, without memory)."""
    base = _node_path(sys_root)
    return tuple(sysfs.read_text(os.path.join(base, f)) for f in (sysfs.NODE_ONLINE, sysfs.NODE_HAS_MEMORY))


@dataclass
class TopologyChange:
    """What a re-discovery changed. ``index_map[i]`` is the new index of old
    tier ``i`` (TIER_UNKNOWN when it is gone): BlockTable.tier and pin_tier
    are rewritten through it, so a tier inserted before swap does not turn
    every swapped block into a CXL block."""

    index_map: np.ndarray  # int8, one per old tier
    added: list[Tier]
    removed: list[Tier]
    nodes_added: tuple[int, ...]
    nodes_removed: tuple[int, ...]

    @property
    def reshaped(self) -> bool:
        """Tiers came, went or were renumbered (not just sizes changing)."""
        return bool(self.added or self.removed) or \
            not np.array_equal(self.index_map, np.arange(self.index_map.size, dtype=np.int8))


def compare(old: Topology, new: Topology) -> TopologyChange:
    """Match tiers of two discoveries by what they are made of: a memory
    tier by the nodes it shares (the one sharing most wins; names are
    generated and a new tier can shift them), swap by being swap."""
    index_map = np.full(len(old.tiers), TIER_UNKNOWN, dtype=np.int8)
    matched: set[int] = set()
    for t in old.tiers:
        if t.kind == KIND_SWAP:
            cand = [(1, n.index) for n in new.tiers if n.kind == KIND_SWAP]
        else:
            cand = [(len(set(t.nodes) & set(n.nodes)), n.index) for n in new.tiers if n.kind != KIND_SWAP]
            cand = [c for c in cand if c[0] > 0]
        cand = [c for c in cand if c[1] not in matched]
        if cand:
            best = max(cand)[1]
            index_map[t.index] = best
            matched.add(best)
    old_nodes = {n for t in old.tiers for n in t.nodes}
    new_nodes = {n for t in new.tiers for n in t.nodes}
    return TopologyChange(
        index_map=index_map,
        added=[t for t in new.tiers if t.index not in matched],
        removed=[t for t in old.tiers if index_map[t.index] == TIER_UNKNOWN],
        nodes_added=tuple(sorted(new_nodes - old_nodes)),
        nodes_removed=tuple(sorted(old_nodes - new_nodes)),
    )
