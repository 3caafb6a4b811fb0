"""Topology discovery on this host's real /sys and /proc (root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.kernel import native, sysfs
from kvtier.kernel import topology as topo

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parent.parent.parent


def test_node0_is_dram_and_agrees_with_libnuma():
    before = native.numa_node_size(0)
    t = topo.discover()
    after = native.numa_node_size(0)
    assert t.tiers[0].kind == "dram" and 0 in t.tiers[0].nodes
    assert t.tier_for_node(0).index == 0
    node0 = t.nodes[0]
    # libnuma reads the same meminfo file; this VM hot-adds memory while it
    # runs, so the value read in between must lie between the two readings.
    lo, hi = sorted((before[0], after[0]))
    assert lo <= node0.total <= hi
    assert node0.cpus and set(node0.cpus) <= set(range(os.cpu_count() or 1))
    # every node libnuma knows with memory is in a tier
    for n in range(native.numa_max_node() + 1):
        try:
            total, _ = native.numa_node_size(n)
        except Exception:
            continue
        if total > 0:
            assert n in t.node_to_tier
            assert native.numa_distance(0, n) == t.nodes[0].distances[n]


def test_refresh_free_tracks_the_kernel():
    t = topo.discover()
    free = t.refresh_free()
    assert len(free) == len(t.tiers)
    _, numa_free = native.numa_node_size(0)
    # Free memory moves all the time; the two readings are microseconds apart
    # on an idle test host, so they agree to within a few percent of total.
    assert abs(free[0] - numa_free) < t.tiers[0].total * 0.05 + (64 << 20)


def test_swap_file_resolves_to_its_block_device(swapfile):
    t = topo.discover()
    dev = next(d for d in t.swap_devices if d.path == swapfile)
    swap = t.swap_tier
    assert swap is not None and dev in swap.swap_devices
    if dev.type == "file":
        st = os.stat(swapfile)
        majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        if os.major(st.st_dev) != 0:
            # the block device found from /sys/dev/block is the one that holds the file
            name = os.path.basename(os.readlink(f"/sys/dev/block/{majmin}"))
            assert dev.block == name and dev.disk is not None
            assert os.path.isdir(f"/sys/block/{dev.disk}")
            rot = Path(f"/sys/block/{dev.disk}/queue/rotational").read_text().strip()
            assert dev.rotational is (rot == "1")
            if dev.transport not in ("dm", "md"):
                assert dev.nvme == dev.disk.startswith("nvme")
    assert swap.total >= dev.size > 0


def test_capture_of_this_host_discovers_the_same_tiers(tmp_path, swapfile):
    dest = tmp_path / "capture"
    subprocess.run([sys.executable, str(REPO / "scripts" / "capture_fixtures.py"), str(dest)], check=True,
                   capture_output=True)
    live = topo.discover()
    captured = topo.discover(str(dest / "sys"), str(dest / "proc"))
    shape = lambda t: [(x.name, x.kind, x.nodes, x.order_source) for x in t.tiers]  # noqa: E731
    assert shape(captured) == shape(live)
    assert [(d.path, d.block, d.disk, d.nvme) for d in captured.swap_devices] == [
        (d.path, d.block, d.disk, d.nvme) for d in live.swap_devices
    ]
    assert (dest / sysfs.FIXTURE_META).is_file()
