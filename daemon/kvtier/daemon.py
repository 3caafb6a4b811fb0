"""kvtierd: the composition root and the main loop.

Every collaborator is built here and handed to the ones that use it; no
module keeps global state. The loop is asyncio's, on the main thread:

    signals ──▶ events ─┐
    clients ──▶ server ─┼─▶ registry ◀── engine.tick() every tick_interval
    pidfds ──▶ registry ┘                  └─▶ worker thread: migrator

Signal handlers only set events (SIGTERM/SIGINT: stop, SIGHUP: reload); the
loop notices them between ticks, within one wakeup. ``kvtier.config.load``
validates the whole configuration once (every key of every table, and the
invariants the policy, DAMON and topology constructors check) before the
socket is opened, so a bad config fails the start with a message naming the
key instead of a running daemon that misbehaves.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier import __version__, cli, config
from kvtier import hotness, logs, state
from kvtier import record as record_mod
from kvtier import watch as watch_mod
from kvtier import metrics as metrics_mod
from kvtier.summary import BlockSummarizer
from kvtier.kernel import sources as sources_mod
from kvtier.kernel import uevents
from kvtier import policy as pol
from kvtier.kernel import topology as topo_mod
from kvtier.blocks import BlockTable
from kvtier.engine import Engine
from kvtier.errors import ConfigError, KvtierError
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.watch import PsutilScanner
from kvtier.kernel.procmap import ProcProcesses
from kvtier.registry import Limits, Registry
from kvtier.sdnotify import Notifier
from kvtier.server import ControlAPI, PidfdWatcher, Server, listen_fds
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.daemon")

VERSION = __version__
# Keys read once at start (config.Option.restart): a reload that changes one is refused.
RESTART_KEYS = frozenset(o.key for o in config.OPTIONS if o.restart)

def limits_of(cfg: config.Config) -> Limits:
    lim = cfg.limits
    return Limits(lim.max_regions_per_process, lim.max_bytes_per_process,
                  lim.max_blocks_per_region, lim.max_blocks_total)


def policy_config(cfg: config.Config, tenant_id) -> pol.PolicyConfig:
    """[policy] -> PolicyConfig. Tenant quotas are keyed by tenant *name* in
    the config and by the registry's tenant id in the policy."""
    table = cfg.table("policy")
    table["tenant_dram_quota"] = {tenant_id(name): b for name, b in table["tenant_dram_quota"].items()}
    return pol.PolicyConfig(**table)


def source_tables(cfg: config.Config) -> dict[str, dict]:
    """[hotness.<source>] tables, as kernel.sources.build takes them."""
    return {name: cfg.table(f"hotness.{name}") for name in sources_mod.SECTIONS}


def topology_overrides(cfg: config.Config) -> dict:
    """[topology] keys set away from their defaults (the defaults mean: as discovered)."""
    return cfg.changed("topology")


