"""What the engine and the metrics collector ask of the kernel adapters.

The engine (snapshot, decide, act) and the metrics collector import nothing
from ``kvtier.kernel``: that keeps them runnable against fakes and the layout
honest (tests/unit/test_layout.py). They still call the topology, the
migrator and the hotness sources, so these Protocols name exactly the part
they use. ``kvtier.kernel.topology.Topology``, ``kvtier.kernel.migrator.Migrator``
and the sources in ``kvtier.kernel.sources`` satisfy them structurally;
tests/unit/test_ports.py checks that on the real objects, so a renamed
attribute fails a test instead of a tick.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from kvtier.blocks import BlockTable


@runtime_checkable
class TierInfo(Protocol):
    """One memory tier (kvtier.kernel.topology.Tier)."""

    index: int  # 0 = fastest
    name: str
    kind: str  # dram, far, cxl, swap
    nodes: tuple[int, ...]
    total: int  # bytes of the tier's nodes or swap devices
    free: int  # bytes free at the last refresh
    capacity: int  # bytes kvtier may fill


@runtime_checkable
class NodeFree(Protocol):
    free: int


@runtime_checkable
class TopologyView(Protocol):
    """The machine's tiers as discovered (kvtier.kernel.topology.Topology)."""

    tiers: Sequence[TierInfo]
    nodes: Mapping[int, NodeFree]
    warnings: list[str]

    @property
    def swap_tier(self) -> TierInfo | None: ...

    def refresh_free(self) -> None: ...

    def node_tier_lut(self) -> np.ndarray: ...

    def node_for(self, tier_idx: int, pid: int) -> tuple[int, str]: ...  # the node a pid's block goes to, and why


class ResidencyView(Protocol):
    node_pages: np.ndarray  # (blocks, nodes) resident pages per node
    swapped: np.ndarray  # (blocks,) pages in swap


class MoveOutcome(Protocol):
    errors: dict[str, int]  # pages by errno name
    block_ok: np.ndarray | None
    block_unmovable: np.ndarray | None
    block_untouched: np.ndarray | None  # no page written yet: never touched, nothing moved
    block_done: np.ndarray | None  # pages that ended at the target, per block
    block_reason: np.ndarray | None  # STUCK_* evidence per block, or None
    dry_run: bool


@runtime_checkable
class MigratorPort(Protocol):
    """Measures and moves pages (kvtier.kernel.migrator.Migrator). Called on
    the engine's worker thread only."""

    dry_run: bool
    page_size: int
    max_node: int  # highest NUMA node it moves to; raised when a node is hot-added

    def query_nodes(self, pid: int, addrs: np.ndarray) -> np.ndarray: ...

    def mapped_blocks(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> np.ndarray: ...

    def residency(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> ResidencyView: ...

    def move(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int, node: int) -> MoveOutcome: ...

    def pageout(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> MoveOutcome: ...

    def pagein(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int, node: int) -> MoveOutcome: ...


class ObservationView(Protocol):
    source: str  # which hotness source (recordings name it)
    rows: np.ndarray  # BlockTable rows as at the last set_targets
    counts: np.ndarray
    weight: float
    prefetch: np.ndarray  # rows the source expects read soon (paged in from swap)
    pending: np.ndarray  # rows seen read, not credited until the source's next collect agrees

    def __len__(self) -> int: ...


class AvailabilityView(Protocol):
    """A probe's answer: true if the source runs; ``reason`` says why (not)."""

    reason: str

    def __bool__(self) -> bool: ...


@runtime_checkable
class HotnessSource(Protocol):
    """A hotness source (kvtier.kernel.sources.base.Source): set_targets on
    the loop thread between jobs, collect on the worker inside one."""

    name: str

    def set_targets(self, table: BlockTable) -> None: ...

    def collect(self, now: float) -> ObservationView: ...

    def close(self) -> None: ...


@runtime_checkable
class RecorderPort(Protocol):
    """What the registry and the engine report to the recording
    (kvtier.record.Recorder, when [record] is on)."""

    def region_added(self, region_id: int) -> None: ...

    def region_removed(self, region_id: int) -> None: ...

    def hint(self, region_id: int, blocks: np.ndarray, counts: np.ndarray | None) -> None: ...

    def observed(self, source: str, rows: np.ndarray, counts: np.ndarray, weight: float) -> None: ...

    def config(self, tiers: list, policy: object) -> None: ...

    def placed(self, cause: str = "move") -> None: ...

    def ticked(self, at: float, busy: bool) -> None: ...

    def move_started(self, started: float, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None: ...

    def moved(self, started: float, finished: float, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
              ok: np.ndarray, seconds: dict, failures: dict) -> None: ...
