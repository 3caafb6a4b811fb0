"""Placement at allocation: which tier and NUMA node a new pool goes to.

Pure: ``choose`` sees a description of the tiers (room left, nodes, their
free memory, distance from the caller, movability) and returns a decision or
raises. The server collects that description from the engine and the kernel
adapters (kvtier.kernel.affinity); the client library applies the decision
with mbind before the pool's first touch.

The rule:
  * ``tier="auto"``: the fastest memory tier with room for the whole pool:
    below its high watermark (placing above it would make the policy demote
    something at once) and within the node's free memory; tier 0 also within
    the tenant's DRAM quota. A named tier is used or refused, never swapped
    for another.
  * within a tier of several nodes (two CXL expanders, two sockets' DRAM):
    the node nearest the caller's CPUs by SLIT distance, then the lower HMAT
    read latency, then the most free memory.
  * ``pinned``: the engine will pin the pages, so they can never be moved or
    swapped: swap is refused, and so is a node whose memory is all
    ZONE_MOVABLE, because the kernel migrates pages out of ZONE_MOVABLE before
    a long-term pin and the pool would silently land somewhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .errors import InvalidArgument, KvtierError


class NoRoom(KvtierError):
    code = "limit_exceeded"


@dataclass(frozen=True)
class NodeRoom:
    node: int
    free: int
    movable_only: bool = False
    distance: int | None = None  # SLIT distance from the nearest of the caller's nodes
    read_latency_ns: int | None = None


@dataclass(frozen=True)
class TierRoom:
    index: int
    name: str
    kind: str
    room: float  # bytes kvtier may still place here before the high watermark
    nodes: tuple[NodeRoom, ...] = ()


@dataclass(frozen=True)
class Placement:
    tier: int
    tier_name: str
    node: int
    reason: str
    skipped: tuple[str, ...] = field(default=())


MOVABLE_WHY = ("its memory is all ZONE_MOVABLE (CXL memory onlined by dax kmem usually is), and the kernel "
               "migrates pages out of ZONE_MOVABLE before a long-term pin, so a pinned pool would silently "
               "land elsewhere; online the memory as ZONE_NORMAL or allocate the pool unpinned")


def rooms(
    tiers: Sequence,  # policy.TierState
    target: Sequence[float],  # bytes kvtier may fill per tier (PolicyConfig.target_bytes)
    high_wm: float,
    reserved: Sequence[float],  # bytes placed by allocate but not measured yet
    nodes: Mapping[int, tuple[int, bool, int | None, int | None]],  # node -> (free, movable_only, distance, latency)
    tier_nodes: Mapping[int, Sequence[int]],
    tenant_room0: float = math.inf,
) -> list[TierRoom]:
    """The tiers as ``choose`` sees them."""
    out = []
    for t in tiers:
        room = target[t.index] * high_wm - t.used_bytes - reserved[t.index]
        if t.index == 0:
            room = min(room, tenant_room0)
        members = tuple(NodeRoom(n, *nodes[n]) for n in tier_nodes.get(t.index, ()) if n in nodes)
        out.append(TierRoom(t.index, t.name, t.kind, room, members))
    return out


def _pick_node(nbytes: int, t: TierRoom, pinned: bool, skipped: list[str]) -> NodeRoom | None:
    fits = []
    for n in t.nodes:
        if pinned and n.movable_only:
            skipped.append(f"{t.name}: node {n.node} refused for a pinned pool: {MOVABLE_WHY}")
        elif n.free < nbytes:
            skipped.append(f"{t.name}: node {n.node} has {n.free} bytes free, the pool needs {nbytes}")
        else:
            fits.append(n)
    if not fits:
        return None
    far = 1 << 30
    return min(fits, key=lambda n: (far if n.distance is None else n.distance,
                                    far if n.read_latency_ns is None else n.read_latency_ns, -n.free, n.node))


def choose(nbytes: int, tiers: Sequence[TierRoom], want: int | None, pinned: bool) -> Placement:
    """Place ``nbytes``; ``want`` is a tier index or None for auto."""
    by_index = {t.index: t for t in tiers}
    if want is not None:
        if want not in by_index:
            raise InvalidArgument(f"no tier {want} (tiers: {', '.join(t.name for t in tiers) or 'none'})")
        candidates = [by_index[want]]
    else:
        candidates = [t for t in sorted(tiers, key=lambda t: t.index) if t.kind != "swap"]
    skipped: list[str] = []
    for t in candidates:
        if t.kind == "swap":
            raise InvalidArgument(
                f"tier {t.name} is swap: allocate places memory on a NUMA node"
                + (" (and a pinned pool can never be swapped)" if pinned else "; blocks reach swap by moving"))
        if t.room < nbytes:
            skipped.append(f"{t.name}: {max(0, int(t.room))} bytes of room below its high watermark"
                           f" (and the tenant's quota), the pool needs {nbytes}")
            continue
        node = _pick_node(nbytes, t, pinned, skipped)
        if node is None:
            continue
        how = "the tier asked for" if want is not None else (
            "the fastest tier with room" if not skipped else "the fastest tier with room after " + "; ".join(skipped))
        near = "" if node.distance is None else f", distance {node.distance} from the caller's CPUs"
        return Placement(t.index, t.name, node.node, f"{how}: node {node.node}{near}", tuple(skipped))
    if want is not None and pinned and any("ZONE_MOVABLE" in s for s in skipped):
        raise InvalidArgument("; ".join(skipped))
    raise NoRoom("no tier can take the pool: " + ("; ".join(skipped) or "no memory tier"))
