"""kvtierd configuration: one table of every option, parsed from TOML.

``OPTIONS`` is the only place an option is named: its table (``daemon``,
``hotness.damon``, ...), key, type, default, bounds and a one-line doc.
``from_dict`` validates a whole document against it in one pass, so every
error names the offending key (``limits.max_message_bytes: must be >= 4096``)
and no value reaches a component with the wrong type. The sample config,
``-s a.b.c=v`` overrides and the tests all read the same table, so a new
option is one new row.

Defaults are not copied here: the policy's come from ``PolicyConfig``, the
exporter's from ``MetricsConfig``, DAMON's from ``DamonParams`` and the other
sources' from their constructors' keyword defaults. A unit test checks that
every field of those dataclasses has its row.

What one value cannot show (``low_wm <= high_wm``, DAMON's interval order, a
topology whose first tier is DRAM) is checked by the owner's constructor,
which ``from_dict`` calls once per table (``TABLE_CHECKS``), so a config that
loads is a config the daemon can build.
"""

from __future__ import annotations

import grp
import inspect
import math
import textwrap
import tomllib
from dataclasses import MISSING, dataclass, fields
from types import SimpleNamespace
from typing import Any, Callable

from kvtier import hintring
from kvtier.errors import ConfigError
from kvtier.hotness import DEFAULT_SOURCE_CPU_BUDGET, DEFAULT_TAU_S, END_OF_RUN
from kvtier.kernel import sources
from kvtier.kernel import topology
from kvtier.kernel.sources.accessbits import MODES as ACCESS_BIT_MODES
from kvtier.kernel.sources.accessbits import AccessBitSource
from kvtier.kernel.sources.damon import DamonParams
from kvtier.kernel.sources.perf import LoadSampleSource, MajorFaultSource
from kvtier.metrics import MetricsConfig
from kvtier.policy import PolicyConfig
from kvtier.protocol import DEFAULT_MAX_MESSAGE, DEFAULT_SOCKET
from kvtier.watch import Rule as _WatchRule
from kvtier.watch import parse_rules as _parse_watch_rules

DEFAULT_PATH = "/etc/kvtierd/kvtierd.toml"
DEFAULT_STATE = "/var/lib/kvtierd/state.json"

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

# How types are named in messages and in the sample config: TOML's words.
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "table"}


