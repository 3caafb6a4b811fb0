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

import math

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

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
class RecordedMachine:
    """The migrator and tick clock of the machine a kvtierd recording was
    made on (kvtier.sim.recording reads them from its ``# move`` and
    ``# tick`` lines). With it the engine runs the daemon's own scheme
    instead of the per-tick budget: one move job at a time, planned at a
    tick, taking ``overhead_s`` plus, per tier pair, ``latency_s + bytes /
    bytes_per_s`` (pairs the recording never moved between take the tiers'
    ``migrate_gbps``); its moves land when it ends, and a tick while it runs
    makes no plan. Blocks start in the tier the daemon first found them
    in (``first_tier``: the kernel's placement, DRAM past kvtier's share of
    it included), not by the model's first touch. A job the replay plans at the tick a recorded job was
    planned at, with the same blocks per tier pair, takes that job's recorded
    time (``jobs``): where the replay does what the daemon did, it takes as
    long as it took, stalls of the loaded machine included. Ticks fall at
    ``tick_times`` (seconds from the start), late and lost ticks included,
    then every ``tick_s`` after the last."""

    tick_times: tuple[float, ...] = ()
    bytes_per_s: dict = field(default_factory=dict)  # (src, dst) tier index -> bytes per mover second
    latency_s: dict = field(default_factory=dict)  # (src, dst) -> fixed seconds per batch
    overhead_s: float = 0.0  # from plan to results in the table, beyond the batches themselves
    swap_faults: bool = True  # a read of a swapped block faults it back (False: the reads never touched memory)
    # recorded jobs: (plan time rounded to 1 us, ((src, dst, blocks), ...) sorted) -> seconds to results
    jobs: dict = field(default_factory=dict)
    # per block (dense id): the tier the daemon first measured it in (-1: never), i.e. where the
    # kernel put it; the replay of the recorded tiers places blocks there, not by first touch
    first_tier: np.ndarray | None = field(default=None, compare=False)
    # (tick time, last decay before it, that step's seconds): where the daemon's temperatures
    # stood at a tick whose predecessor was not recorded (the first, one after an empty table)
    tick_clock: tuple = ()

    @staticmethod
    def job_key(planned: float, pairs) -> tuple:
        return round(float(planned), 6), tuple(sorted((int(s), int(d), int(n)) for s, d, n in pairs))

    def job_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, tiers,
                    planned: float | None = None) -> float:
        """How long the recorded migrator takes for these moves (one job
        planned at ``planned``)."""
        if src.size == 0:
            return 0.0
        pair = src.astype(np.int64) * 256 + dst.astype(np.int64)
        uniq, inv = np.unique(pair, return_inverse=True)
        inv = inv.ravel()
        if planned is not None and self.jobs:
            counts = np.bincount(inv, minlength=uniq.size)
            key = self.job_key(planned, ((*divmod(p, 256), n) for p, n in zip(uniq.tolist(), counts.tolist())))
            if key in self.jobs:
                return self.jobs[key]
        total = np.bincount(inv, weights=nbytes.astype(np.float64), minlength=uniq.size)
        sec = self.overhead_s
        for k, p in enumerate(uniq.tolist()):
            key = divmod(p, 256)
            bps = self.bytes_per_s.get(key)
            if bps is None:  # never seen on the recorded machine: the tier model's figure
                bps = min(tiers[key[0]].migrate_gbps, tiers[key[1]].migrate_gbps) * 1e9
            sec += self.latency_s.get(key, 0.0) + float(total[k]) / bps
        return sec


@dataclass(frozen=True)
class SimConfig:
    tiers: tuple[SimTier, ...] = DEFAULT_TIERS
    tick_s: float = 1.0
    # migrator budget is per tick and per direction, min(migrate_gbps) of the pair;
    # a recording's own migrator and tick clock instead, when given
    machine: RecordedMachine | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("sim: at least one tier")
        for t in self.tiers:
            if t.kind not in TIER_KINDS:
                raise ConfigError(f"sim: tier {t.name}: kind must be one of {TIER_KINDS}")
            if t.capacity_bytes <= 0 or t.read_gbps <= 0 or t.migrate_gbps <= 0 or t.latency_ns < 0:
                raise ConfigError(f"sim: tier {t.name}: capacity, bandwidths must be > 0")
        if not (self.tick_s > 0 and math.isfinite(self.tick_s)):
            raise ConfigError(f"sim: tick_s must be a positive number of seconds, got {self.tick_s!r}")

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
