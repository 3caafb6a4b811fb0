"""The I/O half of zero-integration mode: find the processes ``[[watch]]``
rules select and read their adoptable mappings (kvtier.watch decides).

psutil enumerates processes and reads their name, executable, command line,
uids and RSS (it handles the races of processes exiting mid-read and the
kernel threads' empty answers); the cgroup, start time and mappings come
from kernel/procfs, the one place /proc/PID files are parsed. psutil reads
its own ``psutil.PROCFS_PATH`` (/proc), so this scanner always looks at the
live machine: tests of the selection logic feed ``kvtier.watch`` ProcInfo
records directly.

Cheap selectors first: exe, command line and uid come from the one
process_iter pass; RSS, the cgroup and the maps are read only for processes
that passed them.
"""

from __future__ import annotations

import logging
import os

import psutil

from kvtier.errors import KvtierError
from kvtier.kernel import procfs
from kvtier.watch import Candidate, ProcInfo, Rule, adoptable_ranges

log = logging.getLogger("kvtier.watch")

_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, KvtierError, OSError)


def _cheap_match(rule: Rule, p: ProcInfo) -> bool:
    """The rule's selectors that need nothing beyond process_iter's attributes."""
    full = Rule(rule.name, exe=rule.exe, cmdline=rule.cmdline, uid=rule.uid)
    return full.matches(p)


class PsutilScanner:
    def __init__(self, proc_root: str = "/proc", self_pid: int | None = None):
        self.proc_root = proc_root
        self.self_pid = os.getpid() if self_pid is None else self_pid

    def scan(self, rules: list[Rule]) -> list[Candidate]:
        if not rules:
            return []
        attrs = ["name", "uids"]
        if any(r.exe for r in rules):
            attrs.append("exe")
        if any(r.cmdline is not None for r in rules):
            attrs.append("cmdline")
        out = []
        for proc in psutil.process_iter(attrs):
            if proc.pid == self.self_pid:
                continue  # never adopt the daemon's own memory
            info = proc.info
            uids = info.get("uids")
            p = ProcInfo(proc.pid, 0, name=info.get("name") or "", exe=info.get("exe") or None,
                         cmdline=info.get("cmdline"), uid=uids.real if uids else -1)
            rules_left = [r for r in rules if _cheap_match(r, p)]
            if not rules_left:
                continue
            try:
                p.rss = proc.memory_info().rss
                if any(r.needs_cgroup for r in rules_left):
                    p.cgroup = procfs.read_cgroup(p.pid, self.proc_root)
                rule = next((r for r in rules_left if r.matches(p)), None)
                if rule is None:
                    continue
                p.start_time = procfs.read_start_time(p.pid, self.proc_root)
                maps = procfs.read_maps(p.pid, self.proc_root)
            except _GONE as e:
                log.debug("watch: pid %d skipped: %s", p.pid, e)
                continue
            if p.rss == 0 and not maps:
                continue  # a kernel thread: no memory of its own
            out.append(Candidate(p, rule, adoptable_ranges(maps, rule.min_mapping)))
        return out
