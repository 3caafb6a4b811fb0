"""kvtierctl top's rendering: a pure function of two daemon samples.

The sample shape is the daemon's own answers to status/stats/tiers/regions,
captured from kvtierd on this host (one DRAM tier) and extended to the
guest's four tiers.
"""

from __future__ import annotations

import copy
import re

import pytest

from kvtier import top

MIB = 1 << 20
GIB = 1 << 30

TIERS = [  # the QEMU guest's tiers, as the `tiers` op returns them
    {"index": 0, "name": "dram", "kind": "dram", "nodes": [0], "total": GIB, "free": 600 * MIB,
     "capacity": 256 * MIB, "kvtier_bytes": 128 * MIB, "kvtier_blocks": 64, "read_latency_ns": 80, "notes": []},
    {"index": 1, "name": "far0", "kind": "far", "nodes": [1], "total": GIB, "free": 900 * MIB,
     "capacity": GIB, "kvtier_bytes": 64 * MIB, "kvtier_blocks": 32, "read_latency_ns": 200, "notes": []},
    {"index": 2, "name": "cxl0", "kind": "cxl", "nodes": [2], "total": 256 * MIB, "free": 200 * MIB,
     "capacity": 256 * MIB, "kvtier_bytes": 32 * MIB, "kvtier_blocks": 16, "read_latency_ns": None, "notes": []},
    {"index": 3, "name": "swap", "kind": "swap", "nodes": [], "total": GIB, "free": GIB - 32 * MIB,
     "capacity": GIB, "kvtier_bytes": 32 * MIB, "kvtier_blocks": 16, "read_latency_ns": None, "notes": []},
]


def region(rid, name, tenant, temp_sum, by_tier, nblocks=16):
    return {"id": rid, "pid": 4242, "start_time": 122594, "start": 139844388909056 + rid * 64 * MIB,
            "length": nblocks * 2 * MIB, "block_size": 2 * MIB, "nblocks": nblocks, "name": name,
            "tenant": tenant, "tenant_id": 1, "priority": 0, "constraints": [], "owner_uid": 0,
            "registered_at": 1796107726.09, "block_hints": 168, "blocks_by_tier": by_tier, "temp_sum": temp_sum}


def sample(t, migrated, failures=None, hits=None, regions=None):
    stats = {
        "requests": {"hello": 1, "hint": 300, "register": 8}, "errors": {}, "connections_open": 2,
        "regions": 8, "processes": 2, "blocks": 128, "registered_bytes": 256 * MIB,
        "block_hints_total": 208, "ticks_total": 16, "tick_seconds_last": 0.0005317970001215144,
        "tick_errors_total": 0, "migrations": {}, "migrated_bytes": migrated,
        "migration_failed_pages": failures or {}, "uptime_s": 15.2,
    }
    if hits is not None:
        stats["hint_tier_blocks"] = hits
    return {
        "t": t,
        "status": {"server": "kvtierd", "server_version": "0.1.0", "pid": 14152, "uptime_s": 3725.2,
                   "regions": 8, "processes": 2, "blocks": 128, "registered_bytes": 256 * MIB,
                   "connections": 2,
                   "engine": {"dry_run": False, "tiers": [x["name"] for x in TIERS], "last_tick_age_s": 0.2,
                              "job_running": True, "manual_moves_pending": 0, "warnings": []}},
        "stats": stats,
        "tiers": copy.deepcopy(TIERS),
        "regions": regions if regions is not None else [
            region(1, "kv0", "a", 147.76, {"0": 16}),
            region(2, "kv1", "b", 35.0, {"0": 8, "1": 8}),
            region(3, "kv2", "a", 0.0, {"3": 16}),
        ],
    }


