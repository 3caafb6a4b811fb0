"""The metrics collector against a real Registry/BlockTable/DaemonStats (no
root): what each documented metric reports, read with get_sample_value."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import metrics

from kvtier.kernel import topology
from kvtier.blocks import F_UNMOVABLE, STUCK_LOCKED, TIER_MIXED, BlockTable
from kvtier.hotness import Temperature
from kvtier.registry import Limits, Registry
from kvtier.kernel.procmap import ProcProcesses
from kvtier.stats import DaemonStats

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "host-1node"
MIB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def daemon_state():
    """Two regions of this process's own anonymous memory, registered for real."""
    bufs = [mmap.mmap(-1, 8 * MIB), mmap.mmap(-1, 4 * MIB)]
    stats = DaemonStats()
    table_reg = Registry(
        table=BlockTable(),
        limits=Limits(), stats=stats, temperature=Temperature(10.0), processes=ProcProcesses(), clock=Clock(),
    )
    regs = []
    for i, (b, tenant) in enumerate(zip(bufs, ("alice", "bob"))):
        addr = np.frombuffer(b, dtype=np.uint8).ctypes.data
        regs.append(table_reg.add(os.getpid(), addr, len(b), 2 * MIB, name=f"kv{i}", tenant=tenant))
    topo = topology.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"))
    yield stats, table_reg, topo, regs
    for b in bufs:
        b.close()


def collect(stats, reg, topo, **kw) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    r.register(metrics.Collector(stats, reg, reg.table, topo, **kw))
    return r


def test_tier_bytes_follow_the_block_table(daemon_state):
    stats, reg, topo, (r0, r1) = daemon_state
    t = reg.table
    s0, s1 = t.slices[r0.id], t.slices[r1.id]
    t.tier[s0.start : s0.start + 3] = 0  # 6 MiB of alice in DRAM
    t.tier[s0.start + 3] = 1  # 2 MiB of alice in swap
    t.tier[s1.start] = 0
    t.tier[s1.start + 1] = TIER_MIXED
    c = collect(stats, reg, topo)
    v = c.get_sample_value
    assert [tt.name for tt in topo.tiers] == ["dram", "swap"]
    assert v("kvtier_tier_bytes", {"tier": "dram"}) == 8 * MIB
    assert v("kvtier_tier_bytes", {"tier": "swap"}) == 2 * MIB
    assert v("kvtier_tier_bytes", {"tier": "mixed"}) == 2 * MIB
    assert v("kvtier_tier_blocks", {"tier": "dram"}) == 4
    assert v("kvtier_tenant_tier_bytes", {"tenant": "alice", "tier": "dram"}) == 6 * MIB
    assert v("kvtier_tenant_tier_bytes", {"tenant": "bob", "tier": "mixed"}) == 2 * MIB
    assert v("kvtier_region_tier_bytes", {"region": str(r0.id), "name": "kv0", "tenant": "alice",
                                          "tier": "swap"}) == 2 * MIB
    assert v("kvtier_tier_capacity_bytes", {"tier": "dram"}) == topo.tiers[0].capacity
    assert v("kvtier_tier_info", {"tier": "swap", "index": "1", "kind": "swap", "nodes": ""}) == 1
    assert v("kvtier_regions") == 2 and v("kvtier_clients") == 1 and v("kvtier_blocks") == 6
    assert v("kvtier_registered_bytes") == 12 * MIB
    assert v("kvtier_region_events_total", {"event": "registered"}) == 2


def test_empty_tiers_report_zero_and_per_region_can_be_off(daemon_state):
    stats, reg, topo, _ = daemon_state
    c = collect(stats, reg, topo, per_region=False)
    assert c.get_sample_value("kvtier_tier_bytes", {"tier": "swap"}) == 0
    assert c.get_sample_value("kvtier_tier_bytes", {"tier": "unknown"}) == 12 * MIB
    assert not any(m.name == "kvtier_region_tier_bytes" for m in c.collect())


