"""A shortened run of the demo in the guest, all three modes in one boot:
the driver runs the synthetic workload (its shared prefix starting on the
far node, finished sessions' blocks discarded) with kvtierd, with
numa_balancing=2 and with neither, same seed, same DRAM.

Asserts the demo's claim on outcomes, not speed, with the report's own
code (scripts/demo/report.py): kvtier's share of block reads served from
DRAM (measured by the workload from the kernel) is far above no tiering's
and level with numa_balancing=2's or above; the bytes it moved (kernel counters) are within a small multiple of
what the hot set's turnover requires on its run's own reads, and at most twice what a tierer that knows the
future (Belady MIN) moves for its share; DRAM holds no more than its target but the blocks
first touched since the daemon's newest completed plan; blocks moved up per the daemon's counters.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vmhelpers import scaled

from kvtier import config

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SECONDS = 30
MODES = ("kvtier", "numa_balancing", "none")


def _report():
    spec = importlib.util.spec_from_file_location("demo_report", REPO / "scripts" / "demo" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_kvtier_serves_most_from_dram_moving_near_the_turnover(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo" / "driver.py"), "--out", str(out),
         "--run-dir", str(tmp_path / "run"), "--duration", str(SECONDS), "--modes", ",".join(MODES)],
        capture_output=True, text=True, timeout=len(MODES) * (SECONDS + scaled(150)),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = (out / "status.log").read_text()
    report = _report()
    rows = {}
    for mode in MODES:
        timeline, meta, summary = report.load(out / mode)
        assert len(timeline) >= SECONDS // 2, mode
        row = report.mode_row(mode, timeline, summary)
        target, block = int(meta["budgets"]["0"]), int(summary["block_bytes"])
        row["turnover"] = report.turnover(timeline, target, block)
        row["foresight"] = report.foresight(timeline, target, block)
        rows[mode] = row
    kv = rows["kvtier"]
    # docs/benchmarks.md, four 60 s runs: kvtier 86-92 %, none 39-45 %,
    # numa_balancing=2 41-93 % (once its scanner has promoted the shared
    # prefix it is level with kvtier: 88 vs 87, 90 vs 93). So kvtier is
    # checked to beat no tiering by far and to stay level with the kernel's
    # tiering, which is what holds; the report says which was higher.
    assert kv["mean"] > rows["none"]["mean"] + 0.2, rows
    assert kv["mean"] >= rows["numa_balancing"]["mean"] - 0.05, rows
    # 60 s: 1.8-3.5 times the turnover floor (the first 30 s of those runs:
    # 2.0-2.7). Not checked against the LRU ideal: 0.35-0.48 of it over 60 s,
    # but level with it over a slow run's first 30 s (28 vs 14 MiB).
    floor = kv["turnover"]
    assert floor["bytes"] > 0 and kv["moved"] <= 5 * floor["bytes"], (kv["moved"], floor)
    # The floor never promotes a block back (its share 57-67 %); a tierer
    # that knows the future (Belady MIN, report.py `foresight`) reaches 92-94
    # % on the same reads and moves about what kvtier moves: kvtier 0.93-1.25
    # times its bytes in three 60 s runs (0.94-1.15 over their first 30 s).
    fs = kv["foresight"]
    assert fs["bytes"] > 0 and kv["moved"] <= 2 * fs["bytes"], (kv["moved"], fs)

    run = out / "kvtier"
    timeline, meta, summary = report.load(run)
    dram = meta["tiers"][0]["name"]

    def residency(records):
        reads = sum(x["reads"] for x in records)
        return sum(x["reads_by_tier"].get(dram, 0) for x in records) / reads

    assert residency(timeline[-10:]) > residency(timeline[:2]) + 0.3
    # DRAM holds no more than its target but the first touches since the
    # daemon last acted. Each tick's plan brings DRAM, as the daemon counts
    # it, down to what the policy fills it to (at most the target, less the
    # room for the allocations it expects before the next tick); between
    # plans only the workload's first touches add to it (promotions stop at
    # that same fill line). So, at each sample, DRAM <= target + the fresh
    # blocks written since the newest plan whose moves were all done (the
    # daemon's status says when; a plan still moving has not made its room
    # yet), and since one tick before it (times the guest's slowness): a
    # block written just before a plan is counted only once measured (its
    # hint reaches the daemon within the hint ring's drain interval, then
    # the measurer takes it after the job it may be running), so that plan
    # may not have seen it.
    # A quiet run held 8 MiB or more below this bound (less a tick only;
    # the policy keeps room for the allocations it expects). A daemon that plans no demotion for room lets
    # first touch fill DRAM as far as the kernel lets the pool go: with the
    # policy's overflow, cold and ended steps cut out, 134 MiB, 36 over.
    lag = scaled(config.from_dict({}).get("daemon.tick_interval"))
    target, block = int(meta["budgets"]["0"]), int(summary["block_bytes"])
    series, over, written = [], [], []
    for x in timeline:
        written += x["alloc_fresh_t"]  # the fresh blocks written up to this sample
        settled = x["plan_settled_t"]
        since = -np.inf if settled is None else settled - lag
        recent = int((np.array(written) > since).sum()) * block
        in_dram = x["pool_bytes"].get(dram, 0)
        series.append((x["t"], in_dram // MIB, settled, recent // MIB, x["ticks"]))
        if in_dram > target + recent:
            over.append(x["t"])
    assert not over, (f"DRAM over target {target // MIB} MiB + the first touches since the daemon's last "
                      f"settled plan (less {lag:.1f} s) at t={over}; (t s, DRAM MiB, settled plan t, those "
                      f"first touches MiB, ticks): {series}")

    samples = {}
    for fam in text_string_to_metric_families((run / "metrics.txt").read_text()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    up = sum(v for (name, labels), v in samples.items()
             if name == "kvtier_migrated_bytes_total" and dict(labels)["dst"] == dram)
    assert up >= 8 * MIB  # the shared prefix, at least
    # The workload's status lines went to the console log the host tails.
    assert "reads served from" in status and "workload exited 0" in status
