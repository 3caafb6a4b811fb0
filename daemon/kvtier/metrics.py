"""Prometheus metrics, pulled from the daemon's state at scrape time.

Nothing here keeps its own counters: ``Collector.collect`` reads
``DaemonStats`` (the counters), the ``Registry`` (regions, tenants), the
``Topology`` (tier capacities) and a ``Summary`` of the ``BlockTable``
(bytes per tier, tenant and region, temperatures, access ages) and yields
fresh metric families on every scrape, in the manner of
prometheus/client_python's custom collectors. In the daemon the summary is
kept up to date a bounded number of rows per tick (kvtier.summary), so a
scrape costs the same at 1 TiB registered as at 1 GiB; a Collector built
without one sums the table itself at every scrape (tests, tools).

The exporter serves its own ``CollectorRegistry`` (never the process-global
one) on a loopback address by default: block placement of other tenants is
not something to publish on every interface.

Threading: the HTTP server answers on its own thread while the event loop
mutates the BlockTable. The daemon's summary is replaced whole by the loop
thread, never modified, so a scrape reads one consistent Summary; a region
removed since can at worst leave one scrape's per-region numbers stale,
never raise. Counters in DaemonStats are read without locks (see stats.py).

docs/metrics.md lists every metric; tests/unit/test_metrics_unit.py keeps
that list and ``METRICS`` equal.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
import http.server
import socket
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.exposition import MetricsHandler

from kvtier import __version__, ages, protocol
from kvtier.blocks import STUCK_NAMES, TIER_MIXED, TIER_UNKNOWN, BlockTable
from kvtier.summary import TEMP_BUCKETS, BlockSummarizer, Summary
from kvtier.ports import TierInfo, TopologyView
from kvtier.registry import Registry
from kvtier.stats import MIGRATION_BUCKETS, TICK_BUCKETS, DaemonStats, Histogram, le_label

DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 9464  # the port Prometheus' own exporter list keeps for OpenTelemetry-style exporters

# The hint "source" as kvtier_hotness_source_active names it.
HINT_SOURCE = "hint"
HINT_REASON = "client hints over the socket"

UNKNOWN_TIER = "unknown"
MIXED_TIER = "mixed"


# ---------------------------------------------------------------------------
# configuration: the defaults of [metrics]; kvtier.config validates the table


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    address: str = DEFAULT_ADDRESS
    port: int = DEFAULT_PORT
    # Per-region series cost regions x tiers time series; fleets with
    # thousands of regions per host turn them off and keep per-tenant ones.
    per_region: bool = True
    # The block-table sums a scrape reads are refreshed a slice per tick,
    # one whole pass in about this long (never fewer than SUMMARY_MIN_ROWS
    # rows per tick): ~75 ns per block per pass, so 30 s costs 0.25 % of a
    # core at 1 M blocks and leaves gauges at most 30 s old.
    summary_pass_s: float = 30.0


# Rows of the block table folded into the metrics summary per tick, at
# least: small tables are summed whole every few ticks (16 k rows ~ 1 ms).
SUMMARY_MIN_ROWS = 16384


def summary_budget(rows: int, tick_s: float, pass_s: float) -> int:
    """Rows to fold per tick so that one pass over ``rows`` takes ``pass_s``."""
    return max(SUMMARY_MIN_ROWS, math.ceil(rows * tick_s / pass_s))


# ---------------------------------------------------------------------------
# the metric list (docs/metrics.md mirrors it; a unit test keeps them equal)

# name -> (type, labels, help)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvtier_build_info": ("info", ("version",), "kvtier version of the running daemon."),
    "kvtier_tier_info": ("gauge", ("tier", "index", "kind", "nodes"),
                         "1 per memory tier: its index (0 = fastest), kind and NUMA nodes."),
    "kvtier_tier_capacity_bytes": ("gauge", ("tier",), "Bytes kvtier may fill in the tier (total unless capped)."),
    "kvtier_tier_total_bytes": ("gauge", ("tier",), "Total bytes of the tier's nodes or swap devices."),
    "kvtier_tier_free_bytes": ("gauge", ("tier",), "Free bytes of the tier, machine-wide, at the last refresh."),
    "kvtier_tier_bytes": ("gauge", ("tier",), "Bytes of registered KV blocks in the tier (unknown/mixed included)."),
    "kvtier_tier_blocks": ("gauge", ("tier",), "Registered KV blocks in the tier."),
    "kvtier_tenant_tier_bytes": ("gauge", ("tenant", "tier"), "Bytes of a tenant's KV blocks per tier."),
    "kvtier_region_tier_bytes": ("gauge", ("region", "name", "tenant", "tier"),
                                 "Bytes of one region's KV blocks per tier (metrics.per_region)."),
    "kvtier_tier_access_ratio": ("gauge", ("tier",),
                                 "Share of recent block accesses (decayed temperature) held by blocks now in the tier."),
    "kvtier_hint_block_accesses": ("counter", ("tier",),
                                   "Block accesses named in client hints, by the tier the block was in when hinted."),
    "kvtier_tier_hit_ratio": ("gauge", ("tier",),
                              "Fraction of hinted block accesses that found the block in the tier, since start."),
    "kvtier_topology_events": ("counter", ("event",),
                               "Tier changes after memory hot-plug: tier_added, tier_removed, rediscovered, "
                               "rediscover_failed."),
    "kvtier_access_age_bytes": ("gauge", ("tier", "tenant", "age"),
                                "Bytes of KV blocks by time since their last access (<1s ... >10m; never seen: >10m)."),
    "kvtier_block_temperature": ("gaugehistogram", (), "Blocks by current temperature (decayed access count)."),
    "kvtier_blocks_unmovable": ("gauge", (), "Blocks marked unmovable (pinned pages, repeated failures)."),
    "kvtier_blocks_unmovable_by_reason": ("gauge", ("reason",),
                                          "Unmovable blocks by why: locked (mlock), pinned (long-term pin), "
                                          "declared (registered pinned), failing (repeated failures)."),
    "kvtier_blocks_pinned": ("gauge", (), "Blocks pinned to a tier by an operator."),
    "kvtier_migrated_blocks": ("counter", ("src", "dst"), "Blocks migrated, by source and destination tier."),
    "kvtier_migrated_bytes": ("counter", ("src", "dst"), "Bytes migrated, by source and destination tier."),
    "kvtier_migration_failed_pages": ("counter", ("src", "dst", "reason"),
                                      "Pages that did not move, by tiers and reason (errno name)."),
    "kvtier_dry_run": ("gauge", (), "1 while the daemon runs dry (daemon.dry_run): it plans but moves no page."),
    "kvtier_dry_run_planned_blocks": ("counter", ("src", "dst"),
                                      "Blocks a dry run planned to move and did not (counted again each time a plan "
                                      "picks the block)."),
    "kvtier_dry_run_planned_bytes": ("counter", ("src", "dst"), "Bytes of those planned moves."),
    "kvtier_migration_duration_seconds": ("histogram", (), "Wall time of one migration job (a plan's moves)."),
    "kvtier_source_follow_ups": ("counter", (), "Collects run between ticks because a source saw a block in a "
                                 "lower tier read that it credits only once its next look agrees (DAMON's dumps)."),
    "kvtier_fault_prefetch_blocks": ("counter", (), "Blocks in swap paged in ahead of a reader: the "
                                     "hotness.perf_fault.prefetch_blocks after one that took major faults."),
    "kvtier_hot_promotions": ("counter", (), "Blocks hinted or observed hot in a lower tier and promoted into "
                              "free DRAM room between ticks (without waiting for the next plan)."),
    "kvtier_prefetch_duration_seconds": ("histogram", (), "Time from a prefetch request to the block being in tier 0."),
    "kvtier_release_duration_seconds": ("histogram", (), "Time from a release request to the block being one tier down."),
    "kvtier_tick_duration_seconds": ("histogram", (), "Wall time of one policy tick (snapshot, plan, act)."),
    "kvtier_tick_cpu_seconds": ("histogram", (), "CPU time of the loop thread in one tick (the wall time less waits for a CPU or the GIL)."),
    "kvtier_tick_last_duration_seconds": ("gauge", (), "Wall time of the last tick."),
    "kvtier_ticks": ("counter", (), "Policy ticks run."),
    "kvtier_tick_errors": ("counter", (), "Ticks that raised an error (the loop continued)."),
    "kvtier_ticks_skipped_busy": ("counter", (), "Ticks whose act phase was skipped: previous migration still running."),
    "kvtier_pageout_returns": ("counter", (),
                               "Blocks paged out that their reader faulted straight back in, held in part "
                               "during the pageout, or had paged back in for it within policy.return_window_s "
                               "(each is not paged out again for policy.return_backoff_s)."),
    "kvtier_residency_scans": ("counter", (), "Residency measuring jobs (stale blocks whole, a rotating sample of the rest)."),
    "kvtier_residency_pages": ("counter", (), "Pages whose placement was asked (bounded by daemon.residency_pages_per_s)."),
    "kvtier_residency_blocks": ("counter", ("how",), "Blocks measured: whole (stale) or sampled (a window of pages)."),
    "kvtier_residency_seconds": ("counter", (), "Wall time of the measuring thread in its jobs."),
    "kvtier_residency_pass_seconds": ("gauge", (), "How long the rotating sample took to visit every block, last time."),
    "kvtier_residency_sample_slowdown": ("gauge", (),
                                         "1 = the rotating sample runs at daemon.residency_interval / residency_pages_per_s; "
                                         "2..daemon.residency_idle_slowdown = backed off, its windows found nothing changed."),
    "kvtier_source_cpu_seconds": ("counter", ("source", "where"),
                                  "CPU time of a hotness source: in the daemon's collect, or its kernel thread (kdamond)."),
    "kvtier_source_slowdown": ("gauge", ("source",),
                               "1 = the source runs every tick; 2..64 = backed off, over daemon.source_cpu_budget."),
    "kvtier_regions": ("gauge", (), "Registered regions."),
    "kvtier_clients": ("gauge", (), "Processes with at least one registered region."),
    "kvtier_blocks": ("gauge", (), "Registered KV blocks."),
    "kvtier_registered_bytes": ("gauge", (), "Bytes of registered regions."),
    "kvtier_blocks_unmapped": ("gauge", (), "Blocks of registered regions whose memory is no longer mapped."),
    "kvtier_blocks_placement_lost": ("gauge", (),
                                     "Allocated blocks kvtier never moved that are outside the tier they were placed "
                                     "in: the kernel moved them (a long-term pin migrates pages out of ZONE_MOVABLE)."),
    "kvtier_region_events": ("counter", ("event",),
                             "Region lifecycle: registered, unregistered, dropped_exit, dropped_unmapped "
                             "(its memory was freed), adopted, stale."),
    "kvtier_connections": ("gauge", (), "Open client connections."),
    "kvtier_connections_accepted": ("counter", (), "Client connections accepted."),
    "kvtier_connections_refused": ("counter", (), "Connections refused (max_connections limits)."),
    "kvtier_connections_timed_out": ("counter", (),
                                     "Connections closed for a stalled frame or idleness (limits.frame_timeout, idle_timeout)."),
    "kvtier_requests": ("counter", ("op",), "Protocol requests by operation."),
    "kvtier_request_errors": ("counter", ("op", "code"), "Protocol error responses by operation and error code."),
    "kvtier_hinted_blocks": ("counter", (), "Block indices received in hint requests."),
    "kvtier_hint_rings": ("gauge", (), "Open shared-memory hint rings (one per connection that asked)."),
    "kvtier_hint_ring_entries": ("counter", ("result",),
                                 "Hints (block-index words) drained from hint rings: accepted, bad_region (no such region, or "
                                 "not the connection's to hint), bad_block (index out of range), bad_head "
                                 "(drains skipped: the client's head was not within capacity of the tail)."),
    "kvtier_source_events": ("counter", ("source", "event"),
                             "What a hotness source ran into: perf samples, lost (ring full) and unmatched "
                             "(outside every block); DAMON sysfs_busy_retries (EBUSY writes retried)."),
    "kvtier_hotness_source_active": ("gauge", ("source", "reason"),
                                     "1 if the hotness source feeds temperatures, 0 if not; reason says why."),
    "kvtier_state_writes": ("counter", ("result",), "Registration state file writes (ok, error)."),
    "kvtier_config_reloads": ("counter", ("result",), "Config reloads (ok, error)."),
}


def _tier_name(names: list[str], t: int) -> str:
    if 0 <= t < len(names):
        return names[t]
    if t == TIER_MIXED:
        return MIXED_TIER
    return UNKNOWN_TIER if t == TIER_UNKNOWN else str(t)


SourceStatus = tuple[str, bool, str]  # (name, active, reason)
SourceEvents = tuple[str, dict[str, int]]  # (name, Source.events())


class Collector:
    """A prometheus_client custom collector over the daemon's live state.

    ``sources`` returns the hotness sources' status as (name, active, reason)
    triples; the daemon passes a closure over its source objects.
    ``topology`` is a Topology or a callable returning the current one.
    """

    def __init__(
        self,
        stats: DaemonStats,
        registry: Registry,
        table: BlockTable,
        topology: TopologyView | Callable[[], TopologyView],
        *,
        sources: Callable[[], Iterable[SourceStatus]] | None = None,
        source_events: Callable[[], Iterable[SourceEvents]] | None = None,
        per_region: bool = True,
        version: str | None = None,
        summary: BlockSummarizer | None = None,
    ):
        self.stats = stats
        self.registry = registry
        self.table = table
        self.topology = topology
        self.sources = sources
        self.source_events = source_events
        self.per_region = per_region
        self.version = version if version is not None else __version__
        # The daemon's summarizer, advanced by its loop; without one, every
        # scrape sums the whole table (a copy of it: the loop may write meanwhile).
        self.summarizer = summary

    def describe(self) -> list[Metric]:
        # Registration must not call collect() (it would read half-built state).
        return []

    # -- helpers -----------------------------------------------------------

    def _tiers(self) -> list[TierInfo]:
        # A callable topology follows a daemon that rediscovers on reload
        # (``lambda: engine.topology``); a plain Topology is fixed.
        topo = self.topology() if callable(self.topology) else self.topology
        return list(getattr(topo, "tiers", []) or [])

    def _summary(self) -> Summary:
        if self.summarizer is not None:
            summ = self.summarizer.current
            slices = self.table.slices  # replaced whole by the loop thread: one consistent dict
            return summ.without([r for r in summ.regions if r not in slices])
        own = BlockSummarizer()
        now = self.registry.clock() if hasattr(self.registry, "clock") else 0.0
        return own.refresh(self.table, now)

    # -- collect -----------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        tiers = self._tiers()
        names = [t.name for t in tiers]
        summ = self._summary()

        # No start time of our own: the process collector's
        # process_start_time_seconds is the same number.
        yield InfoMetricFamily("kvtier_build", METRICS["kvtier_build_info"][2], value={"version": self.version})
        yield from self._tier_metrics(tiers, names, summ)
        yield from self._owner_metrics(names, summ)
        yield from self._hotness_metrics(names, summ)
        yield from self._age_metrics(names, summ)
        yield from self._migration_metrics(names)
        yield from self._tick_metrics()
        yield from self._registry_metrics()
        yield from self._server_metrics()
        yield from self._source_metrics()

    def _tier_metrics(self, tiers, names, summ: Summary) -> Iterator[Metric]:
        info = _gauge("kvtier_tier_info")
        cap, total, free = (_gauge(n) for n in ("kvtier_tier_capacity_bytes", "kvtier_tier_total_bytes",
                                                "kvtier_tier_free_bytes"))
        for t in tiers:
            info.add_metric([t.name, str(t.index), t.kind, ",".join(str(n) for n in t.nodes)], 1)
            cap.add_metric([t.name], t.capacity)
            total.add_metric([t.name], t.total)
            free.add_metric([t.name], t.free)
        yield from (info, cap, total, free)

        used, blocks = _gauge("kvtier_tier_bytes"), _gauge("kvtier_tier_blocks")
        by_bytes, by_count = summ.tier_bytes(), summ.tier_blocks()
        # Every tier gets a sample (0 when empty) so dashboards do not show gaps.
        present = dict.fromkeys(range(len(tiers)))
        present.update(dict.fromkeys(by_bytes))
        for t in present:
            used.add_metric([_tier_name(names, t)], by_bytes.get(t, 0))
            blocks.add_metric([_tier_name(names, t)], by_count.get(t, 0))
        yield used
        yield blocks

        yield GaugeMetricFamily("kvtier_blocks_unmovable", METRICS["kvtier_blocks_unmovable"][2],
                                value=summ.unmovable)
        why = _gauge("kvtier_blocks_unmovable_by_reason")
        counts = summ.unmovable_by_reason
        for code, name in enumerate(STUCK_NAMES):
            if code:  # every reason gets a sample, 0 included; "none" is not a reason
                why.add_metric([name], int(counts[code]))
        yield why
        yield GaugeMetricFamily("kvtier_blocks_pinned", METRICS["kvtier_blocks_pinned"][2], value=summ.pinned)

    def _owner_metrics(self, names, summ: Summary) -> Iterator[Metric]:
        reg = self.registry
        tenant_names = {tid: name for name, tid in getattr(reg, "tenants", {}).items()}
        tenant = _gauge("kvtier_tenant_tier_bytes")
        for tid, v in sorted(summ.tenants.items()):
            for t, nb in summ.tier_bytes(v).items():
                tenant.add_metric([tenant_names.get(tid, str(tid)), _tier_name(names, t)], nb)
        yield tenant
        if not self.per_region:
            return
        region = _gauge("kvtier_region_tier_bytes")
        regions = getattr(reg, "regions", {})
        for rid, v in sorted(summ.regions.items()):
            r = regions.get(rid)
            if r is None:  # removed since the summary
                continue
            for t, nb in summ.tier_bytes(v).items():
                region.add_metric([str(rid), r.name, r.tenant, _tier_name(names, t)], nb)
        yield region

    def _age_metrics(self, names, summ: Summary) -> Iterator[Metric]:
        reg = self.registry
        tenant_names = {tid: name for name, tid in getattr(reg, "tenants", {}).items()}
        fam = _gauge("kvtier_access_age_bytes")
        for tid, v in sorted(summ.tenants.items()):
            for t, per in sorted(summ.age_bytes(v).items()):
                for label, b in zip(ages.AGE_LABELS, per):
                    fam.add_metric([_tier_name(names, t), tenant_names.get(tid, str(tid)), label], b)
        yield fam

    def _hotness_metrics(self, names, summ: Summary) -> Iterator[Metric]:
        hist = GaugeHistogramMetricFamily("kvtier_block_temperature", METRICS["kvtier_block_temperature"][2])
        cum = np.cumsum(summ.temp_hist)
        total = summ.temp_sum
        hist.add_metric([], [(le_label(b), int(c)) for b, c in zip(TEMP_BUCKETS + (math.inf,), cum)],
                        gsum_value=total)
        yield hist

        share = _gauge("kvtier_tier_access_ratio")
        by_temp = summ.tier_temp()
        for t in sorted(set(range(len(names))) | set(by_temp)):
            share.add_metric([_tier_name(names, t)], by_temp.get(t, 0.0) / total if total > 0 else 0.0)
        yield share

        # Hit ratio from client hints: DaemonStats.hint_tier_blocks (tier
        # index -> hinted block accesses), counted when the hint arrives.
        hits = self.stats.hint_tier_blocks
        acc, ratio = _counter("kvtier_hint_block_accesses"), _gauge("kvtier_tier_hit_ratio")
        all_hits = sum(hits.values())
        for t in sorted(set(range(len(names))) | set(hits)):
            n = hits.get(t, 0)
            acc.add_metric([_tier_name(names, t)], n)
            ratio.add_metric([_tier_name(names, t)], n / all_hits if all_hits else 0.0)
        yield acc
        yield ratio

    def _migration_metrics(self, names) -> Iterator[Metric]:
        s = self.stats
        blocks, nbytes = _counter("kvtier_migrated_blocks"), _counter("kvtier_migrated_bytes")
        # Every ordered pair of tiers from the start (0 until a move), so a
        # rate() panel does not go empty after a restart.
        pairs = {(a, b) for a in range(len(names)) for b in range(len(names)) if a != b}
        for (src, dst) in sorted(pairs | set(s.migrations) | set(s.migrated_bytes)):
            labels = [_tier_name(names, src), _tier_name(names, dst)]
            blocks.add_metric(labels, s.migrations.get((src, dst), 0))
            nbytes.add_metric(labels, s.migrated_bytes.get((src, dst), 0))
        # By errno name: the label values exist only once a failure happened
        # (docs/metrics.md: use `or vector(0)`).
        fails = _counter("kvtier_migration_failed_pages")
        for (src, dst, why), n in sorted(s.migration_failed_pages.items(), key=lambda kv: str(kv[0])):
            fails.add_metric([_tier_name(names, src), _tier_name(names, dst), str(why)], n)
        yield from (blocks, nbytes, fails)
        yield GaugeMetricFamily("kvtier_dry_run", METRICS["kvtier_dry_run"][2], value=int(bool(s.dry_run)))
        dblocks, dbytes = _counter("kvtier_dry_run_planned_blocks"), _counter("kvtier_dry_run_planned_bytes")
        for (src, dst) in sorted(pairs | set(s.dry_run_moves)):
            labels = [_tier_name(names, src), _tier_name(names, dst)]
            dblocks.add_metric(labels, s.dry_run_moves.get((src, dst), 0))
            dbytes.add_metric(labels, s.dry_run_bytes.get((src, dst), 0))
        yield from (dblocks, dbytes)
        yield _histogram("kvtier_migration_duration_seconds", s.migration_seconds_hist)
        yield CounterMetricFamily("kvtier_source_follow_ups", METRICS["kvtier_source_follow_ups"][2],
                                  value=s.source_follow_ups_total)
        yield CounterMetricFamily("kvtier_fault_prefetch_blocks", METRICS["kvtier_fault_prefetch_blocks"][2],
                                  value=s.fault_prefetch_blocks_total)
        yield CounterMetricFamily("kvtier_hot_promotions", METRICS["kvtier_hot_promotions"][2],
                                  value=s.hot_promotions_total)
        yield _histogram("kvtier_prefetch_duration_seconds", s.prefetch_seconds_hist)
        yield _histogram("kvtier_release_duration_seconds", s.release_seconds_hist)

    def _tick_metrics(self) -> Iterator[Metric]:
        s = self.stats
        yield _histogram("kvtier_tick_duration_seconds", s.tick_seconds_hist)
        yield _histogram("kvtier_tick_cpu_seconds", s.tick_cpu_seconds_hist)
        yield GaugeMetricFamily("kvtier_tick_last_duration_seconds", METRICS["kvtier_tick_last_duration_seconds"][2],
                                value=s.tick_seconds_last)
        for name, value in (("kvtier_ticks", s.ticks_total), ("kvtier_tick_errors", s.tick_errors_total),
                            ("kvtier_ticks_skipped_busy", s.ticks_skipped_busy),
                            ("kvtier_pageout_returns", s.pageout_returns_total),
                            ("kvtier_residency_scans", s.residency_scans_total),
                            ("kvtier_residency_pages", s.residency_pages_total),
                            ("kvtier_residency_seconds", s.residency_seconds_sum)):
            yield CounterMetricFamily(name, METRICS[name][2], value=value)
        fam = _counter("kvtier_residency_blocks")
        fam.add_metric(["whole"], s.residency_full_blocks_total)
        fam.add_metric(["sampled"], s.residency_blocks_total - s.residency_full_blocks_total)
        yield fam
        yield GaugeMetricFamily("kvtier_residency_pass_seconds", METRICS["kvtier_residency_pass_seconds"][2],
                                value=s.residency_pass_seconds)
        yield GaugeMetricFamily("kvtier_residency_sample_slowdown", METRICS["kvtier_residency_sample_slowdown"][2],
                                value=s.residency_sample_slowdown)

    def _registry_metrics(self) -> Iterator[Metric]:
        s = self.stats
        for name, value in (("kvtier_regions", s.regions), ("kvtier_clients", s.processes),
                            ("kvtier_blocks", s.blocks), ("kvtier_registered_bytes", s.registered_bytes),
                            ("kvtier_blocks_unmapped", s.blocks_unmapped),
                            ("kvtier_blocks_placement_lost", s.blocks_placement_lost)):
            yield GaugeMetricFamily(name, METRICS[name][2], value=value)
        ev = _counter("kvtier_region_events")
        for event, value in (("registered", s.regions_registered_total),
                             ("unregistered", s.regions_unregistered_total),
                             ("dropped_exit", s.regions_dropped_exit_total),
                             ("dropped_unmapped", s.regions_dropped_unmapped_total),
                             ("dropped_uid", s.regions_dropped_uid_total),
                             ("adopted", s.regions_adopted_total), ("stale", s.regions_stale_total)):
            ev.add_metric([event], value)
        yield ev
        yield CounterMetricFamily("kvtier_hinted_blocks", METRICS["kvtier_hinted_blocks"][2],
                                  value=s.block_hints_total)
        yield GaugeMetricFamily("kvtier_hint_rings", METRICS["kvtier_hint_rings"][2], value=s.hint_rings_open)
        fam = _counter("kvtier_hint_ring_entries")
        for result in ("accepted", "bad_region", "bad_block", "bad_head"):
            fam.add_metric([result], s.hint_ring_entries.get(result, 0))
        yield fam
        for name, ok, err in (("kvtier_state_writes", s.state_writes_total, s.state_write_errors_total),
                              ("kvtier_config_reloads", s.config_reloads_total, s.config_reload_errors_total)):
            fam = _counter(name)
            fam.add_metric(["ok"], ok)
            fam.add_metric(["error"], err)
            yield fam
        topo = _counter("kvtier_topology_events")
        events = s.topology_events
        # Every event gets a sample (0 until it happens) so alerts can use increase().
        for event in ("tier_added", "tier_removed", "rediscovered", "rediscover_failed"):
            topo.add_metric([event], events.get(event, 0))
        yield topo

    def _server_metrics(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily("kvtier_connections", METRICS["kvtier_connections"][2], value=s.connections_open)
        yield CounterMetricFamily("kvtier_connections_accepted", METRICS["kvtier_connections_accepted"][2],
                                  value=s.connections_total)
        yield CounterMetricFamily("kvtier_connections_refused", METRICS["kvtier_connections_refused"][2],
                                  value=s.connections_refused)
        yield CounterMetricFamily("kvtier_connections_timed_out", METRICS["kvtier_connections_timed_out"][2],
                                  value=s.connections_timed_out)
        req, err = _counter("kvtier_requests"), _counter("kvtier_request_errors")
        # Every op of the protocol from the start; error codes appear when sent.
        for op in sorted(set(protocol.OPS) | set(s.requests)):
            req.add_metric([str(op)], s.requests.get(op, 0))
        for (op, code), n in sorted(s.errors.items()):
            err.add_metric([str(op), str(code)], n)
        yield req
        yield err

    def _source_metrics(self) -> Iterator[Metric]:
        fam = _gauge("kvtier_hotness_source_active")
        # Client hints need no source object and are always accepted.
        fam.add_metric([HINT_SOURCE, HINT_REASON], 1)
        status = list(self.sources()) if self.sources is not None else []
        for name, active, reason in status:
            fam.add_metric([name, reason or ""], 1 if active else 0)
        yield fam
        s = self.stats
        active = [name for name, on, _ in status if on]
        cpu = _counter("kvtier_source_cpu_seconds")
        for name in sorted(set(active) | set(s.source_cpu_seconds)):
            cpu.add_metric([name, "daemon"], s.source_cpu_seconds.get(name, 0.0))
        for name, v in sorted(s.source_kernel_seconds.items()):
            cpu.add_metric([name, "kernel"], v)
        yield cpu
        slow = _gauge("kvtier_source_slowdown")
        for name in sorted(set(active) | set(s.source_slowdown)):
            slow.add_metric([name], s.source_slowdown.get(name) or 1)  # 1 = every tick, until backed off
        yield slow
        ev = _counter("kvtier_source_events")
        for name, events in (self.source_events() if self.source_events is not None else ()):
            for event, n in sorted(events.items()):
                ev.add_metric([name, event], n)
        yield ev


def _gauge(name: str) -> GaugeMetricFamily:
    _, labels, doc = METRICS[name]
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str) -> CounterMetricFamily:
    _, labels, doc = METRICS[name]
    return CounterMetricFamily(name, doc, labels=labels)


def _histogram(name: str, h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, METRICS[name][2])
    fam.add_metric([], h.buckets(), sum_value=h.sum)
    return fam


# ---------------------------------------------------------------------------
# the HTTP exporter


# The exporter is reachable by any local user (and beyond if address is not
# loopback): a fixed pool of handler threads with a socket timeout, and a
# bounded queue of accepted connections, instead of a thread per connection.
HTTP_WORKERS = 4
HTTP_QUEUE = 32
HTTP_TIMEOUT = 5.0


class BoundedHTTPServer(http.server.HTTPServer):
    """HTTPServer whose requests run on HTTP_WORKERS threads. A connection is
    closed at once when HTTP_QUEUE are already waiting, and each one may
    take at most HTTP_TIMEOUT seconds per read or write, so idle or slow
    clients cost a bounded number of threads and fds, never one each."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, addr, handler):
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.address_family = family
        super().__init__(addr, handler)
        self.pool = ThreadPoolExecutor(max_workers=HTTP_WORKERS, thread_name_prefix="kvtier-metrics")
        self.waiting = 0
        self.refused = 0
        self.lock = threading.Lock()

    def process_request(self, request, client_address):
        with self.lock:
            if self.waiting >= HTTP_QUEUE:
                self.refused += 1
                self.shutdown_request(request)
                return
            self.waiting += 1
        request.settimeout(HTTP_TIMEOUT)
        self.pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception:  # a client that hung up or timed out
            pass
        finally:
            self.shutdown_request(request)
            with self.lock:
                self.waiting -= 1

    def server_close(self):
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # the worker's blocked read returns at once
    except OSError:
        pass


