"""Every counter the daemon keeps, in one plain object.

The server and the engine increment it on the event-loop thread; the
Prometheus collector and the ``stats``/``status`` ops read it at request or
scrape time. Plain ints and Counters (no locks): all writers run on the loop
thread, and a reader on another thread sees at worst a value one update old.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable

# Bucket bounds. Migration batches under TCG take 10 ms..seconds, on real
# hardware 100 us..100 ms; one set of log-spaced bounds covers both.
MIGRATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TICK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# ---------------------------------------------------------------------------
# a plain histogram for DaemonStats to fill (stats imports no prometheus_client;
# kvtier.metrics turns it into a HistogramMetricFamily)


class Histogram:
    """Cumulative bucket counts, filled on the loop thread, read at scrape.

    Kept free of prometheus_client so DaemonStats stays a plain object;
    the collector turns it into a HistogramMetricFamily.
    """

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(float(b) for b in bounds)
        # the "le" labels, made once: repr of a float costs ~1 us, and a
        # `stats` answer carries ~80 of them (a client can ask 50,000 times a second)
        self.labels = tuple(le_label(b) for b in self.bounds + (math.inf,))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus wants them, +Inf last."""
        return list(zip(self.labels, itertools.accumulate(self.counts)))


def le_label(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(float(b))




@dataclass
class DaemonStats:
    started_wall: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    # server
    requests: collections.Counter = field(default_factory=collections.Counter)  # op -> n
    errors: collections.Counter = field(default_factory=collections.Counter)  # (op, code) -> n
    bytes_in: int = 0
    bytes_out: int = 0
    connections_open: int = 0
    connections_total: int = 0
    connections_refused: int = 0  # over max_connections(_per_uid)
    connections_timed_out: int = 0  # closed by limits.frame_timeout / idle_timeout
    # registry
    regions: int = 0
    processes: int = 0
    blocks: int = 0
    registered_bytes: int = 0
    regions_registered_total: int = 0
    regions_unregistered_total: int = 0
    regions_dropped_exit_total: int = 0  # owner process exited (pidfd)
    regions_dropped_unmapped_total: int = 0  # memory no longer mapped (freed under the daemon)
    regions_dropped_uid_total: int = 0  # process now runs as another uid (exec of a setuid program)
    blocks_unmapped: int = 0  # blocks of live regions whose memory is gone
    blocks_placement_lost: int = 0  # allocated blocks the kernel moved out of their placement
    regions_adopted_total: int = 0  # re-adopted from the state file at start
    regions_stale_total: int = 0  # in the state file but the process is gone
    block_hints_total: int = 0
    # shared-memory hint rings (kvtier.hintring): open now, and their
    # entries by result (accepted, bad_region, bad_block, bad_head)
    hint_rings_open: int = 0
    hint_ring_entries: collections.Counter = field(default_factory=collections.Counter)
    # hinted block accesses by the tier the block was in when hinted (-1
    # unknown, -2 mixed): the tier hit ratio KV-cache users ask for.
    hint_tier_blocks: collections.Counter = field(default_factory=collections.Counter)
    state_writes_total: int = 0
    state_write_errors_total: int = 0
    # engine
    ticks_total: int = 0
    tick_seconds_sum: float = 0.0
    tick_seconds_last: float = 0.0
    tick_seconds_max: float = 0.0
    tick_seconds_hist: Histogram = field(default_factory=lambda: Histogram(TICK_BUCKETS))
    # the loop thread's CPU time in the tick: on a busy host the wall time
    # above also holds the waits for a CPU (and for the GIL), this does not
    tick_cpu_seconds_hist: Histogram = field(default_factory=lambda: Histogram(TICK_BUCKETS))
    tick_errors_total: int = 0
    ticks_skipped_busy: int = 0  # act phase skipped: previous migration still running
    pageout_returns_total: int = 0  # blocks paged out that their reader faulted straight back in
    migrations: collections.Counter = field(default_factory=collections.Counter)  # (src, dst) -> blocks
    migrated_bytes: collections.Counter = field(default_factory=collections.Counter)  # (src, dst) -> bytes
    migration_failed_pages: collections.Counter = field(default_factory=collections.Counter)  # (src, dst, errno) -> pages
    migration_seconds_sum: float = 0.0
    # dry run (daemon.dry_run): planned moves not made, (src, dst) -> blocks /
    # bytes; a block the plan picks again is counted again. last_*: the last
    # plan's alone.
    dry_run: bool = False
    dry_run_moves: collections.Counter = field(default_factory=collections.Counter)
    dry_run_bytes: collections.Counter = field(default_factory=collections.Counter)
    dry_run_last_moves: collections.Counter = field(default_factory=collections.Counter)
    dry_run_last_bytes: collections.Counter = field(default_factory=collections.Counter)
    migration_seconds_hist: Histogram = field(default_factory=lambda: Histogram(MIGRATION_BUCKETS))
    # tier_added, tier_removed, rediscovered, rediscover_failed (kernel/uevents.TopologyFollower)
    topology_events: collections.Counter = field(default_factory=collections.Counter)
    residency_scans_total: int = 0  # measuring jobs
    residency_seconds_sum: float = 0.0  # measuring thread's wall time in them
    residency_pages_total: int = 0  # pages whose placement was asked (sampled or whole blocks)
    residency_blocks_total: int = 0  # blocks looked at (sampled or whole)
    residency_full_blocks_total: int = 0  # of those, measured page by page
    residency_passes_total: int = 0  # times the rotating sample went round the table
    residency_pass_seconds: float = 0.0  # how long the last round took
    residency_sample_slowdown: int = 1  # the rotating sample's back-off (1 = full rate)
    # hotness sources: CPU of the daemon in collect, of their kernel threads
    # (kdamond), and their current slowdown (1 = every tick)
    source_cpu_seconds: collections.Counter = field(default_factory=collections.Counter)
    source_kernel_seconds: collections.Counter = field(default_factory=collections.Counter)
    source_slowdown: collections.Counter = field(default_factory=collections.Counter)
    # prefetch / release: seconds from the request to the block in its tier
    prefetch_seconds_hist: Histogram = field(default_factory=lambda: Histogram(MIGRATION_BUCKETS))
    release_seconds_hist: Histogram = field(default_factory=lambda: Histogram(MIGRATION_BUCKETS))
    # engine-mode regions: moves sent to their owners, dropped with a lost
    # connection, and the time from sending a move to its answer
    engine_moves_sent_total: int = 0
    engine_moves_dropped_total: int = 0
    engine_move_seconds_hist: Histogram = field(default_factory=lambda: Histogram(MIGRATION_BUCKETS))
    fault_prefetch_blocks_total: int = 0  # blocks paged in ahead of a reader (perf_fault prefetch_blocks)
    source_follow_ups_total: int = 0  # collects asked for by a source's unconfirmed reads (Engine._follow_up)
    hot_promotions_total: int = 0  # hot blocks in a lower tier sent to free DRAM room between ticks
    config_reloads_total: int = 0
    config_reload_errors_total: int = 0
    # Counter keys as to_dict writes them ("0:1:EBUSY"), made once per key
    # (the keys are ops, error codes and tier pairs: a few hundred at most).
    _key_texts: dict = field(default_factory=dict, repr=False, compare=False)

    def observe_tick(self, seconds: float, cpu_seconds: float | None = None) -> None:
        self.ticks_total += 1
        if cpu_seconds is not None:
            self.tick_cpu_seconds_hist.observe(cpu_seconds)
        self.tick_seconds_sum += seconds
        self.tick_seconds_last = seconds
        if seconds > self.tick_seconds_max:
            self.tick_seconds_max = seconds
        self.tick_seconds_hist.observe(seconds)

    def observe_migration(self, seconds: float) -> None:
        self.migration_seconds_sum += seconds
        self.migration_seconds_hist.observe(seconds)

    def observe_scheduled(self, kind: str, seconds: float) -> None:
        (self.prefetch_seconds_hist if kind == "prefetch" else self.release_seconds_hist).observe(seconds)

    def observe_engine_move(self, seconds: float) -> None:
        self.engine_move_seconds_hist.observe(seconds)

    def to_dict(self) -> dict:
        """Wire/JSON form: counters keyed by strings."""
        out = {}
        texts = self._key_texts
        for k, v in self.__dict__.items():
            if k[0] == "_":
                continue
            if isinstance(v, Histogram):
                out[k] = {"sum": v.sum, "count": v.count, "buckets": dict(v.buckets())}
            elif isinstance(v, collections.Counter):
                items = []
                for key, n in v.items():
                    text = texts.get(key)
                    if text is None:
                        text = texts[key] = ":".join(str(x) for x in key) if isinstance(key, tuple) else str(key)
                    items.append((text, n))
                items.sort()
                out[k] = dict(items)
            else:
                out[k] = v
        out["uptime_s"] = time.monotonic() - self.started_mono
        return out