def test_migrations_failures_and_flags(daemon_state):
    stats, reg, topo, (r0, _) = daemon_state
    stats.migrations[(0, 1)] += 3
    stats.migrated_bytes[(0, 1)] += 6 * MIB
    stats.migrations[(1, 0)] += 1
    stats.migration_failed_pages[(0, 1, "EBUSY")] += 7
    reg.table.flags[0:2] |= F_UNMOVABLE
    reg.table.stuck[0] = STUCK_LOCKED
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_migrated_blocks_total", {"src": "dram", "dst": "swap"}) == 3
    assert v("kvtier_migrated_blocks_total", {"src": "swap", "dst": "dram"}) == 1
    assert v("kvtier_migrated_bytes_total", {"src": "dram", "dst": "swap"}) == 6 * MIB
    assert v("kvtier_migration_failed_pages_total", {"src": "dram", "dst": "swap", "reason": "EBUSY"}) == 7
    assert v("kvtier_blocks_unmovable") == 2
    assert v("kvtier_blocks_unmovable_by_reason", {"reason": "locked"}) == 1
    assert v("kvtier_blocks_unmovable_by_reason", {"reason": "pinned"}) == 0
    assert v("kvtier_blocks_unmovable_by_reason", {"reason": "none"}) is None  # marked without a reason: total only


def test_hint_hits_and_access_ratio(daemon_state):
    stats, reg, topo, (r0, r1) = daemon_state
    t = reg.table
    t.tier[:] = 1
    t.tier[t.slices[r0.id].start] = 0
    reg.hint(r0.id, np.array([0, 0, 0, 1], dtype=np.uint32), None)  # 3 reads of a DRAM block, 1 of swap
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_tier_access_ratio", {"tier": "dram"}) == pytest.approx(0.75)
    assert v("kvtier_tier_access_ratio", {"tier": "swap"}) == pytest.approx(0.25)
    assert v("kvtier_hinted_blocks_total") == 4
    if not hasattr(stats, "hint_tier_blocks"):
        # The true hit counter needs DaemonStats to count hint hits per tier.
        assert v("kvtier_tier_hit_ratio", {"tier": "dram"}) is None
    stats.hint_tier_blocks = {0: 30, 1: 10}
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_hint_block_accesses_total", {"tier": "dram"}) == 30
    assert v("kvtier_tier_hit_ratio", {"tier": "dram"}) == pytest.approx(0.75)


def test_temperature_histogram(daemon_state):
    stats, reg, topo, _ = daemon_state
    reg.table.temp[:] = [0.0, 0.5, 5.0, 5.0, 50.0, 20000.0]
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_block_temperature_bucket", {"le": "0.0"}) == 1
    assert v("kvtier_block_temperature_bucket", {"le": "1.0"}) == 2
    assert v("kvtier_block_temperature_bucket", {"le": "10.0"}) == 4
    assert v("kvtier_block_temperature_bucket", {"le": "10000.0"}) == 5
    assert v("kvtier_block_temperature_bucket", {"le": "+Inf"}) == 6
    assert v("kvtier_block_temperature_gsum") == pytest.approx(20060.5)


def test_requests_ticks_and_sources(daemon_state):
    stats, reg, topo, _ = daemon_state
    stats.requests["hint"] += 5
    stats.errors[("register", "overlap")] += 2
    stats.observe_tick(0.25)
    stats.observe_tick(0.75)
    sources = [("hint", True, ""), ("damon", False, "no vaddr ops")]
    v = collect(stats, reg, topo, sources=lambda: sources).get_sample_value
    assert v("kvtier_requests_total", {"op": "hint"}) == 5
    assert v("kvtier_request_errors_total", {"op": "register", "code": "overlap"}) == 2
    assert v("kvtier_tick_duration_seconds_count") == 2
    assert v("kvtier_tick_duration_seconds_sum") == 1.0
    assert v("kvtier_tick_last_duration_seconds") == 0.75
    assert v("kvtier_hotness_source_active", {"source": "damon", "reason": "no vaddr ops"}) == 0
    assert v("kvtier_hotness_source_active", {"source": "hint", "reason": ""}) == 1


def test_histogram_buckets_are_cumulative():
    h = metrics.Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 3.0):
        h.observe(x)
    assert h.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(3.65)