@dataclass(frozen=True)
class Option:
    """One config key. ``type`` is bool, int, float, str, list (a TOML array of
    ``item``) or dict (a TOML table of ``item`` values), or a tuple of these.
    ``lo``/``hi`` bound a number, the length of a string, or each item of a
    list or table; ``lo_open`` makes ``lo`` exclusive. ``int_keys``: a table's
    keys must be integers (tier indices). ``check`` validates what a type
    cannot say and raises ConfigError. ``restart``: read once at start; a
    reload (SIGHUP) that changes it is refused, naming it."""

    section: str
    name: str
    type: Any
    default: Any
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] | None = None
    item: type | None = None
    int_keys: bool = False
    check: Callable[[Any], Any] | None = None
    restart: bool = False

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    def type_name(self) -> str:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        name = " or ".join(_TYPE_NAMES[t] for t in types)
        if self.item is not None:
            name += f" of {_TYPE_NAMES[self.item]}"
        return name

    def bounds_text(self) -> str:
        out = []
        if self.type is str:
            if self.lo:
                out.append("not empty")
        else:
            if self.lo is not None:
                out.append(f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
            if self.hi is not None:
                out.append(f"<= {_num(self.hi)}")
        if self.choices:
            out.append("one of " + ", ".join(self.choices))
        return "; ".join(out)


def _num(x: float) -> str:
    """A bound as an operator reads it: 1073741824, not 1.07374e+09."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _field_default(cls: type, name: str) -> Any:
    """The default of a dataclass field (``default_factory`` called)."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            break
    raise LookupError(f"{cls.__name__}.{name} has no default")


def _kw_default(cls: type, name: str) -> Any:
    """The default of a keyword argument of ``cls``'s constructor or of the
    first base constructor that declares it (``**kw`` passes it on)."""
    for klass in cls.__mro__:
        param = inspect.signature(klass.__init__).parameters.get(name)
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
    raise LookupError(f"{cls.__name__}({name}=...) has no default")


def _group_exists(name: str) -> None:
    if name and not name.isdigit():  # a numeric gid needs no group entry
        try:
            grp.getgrnam(name)
        except KeyError:
            raise ConfigError(f"no such group {name!r}") from None


def _power_of_two(n: int) -> None:
    if n & (n - 1):
        raise ConfigError(f"must be a power of two, got {n}")


def _topology_tiers(tiers: list) -> None:
    if tiers:
        topology.validate_overrides({"tiers": tiers})


def _topology_swap(swap: Any) -> None:
    topology.validate_overrides({"swap": swap})


def _ring_pages(section: str, cls: type) -> Option:
    """Both perf sources take the same ring size key."""
    return Option(section, "ring_pages", int, _kw_default(cls, "ring_pages"),
                  "Pages of each perf ring buffer (a power of two).", 1, 1 << 16, check=_power_of_two)


_P = PolicyConfig
_M = MetricsConfig
_D = DamonParams
_SOURCE_ON = {name: on for name, (_, on) in sources.SECTIONS.items()}

OPTIONS: tuple[Option, ...] = (
    # -- daemon ---------------------------------------------------------
    Option("daemon", "socket", str, DEFAULT_SOCKET,
           "Unix socket path; ignored when systemd passes a socket (LISTEN_FDS).", lo=1, restart=True),
    Option("daemon", "socket_group", str, "",
           "Group owning the socket (clients must be in it); empty = the daemon's group.",
           check=_group_exists, restart=True),
    Option("daemon", "socket_mode", int, 0o660, "Permission bits of the socket.", 0, 0o777, restart=True),
    Option("daemon", "state_file", str, DEFAULT_STATE,
           "Registrations persist here (atomic rename) so a restart re-adopts them; empty disables.",
           restart=True),
    Option("daemon", "state_flush_delay", float, 0.05,
           "Seconds to batch registration changes before one atomic state write.", 0.0, 60.0),
    Option("daemon", "tick_interval", float, 1.0,
           "Seconds between policy ticks (snapshot, plan, migrate).", 0.01, 3600.0),
    Option("daemon", "residency_interval", float, 10.0,
           "Seconds for the rotating residency sample to look at every block once "
           "(longer when residency_pages_per_s cannot pay for it, or while it backs off: residency_idle_slowdown).",
           0.1, 86400.0),
    Option("daemon", "residency_pages_per_s", float, 65536.0,
           "Budget of pages per second whose placement is measured (sampled windows, blocks that changed): "
           "bounds the measuring cost whatever is registered.", 1.0, 1e9),
    Option("daemon", "residency_idle_slowdown", int, 8,
           "The rotating sample runs up to this many times more slowly while its windows find nothing "
           "the daemon did not do (halving after each 16,384 windows or whole table that agreed; the first "
           "that disagrees restores full rate); 1 = never back off.", 1, 1024),
    Option("daemon", "residency_sample_pages", int, 16,
           "Pages per block in the rotating sample's window; a block it finds elsewhere is measured whole.",
           1, 1 << 20),
    Option("daemon", "move_threads", int, 0,
           "Threads one migration may use: a large move_pages is cut into that many parts moved at once; "
           "0 = the CPUs the daemon may run on, at most 4.", 0, 256),
    Option("daemon", "source_cpu_budget", float, DEFAULT_SOURCE_CPU_BUDGET,
           "Share of one core each hotness source may use (its collect plus its kernel thread); "
           "above it the source runs less often and says so in status and metrics.", 0.0001, 64.0),
    Option("daemon", "proc_root", str, "/proc", "procfs root (tests point it elsewhere).", lo=1, restart=True),
    Option("daemon", "sys_root", str, "/sys", "sysfs root (tests point it elsewhere).", lo=1, restart=True),
    Option("daemon", "dry_run", bool, False,
           "Plan, measure and observe, but move no page: planned moves are counted apart "
           "(status dry_run_planned, kvtier_dry_run_planned_*) and every block keeps the tier the kernel shows."),
    Option("daemon", "log_level", str, "info", "Logging level.",
           choices=("debug", "info", "warning", "error")),
    Option("daemon", "hint_ring_interval", float, hintring.DEFAULT_INTERVAL,
           "Seconds between drains of the clients' shared-memory hint rings (a ring is also drained "
           "before each request of its connection): how late a hint written there is applied.",
           0.001, 10.0),
    Option("daemon", "watch_interval", float, 2.0,
           "Seconds between scans for processes matching [[watch]] rules and for their mappings.", 0.1, 3600.0),
    # -- security -------------------------------------------------------
    Option("security", "admin_group", str, "",
           "Members act as root on the socket: register any process's memory, use any region; root always may.",
           check=_group_exists),
    # -- limits ---------------------------------------------------------
    Option("limits", "max_regions_per_process", int, 4096,
           "Registered regions one process may hold.", 1, 1 << 20),
    Option("limits", "max_bytes_per_process", int, 64 * TIB,
           "Registered bytes one process may hold.", 4096, 1 << 62),
    Option("limits", "max_blocks_per_region", int, 1 << 22,
           "Blocks in one region (per-block state costs ~64 bytes of daemon memory).", 1, 1 << 30),
    Option("limits", "max_blocks_total", int, 1 << 24,
           "Blocks across all regions: bounds the daemon's own memory.", 1, 1 << 31),
    Option("limits", "max_message_bytes", int, DEFAULT_MAX_MESSAGE,
           "Largest request frame accepted; larger ones close the connection.", 4096, 1 << 30),
    Option("limits", "requests_per_second", float, 50000.0,
           "Sustained requests per second per connection (token bucket).", 1.0, 1e9),
    Option("limits", "request_burst", int, 5000,
           "Token bucket depth: requests a connection may send at once.", 1, 1 << 30),
    Option("limits", "max_connections", int, 1024, "Open client connections.", 1, 1 << 20),
    Option("limits", "hint_ring_entries", int, hintring.DEFAULT_ENTRIES,
           "Largest shared-memory hint ring one connection may ask for, in 4-byte words (about one "
           "per block hint; rounded down to a power of two; 128 Ki = 516 KiB of memfd per ring); "
           "0 refuses rings.", 0, 1 << 24),
    Option("limits", "max_connections_per_uid", int, 128,
           "Open connections of one user id.", 1, 1 << 20),
    Option("limits", "reserved_connections", int, 16,
           "Of max_connections, kept for root and security.admin_group (kvtierctl works under a flood).",
           0, 1 << 20),
    Option("limits", "max_pending_bytes_per_uid", int, 32 * MIB,
           "Bytes of requests received and not yet answered (mostly incomplete frames) across one "
           "uid's connections; the connection that goes past it is closed.", 4096, 1 << 40),
    Option("limits", "frame_timeout", float, 10.0,
           "Seconds a frame may take from its first byte to its last; a stalled frame closes the "
           "connection.", 0.01, 3600.0),
    Option("limits", "idle_timeout", float, 600.0,
           "Seconds a connection may stay without a request before it is closed (registrations "
           "belong to the process and survive; the client library reconnects); 0 disables.",
           0.0, 1e9),
    # -- policy (kvtier.policy.PolicyConfig; the control law is in policy.py) --
    Option("policy", "capacity", dict, _field_default(_P, "capacity"),
           "Per tier index: the share of the tier kvtier may fill (<= 1.0) or a byte count (> 1), "
           "e.g. {0 = 0.8, 1 = 68719476736}; tiers not listed use their whole capacity.",
           lo=0, lo_open=True, item=float, int_keys=True),
    Option("policy", "high_wm", float, _P.high_wm,
           "Fraction of a tier's capacity above which its coldest blocks are demoted.", 0, 1, lo_open=True),
    Option("policy", "low_wm", float, _P.low_wm,
           "Demotion stops at this fraction (<= high_wm); between the two only cold blocks go.",
           0, 1, lo_open=True),
    Option("policy", "promote_temp", float, _P.promote_temp,
           "Temperature (decayed accesses) at which a block in a slower tier is promoted.", 0),
    Option("policy", "demote_temp", float, _P.demote_temp,
           "Below this temperature a block is cold (<= promote_temp: the hysteresis).", 0),
    Option("policy", "margin_ratio", float, _P.margin_ratio,
           "A promotion displaces a resident only if hotter by this ratio ...", 0),
    Option("policy", "margin_abs", float, _P.margin_abs, "... plus this absolute margin ...", 0),
    Option("policy", "margin_sigma", float, _P.margin_sigma,
           "... plus this many sqrt(temperature) units of counting noise.", 0),
    Option("policy", "min_residence_s", float, _P.min_residence_s,
           "Seconds a block stays in a tier after a move before it may be demoted (promotions do not wait: "
           "a block read again is worth its move).", 0),
    Option("policy", "promote_mbps", float, _P.promote_mbps,
           "Promotion bandwidth budget, MiB/s.", 0, lo_open=True),
    Option("policy", "demote_mbps", float, _P.demote_mbps,
           "Demotion bandwidth budget, MiB/s.", 0, lo_open=True),
    Option("policy", "burst_s", float, _P.burst_s,
           "Bandwidth bucket depth in seconds of rate (at least one block).", 0),
    Option("policy", "tenant_dram_quota", dict, _field_default(_P, "tenant_dram_quota"),
           "Per tenant name: bytes of DRAM (tier 0) its blocks may hold, e.g. {batch = 8589934592}.",
           lo=0, item=int),
    Option("policy", "prefill_done_factor", float, _P.prefill_done_factor,
           "Share of its temperature a block counts once its prompt's prefill is done.", 0, 1),
    Option("policy", "cold_demote", bool, _P.cold_demote,
           "Demote cold blocks between the watermarks (false: only above high_wm)."),
    Option("policy", "backoff_base_s", float, _P.backoff_base_s,
           "First retry delay after the kernel failed to move a block (doubles per failure).", 0),
    Option("policy", "backoff_max_s", float, _P.backoff_max_s, "Longest retry delay.", 0),
    Option("policy", "unmovable_after", int, _P.unmovable_after,
           "Consecutive failed moves after which a block is marked unmovable.", 1, 1 << 20),
    Option("policy", "unmovable_reprobe_s", float, _P.unmovable_reprobe_s,
           "Seconds before a block the kernel would not move (locked, pinned, failing) is tried again.", 0),
    Option("policy", "return_window_s", float, _P.return_window_s,
           "A block found back in memory this soon after it was paged out came straight back "
           "(its reader faulted it in).", 0),
    Option("policy", "return_backoff_s", float, _P.return_backoff_s,
           "How long such a block is not paged out again (doubles per return in a row, up to backoff_max_s); "
           "in a region whose owner hints, until the owner stops reading it.", 0),
    # -- topology (kvtier.kernel.topology.validate_overrides) -----------------
    Option("topology", "tiers", list, [],
           "Memory tiers in order, fastest first, replacing the discovered ones; empty = discover. "
           'Each: {name = "dram", nodes = [0], kind = "dram"|"far"|"cxl", capacity = bytes} '
           "(kind and capacity optional; the first tier must be dram).",
           item=dict, check=_topology_tiers),
    Option("topology", "swap", (bool, dict), True,
           "Use swap as the slowest tier: true, false, or {enabled = true, name = \"swap\", capacity = bytes}.",
           check=_topology_swap),
    # -- hotness --------------------------------------------------------------
    Option("hotness", "tau_s", float, DEFAULT_TAU_S,
           "Seconds of memory of block temperature: a block read r times a second settles at r * tau_s.",
           0, lo_open=True),
    Option("hotness", "end_of_run", float, END_OF_RUN,
           "A block's run of reads ends (temperature 0) once its silence had less than exp(-end_of_run) "
           "chance at the rate it was read at; 0 = never (temperatures only decay).", 0),
    Option("hotness.damon", "enabled", bool, _SOURCE_ON["damon"],
           "DAMON virtual-address monitoring of registered processes."),
    Option("hotness.damon", "sample_us", int, _D.sample_us,
           "Microseconds between access checks of each region.", 1, 1 << 40),
    Option("hotness.damon", "aggr_us", int, _D.aggr_us,
           "Microseconds per aggregation (>= sample_us); accesses are counted per aggregation.", 1, 1 << 40),
    Option("hotness.damon", "update_us", int, _D.update_us,
           "Microseconds between re-reads of the monitored address ranges (>= aggr_us).", 1, 1 << 40),
    Option("hotness.damon", "min_nr_regions", int, _D.min_nr_regions,
           "Fewest regions DAMON splits the address space into.", 3, 1 << 31),
    Option("hotness.damon", "max_nr_regions", int, _D.max_nr_regions,
           "Most regions (>= min_nr_regions): bounds DAMON's CPU cost.", 3, 1 << 31),
    Option("hotness.access_bits", "enabled", bool, _SOURCE_ON["access_bits"],
           "Page accessed bits, where a self-test at start shows the kernel reports them (idle page tracking; "
           "not in Debian's kernels); not used where DAMON runs: both would clear the same bits."),
    Option("hotness.access_bits", "mode", str, _kw_default(AccessBitSource, "mode"),
           "How to read them: idle page tracking, /proc/kpageflags, or auto (the first that works).",
           choices=("auto", *ACCESS_BIT_MODES)),
    Option("hotness.perf_fault", "enabled", bool, _SOURCE_ON["perf_fault"],
           "perf samples of major faults (swap-ins): which blocks are read back from swap."),
    Option("hotness.perf_fault", "prefetch_blocks", int, _kw_default(MajorFaultSource, "prefetch_blocks"),
           "On a major fault in a block, page in this many following blocks of its region that are in swap, "
           "ahead of a sequential reader (0 = none).", 0, 1 << 16),
    _ring_pages("hotness.perf_fault", MajorFaultSource),
    Option("hotness.perf", "enabled", bool, _SOURCE_ON["perf"],
           "PEBS/IBS load-address samples where the CPU has them."),
    Option("hotness.perf", "sample_period", int, _kw_default(LoadSampleSource, "sample_period"),
           "One sample per this many loads.", 1, 1 << 40),
    _ring_pages("hotness.perf", LoadSampleSource),
    # -- metrics (kvtier.metrics.MetricsConfig) --------------------------------
    Option("metrics", "enabled", bool, _M.enabled, "Serve Prometheus metrics over HTTP."),
    Option("metrics", "address", str, _M.address,
           "Address to listen on (loopback by default: block placement is not for every interface).", lo=1),
    Option("metrics", "port", int, _M.port, "TCP port (0 = any free port).", 0, 65535),
    Option("metrics", "per_region", bool, _M.per_region,
           "Per-region series (regions x tiers of them); off keeps the per-tenant ones."),
    Option("metrics", "summary_pass_s", float, _M.summary_pass_s,
           "Seconds for one pass of the block-table sums metrics read (refreshed a slice per tick; "
           "a scrape's cost then does not grow with blocks).", 1.0, 86400.0),
    # -- record (kvtier.record: replay with kvtier-sim) ------------------------
    Option("record", "enabled", bool, False,
           "Record registrations, hints, source observations and placements for kvtier-sim replay."),
    Option("record", "dir", str, "/var/lib/kvtierd/recording",
           "Directory of the recording (kvtier.csv, then kvtier.csv.1 ... as it rotates).", lo=1),
    Option("record", "max_bytes", int, 64 * MIB, "Size at which the current file rotates.", 4096, 1 << 40),
    Option("record", "files", int, 4, "Files kept, the current one included (bounds the disk used).", 1, 1000),
)

SECTION_DOCS = {
    "daemon": "The service: socket, state file, tick.",
    "security": "Who may do what beyond their own memory.",
    "limits": "Bounds on what clients may ask of the daemon.",
    "policy": "Placement policy (kvtier.policy.PolicyConfig).",
    "topology": "Tier overrides, e.g. which NUMA nodes are CXL.",
    "hotness": "How block temperature is measured.",
    "hotness.damon": "DAMON source.",
    "hotness.access_bits": "Access-bit source.",
    "hotness.perf_fault": "Major-fault sample source.",
    "hotness.perf": "Load sample source.",
    "metrics": "Prometheus exporter.",
    "record": "Recording of what the daemon saw, in kvtier-sim's trace format.",
}

# Arrays of tables: ``[[watch]]`` holds one zero-integration rule per table
# (kvtier.watch). These rows declare the keys of each entry, validated by the
# same check_value; defaults come from kvtier.watch.Rule.
_WR = _WatchRule
REPEATED: dict[str, tuple[Option, ...]] = {
    "watch": (
        Option("watch", "name", str, "", "Rule name, shown in kvtierctl regions (empty: watchN)."),
        Option("watch", "exe", str, _WR.exe,
               "Executable to match: its file name, or the full path when it contains '/'."),
        Option("watch", "cmdline", str, "",
               "Regular expression searched in the command line (arguments joined by spaces)."),
        Option("watch", "cgroup", str, _WR.cgroup,
               "cgroup path (e.g. /system.slice/vllm.service); matches it and below."),
        Option("watch", "uid", int, _WR.uid, "Real user id to match; -1: any.", -1, (1 << 32) - 1),
        Option("watch", "min_rss", int, _WR.min_rss,
               "Only processes whose resident set is at least this many bytes.", 0, 1 << 62),
        Option("watch", "min_mapping", int, _WR.min_mapping,
               "Adopt private anonymous or shared-memory mappings at least this large.", 4096, 1 << 62),
        Option("watch", "block_size", int, _WR.block_size, "Block size of adopted regions.", 4096, 1 << 40),
        Option("watch", "tenant", str, _WR.tenant,
               "Tenant of adopted regions; empty: the last component of the process's cgroup path.", hi=64),
        Option("watch", "priority", int, _WR.priority, "Priority of adopted regions.", -100, 100),
    ),
}
SECTION_DOCS["watch"] = ("Zero-integration mode: adopt the memory of processes that cannot register "
                         "(one [[watch]] table per rule; every key given must match).")

_BY_KEY = {o.key: o for o in OPTIONS}
SECTIONS = tuple(dict.fromkeys(o.section for o in OPTIONS))
# Every table a document may hold: the sections and the tables above them.
_TABLES = {".".join(s.split(".")[: i + 1]) for s in SECTIONS for i in range(s.count(".") + 1)}


def _subtables(prefix: str) -> list[str]:
    return [t.rpartition(".")[2] for t in sorted(_TABLES) if t.rpartition(".")[0] == prefix]


def _known_in(prefix: str) -> str:
    return ", ".join([o.name for o in OPTIONS if o.section == prefix] + _subtables(prefix))


class Config:
    """Validated options: ``cfg.daemon.socket``, ``cfg.hotness.damon.sample_us``;
    ``cfg.table("policy")`` is one table as a dict; ``cfg.source`` says where
    it came from."""

    def __init__(self, values: dict[str, Any], source: str = "<defaults>",
                 repeated: dict[str, list[dict[str, Any]]] | None = None):
        self.values = values
        self.source = source
        # ``cfg.watch``: one namespace per [[watch]] entry, defaults filled in.
        self.repeated = {sec: list((repeated or {}).get(sec, ())) for sec in REPEATED}
        for sec, entries in self.repeated.items():
            setattr(self, sec, [SimpleNamespace(**e) for e in entries])
        for sec in SECTIONS:
            ns: Any = self
            for part in sec.split("."):
                if not hasattr(ns, part):
                    setattr(ns, part, SimpleNamespace())
                ns = getattr(ns, part)
            for o in OPTIONS:
                if o.section == sec:
                    setattr(ns, o.name, values[o.key])

    def get(self, key: str) -> Any:
        return self.values[key]

    def table(self, section: str) -> dict[str, Any]:
        """The options of one table (not its sub-tables), defaults filled in."""
        return {o.name: self.values[o.key] for o in OPTIONS if o.section == section}

    def differences(self, other: "Config") -> list[str]:
        """Keys (section.name, and the [[watch]] tables) whose value differs in ``other``."""
        out = [o.key for o in OPTIONS if self.values[o.key] != other.values[o.key]]
        return out + [sec for sec in REPEATED if self.repeated[sec] != other.repeated[sec]]

    def changed(self, section: str) -> dict[str, Any]:
        """The options of one table that differ from their defaults."""
        return {o.name: self.values[o.key] for o in OPTIONS
                if o.section == section and self.values[o.key] != o.default}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in OPTIONS:
            tbl = out
            for part in o.section.split("."):
                tbl = tbl.setdefault(part, {})
            tbl[o.name] = self.values[o.key]
        out.update((sec, [dict(e) for e in entries]) for sec, entries in self.repeated.items())
        return out


def _got(value: Any) -> str:
    return f"got {_TYPE_NAMES.get(type(value), type(value).__name__)} {value!r}"


def _scalar(key: str, t: type, value: Any) -> Any:
    """``value`` as type ``t`` or ConfigError. TOML tells int from float:
    an int is accepted where a float is wanted, never a bool where a number is
    (bool is an int subclass in Python)."""
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_TYPE_NAMES[t]}, {_got(value)}")
    if t is float and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return value


