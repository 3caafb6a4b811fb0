"""Recording (kvtier/record.py) and its replay reader (kvtier/sim/recording.py):
a real registry and block table of this process's own memory, the files on
disk, and kvtier-sim reading them back."""

from __future__ import annotations

import json
import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier import record
from kvtier.blocks import BlockTable
from kvtier.hotness import Temperature
from kvtier.kernel.procmap import ProcProcesses
from kvtier.policy import PolicyConfig, TierState
from kvtier.registry import Limits, Registry
from kvtier.sim import cli as sim_cli
from kvtier.sim import recording
from kvtier.sim.trace import OP_ACCESS, OP_ALLOC, OP_FREE
from kvtier.stats import DaemonStats

MIB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def setup(tmp_path):
    bufs = [mmap.mmap(-1, 8 * MIB) for _ in range(2)]
    clock = Clock()
    table = BlockTable()
    stats = DaemonStats()
    tiers = [TierState(0, "dram", "dram", 64 * MIB), TierState(1, "swap", "swap", 1024 * MIB)]
    pcfg = PolicyConfig(capacity={0: 4 * MIB})
    rec = record.Recorder(str(tmp_path / "rec"), 1 << 20, 3, table, clock, meta={"tick_s": 0.5, "tau_s": 5.0})
    reg = Registry(table, Limits(), stats, Temperature(10.0), ProcProcesses(), clock=clock, recorder=rec)
    rec.config(tiers, pcfg)  # as the engine does when it is built
    yield SimpleNamespace(reg=reg, table=table, rec=rec, clock=clock, bufs=bufs, stats=stats,
                          dir=tmp_path / "rec")
    rec.close()
    for b in bufs:
        b.close()


def addr(buf):
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_recording_replays_with_the_live_hit_ratio(setup):
    s = setup
    r = s.reg.add(os.getpid(), addr(s.bufs[0]), 8 * MIB, 2 * MIB, tenant="a")  # 4 blocks
    t = s.table
    t.tier[:] = [0, 0, 1, 1]
    s.rec.placed()
    s.clock.t += 1
    s.reg.hint(r.id, np.array([0, 1, 2], dtype=np.uint32), np.array([3, 1, 2], dtype=np.uint32))
    t.tier[:] = [0, 1, 0, 1]  # block 1 demoted, block 2 promoted
    s.rec.placed()
    s.clock.t += 1
    s.reg.hint(r.id, np.array([1, 2], dtype=np.uint32), None)
    s.rec.observed("damon", np.array([3]), np.array([4.0], dtype=np.float32), 0.25)
    s.reg.remove(r.id)
    s.rec.close()

    rec = recording.load(s.dir)
    tr = rec.trace
    assert tr.nblocks == 4 and tr.block_bytes == 2 * MIB
    assert (tr.op == OP_ALLOC).sum() == 4 and (tr.op == OP_FREE).sum() == 4
    acc = tr.op == OP_ACCESS
    assert tr.count[acc].sum() == 8 and tr.t[acc].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]
    # Hits where the block was in DRAM when hinted: 3 (block 0) + 1 (block 1, first) + 1 (block 2, later) of 8.
    assert rec.live_fast_hit == pytest.approx(5 / 8) and rec.hinted_accesses == 8
    # ... which is what the daemon's own counter says.
    hits = s.stats.hint_tier_blocks
    assert hits[0] / sum(hits.values()) == pytest.approx(rec.live_fast_hit)
    cfg = rec.sim_config()
    assert [(x.name, x.kind, x.capacity_bytes) for x in cfg.tiers] == [("dram", "dram", 4 * MIB),
                                                                       ("swap", "swap", 1024 * MIB)]
    assert cfg.tick_s == 0.5
    pol, tau, end_of_run = rec.settings()
    assert end_of_run == 0.0  # meta without it: a recording from before runs ended on silence
    assert tau == 5.0 and pol.capacity == {} and pol.high_wm == PolicyConfig().high_wm
    assert rec.sim_config(dram_gib=1).tiers[0].capacity_bytes == 1 << 30


def test_rotation_bounds_the_files_and_each_file_replays_alone(setup):
    s = setup
    r = s.reg.add(os.getpid(), addr(s.bufs[0]), 8 * MIB, 2 * MIB)
    s.table.tier[:] = 0
    s.rec.placed()
    hot = np.zeros(2000, dtype=np.uint32)
    for _ in range(50):  # 100000 lines of ~30 bytes: 1 MiB files rotate 2-3 times
        s.reg.hint(r.id, hot, None)
    assert s.rec.rotations_total >= 2
    files = sorted(p.name for p in s.dir.iterdir())
    assert files == ["kvtier.csv", "kvtier.csv.1", "kvtier.csv.2"]  # files = 3 kept
    assert all(p.stat().st_size < 1 << 20 + 4096 for p in s.dir.iterdir())
    s.rec.close()
    newest = recording.load(s.dir / "kvtier.csv")
    assert (newest.trace.op == OP_ALLOC).sum() == 4  # the live blocks, re-allocated at the top
    assert newest.live_fast_hit == 1.0  # the block's tier was re-recorded too
    whole = recording.load(s.dir)
    assert (whole.trace.op == OP_ALLOC).sum() == 4  # rotated-in allocs of live blocks dropped
    assert whole.hinted_accesses == (whole.trace.op == OP_ACCESS).sum()


def test_kvtier_sim_replays_a_recording(setup, capsys):
    s = setup
    r = s.reg.add(os.getpid(), addr(s.bufs[0]), 8 * MIB, 2 * MIB)
    s.table.tier[:] = [0, 0, 1, 1]
    s.rec.placed()
    for i in range(20):
        s.clock.t += 0.5
        s.reg.hint(r.id, np.array([i % 2], dtype=np.uint32), None)
    s.rec.close()
    assert recording.is_recording(s.dir) and not recording.is_recording(s.dir / "nope")
    rc = sim_cli.main(["run", "--trace", str(s.dir), "--policy", "kvtier", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["recording"]["live_fast_hit"] == 1.0
    assert doc["tiers"][0]["capacity_bytes"] == 4 * MIB
    (res,) = doc["results"]
    assert 0 < res["hit_ratio"][0] <= 1