class _Handler(MetricsHandler):
    # Per read or write: a client that stops is dropped after this long.
    timeout = HTTP_TIMEOUT

    def setup(self):
        super().setup()
        # ...and the whole request line and headers must arrive within it
        # too: the timeout above restarts with every byte, so four clients
        # trickling a byte a second held the four workers for as long as
        # they liked, and no scrape was answered meanwhile.
        self._deadline = threading.Timer(HTTP_TIMEOUT, _cut, (self.connection,))
        self._deadline.daemon = True
        self._deadline.start()

    def parse_request(self):
        try:
            return super().parse_request()  # reads the headers
        finally:
            self._deadline.cancel()

    def finish(self):
        self._deadline.cancel()
        super().finish()

    def log_message(self, format, *args):  # no line per scrape on stderr
        pass


class MetricsExporter:
    """Serves ``Collector`` plus process metrics over HTTP on ``address:port``.

    ``port=0`` binds an ephemeral port (tests); ``self.port`` is the bound one
    after ``start()``. Process metrics (CPU, RSS, fds) come from
    prometheus_client's ProcessCollector reading ``proc_root``.
    """

    def __init__(
        self,
        stats: DaemonStats,
        registry: Registry,
        table: BlockTable,
        topology: TopologyView | Callable[[], TopologyView],
        address: str = DEFAULT_ADDRESS,
        port: int = DEFAULT_PORT,
        *,
        proc_root: str = "/proc",
        sources: Callable[[], Iterable[SourceStatus]] | None = None,
        source_events: Callable[[], Iterable[SourceEvents]] | None = None,
        per_region: bool = True,
        summary: BlockSummarizer | None = None,
    ):
        self.address = address
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = Collector(stats, registry, table, topology, sources=sources, source_events=source_events,
                                   per_region=per_region, summary=summary)
        self.registry.register(self.collector)
        ProcessCollector(proc=proc_root, registry=self.registry)
        self._server = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: MetricsConfig, stats, registry, table, topology, **kw) -> "MetricsExporter":
        return cls(stats, registry, table, topology, cfg.address, cfg.port, per_region=cfg.per_region, **kw)

    @property
    def summarizer(self) -> BlockSummarizer | None:
        return self.collector.summarizer

    def render(self) -> bytes:
        """The exposition text a scrape would return (kvtierctl, tests)."""
        return generate_latest(self.registry)

    def start(self) -> None:
        """Bind and serve on a daemon thread; OSError (EADDRINUSE...) propagates."""
        if self._server is not None:
            return
        server = BoundedHTTPServer((self.address, self.port), _Handler.factory(self.registry))
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="kvtier-metrics-accept", daemon=True)
        self._thread.start()
        self.port = server.server_address[1]

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"