def test_migration_histogram_from_stats(daemon_state):
    stats, reg, topo, _ = daemon_state
    stats.migration_seconds_hist = metrics.Histogram(metrics.MIGRATION_BUCKETS)
    stats.migration_seconds_hist.observe(0.003)
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_migration_duration_seconds_bucket", {"le": "0.0025"}) == 0
    assert v("kvtier_migration_duration_seconds_bucket", {"le": "0.005"}) == 1
    assert v("kvtier_migration_duration_seconds_count") == 1


def test_every_metric_is_documented_and_every_documented_one_exists(daemon_state):
    stats, reg, topo, _ = daemon_state
    stats.hint_tier_blocks = {0: 1}
    doc = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(kvtier_[a-z_]+)` \|", doc, re.M))
    suffix = {"counter": "_total", "info": "_info"}
    exposed = {m.name + suffix.get(m.type, "") for m in collect(stats, reg, topo).collect()}
    assert documented == exposed
    for name, (typ, labels, _) in metrics.METRICS.items():
        shown = name + ("_total" if typ == "counter" else "")
        assert re.search(rf"^\| `{shown}` \| {typ} \|", doc, re.M), name


def test_exposition_parses_and_names_follow_conventions(daemon_state):
    stats, reg, topo, _ = daemon_state
    exp = metrics.MetricsExporter(stats, reg, reg.table, topo, port=0)
    fams = list(text_string_to_metric_families(exp.render().decode()))
    names = {f.name for f in fams}
    assert "process_cpu_seconds" in names
    for f in fams:
        if f.name.startswith("process_") or f.name.startswith("python_"):
            continue
        assert f.name.startswith("kvtier_"), f.name
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), f.name


def test_process_metrics_read_the_injected_proc_root(daemon_state, tmp_path):
    """ProcessCollector reads <proc_root>/self/{stat,limits,fd} and stat's btime."""
    stats, reg, topo, _ = daemon_state
    proc = tmp_path / "proc"
    (proc / "self" / "fd").mkdir(parents=True)
    for i in range(3):
        (proc / "self" / "fd" / str(i)).write_text("")
    # A captured /proc/self/stat line: utime 250, stime 150 ticks, vsize, rss 1000 pages.
    fields = ["4242", "(kvtierd)", "S"] + ["0"] * 10 + ["250", "150"] + ["0"] * 6 + ["12345", "104857600", "1000"]
    (proc / "self" / "stat").write_text(" ".join(fields) + "\n")
    (proc / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    (proc / "self" / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max open files            1024                 4096                 files     \n"
    )
    exp = metrics.MetricsExporter(stats, reg, reg.table, topo, port=0, proc_root=str(proc))
    v = exp.registry.get_sample_value
    assert v("process_virtual_memory_bytes") == 104857600
    assert v("process_resident_memory_bytes") == 1000 * os.sysconf("SC_PAGE_SIZE")
    assert v("process_open_fds") == 3
    assert v("process_max_fds") == 1024
    assert v("process_cpu_seconds_total") == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))


def test_topology_may_be_a_callable_that_follows_rediscovery(daemon_state):
    stats, reg, topo, _ = daemon_state
    current = [topo]
    c = collect(stats, reg, lambda: current[0])
    assert c.get_sample_value("kvtier_tier_capacity_bytes", {"tier": "swap"}) is not None
    current[0] = topology.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"), {"swap": {"enabled": False}})
    assert c.get_sample_value("kvtier_tier_capacity_bytes", {"tier": "swap"}) is None


def test_dashboard_queries_only_documented_metrics():
    import json

    dash = json.loads((REPO / "dashboards" / "kvtier-grafana.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    known = set()
    for name, (typ, _, _) in metrics.METRICS.items():
        base = name + ("_total" if typ == "counter" else "")
        known.add(base)
        if typ in ("histogram", "gaugehistogram"):
            known |= {name + s for s in ("_bucket", "_sum", "_count", "_gsum", "_gcount")}
    known |= {"process_cpu_seconds_total", "process_resident_memory_bytes"}
    used = {m for e in exprs for m in re.findall(r"\b((?:kvtier|process)_[a-z_]+)\b", e)}
    assert used <= known, used - known
    # Every panel's grid position fits Grafana's 24 columns.
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]


def test_access_ages_by_tier_and_tenant(daemon_state):
    """kvtier_access_age_bytes: hints set last_access on the registry clock;
    the scrape buckets now - last_access (never seen: >10m)."""
    stats, reg, topo, (r0, r1) = daemon_state
    t = reg.table
    t.tier[:] = 0
    t.tier[t.slices[r1.id].start:] = 1  # bob's blocks in swap
    clock = reg.clock
    reg.hint(r0.id, np.array([0], dtype=np.uint32), None)  # read at 1000
    clock.t += 3.0
    reg.hint(r0.id, np.array([1], dtype=np.uint32), None)  # read at 1003
    reg.hint(r1.id, np.array([0], dtype=np.uint32), None)
    clock.t += 1.0  # now 1004: ages 4 s, 1 s (an age on an edge is the older bucket)
    v = collect(stats, reg, topo).get_sample_value
    age = lambda tier, tenant, bucket: v("kvtier_access_age_bytes", {"tier": tier, "tenant": tenant,  # noqa: E731
                                                                     "age": bucket})
    assert age("dram", "alice", "1-5s") == 4 * MIB  # block 0 (4 s) and block 1 (1 s)
    assert age("dram", "alice", "<1s") == 0
    assert age("dram", "alice", ">10m") == 4 * MIB  # never read
    assert age("swap", "bob", "1-5s") == 2 * MIB
    assert age("swap", "bob", ">10m") == 2 * MIB
    clock.t += 200.0
    v = collect(stats, reg, topo).get_sample_value
    assert v("kvtier_access_age_bytes", {"tier": "dram", "tenant": "alice", "age": "2-10m"}) == 4 * MIB


# -- a real scrape of a freshly started kvtierd ------------------------------

# Documented series that cannot have a sample before something happened:
# their label values are tenants, regions, errno names or error codes.
EMPTY_AT_START = {
    "kvtier_migration_failed_pages_total": "errno names appear with the first failure",
    "kvtier_request_errors_total": "(op, code) pairs appear with the first error",
    "kvtier_tenant_tier_bytes": "no tenant has blocks yet",
    "kvtier_region_tier_bytes": "no region registered yet",
    "kvtier_access_age_bytes": "no tenant has blocks yet",
}


def _documented() -> set[str]:
    doc = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(kvtier_[a-z_]+)` \|", doc, re.M))


