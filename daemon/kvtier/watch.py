"""Zero-integration mode: adopt the large anonymous mappings of processes
that ``[[watch]]`` rules select, for engines that cannot be changed.

Split as everywhere in kvtier: a scanner (kernel/watch.py, psutil and
/proc/PID/maps) produces a snapshot of matching processes and their
KV-eligible mappings on a worker thread; ``Watcher.apply`` decides on the
loop thread, against the registry, what to adopt, resize and release:

* a mapping at least ``min_mapping`` bytes long that no region covers is
  adopted as a region (tenant from the rule, else the process's cgroup);
* an adopted region whose mapping changed length (a heap that grew, an
  mremap, a munmap of the tail) is re-registered at the new length, keeping
  the temperature, last access and tier of the blocks that stayed;
* an adopted region whose mapping is gone is released;
* a process that exits loses its regions through the registry's pidfd
  watch, like any client's.

Adopted regions carry ``Region.adopted_by`` (the rule name): kvtierctl
regions shows them, the state file skips them (the next scan after a
restart adopts them again), and the watcher never touches a region a client
registered itself (that mapping is simply not adopted).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from kvtier import logs
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger("kvtier.watch")

# Per-block state carried over when an adopted mapping changes length.
# check_at with temp: its bound on when the run can end still holds (hotness.Temperature._arm)
KEPT_FIELDS = ("temp", "last_access", "check_at", "tier", "flags", "last_move", "retry_at", "fail_count", "stuck", "prior")


@dataclass(frozen=True)
class Rule:
    """One validated ``[[watch]]`` entry (keys and defaults: config.OPTIONS)."""

    name: str
    exe: str = ""
    cmdline: re.Pattern | None = None
    cgroup: str = ""
    uid: int = -1
    min_rss: int = 0
    min_mapping: int = 64 << 20
    block_size: int = 2 << 20
    tenant: str = ""
    priority: int = 0

    def matches(self, p: "ProcInfo") -> bool:
        """Every selector given must hold; attributes the scanner could not
        read (None) fail the selector that needs them."""
        if self.exe:
            if p.exe is None:
                return False
            exe = p.exe if "/" in self.exe else p.exe.rsplit("/", 1)[-1]
            if exe != self.exe and not ("/" not in self.exe and p.name == self.exe):
                return False
        if self.cmdline is not None and (p.cmdline is None or not self.cmdline.search(" ".join(p.cmdline))):
            return False
        if self.uid >= 0 and p.uid != self.uid:
            return False
        if self.cgroup:
            if p.cgroup is None:
                return False
            base = self.cgroup.rstrip("/") or "/"
            if not (p.cgroup == base or p.cgroup.startswith(base if base == "/" else base + "/")):
                return False
        return p.rss >= self.min_rss

    @property
    def needs_cgroup(self) -> bool:
        return bool(self.cgroup) or not self.tenant


def parse_rules(entries: Iterable[Any]) -> list[Rule]:
    """config's ``cfg.watch`` namespaces -> Rules; ConfigError names the entry."""
    rules = []
    names: set[str] = set()
    for i, e in enumerate(entries):
        where = f"watch[{i}]"
        d = dict(vars(e)) if not isinstance(e, dict) else dict(e)
        if not (d.get("exe") or d.get("cmdline") or d.get("cgroup") or d.get("uid", -1) >= 0):
            raise ConfigError(f"{where}: needs at least one of exe, cmdline, cgroup, uid "
                              "(a rule without one would adopt every process)")
        pattern = None
        if d.get("cmdline"):
            try:
                pattern = re.compile(d["cmdline"])
            except re.error as err:
                raise ConfigError(f"{where}.cmdline: bad regular expression {d['cmdline']!r}: {err}") from None
        if d.get("cgroup") and not d["cgroup"].startswith("/"):
            raise ConfigError(f"{where}.cgroup: must be an absolute cgroup path, got {d['cgroup']!r}")
        name = d.get("name") or f"watch{i}"
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is used by another rule")
        names.add(name)
        rules.append(Rule(name=name, exe=d.get("exe", ""), cmdline=pattern, cgroup=d.get("cgroup", ""),
                          uid=d.get("uid", -1), min_rss=d.get("min_rss", 0),
                          min_mapping=d.get("min_mapping", 64 << 20), block_size=d.get("block_size", 2 << 20),
                          tenant=d.get("tenant", ""), priority=d.get("priority", 0)))
    return rules


