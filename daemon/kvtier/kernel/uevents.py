"""Memory hot-plug events: kernel uevents for memory blocks, NUMA nodes and
memory tiers, from a NETLINK_KOBJECT_UEVENT socket (pyroute2's
AsyncUeventSocket, on the daemon's event loop).

A CXL region onlined through dax kmem produces one ``add`` and one
``online`` event per memory block (128 MiB each on x86: hundreds for a large
expander), then ``add`` of the node and of a memory tier; offlining produces
``offline``/``remove`` the same way. The listener coalesces a burst into one
callback, ``debounce`` seconds after its last event, so the daemon
re-discovers the topology once per burst, not once per block.

The kernel sends these events to multicast group 1 of the uevent family;
binding needs no privilege beyond the socket (systemd's
RestrictAddressFamilies must keep AF_NETLINK). When the socket cannot be
opened (a sandbox without netlink) ``start`` says so and returns False:
the engine's per-tick check of the node list (``Topology.changed_on_disk``)
still notices the change, one tick later.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from kvtier import logs
from kvtier.errors import KvtierError
from kvtier.kernel import sysfs, topology

log = logging.getLogger("kvtier.uevents")

# Subsystems whose events change what the tiers are: memory blocks
# (/sys/devices/system/memory/memoryN), nodes, the kernel's memory tiers.
SUBSYSTEMS = frozenset({"memory", "node", "memory_tiering"})
ACTIONS = frozenset({"add", "remove", "online", "offline", "change", "move"})
KERNEL_GROUP = 1  # multicast group of kernel-originated uevents (udev re-broadcasts on 2)
DEFAULT_DEBOUNCE_S = 0.2


@dataclass(frozen=True)
class Uevent:
    action: str
    subsystem: str
    devpath: str

    @property
    def name(self) -> str:
        return self.devpath.rsplit("/", 1)[-1]


def parse(msg: Mapping[str, Any]) -> Uevent | None:
    """A pyroute2 ueventmsg (or any mapping of the uevent's KEY=VALUE
    lines) -> Uevent, None when it is not about memory topology."""
    action, subsystem, devpath = msg.get("ACTION"), msg.get("SUBSYSTEM"), msg.get("DEVPATH")
    if not (isinstance(action, str) and isinstance(subsystem, str) and isinstance(devpath, str)):
        return None
    if subsystem not in SUBSYSTEMS or action not in ACTIONS:
        return None
    return Uevent(action, subsystem, devpath)


class UeventListener:
    """Calls ``on_burst(events)`` on the loop thread once per burst of
    memory-topology uevents."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_burst: Callable[[list[Uevent]], None],
                 debounce: float = DEFAULT_DEBOUNCE_S, socket_factory: Callable[[], Any] | None = None):
        self.loop = loop
        self.on_burst = on_burst
        self.debounce = debounce
        self._factory = socket_factory
        self._sock: Any = None
        self._task: asyncio.Task | None = None
        self._pending: list[Uevent] = []
        self._timer: asyncio.TimerHandle | None = None
        self.events_total = 0
        self.bursts_total = 0

    async def start(self) -> bool:
        try:
            if self._factory is None:
                from pyroute2.netlink.uevent import AsyncUeventSocket

                sock = AsyncUeventSocket()
            else:
                sock = self._factory()
            await sock.bind(groups=KERNEL_GROUP)
        except (OSError, ImportError) as e:
            log.warning("memory hot-plug events unavailable (%s): tiers follow hot-plug by polling the node list", e)
            return False
        self._sock = sock
        self._task = self.loop.create_task(self._run())
        logs.event(log, "uevent_listening", subsystems=",".join(sorted(SUBSYSTEMS)), debounce_s=self.debounce)
        return True

    async def _run(self) -> None:
        while True:
            try:
                # One recv's worth of messages per get().
                async for msg in self._sock.get():
                    self.feed([msg])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken socket must not end the daemon
                log.error("uevent socket failed, hot-plug events stop (polling continues): %r", e)
                return

    def feed(self, msgs: Iterable[Mapping[str, Any]]) -> None:
        for msg in msgs:
            ev = parse(msg)
            if ev is None:
                continue
            self.events_total += 1
            self._pending.append(ev)
        if self._pending:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(self.debounce, self._flush)

    def _flush(self) -> None:
        self._timer = None
        events, self._pending = self._pending, []
        if events:
            self.bursts_total += 1
            self.on_burst(events)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
        if self._sock is not None:
            try:
                self._sock.close()
            except Exception:  # closing a half-broken netlink socket
                pass


