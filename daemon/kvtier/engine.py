"""The tick: snapshot, decide, act — with the acting done off the loop thread.

Each tick, on the event-loop thread (where the registry lives, so no locks):
  1. age temperatures, refresh tier free memory, drop regions of dead
     processes the pidfds missed;
  2. if no migration job is running: snapshot the BlockTable, ask the pure
     policy for a plan, add operator moves (kvtierctl migrate), and hand the
     job to the single worker thread.
The worker measures where blocks are (move_pages query + pagemap) and runs
the moves; it sees only arrays copied at snapshot time. Its results come back
to the loop thread, keyed by (region id, block index) rather than table row,
because regions registered or dropped meanwhile shift the rows.

One job at a time: migrations of a tick that are still running when the
next tick comes simply make that tick skip its act phase (counted in
``ticks_skipped_busy``), so a slow kernel never queues up stale plans.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from kvtier import logs
from kvtier import policy as pol
from kvtier.blocks import FIELDS, F_KEEP_DRAM, F_NEVER_SWAP, F_NOT_PRESENT, TIER_UNKNOWN, BlockTable
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.hotness import Temperature
from kvtier.ports import AvailabilityView, HotnessSource, MigratorPort, ObservationView, TopologyView
from kvtier.registry import Registry
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.engine")


@dataclass
class Job:
    """Work for the migration thread; everything is a copy."""

    region: np.ndarray  # int32 region id per block
    index: np.ndarray  # int32 block index in its region
    pid: np.ndarray
    addr: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    measure: np.ndarray  # bool: measure this block's residency
    move: np.ndarray  # bool: this block is in the plan
    src: np.ndarray  # int8 tier now (plan rows only meaningful)
    dst: np.ndarray  # int8 tier wanted
    sources: list[HotnessSource] = field(default_factory=list)  # to collect from
    plan: pol.Plan | None = None
    plan_pos: np.ndarray | None = None  # position of each job block in plan.rows (-1 = none)
    started: float = 0.0
    # results (filled by the worker)
    measured_tier: np.ndarray | None = None
    present: np.ndarray | None = None
    ok: np.ndarray | None = None
    unmovable: np.ndarray | None = None
    failures: collections.Counter = field(default_factory=collections.Counter)
    observations: list[ObservationView] = field(default_factory=list)  # rows as at snapshot
    seconds: float = 0.0


class Engine:
    def __init__(
        self,
        table: BlockTable,
        registry: Registry,
        topology: TopologyView,
        migrator: MigratorPort,
        temperature: Temperature,
        policy_cfg: pol.PolicyConfig,
        stats: DaemonStats,
        loop: asyncio.AbstractEventLoop,
        *,
        residency_interval: float = 10.0,
        sources: Sequence[HotnessSource] = (),
        availability: Mapping[str, AvailabilityView] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``loop`` is the event loop the registry lives on: a finished job
        is applied there (call_soon_threadsafe from the worker)."""
        self.table = table
        self.registry = registry
        self.topology = topology
        self.migrator = migrator
        self.temperature = temperature
        self.policy_cfg = policy_cfg
        self.pstate = pol.PolicyState()
        self.stats = stats
        self.residency_interval = residency_interval
        self.clock = clock
        # The worker keeps the daemon's scheduling priority on purpose: it
        # holds the GIL while it runs Python, so a deprioritised worker would
        # make the loop thread wait on it (priority inversion through the GIL).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-migrate")
        self.job: Job | None = None
        self.future: Future | None = None
        self.last_tick = 0.0
        self.last_full_measure = -np.inf
        self.manual: list[tuple[np.ndarray, np.ndarray, int]] = []  # (region ids, indices, tier)
        self.loop = loop
        # Hotness sources that probed available; their set_targets runs on
        # this thread between jobs, their collect on the worker inside a job,
        # so a source is never used by two threads at once.
        self.availability = dict(availability or {})
        self.sources = [s for s in sources if self.availability.get(s.name)]
        self._targets_gen = -1
        self._pending_topology: tuple[Any, np.ndarray] | None = None

    # -- tiers -----------------------------------------------------------

    def tier_names(self) -> list[str]:
        return [t.name for t in self.topology.tiers]

    def check_tier(self, tier: int | None) -> None:
        if tier is not None and not 0 <= tier < len(self.topology.tiers):
            raise InvalidArgument(f"no tier {tier} (tiers: {', '.join(self.tier_names()) or 'none'})")

    def tier_states(self) -> list[pol.TierState]:
        used = self._bytes_by_tier()
        return [
            pol.TierState(t.index, t.name, t.kind, int(t.capacity), int(used[t.index]), int(t.free))
            for t in self.topology.tiers
        ]

    def _bytes_by_tier(self) -> np.ndarray:
        n = len(self.topology.tiers)
        tier = self.table.tier
        known = tier >= 0
        return np.bincount(tier[known].astype(np.int64), weights=self.table.nbytes[known].astype(np.float64),
                           minlength=n)[:n] if n else np.zeros(0)

    def tiers(self) -> list[dict]:
        used = self._bytes_by_tier()
        blocks = np.bincount(self.table.tier[self.table.tier >= 0].astype(np.int64),
                             minlength=len(self.topology.tiers))
        out = []
        for t in self.topology.tiers:
            out.append({
                "index": t.index, "name": t.name, "kind": t.kind, "nodes": list(t.nodes),
                "total": int(t.total), "free": int(t.free), "capacity": int(t.capacity),
                "kvtier_bytes": int(used[t.index]), "kvtier_blocks": int(blocks[t.index]),
                "read_latency_ns": t.read_latency_ns, "notes": list(t.notes),
            })
        return out

    def _node_for(self, tier_idx: int) -> int:
        """The tier's node with the most free memory (tiers of several nodes,
        e.g. two CXL expanders, fill evenly)."""
        t = self.topology.tiers[tier_idx]
        return max(t.nodes, key=lambda n: self.topology.nodes[n].free)

    def _is_swap(self, tier_idx: int) -> bool:
        return self.topology.tiers[tier_idx].kind == "swap"

    # -- topology changes (memory hot-plug, config reload) ----------------

    def latest_topology(self) -> Any:
        return self._pending_topology[0] if self._pending_topology else self.topology

    def set_topology(self, topology: Any, index_map: np.ndarray) -> None:
        """Switch to a re-discovered topology; ``index_map`` maps each tier
        index of ``latest_topology()`` to the new one (-1: gone). Applied
        between migration jobs: a running job's tier numbers are the old ones."""
        if self._pending_topology is not None:
            first = self._pending_topology[1]
            index_map = np.where(first >= 0, index_map[np.maximum(first, 0)], first).astype(np.int8)
        self._pending_topology = (topology, index_map)
        if self.future is None:
            self._apply_topology()

    def _apply_topology(self) -> None:
        topology, index_map = self._pending_topology
        self._pending_topology = None
        for name in ("tier", "pin_tier"):
            col = getattr(self.table, name)
            known = col >= 0
            col[known] = index_map[col[known].astype(np.int64)]
        self.manual = [(r, i, int(index_map[t])) for r, i, t in self.manual if index_map[t] >= 0]
        self.topology = topology
        # Memory went offline under some blocks (the kernel moved their
        # pages) or a tier is new: measure every block where it really is.
        self.last_full_measure = -np.inf

    # -- operator requests -----------------------------------------------

    def request_move(self, rows: np.ndarray, tier: int) -> int:
        """kvtierctl migrate: moved with the next job, outside the policy's
        budget (the operator asked for it)."""
        self.check_tier(tier)
        # The region's own constraints win over an operator's one-off move
        # (unregister and register again to change them).
        flags = np.bitwise_or.reduce(self.table.flags[rows]) if rows.size else 0
        if flags & F_NEVER_SWAP and self._is_swap(tier):
            raise InvalidArgument("blocks of a never_swap region cannot be moved to swap")
        if flags & F_KEEP_DRAM and tier != 0:
            raise InvalidArgument("blocks of a keep_dram region cannot leave tier 0")
        self.manual.append((self.table.region[rows].copy(), self.table.index[rows].copy(), tier))
        return int(rows.size)

    def explain(self, row: int) -> str:
        snap = self.table.snapshot()
        return pol.explain(snap, row, self.tier_states(), self.policy_cfg, self.pstate, self.clock())

    def status(self) -> dict:
        now = self.clock()
        return {
            "dry_run": bool(self.migrator.dry_run),
            "tiers": self.tier_names(),
            "last_tick_age_s": now - self.last_tick if self.last_tick else None,
            "job_running": self.future is not None and not self.future.done(),
            "manual_moves_pending": sum(int(r.size) for r, _, _ in self.manual),
            "sources": {name: {"active": bool(a), "reason": a.reason} for name, a in self.availability.items()},
            "warnings": list(getattr(self.topology, "warnings", [])),
        }

    # -- the tick --------------------------------------------------------

    def tick(self) -> None:
        t0 = time.monotonic()
        now = self.clock()
        try:
            self._tick(now)
        except Exception:  # one bad tick must not stop the loop
            self.stats.tick_errors_total += 1
            log.exception("tick failed")
        self.last_tick = now
        self.stats.observe_tick(time.monotonic() - t0)

    def _tick(self, now: float) -> None:
        if self._pending_topology is not None and self.future is None:
            self._apply_topology()
        self.temperature.decay(self.table, now)
        self.registry.check_alive()
        try:
            self.topology.refresh_free()
        except (KvtierError, OSError) as e:
            log.warning("topology refresh failed: %s", e)
        if self.future is not None:
            self.stats.ticks_skipped_busy += 1
            return
        if len(self.table) == 0 or not self.topology.tiers:
            self.manual.clear()
            return
        job = self._build_job(now)
        if job is None:
            return
        self.job = job
        self.future = self.executor.submit(self._run, job)
        self.future.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._finish, job, f))

    def _build_job(self, now: float) -> Job | None:
        t = self.table
        n = len(t)
        full = now - self.last_full_measure >= self.residency_interval
        if full and not self.migrator.dry_run:
            measure = np.ones(n, dtype=bool)
            self.last_full_measure = now
        else:
            measure = t.tier == TIER_UNKNOWN
            if full:
                self.last_full_measure = now
        # The policy is pure and runs right here, so it may read the live
        # arrays; only what the worker thread reads later is copied (a region
        # removed meanwhile shifts the live rows in place).
        live = {name: getattr(t, name) for name in FIELDS}
        plan, self.pstate = pol.plan(live, self.tier_states(), self.policy_cfg, self.pstate, now)
        snap = {name: live[name].copy() for name in ("region", "index", "pid", "addr", "nbytes", "tier")}
        move = np.zeros(n, dtype=bool)
        src = snap["tier"].copy()
        dst = np.full(n, TIER_UNKNOWN, dtype=np.int8)
        plan_pos = np.full(n, -1, dtype=np.int64)
        if len(plan):
            move[plan.rows] = True
            dst[plan.rows] = plan.dst
            plan_pos[plan.rows] = np.arange(len(plan))
        for regions, indices, tier in self.manual:
            for rid in np.unique(regions):
                s = t.slices.get(int(rid))
                if s is None:
                    continue
                rows = indices[regions == rid].astype(np.int64) + s.start
                move[rows] = True
                dst[rows] = tier
        self.manual.clear()
        # A block already where it should be is not moved (manual no-ops).
        move &= dst != src
        if self.sources and self._targets_gen != self.registry.generation:
            # Rows shifted since the sources last saw the table: re-target them
            # now, so their next observations index this snapshot's rows.
            for source in self.sources:
                try:
                    source.set_targets(t)
                except (KvtierError, OSError) as e:
                    log.warning("hotness source %s: set_targets failed: %s", source.name, e)
            self._targets_gen = self.registry.generation
        if not (move.any() or measure.any() or self.sources):
            return None
        return Job(
            region=snap["region"], index=snap["index"], pid=snap["pid"], addr=snap["addr"],
            nbytes=snap["nbytes"], measure=measure, move=move, src=src, dst=dst,
            plan=plan if len(plan) else None, plan_pos=plan_pos, started=now, sources=list(self.sources),
        )

    # -- worker thread ---------------------------------------------------

    def _run(self, job: Job) -> Job:
        """On the worker thread: only the migrator and the job's arrays."""
        t0 = time.monotonic()
        n = job.region.size
        job.ok = np.zeros(n, dtype=bool)
        job.unmovable = np.zeros(n, dtype=bool)
        if job.move.any():
            self._act(job)
        if job.measure.any():
            self._measure(job)
        for source in job.sources:
            try:
                job.observations.append(source.collect(job.started))
            except (KvtierError, OSError) as e:
                log.warning("hotness source %s: collect failed: %s", source.name, e)
        job.seconds = time.monotonic() - t0
        return job

    def _act(self, job: Job) -> None:
        m = self.migrator
        sel_all = np.flatnonzero(job.move)
        keys = np.stack([job.pid[sel_all].astype(np.int64), job.src[sel_all].astype(np.int64),
                         job.dst[sel_all].astype(np.int64)], axis=1)
        for pid, src, dst in np.unique(keys, axis=0):
            sel = sel_all[(keys[:, 0] == pid) & (keys[:, 1] == src) & (keys[:, 2] == dst)]
            starts, lengths = job.addr[sel], job.nbytes[sel]
            try:
                if self._is_swap(int(dst)):
                    res = m.pageout(int(pid), starts, lengths)
                elif src >= 0 and self._is_swap(int(src)):
                    res = m.pagein(int(pid), starts, lengths, self._node_for(int(dst)))
                else:
                    res = m.move(int(pid), starts, lengths, self._node_for(int(dst)))
            except (KvtierError, OSError) as e:
                name = getattr(e, "errno_name", None) or type(e).__name__
                job.failures[(int(src), int(dst), name)] += int(sel.size)
                logs.event(log, "migration_batch_failed", logging.WARNING, pid=int(pid), src=int(src),
                           dst=int(dst), blocks=int(sel.size), reason=name, error=str(e))
                continue
            if res.dry_run:
                job.ok[sel] = True  # pretend, so a dry run reaches the policy's steady state
                continue
            job.ok[sel] = res.block_ok
            job.unmovable[sel] = res.block_unmovable
            for name, pages in res.errors.items():
                job.failures[(int(src), int(dst), name)] += pages
            if res.errors:
                # One line per batch, never per page: which pages failed and why.
                logs.event(log, "migration_batch_partial", logging.WARNING, pid=int(pid), src=int(src),
                           dst=int(dst), blocks=int(sel.size), blocks_failed=int((~res.block_ok).sum()),
                           blocks_unmovable=int(res.block_unmovable.sum()),
                           errors=",".join(f"{k}:{v}" for k, v in sorted(res.errors.items())))

    def _measure(self, job: Job) -> None:
        topo = self.topology
        lut = topo.node_tier_lut()
        ntiers = len(topo.tiers)
        swap = topo.swap_tier
        job.measured_tier = np.full(job.region.size, TIER_UNKNOWN, dtype=np.int8)
        job.present = np.zeros(job.region.size, dtype=bool)
        sel_all = np.flatnonzero(job.measure)
        pids = job.pid[sel_all]
        for pid in np.unique(pids):
            sel = sel_all[pids == pid]
            try:
                r = self.migrator.residency(int(pid), job.addr[sel], job.nbytes[sel])
            except (KvtierError, OSError) as e:
                log.debug("residency of pid %d: %s", pid, e)
                continue
            # Pages per tier; a block belongs to the tier holding most of its pages
            # (the next move takes all of its pages there).
            per_tier = np.zeros((sel.size, ntiers + 1), dtype=np.int64)
            nodes = min(r.node_pages.shape[1], lut.size)
            for node in range(nodes):
                if lut[node] >= 0:
                    per_tier[:, lut[node]] += r.node_pages[:, node]
            if swap is not None:
                per_tier[:, swap.index] += r.swapped
            total = per_tier.sum(axis=1)
            dom = per_tier.argmax(axis=1)
            job.present[sel] = total > 0
            job.measured_tier[sel] = np.where(total > 0, dom, TIER_UNKNOWN)
        self.stats.residency_scans_total += 1

    # -- back on the loop thread -----------------------------------------

    def _rows_now(self, job: Job) -> np.ndarray:
        """Current table row of each job block, -1 where its region is gone."""
        rows = np.full(job.region.size, -1, dtype=np.int64)
        for rid in np.unique(job.region):
            s = self.table.slices.get(int(rid))
            if s is not None:
                sel = job.region == rid
                rows[sel] = job.index[sel].astype(np.int64) + s.start
        return rows

    def _finish(self, job: Job, fut: Future) -> None:
        self.future = None
        self.job = None
        exc = fut.exception()
        if exc is not None:
            self.stats.tick_errors_total += 1
            log.error("migration job failed: %r", exc)
            return
        st = self.stats
        st.observe_migration(job.seconds)
        rows = self._rows_now(job)
        live = rows >= 0
        now = self.clock()
        mv = np.flatnonzero(job.move & live)
        if mv.size:
            pol.record_results(self.table, rows[mv], job.ok[mv], job.unmovable[mv], now,
                               self.policy_cfg, dst=job.dst[mv])
            okm = job.ok[mv]
            pairs = np.stack([job.src[mv], job.dst[mv]], axis=1)[okm].astype(np.int64)
            nb = job.nbytes[mv][okm]
            if pairs.size:
                uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
                inv = inv.ravel()
                for k, (s, d) in enumerate(uniq):
                    st.migrations[(int(s), int(d))] += int((inv == k).sum())
                    st.migrated_bytes[(int(s), int(d))] += int(nb[inv == k].sum())
        for key, n in job.failures.items():
            st.migration_failures[key] += n
        if job.plan is not None:
            ok_plan = np.zeros(len(job.plan), dtype=bool)
            has = job.plan_pos >= 0
            ok_plan[job.plan_pos[has]] = job.ok[has] & live[has]
            self.pstate = pol.refund(self.pstate, job.plan, ok_plan, self.policy_cfg)
        for obs in job.observations:
            if len(obs):
                r = rows[obs.rows]
                ok = r >= 0
                self.temperature.add(self.table, r[ok], obs.counts[ok], now, obs.weight)
        if job.measured_tier is not None:
            ms = np.flatnonzero(job.measure & live)
            r = rows[ms]
            measured = job.measured_tier[ms]
            pres = job.present[ms]
            swap = self.topology.swap_tier
            if swap is not None:
                # Swapped-out shared memory (MAP_SHARED, memfd, shm) has no swap
                # PTE, so pagemap shows it as never touched; a block we know is
                # in swap stays there until a page of it shows up again.
                keep = ~pres & (self.table.tier[r] == swap.index)
                measured = np.where(keep, np.int8(swap.index), measured)
                pres = pres | keep
            self.table.tier[r] = measured
            flags = self.table.flags
            flags[r[pres]] &= np.uint8(~F_NOT_PRESENT & 0xFF)
            flags[r[~pres]] |= np.uint8(F_NOT_PRESENT)

    def wait_idle(self, timeout: float | None = None) -> None:
        fut = self.future
        if fut is not None:
            try:
                fut.result(timeout)
            except Exception:
                pass

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        for source in self.sources:
            try:
                source.close()
            except (KvtierError, OSError) as e:
                log.warning("hotness source %s: close failed: %s", source.name, e)