def _bounded(opt: Option, key: str, value: Any) -> Any:
    size = len(value) if isinstance(value, str) else value
    if opt.lo is not None:
        if isinstance(value, str) and size < opt.lo:
            raise ConfigError(f"{key}: must not be empty")
        if opt.lo_open and not size > opt.lo:
            raise ConfigError(f"{key}: must be > {_num(opt.lo)}, got {value!r}")
        if size < opt.lo:
            raise ConfigError(f"{key}: must be >= {_num(opt.lo)}, got {value!r}")
    if opt.hi is not None and size > opt.hi:
        raise ConfigError(f"{key}: must be <= {_num(opt.hi)}, got {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise ConfigError(f"{key}: must be one of {', '.join(opt.choices)}, got {value!r}")
    return value


def check_value(opt: Option, value: Any) -> Any:
    """Validate one value against its row; returns it normalised (ints as
    floats where floats are wanted, integer table keys as ints)."""
    key = opt.key
    types = opt.type if isinstance(opt.type, tuple) else (opt.type,)
    t = next((t for t in types if isinstance(value, t) or (t is float and isinstance(value, int))), None)
    if t is None:
        raise ConfigError(f"{key}: expected {opt.type_name()}, {_got(value)}")
    if t is list:
        value = [_bounded(opt, f"{key}[{i}]", _scalar(f"{key}[{i}]", opt.item, v)) if opt.item is not dict
                 else _scalar(f"{key}[{i}]", dict, v) for i, v in enumerate(value)]
    elif t is dict and opt.item is not None:
        out = {}
        for k, v in value.items():
            if opt.int_keys:
                try:
                    k = int(k)
                except ValueError:
                    raise ConfigError(f"{key}.{k}: keys must be integers (tier indices)") from None
            out[k] = _bounded(opt, f"{key}.{k}", _scalar(f"{key}.{k}", opt.item, v))
        value = out
    elif t not in (list, dict):
        value = _bounded(opt, key, _scalar(key, t, value))
    if opt.check is not None:
        try:
            opt.check(value)
        except ConfigError as e:
            msg = str(e)
            if msg.startswith(opt.name):  # "tiers[0].name: ..." from the owner
                raise ConfigError(f"{opt.section}.{msg}") from None
            if not msg.startswith(key):
                raise ConfigError(f"{key}: {msg}") from None
            raise
    return value


def _check_policy(cfg: Config) -> None:
    PolicyConfig(**cfg.table("policy"))


def _check_damon(cfg: Config) -> None:
    DamonParams(**{k: v for k, v in cfg.table("hotness.damon").items() if k != "enabled"})


def _check_topology(cfg: Config) -> None:
    topology.validate_overrides(cfg.changed("topology"))


# Invariants across the keys of one table, checked by the owner's constructor.
TABLE_CHECKS: dict[str, Callable[[Config], None]] = {
    "policy": _check_policy,
    "hotness.damon": _check_damon,
    "topology": _check_topology,
}


def _walk(prefix: str, tbl: dict[str, Any], values: dict[str, Any]) -> None:
    for name, value in tbl.items():
        key = f"{prefix}.{name}" if prefix else name
        opt = _BY_KEY.get(key)
        if opt is not None:
            values[key] = check_value(opt, value)
        elif key in _TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table, {_got(value)}")
            _walk(key, value, values)
        elif not prefix:
            raise ConfigError(f"{key}: unknown section (known: {_known_in('')})")
        else:
            raise ConfigError(f"{key}: unknown option (known in [{prefix}]: {_known_in(prefix)})")


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a parsed TOML document; unknown keys and tables are errors
    (a typo must not silently fall back to a default)."""
    values = {o.key: o.default for o in OPTIONS}
    repeated = {sec: _entries(sec, data[sec]) for sec in REPEATED if sec in data}
    _parse_watch_rules(repeated.get("watch", ()))  # selectors, regex: what one key cannot show
    _walk("", {k: v for k, v in data.items() if k not in REPEATED}, values)
    cfg = Config(values, source, repeated)
    for section, table_check in TABLE_CHECKS.items():
        try:
            table_check(cfg)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(section) else f"{section}: {msg}") from None
    return cfg


def _entries(sec: str, entries: Any) -> list[dict[str, Any]]:
    """An array of tables, each entry's keys checked against REPEATED[sec]."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{sec}: expected an array of tables ([[{sec}]]), {_got(entries)}")
    rows = {o.name: o for o in REPEATED[sec]}
    out = []
    for i, entry in enumerate(entries):
        values = {name: o.default for name, o in rows.items()}
        for name, value in entry.items():
            opt = rows.get(name)
            if opt is None:
                raise ConfigError(f"{sec}[{i}].{name}: unknown option (known in [[{sec}]]: {', '.join(rows)})")
            try:
                values[name] = check_value(opt, value)
            except ConfigError as e:
                raise ConfigError(f"{sec}[{i}]" + str(e)[len(sec):]) from None
        out.append(values)
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b.c=VALUE`` (``-s``/``--set``): VALUE is read as a TOML value
    (``0.5``, ``true``, ``[1, 2]``, ``{1 = 0.5}``), else taken as a bare string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. daemon.tick_interval=0.5")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def _merge(data: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested document: ``hotness.damon.sample_us``,
    or an item of a table option: ``policy.capacity.1``."""
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"{key}: override must be section.name (e.g. daemon.tick_interval)")
    tbl = data
    for i, part in enumerate(parts[:-1]):
        nxt = tbl.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a table, cannot set {key}")
        tbl = nxt
    tbl[parts[-1]] = value


def load(path: str | None = DEFAULT_PATH, *, missing_ok: bool = False,
         overrides: dict[str, Any] | None = None) -> Config:
    """Read and validate ``path``; ``overrides`` ({"daemon.socket": ...}) win."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            source = path
        except FileNotFoundError:
            if not missing_ok:
                raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 (TOML must be): byte 0x{e.object[e.start]:02x} "
                              f"at offset {e.start}") from None
        except RecursionError:
            raise ConfigError(f"{path}: arrays or tables nested too deeply") from None
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror}") from None
    for key, value in (overrides or {}).items():
        _merge(data, key, value)
    return from_dict(data, source)