# Actions after which memory may still be going away: a re-discovery then
# does not read the kernel's memory tiers (topology.discover, memory_tiers).
GOING = frozenset({"offline", "remove"})


class TopologyFollower:
    """Re-discovers the tiers after a hot-plug burst (or when the per-tick
    check sees the node lists change) and hands the new topology to the
    engine with the tier renumbering (topology.compare). Logs ``tier_added``
    and ``tier_removed`` events and counts them in
    ``DaemonStats.topology_events``.

    ``discover(memory_tiers=None)`` re-reads the machine. Where memory is
    going away (a burst with an offline or remove, node lists that lost a
    node) it is given the kernel memory tiers the current topology knows
    instead of reading them: reading a memory tier's nodelist while an
    offline removes that tier deadlocks the kernel (topology.discover). The
    nodes that stay keep their tiers, the ones that went drop out; a node
    that comes at the same time is ordered by HMAT/SLIT until the next
    re-discovery that reads them (the next burst of onlines)."""

    def __init__(self, engine: Any, stats: Any, discover: Callable[..., Any]):
        self.engine = engine
        self.stats = stats
        self.discover = discover

    def on_burst(self, events: list[Uevent]) -> None:
        kinds = sorted({f"{e.subsystem}:{e.action}" for e in events})
        self.refresh(f"{len(events)} uevent(s) {','.join(kinds)}",
                     memory_going=any(e.action in GOING for e in events))

    def poll(self) -> None:
        """Every tick: two small sysfs reads (Topology.changed_on_disk). The
        kernel clears a node from has_memory before it unregisters the
        node's memory tier, so a change seen here can be an offline still
        under way."""
        old = self.engine.latest_topology()
        try:
            now = topology.node_signature(old.sys_root)  # what changed_on_disk compares
        except (KvtierError, OSError) as e:
            log.debug("node list check failed: %s", e)
            return
        if now != old.signature:
            self.refresh("node list changed", memory_going=_lost_nodes(old.signature, now))

    def refresh(self, why: str, memory_going: bool = False) -> None:
        old = self.engine.latest_topology()
        ev = self.stats.topology_events
        try:
            new = self.discover(memory_tiers=old.memory_tier_map()) if memory_going else self.discover()
        except (KvtierError, OSError) as e:
            ev["rediscover_failed"] += 1
            logs.event(log, "topology_rediscover_failed", logging.ERROR, reason=why, error=str(e))
            return
        change = topology.compare(old, new)
        for t in change.removed:
            ev["tier_removed"] += 1
            logs.event(log, "tier_removed", logging.WARNING, tier=t.name, index=t.index, kind=t.kind,
                       nodes=",".join(map(str, t.nodes)) or "-")
        for t in change.added:
            ev["tier_added"] += 1
            logs.event(log, "tier_added", tier=t.name, index=t.index, kind=t.kind,
                       nodes=",".join(map(str, t.nodes)) or "-", total_bytes=t.total, order=t.order_source,
                       read_latency_ns=t.read_latency_ns if t.read_latency_ns is not None else "-")
        ev["rediscovered"] += 1
        logs.event(log, "topology_changed", reason=why, tiers=",".join(t.name for t in new.tiers),
                   nodes_added=",".join(map(str, change.nodes_added)) or "-",
                   nodes_removed=",".join(map(str, change.nodes_removed)) or "-")
        self.engine.set_topology(new, change.index_map)


def _lost_nodes(before: tuple, now: tuple | None) -> bool:
    """Whether a node left the online or has_memory list between two
    ``topology.node_signature`` readings (unreadable lists count as lost)."""
    if now is None or len(before) != len(now):
        return True
    for a, b in zip(before, now):
        if a is None or b is None:
            if a != b:
                return True
            continue
        if not set(sysfs.parse_list(a)) <= set(sysfs.parse_list(b)):
            return True
    return False