def _sample_base(name: str) -> str:
    for suffix in ("_bucket", "_gcount", "_gsum", "_count", "_sum", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@pytest.fixture(scope="module")
def fresh_scrape(tmp_path_factory):
    """The exposition of a kvtierd that just started: nothing registered,
    no request but our own connection check, no migration."""
    import sys
    import urllib.request

    sys.path.insert(0, str(REPO / "tests"))
    from kvtierd import Kvtierd, free_port
    from waiting import wait_for

    port = free_port()
    d = Kvtierd(tmp_path_factory.mktemp("kvtierd-metrics"),
                f'[metrics]\nenabled = true\naddress = "127.0.0.1"\nport = {port}\n')

    def scrape():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return None

    try:
        yield wait_for(scrape, "the metrics endpoint", timeout=60, interval=0.1)
    finally:
        d.stop()


def test_every_documented_series_exists_at_start(fresh_scrape):
    fams = {f.name: f for f in text_string_to_metric_families(fresh_scrape)}
    samples: dict[str, list] = {}
    for f in fams.values():
        for s in f.samples:
            samples.setdefault(_sample_base(s.name), []).append(s)
    tiers = [s.labels["tier"] for s in samples["kvtier_tier_info"]]
    # A machine with one tier (DRAM, no swap) has no tier pair to migrate between.
    one_tier = {"kvtier_migrated_blocks_total", "kvtier_migrated_bytes_total", "kvtier_dry_run_planned_blocks_total",
                "kvtier_dry_run_planned_bytes_total"} if len(tiers) < 2 else set()
    missing = []
    for name in sorted(_documented()):
        if name in EMPTY_AT_START or name in one_tier:
            continue
        if not samples.get(name) and not samples.get(name.removesuffix("_total")):
            missing.append(name)
    assert not missing, f"documented but no series at start: {missing}"
    assert "kvtier_start_time_seconds" not in samples  # process_start_time_seconds is the one
    assert samples.get("process_start_time_seconds")


def _values(scrape: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(scrape) for s in f.samples
            if s.name == name]


def test_labelled_counters_start_at_zero_with_config_names(fresh_scrape):
    from kvtier import protocol
    from kvtier.kernel import sources

    tiers = [lb["tier"] for lb, _ in _values(fresh_scrape, "kvtier_tier_info")]
    assert tiers and tiers[0] == "dram"
    pairs = {(lb["src"], lb["dst"]): v for lb, v in _values(fresh_scrape, "kvtier_migrated_blocks_total")}
    assert pairs == {(a, b): 0.0 for a in tiers for b in tiers if a != b}
    assert {(lb["src"], lb["dst"]) for lb, _ in _values(fresh_scrape, "kvtier_migrated_bytes_total")} == set(pairs)
    ops = {lb["op"] for lb, _ in _values(fresh_scrape, "kvtier_requests_total")}
    assert ops == set(protocol.OPS)
    active = {lb["source"]: v for lb, v in _values(fresh_scrape, "kvtier_hotness_source_active")}
    assert active["hint"] == 1.0
    assert set(active) == {"hint", *sources.SECTIONS}  # the [hotness.<name>] tables, not "access_bit"
    for name in ("kvtier_hint_block_accesses_total", "kvtier_tier_hit_ratio", "kvtier_tier_access_ratio"):
        assert {lb["tier"] for lb, _ in _values(fresh_scrape, name)} >= set(tiers), name
    ratios = [f.name for f in text_string_to_metric_families(fresh_scrape)
              if f.name.startswith("kvtier_") and ("share" in f.name or "fraction" in f.name)]
    assert not ratios, f"ratios end in _ratio: {ratios}"


def test_daemon_summary_is_kept_a_slice_per_tick_and_read_whole_by_a_scrape(daemon_state):
    """In the daemon a scrape reads sums the loop keeps (kvtier.summary):
    folding the table in slices of a budget gives the same numbers as a
    full pass, a scrape visits no block, and an unregistered region's
    bytes leave at once."""
    from kvtier.summary import BlockSummarizer

    stats, reg, topo, (r0, r1) = daemon_state
    t = reg.table
    t.tier[:] = 0
    t.tier[t.slices[r1.id].start] = 1
    t.temp[:] = [0.0, 0.5, 3.0, 50.0, 2e4, 7.0]
    t.last_access[:] = reg.clock() - np.array([0.5, 2.0, 10.0, 100.0, 1000.0, 0.1])
    summ = BlockSummarizer(clock=reg.clock)
    r = CollectorRegistry(auto_describe=False)
    r.register(metrics.Collector(stats, reg, t, topo, summary=summ))
    full = collect(stats, reg, topo)  # a collector without one: sums the table at each scrape
    v = r.get_sample_value
    assert v("kvtier_tier_bytes", {"tier": "dram"}) == 0  # nothing folded yet
    visits = [summ.advance(t, reg.clock(), 4) for _ in range(2)]
    assert visits == [4, 4]  # the budget bounds each slice; the second wraps into the next pass
    before = summ.rows_visited_total
    text = generate_latest(r)
    assert summ.rows_visited_total == before  # the scrape itself visited no block
    assert text == generate_latest(full)
    assert v("kvtier_tier_bytes", {"tier": "dram"}) == 10 * MIB
    assert v("kvtier_access_age_bytes", {"tier": "dram", "tenant": "alice", "age": "5-30s"}) == 2 * MIB
    assert v("kvtier_block_temperature_bucket", {"le": "1.0"}) == 2  # temperatures 0 and 0.5
    reg.remove(r0.id)
    for _ in range(2):  # at once (the scrape leaves unregistered regions out), and after the next slice
        assert v("kvtier_tier_bytes", {"tier": "dram"}) == 2 * MIB
        assert v("kvtier_tenant_tier_bytes", {"tenant": "alice", "tier": "dram"}) is None
        summ.advance(t, reg.clock(), 4)


def test_summary_budget_gives_one_pass_per_summary_pass_s():
    assert metrics.summary_budget(1 << 20, 1.0, 30.0) == -(-(1 << 20) // 30)
    assert metrics.summary_budget(1000, 1.0, 30.0) == metrics.SUMMARY_MIN_ROWS
