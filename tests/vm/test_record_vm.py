"""Record and replay in the guest (issue 15, "Shown by"): kvtierd records a
hinted workload with tiers DRAM (node 0), CXL (node 2, the emulated type-3
device) and swap (NVMe), then kvtier-sim replays the recording with the
recorded configuration; the replayed DRAM hit ratio must be within
TOLERANCE of what the daemon measured live (its own hint hit counter).

Under TCG a move into the CXL node runs at a few MiB/s, so the recorded
migrator is far slower than the simulator's tier model: the replay has to
use the recorded machine (``# move`` / ``# tick`` lines) to come close. The
recording and a report go to the share (``record_vm/``, ``record_vm.json``)
so the host can replay the same recording (docs/operations.md)."""

from __future__ import annotations

import json
import mmap
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from vmhelpers import CXL_NODE, DRAM_NODE, GuestKvtierd, scaled, wait_for

pytestmark = pytest.mark.vm

MiB = 1 << 20
# Small: TCG moves into the CXL node at a few MiB/s at best (a first run
# with 1 MiB blocks kept the mover busy with the first demotion for 25 s).
BLOCK, BLOCKS, HOT = 256 << 10, 16, 2
PHASE_S, PHASES = 10.0, 3
TICK_S = 0.5
SHARE = Path("/mnt/kvtier")
# Replayed vs live DRAM hit ratio, absolute. Measured in the guest: see
# docs/operations.md "Recording and replay" (the spread of live runs, and
# what the replay cannot see: the moment within a tick a move lands).
TOLERANCE = 0.08


def test_guest_recording_replays_close_to_the_live_hit_ratio(tmp_path):
    from kvtier.client import Client

    rec_dir = tmp_path / "recording"
    config = textwrap.dedent(f"""\
        [policy]
        capacity = {{ 0 = {4 * BLOCK}, 1 = {6 * BLOCK} }}
        [topology]
        tiers = [{{ name = "dram", nodes = [{DRAM_NODE}], kind = "dram" }},
                 {{ name = "cxl0", nodes = [{CXL_NODE}], kind = "cxl" }}]
        swap = true
        [hotness.damon]
        enabled = false
        [hotness.perf_fault]
        enabled = false
        [hotness.access_bits]
        enabled = false
        [record]
        enabled = true
        dir = "{rec_dir}"
        """)
    d = GuestKvtierd(tmp_path, config, daemon={"tick_interval": TICK_S}, name="test_record_vm")
    pool = mmap.mmap(-1, BLOCKS * BLOCK)
    pool.write(b"\1" * len(pool))  # every page present, in DRAM (first touch on node 0)
    rng = np.random.default_rng(3)
    try:
        with Client(str(d.sock), timeout=scaled(60)) as c:
            region = c.register(pool, block_size=BLOCK, name="kv")
            wait_for(lambda: -1 not in region.query().tolist(), "residency measured", timeout=60, interval=0.2)
            t0 = time.monotonic()
            while (el := time.monotonic() - t0) < PHASE_S * PHASES:
                first = int(el // PHASE_S) * HOT
                hot = list(range(first, first + HOT))
                region.hint(hot + rng.integers(0, BLOCKS, 1).tolist(), counts=[4] * HOT + [1])
                c.flush()
                time.sleep(0.1)
            stats = d.stats()
            region.unregister()
    finally:
        d.stop()
        pool.close()
    hits = stats["hint_tier_blocks"]
    live = hits.get("0", 0) / sum(hits.values())
    out = subprocess.run([sys.executable, "-m", "kvtier.sim.cli", "run", "--trace", str(rec_dir), "--policy",
                          "kvtier", "--json"], capture_output=True, text=True, check=True,
                         timeout=scaled(120)).stdout
    doc = json.loads(out)
    model = json.loads(subprocess.run(
        [sys.executable, "-m", "kvtier.sim.cli", "run", "--trace", str(rec_dir), "--policy", "kvtier", "--json",
         "--migrator", "model"], capture_output=True, text=True, check=True, timeout=scaled(120)).stdout)
    replayed = doc["results"][0]["hit_ratio"][0]
    report = {"live": live, "live_from_recording": doc["recording"]["live_fast_hit"], "replayed": replayed,
              "replayed_tier_model": model["results"][0]["hit_ratio"][0],
              "machine": doc["recording"]["machine"], "hint_tier_blocks": hits,
              "tiers": [(t["name"], t["capacity_bytes"]) for t in doc["tiers"]]}
    if SHARE.is_dir():
        shutil.copytree(rec_dir, SHARE / "record_vm", dirs_exist_ok=True)
        (SHARE / "record_vm.json").write_text(json.dumps(report) + "\n")
    print(json.dumps(report))
    assert [t[0] for t in report["tiers"]] == ["dram", "cxl0", "swap"]
    assert report["live_from_recording"] == pytest.approx(live, abs=0.02)  # the same events, the same measure
    assert 0 < live < 0.99  # the DRAM cap was binding
    m = doc["recording"]["machine"]
    assert {(p["src"], p["dst"]) for p in m["pairs"]} & {(0, 1), (1, 0)}, m  # CXL moves were recorded
    assert abs(replayed - live) <= TOLERANCE, report