@dataclass
class ProcInfo:
    """What the scanner knows of one process (None: could not be read)."""

    pid: int
    start_time: int
    name: str = ""
    exe: str | None = None
    cmdline: list[str] | None = None
    uid: int = -1
    rss: int = 0
    cgroup: str | None = None


@dataclass
class Candidate:
    """A process some rule selected, with its adoptable ranges (start, end)."""

    proc: ProcInfo
    rule: Rule
    ranges: list[tuple[int, int]] = field(default_factory=list)


def tenant_of(rule: Rule, proc: ProcInfo) -> str:
    if rule.tenant:
        return rule.tenant
    if proc.cgroup and proc.cgroup != "/":
        return proc.cgroup.rstrip("/").rsplit("/", 1)[-1][:64]
    return ""


def adoptable_ranges(maps: Iterable[Any], min_bytes: int) -> list[tuple[int, int]]:
    """KV-eligible mappings (procfs.Mapping.kv_eligible) merged where they
    touch (the kernel splits one allocation into several VMAs when part of
    it is madvised or mbind'ed), kept when at least ``min_bytes`` long."""
    out: list[list[int]] = []
    for m in sorted(maps, key=lambda m: m.start):
        if not m.kv_eligible:
            continue
        if out and out[-1][1] == m.start:
            out[-1][1] = m.end
        else:
            out.append([m.start, m.end])
    return [(a, b) for a, b in out if b - a >= min_bytes]


class Scanner(Protocol):
    def scan(self, rules: list[Rule]) -> list[Candidate]: ...