def test_first_frame_shows_totals_and_tiers():
    lines = top.render(sample(10.0, {"0:3": 32 * MIB}), None, 120, 50)
    text = "\n".join(lines)
    assert lines[0].startswith("kvtierd 0.1.0 pid 14152  up 1:02:05  regions 8  clients 2  blocks 128")
    assert "[migrating]" in lines[1]
    row = next(ln for ln in lines if ln.startswith("dram "))
    assert re.search(r"256\.0 MiB +600\.0 MiB +128\.0 MiB +64 +50\.0%", row)
    assert "[########........]" in row
    for name in ("far0", "cxl0", "swap"):
        assert any(ln.startswith(name + " ") for ln in lines)
    assert "(totals; rates from the next frame)" in text
    assert re.search(r"dram → swap +total 32\.0 MiB", text)


def test_rates_are_differences_between_frames():
    prev = sample(10.0, {"0:3": 32 * MIB, "2:0": 10 * MIB}, failures={"1:0:EBUSY": 3})
    cur = sample(12.0, {"0:3": 32 * MIB, "2:0": 110 * MIB}, failures={"1:0:EBUSY": 5})
    text = "\n".join(top.render(cur, prev, 120, 50))
    assert "MIGRATIONS (last 2.0 s)" in text
    assert re.search(r"cxl0 → dram +50\.0 MiB/s +total 110\.0 MiB", text)
    assert re.search(r"dram → swap +0 B/s +total 32\.0 MiB", text)
    assert "failed far0 → dram EBUSY: 5 (+2)" in text


def test_hit_ratio_from_hint_counters_per_interval():
    prev = sample(10.0, {}, hits={"0": 10, "2": 10})
    cur = sample(11.0, {}, hits={"0": 40, "2": 20})
    lines = top.render(cur, prev, 120, 50)
    assert re.search(r" 75\.0%  \[", next(ln for ln in lines if ln.startswith("dram ")))
    assert re.search(r" 25\.0%  \[", next(ln for ln in lines if ln.startswith("cxl0 ")))
    assert re.search(r"  0\.0%  \[", next(ln for ln in lines if ln.startswith("swap ")))
    # First frame: since start.
    first = top.render(cur, None, 120, 50)
    assert re.search(r" 66\.7%  \[", next(ln for ln in first if ln.startswith("dram ")))


def test_without_hint_counters_the_hit_column_says_so():
    text = "\n".join(top.render(sample(1.0, {}), None, 120, 50))
    assert "does not count hint hits" in text


def test_regions_hottest_first_then_split_when_many():
    lines = top.render(sample(1.0, {}), None, 120, 50)
    i = lines.index("REGIONS, hottest first")
    names = [ln.split()[1] for ln in lines[i + 2 : i + 5]]
    assert names == ["kv0", "kv1", "kv2"]
    assert re.search(r"kv1 +b +4242 +32\.0 MiB +2\.19 +50\.0%", lines[i + 3])

    many = [region(i, f"r{i}", "t", float(i), {"0": 16}) for i in range(1, 41)]
    lines = top.render(sample(1.0, {}, regions=many), None, 100, 30)
    assert len(lines) <= 30 and all(len(ln) <= 100 for ln in lines)
    hot = lines.index("HOTTEST REGIONS")
    cold = lines.index("COLDEST REGIONS")
    assert lines[hot + 2].split()[1] == "r40"
    assert lines[cold + 2].split()[1] == "r1"


def test_no_regions_and_warnings():
    s = sample(1.0, {}, regions=[])
    s["status"]["engine"]["warnings"] = ["no active swap device (/proc/swaps): no swap tier"]
    s["status"]["engine"]["dry_run"] = True
    lines = top.render(s, None, 120, 50)
    assert "no regions registered" in lines
    assert lines[-1] == "! no active swap device (/proc/swaps): no swap tier"
    assert "DRY RUN" in lines[1]


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * GIB, "3.0 GiB"),
                                     (None, "-")])
def test_human(n, text):
    assert top.human(n) == text


def test_duration():
    assert top.duration(3725.2) == "1:02:05"
    assert top.duration(90000) == "1d 1:00:00"
