"""Tier and cost model of the simulator; defaults and their sources are in docs/simulator.md.

A block access costs ``latency_ns + block_bytes / read_gbps`` on the tier it
sits in (a decode step streams the whole block). Moving a block between two
tiers costs ``block_bytes / min(migrate_gbps of both)`` of migrator time; the
migrator is given ``migrate_gbps`` of the slower side per tick.

Every number can be overridden from a TOML file:

    tick_s = 1.0
    [[tier]]
    name = "dram"
    kind = "dram"
    capacity_gib = 64
    latency_ns = 100
    read_gbps = 40
    migrate_gbps = 8
    usd_per_gb = 3.0
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..errors import ConfigError
from ..policy import TIER_KINDS, TierState

GIB = 1 << 30


@dataclass(frozen=True)
class SimTier:
    name: str
    kind: str
    capacity_bytes: int
    latency_ns: float
    read_gbps: float  # sustained read bandwidth available to one decode stream
    migrate_gbps: float  # what move_pages / swap I/O achieves into or out of it
    usd_per_gb: float

    def access_ns(self, block_bytes: int) -> float:
        return self.latency_ns + block_bytes / self.read_gbps  # bytes / (GB/s) = ns

    def state(self, index: int) -> TierState:
        return TierState(index, self.name, self.kind, self.capacity_bytes)


# Defaults: see docs/simulator.md for where each figure comes from.
DEFAULT_TIERS = (
    SimTier("dram", "dram", 64 * GIB, latency_ns=100.0, read_gbps=40.0, migrate_gbps=4.0, usd_per_gb=3.0),
    SimTier("cxl", "cxl", 256 * GIB, latency_ns=250.0, read_gbps=20.0, migrate_gbps=4.0, usd_per_gb=1.5),
)
DEFAULT_SWAP = SimTier(
    "swap", "swap", 1024 * GIB, latency_ns=80_000.0, read_gbps=3.0, migrate_gbps=2.0, usd_per_gb=0.08
)


@dataclass(frozen=True)
class SimConfig:
    tiers: tuple[SimTier, ...] = DEFAULT_TIERS
    tick_s: float = 1.0
    # migrator budget is per tick and per direction, min(migrate_gbps) of the pair

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("sim: at least one tier")
        for t in self.tiers:
            if t.kind not in TIER_KINDS:
                raise ConfigError(f"sim: tier {t.name}: kind must be one of {TIER_KINDS}")
            if t.capacity_bytes <= 0 or t.read_gbps <= 0 or t.migrate_gbps <= 0 or t.latency_ns < 0:
                raise ConfigError(f"sim: tier {t.name}: capacity, bandwidths must be > 0")
        if self.tick_s <= 0:
            raise ConfigError("sim: tick_s must be > 0")

    def with_capacities(self, gib: list[float]) -> "SimConfig":
        ts = list(self.tiers)
        for i, g in enumerate(gib[: len(ts)]):
            ts[i] = replace(ts[i], capacity_bytes=int(g * GIB))
        return replace(self, tiers=tuple(ts))

    def with_swap(self) -> "SimConfig":
        if any(t.kind == "swap" for t in self.tiers):
            return self
        return replace(self, tiers=self.tiers + (DEFAULT_SWAP,))


_TIER_KEYS = {f.name for f in fields(SimTier)} - {"capacity_bytes"} | {"capacity_gib"}


def load_config(path: str | Path) -> SimConfig:
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    tiers = []
    defaults = {t.name: t for t in DEFAULT_TIERS + (DEFAULT_SWAP,)}
    for i, d in enumerate(doc.get("tier", [])):
        unknown = set(d) - _TIER_KEYS
        if unknown:
            raise ConfigError(f"{path}: tier {i}: unknown keys {sorted(unknown)}")
        base = defaults.get(d.get("name", ""), defaults.get(d.get("kind", ""), DEFAULT_TIERS[-1]))
        kw = {k: v for k, v in d.items() if k != "capacity_gib"}
        if "capacity_gib" in d:
            kw["capacity_bytes"] = int(float(d["capacity_gib"]) * GIB)
        tiers.append(replace(base, **kw))
    extra = set(doc) - {"tier", "tick_s"}
    if extra:
        raise ConfigError(f"{path}: unknown keys {sorted(extra)}")
    return SimConfig(tuple(tiers) if tiers else DEFAULT_TIERS, float(doc.get("tick_s", 1.0)))
