"""Record and replay with the real kvtierd: a client's hinted workload on a
64 MiB pool whose DRAM share is capped at 16 MiB (the rest pages out to the
swap file), recorded by ``[record]``, replayed by ``kvtier-sim`` with the
recorded tiers, policy, tick clock and migrator; the replayed DRAM hit ratio
is compared with the one the daemon measured live (its hint hit counter).

What the replay still cannot reproduce exactly: the daemon's promotions
between ticks (the replay promotes at ticks only); a move job lands in the
replay at a tick boundary, live between two hints; a job the replay plans
differently from the daemon takes the fitted speed, not a recorded time.
TOLERANCE is what that leaves, with room for a loaded host."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
from test_daemon import PY, ChildClient, DaemonProc, measured, wait_for, workdir  # noqa: F401

pytestmark = pytest.mark.root

MIB = 1 << 20
BLOCKS, HOT = 32, 4
# Replayed vs live, absolute (docs/operations.md has the runs): 0.000 to 0.008
# apart in 6 runs while the daemon moved blocks only at ticks; 0.048 to 0.052
# in 3 runs since it also promotes hinted blocks into free DRAM between ticks
# (engine._promote_hot), which kvtier-sim's kvtier does not do: its plan at
# the next tick makes the same promotion a tick later, and the plans diverge.
TOLERANCE = 0.08


def test_recording_replays_close_to_the_live_hit_ratio(swapfile, workdir):
    rec_dir = os.path.join(workdir, "recording")
    d = DaemonProc(workdir, extra_config=f"""
        [policy]
        capacity = {{ 0 = {16 * MIB} }}
        [record]
        enabled = true
        dir = "{rec_dir}"
        """, args=("--set", "daemon.tick_interval=0.25")).start()
    rng = np.random.default_rng(7)
    try:
        with ChildClient(d.sock, size=BLOCKS * 2 * MIB, block_size=2 * MIB) as child:
            child("register", name="pool")
            measured(child)
            # Three phases of a shifting hot set, and a trickle of cold reads.
            end = time.monotonic() + 12.0
            while time.monotonic() < end:
                phase = int((12.0 - (end - time.monotonic())) // 4)
                hot = list(range(phase * HOT, phase * HOT + HOT))
                cold = rng.integers(0, BLOCKS, 1).tolist()
                child("hint", blocks=hot + cold, counts=[4] * HOT + [1])
                time.sleep(0.05)
            with d.client() as c:
                hits = c.stats()["hint_tier_blocks"]
    finally:
        assert d.stop() == 0, d.read_log()
    live = hits.get("0", 0) / sum(hits.values())
    if os.environ.get("KVTIER_KEEP_RECORDING"):  # for looking at it by hand (docs/operations.md)
        subprocess.run(["cp", "-r", rec_dir, os.environ["KVTIER_KEEP_RECORDING"]], check=True)
    out = subprocess.run([PY, "-m", "kvtier.sim.cli", "run", "--trace", rec_dir, "--policy", "kvtier", "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    replayed = doc["results"][0]["hit_ratio"][0]
    recorded_live = doc["recording"]["live_fast_hit"]
    machine = doc["recording"]["machine"]
    print(f"\nlive DRAM hit ratio {live:.3f} (daemon counter), {recorded_live:.3f} (from the recording); "
          f"replayed {replayed:.3f}; tiers {[(t['name'], t['capacity_bytes']) for t in doc['tiers']]}; "
          f"recorded machine {machine}")
    # The recording reproduces the daemon's own measure (same events, same order) ...
    assert recorded_live == pytest.approx(live, abs=0.02)
    # ... and the DRAM cap was binding: not everything was a hit.
    assert live < 0.99
    assert doc["tiers"][0]["capacity_bytes"] == 16 * MIB
    # The replay ran on the recorded machine: its ticks, its moves (pages out and back in) ...
    assert machine["ticks"] >= 12 / 0.25 * 0.8 and machine["move_jobs"] >= 2, machine
    assert {(p["src"], p["dst"]) for p in machine["pairs"]} == {(0, 1), (1, 0)}, machine
    assert machine["swap_faults"] is False  # the client hints but never reads its pool
    # ... and comes within TOLERANCE of what the daemon measured.
    assert abs(replayed - live) <= TOLERANCE, (replayed, live)
