"""Zero-integration mode in the guest (issue 15, "Shown by"): an unmodified
Python program (no kvtier import) allocates 256 MiB and keeps reading a
32 MiB part of it; a ``[[watch]]`` rule adopts it, DAMON (the only hotness
source: the program sends no hints) finds the hot part, and with DRAM capped
at 64 MiB the hot part ends on node 0 and the cold part in the lower tiers
(node 1, swap). When the program exits its regions are gone.

As in test_tiering_e2e_vm.py the emulated CXL node is left out of the tiers
(a move into it runs at ~2.5 MiB/s under TCG). Placement is read from the
kernel (move_pages status, pagemap). Convergence is counted in daemon ticks,
scaled by the guest's measured slowness.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvtier.kernel import topology
from kvtier.kernel.migrator import Migrator
from vmhelpers import DRAM_NODE, FAR_NODE, GuestKvtierd, scaled, scaled_count

pytestmark = pytest.mark.vm

MiB = 1 << 20
POOL, HOT, BLOCK = 256 * MiB, 32 * MiB, 2 * MiB
DRAM_TARGET = 64 * MiB
TICK_S = 0.5
TICKS = 160  # DAMON-only convergence took 8-49 ticks per phase in test_tiering_e2e_vm; ~3x
SHARE = Path("/mnt/kvtier")

# Plain Python: a bytearray this large is its own anonymous mapping (malloc
# uses mmap); the hot part is read one byte per page, over and over.
PROGRAM = textwrap.dedent(f"""
    import ctypes, sys, time
    pool = bytearray({POOL})
    pool[::4096] = b"\\1" * ({POOL} // 4096)
    print(ctypes.addressof((ctypes.c_char * len(pool)).from_buffer(pool)), flush=True)
    while True:
        bytes(pool[:{HOT}:4096])
        time.sleep(0.02)
""")


def placement(pid: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block of the region: fraction of pages on node 0, on node 1, in swap."""
    n = length // BLOCK
    starts = np.uint64(start) + np.arange(n, dtype=np.uint64) * np.uint64(BLOCK)
    r = Migrator().residency(pid, starts, np.full(n, BLOCK, dtype=np.uint64))
    pages = np.maximum(r.pages, 1).astype(float)
    return r.node_pages[:, DRAM_NODE] / pages, r.node_pages[:, FAR_NODE] / pages, r.swapped / pages


def test_unmodified_program_is_adopted_and_tiered_by_damon(tmp_path):
    tag = f"kvtier-watch-vm-{uuid.uuid4().hex[:8]}"
    mem = [t for t in topology.discover().tiers if t.kind not in (topology.KIND_SWAP, topology.KIND_CXL)]
    tiers = ", ".join(f'{{ name = "{t.name}", nodes = {list(t.nodes)}, kind = "{t.kind}" }}' for t in mem)
    config = textwrap.dedent(f"""\
        [policy]
        capacity = {{ 0 = {DRAM_TARGET} }}
        [topology]
        tiers = [{tiers}]
        [hotness.perf_fault]
        enabled = false
        [[watch]]
        name = "plain"
        cmdline = "{tag}"
        min_mapping = {128 * MiB}
        block_size = {BLOCK}
        tenant = "zero-int"
        """)
    d = GuestKvtierd(tmp_path, config, daemon={"tick_interval": TICK_S, "watch_interval": 0.5}, name="test_watch_vm")
    report = {}
    log = d.log
    prog = None
    try:
        prog = subprocess.Popen([sys.executable, "-c", PROGRAM, tag], stdout=subprocess.PIPE, text=True)
        data = int(prog.stdout.readline())  # where the pool's bytes start
        c = d.client

        def mine():
            return [r for r in c.request("regions")["regions"] if r["pid"] == prog.pid]

        t0 = time.monotonic()
        while not mine():
            assert time.monotonic() - t0 < scaled(60), log.read_text()[-3000:]
            time.sleep(0.2)
        (r,) = mine()
        assert r["adopted_by"] == "plain" and r["tenant"] == "zero-int" and r["length"] >= POOL - BLOCK
        assert r["start"] < data + BLOCK and data + POOL <= r["start"] + r["length"] + BLOCK
        # Blocks wholly inside the hot 32 MiB, and wholly inside the rest of
        # the pool (the mapping may have merged with the interpreter's own
        # anonymous memory: those blocks are neither).
        nblocks = r["length"] // BLOCK
        lo = r["start"] + np.arange(nblocks) * BLOCK
        hot = np.flatnonzero((lo >= data) & (lo + BLOCK <= data + HOT))
        cold = np.flatnonzero((lo >= data + HOT) & (lo + BLOCK <= data + POOL))
        assert hot.size >= 14 and cold.size >= 100, (hot.size, cold.size)
        ticks0 = c.request("stats")["ticks_total"]
        limit = scaled_count(TICKS)
        while True:
            n = c.request("stats")["ticks_total"] - ticks0
            dram, far, swap = placement(prog.pid, r["start"], nblocks * BLOCK)
            hot_frac = float(dram[hot].mean())
            cold_down = float(((far[cold] + swap[cold]) >= 0.5).mean())
            if hot_frac >= 0.9 and cold_down >= 0.75:
                report = {"ticks": int(n), "hot_in_dram": hot_frac, "cold_below": cold_down}
                break
            assert n <= limit, (f"not converged in {limit} ticks: hot on node 0 {hot_frac:.0%}, cold blocks "
                                f"below DRAM {cold_down:.0%}\n{log.read_text()[-3000:]}")
            time.sleep(TICK_S)
        prog.kill()
        prog.wait()
        t0 = time.monotonic()
        while mine():
            assert time.monotonic() - t0 < scaled(30), "the exited program's regions stayed"
            time.sleep(0.1)
    finally:
        if prog is not None and prog.poll() is None:
            prog.kill()
            prog.wait()
        d.stop()
    if SHARE.is_dir():
        with open(SHARE / "watch_vm.json", "w") as f:
            f.write(json.dumps(report) + "\n")
