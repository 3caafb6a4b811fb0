"""Hotness sources: DAMON, page access bits, perf samples (interface in base.py).

``build`` turns the ``[hotness]`` config table into source objects (no I/O)
and ``probe_all`` probes each once, giving the table the daemon logs at start
and serves in its status: which source runs, and why each other one does not.

    [hotness.damon]        enabled, sample_us, aggr_us, update_us, min_nr_regions, max_nr_regions
    [hotness.access_bits]  enabled, mode ("auto" | "page_idle" | "kpageflags")
    [hotness.perf_fault]   enabled, prefetch_blocks, ring_pages
    [hotness.perf]         enabled, sample_period, ring_pages   (PEBS/IBS loads)

Client hints need no source object: the server hands them straight to
hotness.Temperature.add_region_hints.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.kernel.sources.accessbits import AccessBitSource
from kvtier.kernel.sources.base import Availability, BlockIndex, Observation, Source
from kvtier.kernel.sources.damon import DamonParams, DamonSource
from kvtier.kernel.sources.perf import LoadSampleSource, MajorFaultSource
from kvtier.kernel.sysfs_io import SysfsIO

__all__ = [
    "Availability", "BlockIndex", "Observation", "Source", "build", "probe_all", "SECTIONS",
]

# config sub-table -> (keys it takes besides "enabled", enabled by default)
SECTIONS: dict[str, tuple[tuple[str, ...], bool]] = {
    "damon": (("sample_us", "aggr_us", "update_us", "min_nr_regions", "max_nr_regions"), True),
    "access_bits": (("mode",), True),
    "perf_fault": (("prefetch_blocks", "ring_pages"), True),
    "perf": (("sample_period", "ring_pages"), True),
}


def _section(hotness: dict[str, Any], name: str) -> tuple[bool, dict[str, Any]]:
    keys, default_on = SECTIONS[name]
    table = hotness.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"hotness.{name}: expected a table")
    unknown = set(table) - set(keys) - {"enabled"}
    if unknown:
        raise ConfigError(f"hotness.{name}: unknown key(s) {', '.join(sorted(unknown))} (known: enabled, {', '.join(keys)})")
    enabled = table.get("enabled", default_on)
    if not isinstance(enabled, bool):
        raise ConfigError(f"hotness.{name}.enabled: expected true or false")
    return enabled, {k: v for k, v in table.items() if k != "enabled"}


def build(hotness: dict[str, Any] | None, sys_root: str = "/sys", proc_root: str = "/proc",
          *, dry_run: bool = False) -> list[Source]:
    """The enabled sources, most precise first. Raises ConfigError naming the key."""
    hotness = hotness or {}
    out: list[Source] = []
    try:
        on, kw = _section(hotness, "perf")
        if on:
            out.append(LoadSampleSource(sys_root, proc_root, **kw))
        on, kw = _section(hotness, "damon")
        if on:
            out.append(DamonSource(SysfsIO(sys_root, dry_run=dry_run), DamonParams(**kw), proc_root))
        on, kw = _section(hotness, "access_bits")
        if on:
            out.append(AccessBitSource(sys_root, proc_root, **kw))
        on, kw = _section(hotness, "perf_fault")
        if on:
            out.append(MajorFaultSource(sys_root, proc_root, **kw))
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"hotness: {e}") from None
    return out


def probe_all(sources: list[Source], *, exclusive_sampling: bool = True,
              known: dict[str, Availability] | None = None) -> dict[str, Availability]:
    """Probe every source once, except those named in ``known`` (a reload
    keeps what it did not change). With ``exclusive_sampling``, access bits
    are not used where DAMON runs: both would clear the same page-table
    accessed bits and each would see only what the other left."""
    table: dict[str, Availability] = {}
    for source in sources:
        if known and source.name in known:
            table[source.name] = known[source.name]
        elif exclusive_sampling and source.name == "access_bits" and table.get("damon"):
            table[source.name] = Availability(False, "not needed: DAMON vaddr runs (both would clear the same accessed bits)")
        else:
            table[source.name] = source.probe()
    return table