def _toml_key(k: Any) -> str:
    s = str(k)
    return s if s.replace("_", "").replace("-", "").isalnum() else _toml_value(s)


def _toml_value(v: Any, opt: Option | None = None) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if opt is not None and opt.name == "socket_mode":
        return f"0o{v:o}"
    return repr(v)


def sample_toml() -> str:
    """The commented sample config, generated from OPTIONS (systemd/kvtierd.toml
    is this text; a test keeps them equal)."""
    lines = [
        "# kvtierd configuration (TOML). Every option is shown commented out with",
        "# its default; uncomment to change. Unknown keys are errors. Any key can",
        "# also be set on the command line: kvtierd -s hotness.damon.aggr_us=200000",
        "# Generated from kvtier.config.OPTIONS: `kvtierd --print-sample-config`.",
        "# A reload (SIGHUP, systemctl reload) applies every key at once, except the",
        "# few marked \"Read at start\": changing one of those refuses the reload.",
    ]
    for sec in SECTIONS:
        lines += ["", f"# {SECTION_DOCS[sec]}", f"[{sec}]"]
        for o in OPTIONS:
            if o.section != sec:
                continue
            bounds = o.bounds_text()
            doc = f"{o.doc} ({o.type_name()}{'; ' + bounds if bounds else ''})"
            if o.restart:
                doc += " Read at start: a reload that changes it is refused."
            lines += textwrap.wrap(doc, 78, initial_indent="# ", subsequent_indent="# ",
                                   break_on_hyphens=False)
            lines.append(f"#{o.name} = {_toml_value(o.default, o)}")
    for sec, rows in REPEATED.items():
        lines += ["", *textwrap.wrap(SECTION_DOCS[sec], 78, initial_indent="# ", subsequent_indent="# "),
                  f"# [[{sec}]]"]
        for o in rows:
            bounds = o.bounds_text()
            doc = f"{o.doc} ({o.type_name()}{'; ' + bounds if bounds else ''})"
            lines += textwrap.wrap(doc, 78, initial_indent="# ", subsequent_indent="# ",
                                   break_on_hyphens=False)
            # "# key = value", not "#key": uncommented alone it would land in
            # the table above; a rule is uncommented with its [[watch]] line.
            lines.append(f"# {o.name} = {_toml_value(o.default, o)}")
    lines.append("")
    return "\n".join(lines)