class Daemon:
    def __init__(self, cfg: config.Config, config_path: str | None, notifier: Notifier | None = None,
                 inherited_fds: list[int] | None = None, overrides: dict[str, Any] | None = None):
        self.cfg = cfg
        self.config_path = config_path
        # command-line overrides (--socket, --dry-run, -s): still in force after a reload
        self.overrides = dict(overrides or {})
        self.notifier = notifier or Notifier()
        self.inherited_fds = inherited_fds
        self.stats = DaemonStats()
        self.stop_event: asyncio.Event | None = None
        self.reload_event: asyncio.Event | None = None
        self._state_timer: asyncio.TimerHandle | None = None
        self._state_future: asyncio.Future | None = None
        self._state_again = False
        # Futures of requests whose answer waits until the state file shows
        # their change (unregister): for the next snapshot, and for the one
        # being written now.
        self._durable_next: list[asyncio.Future] = []
        self._durable_writing: list[asyncio.Future] = []
        self._closing = False
        self._state_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-state")

    # -- composition -----------------------------------------------------

    def build(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wiring only: each collaborator is complete when constructed (the
        config was validated by config.load; announce() logs what was found)."""
        cfg, d, lim = self.cfg, self.cfg.daemon, self.cfg.limits
        self.table = BlockTable(lim.max_blocks_total)  # address space only, until blocks are registered
        self.temperature = hotness.Temperature(cfg.hotness.tau_s, cfg.hotness.end_of_run)
        self.watcher = PidfdWatcher(loop)
        self.recorder = self._recorder(cfg)
        self.registry = Registry(self.table, limits_of(cfg), self.stats, self.temperature,
                                 ProcProcesses(d.proc_root), self.watcher, on_change=self._state_dirty,
                                 recorder=self.recorder)
        self.topology = topo_mod.discover(d.sys_root, d.proc_root, topology_overrides(cfg))
        self.migrator = Migrator(proc_root=d.proc_root, dry_run=d.dry_run, move_threads=d.move_threads)
        # A dry run observes for real (DAMON monitoring moves no page): its
        # plans are then the ones the daemon would make.
        self.sources = sources_mod.build(source_tables(cfg), d.sys_root, d.proc_root)
        self.availability = sources_mod.probe_all(self.sources)
        self.engine = Engine(
            self.table, self.registry, self.topology, self.migrator, self.temperature,
            policy_config(cfg, self.registry.quota_tenant_id), self.stats, loop,
            residency_interval=d.residency_interval, residency_pages_per_s=d.residency_pages_per_s,
            residency_sample_pages=d.residency_sample_pages, residency_idle_slowdown=d.residency_idle_slowdown,
            source_cpu_budget=d.source_cpu_budget, sources=self.sources, availability=self.availability, recorder=self.recorder,
        )
        self.registry.on_added, self.registry.on_hinted = self.engine.registered, self.engine.hinted
        self.hotplug = uevents.TopologyFollower(self.engine, self.stats, lambda memory_tiers=None: topo_mod.discover(
            d.sys_root, d.proc_root, topology_overrides(self.cfg), hotplug=True, memory_tiers=memory_tiers))
        self.uevents = uevents.UeventListener(loop, self.hotplug.on_burst)
        self.metrics_cfg = metrics_mod.MetricsConfig(**cfg.table("metrics"))
        self.metrics = self._exporter(self.metrics_cfg)
        self.watch = watch_mod.Watcher(watch_mod.parse_rules(cfg.watch), self.registry, PsutilScanner(d.proc_root))
        self.watch_schedule = watch_mod.Schedule(self.watch, loop, d.watch_interval)
        self.api = ControlAPI(self.registry, self.engine, self.stats, lim.max_message_bytes, VERSION)
        self.api.durable = self.state_durable
        self.api.ring_entries, self.api.ring_interval = lim.hint_ring_entries, d.hint_ring_interval
        self.server = Server(
            self.api, self.stats, path=d.socket, mode=d.socket_mode, group=d.socket_group,
            admin_group=cfg.security.admin_group, limits=lim,
            inherited_fds=self.inherited_fds, proc_root=d.proc_root,
        )

    def _exporter(self, mcfg: metrics_mod.MetricsConfig) -> metrics_mod.MetricsExporter | None:
        if not mcfg.enabled:
            return None
        # Through self: a reload may replace the sources.
        return metrics_mod.MetricsExporter.from_config(
            mcfg, self.stats, self.registry, self.table, lambda: self.engine.topology,
            proc_root=self.cfg.daemon.proc_root,
            sources=lambda: [(n, bool(a), a.reason) for n, a in self.availability.items()],
            source_events=lambda: [(s.name, s.events()) for s in self.sources],
            summary=BlockSummarizer(clock=self.registry.clock))

    def _start_metrics(self) -> None:
        """Metrics are not worth refusing to manage memory for: a port in
        use is logged and the daemon runs without them."""
        try:
            self.metrics.start()
            log.info("metrics on http://%s:%d/metrics", self.metrics.address, self.metrics.port)
        except OSError as e:
            log.error("metrics exporter not started on %s:%d: %s", self.metrics.address, self.metrics.port, e)
            self.metrics = None

    def _recorder(self, cfg: config.Config, in_force: tuple | None = None) -> record_mod.Recorder | None:
        """At start the engine, built after it, writes the tiers and policy;
        a reload's new recorder gets them (``in_force``) for its first file."""
        if not cfg.record.enabled:
            return None
        return record_mod.Recorder(cfg.record.dir, cfg.record.max_bytes, cfg.record.files, self.table,
                                   meta={"tick_s": cfg.daemon.tick_interval, "tau_s": cfg.hotness.tau_s,
                                         "end_of_run": cfg.hotness.end_of_run},
                                   in_force=in_force)

    def announce(self) -> None:
        """The structured events an operator reads at start: every tier found,
        every topology warning, and which hotness source runs or why not."""
        for t in self.topology.tiers:
            logs.event(log, "tier_discovered", tier=t.name, index=t.index, kind=t.kind,
                       nodes=",".join(map(str, t.nodes)) or "-", total_bytes=t.total, order=t.order_source)
        for w in self.topology.warnings:
            logs.event(log, "topology_warning", logging.WARNING, warning=w)
        for name, a in self.availability.items():
            if a:
                logs.event(log, "source_active", source=name, detail=a.reason)
            else:
                logs.event(log, "source_unavailable", logging.WARNING, source=name, reason=a.reason)

    # -- state file ------------------------------------------------------

    def _state_dirty(self) -> None:
        # Coalesce a burst of registrations into one write, after
        # state_flush_delay; at most one write in flight.
        if not self.cfg.daemon.state_file or self._state_timer is not None or self._closing:
            return
        loop = asyncio.get_running_loop()
        self._state_timer = loop.call_later(self.cfg.daemon.state_flush_delay, self._state_write_async)

    def _state_write_async(self) -> None:
        """Snapshot on the loop thread (a few hundred bytes per region), then
        write + fsync on the state thread: an fsync takes milliseconds to
        tens of milliseconds and must not stall every client's requests."""
        self._state_timer = None
        if self._closing:
            return  # shutdown() writes the final state itself
        if self._state_future is not None:
            self._state_again = True  # written again when the current write ends
            return
        doc = (self.cfg.daemon.state_file, self.registry.to_state(), self.registry.next_id)
        self._durable_writing, self._durable_next = self._durable_next, []
        loop = asyncio.get_running_loop()
        self._state_future = loop.run_in_executor(self._state_executor, self._write_state, *doc)
        self._state_future.add_done_callback(self._state_written)

    def _state_written(self, fut) -> None:
        self._state_future = None
        self._release_durable(self._durable_writing)
        self._durable_writing = []
        if self._state_again:
            self._state_again = False
            self._state_dirty()

    @staticmethod
    def _release_durable(waiters: list[asyncio.Future]) -> None:
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def state_durable(self) -> asyncio.Future | None:
        """A future done once the registry as it is now is in the state file
        (None without a state file). An unregister is answered only then, so
        a crash after the answer can never bring the region back."""
        if not self.cfg.daemon.state_file or self._closing:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._durable_next.append(fut)
        # Someone waits for this write: no point batching (state_flush_delay)
        # behind it; write now, or right after the write in flight.
        if self._state_timer is not None:
            self._state_timer.cancel()
            self._state_timer = None
        self._state_write_async()
        return fut

    def _write_state(self, path: str, regions: list[dict], next_id: int) -> None:
        try:
            state.save(path, regions, next_id)
            self.stats.state_writes_total += 1
        except KvtierError as e:
            self.stats.state_write_errors_total += 1
            log.error("%s", e)

    def flush_state(self) -> None:
        """Synchronous write (start-up and shutdown)."""
        if self.cfg.daemon.state_file:
            self._write_state(self.cfg.daemon.state_file, self.registry.to_state(), self.registry.next_id)

    def adopt(self) -> None:
        path = self.cfg.daemon.state_file
        if not path:
            return
        entries, next_id = state.load(path)
        adopted, dropped = self.registry.adopt(entries, next_id)
        if entries:
            log.info("state %s: re-adopted %d region(s), dropped %d whose process is gone or changed",
                     path, adopted, dropped)
        if dropped:
            self.flush_state()

    # -- reload ----------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: re-read the config and apply every changed key, or, if a
        key read only at start changed (RESTART_KEYS: the socket, the state
        file, the roots), refuse the whole reload naming it. On any error
        the daemon keeps running on the old config, unchanged."""
        self.notifier.reloading()
        try:
            new = config.load(self.config_path, missing_ok=self.config_path == config.DEFAULT_PATH,
                              overrides=self.overrides)
            pcfg = policy_config(new, self.registry.quota_tenant_id)
            changed = self.cfg.differences(new)
            fixed = [k for k in changed if k in RESTART_KEYS]
            if fixed:
                raise ConfigError("; ".join(f"{k} changed ({self.cfg.get(k)!r} -> {new.get(k)!r}): read only at "
                                            "start, restart kvtierd to change it" for k in fixed))
        except Exception as e:  # any error, even a bug in a validator: never die on SIGHUP
            self.stats.config_reload_errors_total += 1
            if isinstance(e, (ConfigError, OSError)):
                log.error("reload refused, keeping the running config: %s", e)
            else:
                log.exception("reload refused, keeping the running config")
            self.notifier.ready(self._status_line())
            return
        old, self.cfg = self.cfg, new
        if topology_overrides(new) != topology_overrides(old):
            try:
                t = topo_mod.discover(new.daemon.sys_root, new.daemon.proc_root, topology_overrides(new))
                # Renumbers the blocks' tiers; waits for a running migration.
                self.engine.set_topology(t, topo_mod.compare(self.engine.latest_topology(), t).index_map)
                self.topology = t
            except (KvtierError, OSError) as e:
                log.error("topology rediscovery failed, keeping the old one: %s", e)
        self.registry.limits = limits_of(new)
        self.server.apply_limits(new.limits, new.security.admin_group)
        self.api.ring_interval = new.daemon.hint_ring_interval
        self.engine.policy_cfg = pcfg
        self.engine.residency_interval = new.daemon.residency_interval
        self.engine.residency_pages_per_s = new.daemon.residency_pages_per_s
        self.engine.residency_sample_pages = new.daemon.residency_sample_pages
        self.engine.residency_idle_slowdown = new.daemon.residency_idle_slowdown
        self.engine.source_cpu_budget = new.daemon.source_cpu_budget
        self.temperature.tau_s = new.hotness.tau_s
        self.temperature.end_of_run = new.hotness.end_of_run
        self.watch.rules = watch_mod.parse_rules(new.watch)
        self.watch_schedule.interval = new.daemon.watch_interval
        self.migrator.dry_run = new.daemon.dry_run
        self.migrator.move_threads = new.daemon.move_threads
        self.stats.dry_run = new.daemon.dry_run
        logs.setup(new.daemon.log_level)
        self._reload_sources(old, new)
        if old.table("metrics") != new.table("metrics"):
            self._reload_metrics(new)
        if any(k.startswith("record.") or k in ("daemon.tick_interval", "hotness.tau_s", "hotness.end_of_run") for k in changed) \
                and (old.record.enabled or new.record.enabled):
            if self.recorder is not None:
                self.recorder.close()
            self.recorder = self._recorder(new, (self.engine.tier_states(), self.engine.policy_cfg))
            # a reload swaps the collaborator the registry and engine were built with
            self.registry.recorder = self.engine.recorder = self.recorder
        # tick_interval and state_flush_delay are read from self.cfg where used.
        self.stats.config_reloads_total += 1
        logs.event(log, "config_reloaded", source=new.source, changed=",".join(changed) or "-")
        self.notifier.ready(self._status_line())

    def _reload_sources(self, old: config.Config, new: config.Config) -> None:
        """Rebuild the hotness sources whose [hotness.<name>] table changed
        (access bits too when DAMON's did: they stand down where it runs);
        the others keep running as they are."""
        changed = {n for n in sources_mod.SECTIONS if old.table(f"hotness.{n}") != new.table(f"hotness.{n}")}
        if not changed:
            return
        if "damon" in changed:
            changed.add("access_bits")
        d = new.daemon
        before = {s.name: s for s in self.sources}
        sources = [before[s.name] if s.name in before and s.name not in changed else s
                   for s in sources_mod.build(source_tables(new), d.sys_root, d.proc_root)]
        known = {n: a for n, a in self.availability.items() if n in before and n not in changed}
        availability = sources_mod.probe_all(sources, known=known)
        for s in before.values():  # the engine closes the active ones it drops
            if s not in sources and not self.availability.get(s.name):
                s.close()
        self.sources, self.availability = sources, availability
        self.engine.set_sources(sources, availability)
        for name in sorted(changed):
            a = availability.get(name)
            if a is None:
                logs.event(log, "source_disabled", source=name)
            elif a:
                logs.event(log, "source_active", source=name, detail=a.reason)
            else:
                logs.event(log, "source_unavailable", logging.WARNING, source=name, reason=a.reason)

    def _reload_metrics(self, new: config.Config) -> None:
        """A new exporter for the new [metrics] table; the old one stops
        first when both want the same port."""
        mcfg = self.metrics_cfg = metrics_mod.MetricsConfig(**new.table("metrics"))
        old = self.metrics
        same_port = old is not None and mcfg.port != 0 and (mcfg.address, mcfg.port) == (old.address, old.port)
        if old is not None and (same_port or not mcfg.enabled):
            old.stop()
            old = None
        self.metrics = self._exporter(mcfg)
        if self.metrics is not None:
            self._start_metrics()
        if old is not None:
            old.stop()

    # -- main loop -------------------------------------------------------

    def _summarize(self) -> None:
        """Fold the next slice of the block table into the sums metrics read."""
        summ = self.metrics.summarizer if self.metrics is not None else None
        if summ is not None:
            summ.advance(self.table, self.registry.clock(), metrics_mod.summary_budget(
                len(self.table), self.cfg.daemon.tick_interval, self.metrics_cfg.summary_pass_s))

    def _status_line(self) -> str:
        s = self.stats
        return (f"{s.regions} regions of {s.processes} processes, {s.blocks} blocks; "
                f"{s.connections_open} clients; tick {s.tick_seconds_last * 1000:.1f} ms")

    def _watchdog(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.notifier.watchdog()
        loop.call_later(interval, self._watchdog, loop, interval)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        self.reload_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_event.set)
        self.build(loop)
        self.announce()
        self.adopt()
        await self.server.start()
        self.watch_schedule.start()
        await self.uevents.start()
        if self.metrics is not None:
            self._start_metrics()
        # Everything built so far, the modules the listeners imported
        # included, lives until exit: keep it out of the cyclic GC's
        # generations so collections stay short (request tail latency).
        # Frozen before the listeners started, the 15,000 objects they
        # brought (pyroute2, prometheus_client) were walked by every
        # generation-2 collection: 4.6-7.6 ms inside some request under
        # scripts/bench/robustness.py. Garbage first, so none stays for good.
        gc.collect()
        gc.freeze()
        self.notifier.ready(self._status_line())
        if self.notifier.watchdog_interval:
            self._watchdog(loop, self.notifier.watchdog_interval)
        log.info("kvtierd %s ready: %d tier(s) %s%s", VERSION, len(self.topology.tiers),
                 ", ".join(self.engine.tier_names()), " (dry run)" if self.migrator.dry_run else "")
        waits = {asyncio.ensure_future(self.stop_event.wait()), asyncio.ensure_future(self.reload_event.wait())}
        next_tick = time.monotonic()
        last_status = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if now >= next_tick:
                self.engine.tick()
                self.hotplug.poll()
                self._summarize()
                # Fixed-rate ticks; after a stall, resume from now instead of bursting.
                next_tick = max(next_tick + self.cfg.daemon.tick_interval, time.monotonic())
                if now - last_status >= 5.0:
                    self.notifier.status(self._status_line())
                    last_status = now
            done, _ = await asyncio.wait(waits, timeout=max(0.0, next_tick - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if self.reload_event.is_set():
                self.reload_event.clear()
                waits = {w for w in waits if not w.done()} | {asyncio.ensure_future(self.reload_event.wait())}
                self.reload()
        for w in waits:
            w.cancel()
        await self.shutdown()
        return 0

    async def shutdown(self) -> None:
        self._closing = True
        self.notifier.stopping()
        log.info("stopping")
        await self.server.close()
        self.watch_schedule.close()
        self.uevents.close()
        # The running job finishes (a move_pages batch cannot be interrupted
        # safely anyway); its results are applied before the final state write.
        await asyncio.get_running_loop().run_in_executor(None, self.engine.wait_idle, 60.0)
        await asyncio.sleep(0)
        self.engine.shutdown()
        if self.recorder is not None:
            self.recorder.close()  # after the last job's results
        if self._state_timer is not None:
            self._state_timer.cancel()
        self._state_executor.shutdown(wait=True)  # an in-flight write finishes first
        self.flush_state()
        self._release_durable(self._durable_writing + self._durable_next)
        self.watcher.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.notifier.close()


# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def bound_heap() -> None:
    """Give freed table-sized arrays back to the kernel.

    Each tick allocates and frees column-sized numpy temporaries (masks,
    subsets, bincounts: megabytes at a million blocks). glibc raises its mmap
    threshold to the largest chunk freed so far, after which such arrays come
    from the heap and their pages stay resident when freed: the daemon's RSS
    then grows by tens of bytes per block for nothing. A fixed threshold keeps
    large arrays mmapped (returned on free) and a trim threshold returns the
    heap's free top.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 256 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtierd", description="Memory-tiering daemon for LLM KV caches.",
                                 epilog="exit status: 0 stopped cleanly, 1 failed, 78 bad config")
    cli.add_version(ap)
    ap.add_argument("-c", "--config", default=config.DEFAULT_PATH, help="TOML config (default %(default)s)")
    ap.add_argument("--socket", help="override daemon.socket")
    ap.add_argument("--state-file", help="override daemon.state_file ('' disables persistence)")
    ap.add_argument("--dry-run", action="store_true", help="plan but never move a page")
    ap.add_argument("-s", "--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any option, e.g. -s daemon.tick_interval=0.5 -s hotness.damon.enabled=false")
    ap.add_argument("--check-config", action="store_true", help="validate the config and exit")
    ap.add_argument("--print-sample-config", action="store_true", help="print the commented sample config")
    args = ap.parse_args(argv)
    if args.print_sample_config:
        sys.stdout.write(config.sample_toml())
        return 0
    try:
        overrides = dict(config.parse_override(item) for item in args.set)
        if args.socket:
            overrides["daemon.socket"] = args.socket
        if args.state_file is not None:
            overrides["daemon.state_file"] = args.state_file
        if args.dry_run:
            overrides["daemon.dry_run"] = True
        cfg = config.load(args.config, missing_ok=args.config == config.DEFAULT_PATH, overrides=overrides)
    except ConfigError as e:
        print(f"kvtierd: config error: {e}", file=sys.stderr)
        return cli.EXIT_CONFIG  # EX_CONFIG: systemd shows it, Restart=on-failure will not loop on it forever
    if args.check_config:
        print(f"{cfg.source}: ok")
        return 0
    logs.setup(cfg.daemon.log_level)
    # The loop thread answers clients while the worker thread migrates; a
    # shorter GIL switch interval bounds how long a request waits for the
    # GIL behind numpy work on the worker (default 5 ms).
    sys.setswitchinterval(0.0005)
    bound_heap()
    try:
        daemon = Daemon(cfg, args.config, inherited_fds=listen_fds(), overrides=overrides)
        return asyncio.run(daemon.run())
    except (KvtierError, OSError) as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