class Watcher:
    """Applies scans to the registry (loop thread only, like the registry)."""

    def __init__(self, rules: list[Rule], registry: Any, scanner: Scanner):
        self.rules = rules
        self.registry = registry
        self.scanner = scanner
        self.adopted_total = 0
        self.resized_total = 0
        self.released_total = 0
        self.errors_total = 0
        self._refused: set[tuple[int, int, int]] = set()  # (pid, start, end) logged once

    def scan(self) -> list[Candidate]:
        """The I/O half: runs on a worker thread."""
        return self.scanner.scan(self.rules)

    def _adopted(self) -> dict[int, list[Any]]:
        """pid -> regions this watcher adopted."""
        out: dict[int, list[Any]] = {}
        for r in self.registry.regions.values():
            if r.adopted_by:
                out.setdefault(r.pid, []).append(r)
        return out

    def apply(self, candidates: list[Candidate]) -> None:
        """The decide-and-act half, on the loop thread.

        Each adoptable range becomes one region starting at the first
        multiple of the block size inside it (the head, less than a block,
        stays unmanaged). So every region of a process lies on one grid of
        absolute addresses, and a mapping that grows, shrinks or merges with
        a neighbour (the kernel merges adjacent anonymous VMAs: a second
        malloc'ed pool grows the first one downwards) keeps the state of the
        blocks it still holds, whatever its new start.
        """
        reg = self.registry
        adopted = self._adopted()
        for c in candidates:
            pid = c.proc.pid
            if pid in reg.pid_start and reg.pid_start[pid] != c.proc.start_time:
                continue  # the pid was reused since the scan: the pidfd drops the old regions
            mine = adopted.pop(pid, [])
            bs = c.rule.block_size
            kept: set[int] = set()
            for a, b in c.ranges:
                inside = sorted((r for r in mine if r.id not in kept and r.id in reg.regions and r.start < b and a < r.end),
                                key=lambda r: -r.length)
                if not inside:
                    start = -(-a // bs) * bs
                    if b - start >= bs:
                        self._adopt(c, start, b)
                    continue
                keep = inside[0]
                for other in inside[1:]:
                    self._release(other, f"merged into region {keep.id}")
                start = -(-a // keep.block_size) * keep.block_size
                if (start, b) != (keep.start, keep.end):
                    self._resize(keep, start, b - start)
                kept.add(keep.id)
            for r in mine:
                if r.id not in kept and r.id in reg.regions:
                    self._release(r, "mapping gone")
        for regions in adopted.values():
            # Still running but no longer matching (rules reloaded, RSS
            # dropped below min_rss, uid changed) or gone: let go of it.
            for r in regions:
                if r.id in reg.regions:
                    self._release(r, "process no longer matches")
        live = {(c.proc.pid, a, b) for c in candidates for a, b in c.ranges}
        self._refused &= live

    def _adopt(self, c: Candidate, start: int, end: int) -> None:
        rule, p = c.rule, c.proc
        try:
            reg = self.registry.add(
                p.pid, start, end - start, rule.block_size, name=f"{rule.name}:{p.name or p.pid}",
                tenant=tenant_of(rule, p), priority=rule.priority, owner_uid=max(p.uid, 0),
                start_time=p.start_time, adopted_by=rule.name,
            )
        except (KvtierError, OSError) as e:
            key = (p.pid, start, end)
            if key not in self._refused:
                # Overlap (the process registered this itself), limits, a
                # mapping gone since the scan: said once, retried each scan.
                self._refused.add(key)
                self.errors_total += 1
                logs.event(log, "watch_adopt_failed", logging.INFO, rule=rule.name, pid=p.pid,
                           start=f"0x{start:x}", bytes=end - start, error=str(e))
            return
        self.adopted_total += 1
        logs.event(log, "watch_adopted", rule=rule.name, pid=p.pid, region=reg.id, start=f"0x{start:x}",
                   bytes=end - start, tenant=reg.tenant)

    def _release(self, r: Any, why: str) -> None:
        self.registry.remove(r.id)
        self.released_total += 1
        logs.event(log, "watch_released", rule=r.adopted_by, pid=r.pid, region=r.id, reason=why)

    def _resize(self, r: Any, start: int, length: int) -> None:
        """Re-register at the new range, same block size: old block i is at
        the same address as new block i + shift, so it keeps its state (a
        growing heap does not forget what is hot)."""
        table = self.registry.table
        saved = {f: table.region_view(r.id, f).copy() for f in KEPT_FIELDS}
        self.registry.remove(r.id)
        try:
            new = self.registry.add(r.pid, start, length, r.block_size, name=r.name, tenant=r.tenant,
                                    priority=r.priority, owner_uid=r.owner_uid, start_time=r.start_time,
                                    region_id=r.id, adopted_by=r.adopted_by)
        except (KvtierError, OSError) as e:
            self.errors_total += 1
            logs.event(log, "watch_released", logging.INFO, rule=r.adopted_by, pid=r.pid, region=r.id,
                       reason=f"resize failed: {e}")
            return
        shift = (r.start - start) // r.block_size
        lo, hi = max(0, -shift), min(r.nblocks, new.nblocks - shift)
        for f, values in saved.items():
            if hi > lo:
                table.region_view(new.id, f)[lo + shift:hi + shift] = values[lo:hi]
        self.resized_total += 1
        logs.event(log, "watch_resized", rule=r.adopted_by, pid=r.pid, region=r.id, old_start=f"0x{r.start:x}",
                   old_bytes=r.length, start=f"0x{start:x}", bytes=length)

    def counters(self) -> dict[str, int]:
        return {"adopted": self.adopted_total, "resized": self.resized_total,
                "released": self.released_total, "errors": self.errors_total}


class Schedule:
    """Runs ``Watcher`` scans every ``interval`` seconds: the scan on its own
    thread (psutil and /proc reads of many processes take milliseconds to
    tens of milliseconds, which must not stall clients), the apply back on
    the loop thread. One scan at a time; the next starts ``interval`` after
    the previous one was applied."""

    def __init__(self, watcher: Watcher, loop: Any, interval: float):
        from concurrent.futures import ThreadPoolExecutor

        self.watcher = watcher
        self.loop = loop
        self.interval = interval
        self.scans_total = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-watch")
        self._timer = None
        self._closed = False

    def start(self) -> None:
        self._timer = self.loop.call_soon(self._scan)

    def _scan(self) -> None:
        self._timer = None
        if self._closed:
            return
        fut = self.loop.run_in_executor(self._executor, self.watcher.scan)
        fut.add_done_callback(self._scanned)

    def _scanned(self, fut: Any) -> None:
        if self._closed:
            return
        exc = fut.exception()
        if exc is not None:
            self.watcher.errors_total += 1
            log.error("watch scan failed: %r", exc)
        else:
            try:
                self.watcher.apply(fut.result())
            except Exception:  # one bad scan must not end watching
                self.watcher.errors_total += 1
                log.exception("watch apply failed")
        self.scans_total += 1
        self._timer = self.loop.call_later(self.interval, self._scan)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
