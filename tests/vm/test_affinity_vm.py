"""Per-process far-node affinity on a two-socket guest (issue 15 item 2; the
"nearest far node" of issue 14's ``allocate``).

scripts/vm/run.py --shape two-socket: CPU 0 on node 0, CPU 1 on node 1, and a
CPU-less memory node beside each socket (node 2 near node 0, node 3 near
node 1, by SLIT and HMAT), which kvtier makes one far tier of two nodes.

- ``allocate`` into the far tier, called from a process pinned to one CPU,
  binds the pool to that socket's far node;
- the policy demotes the blocks of two processes, one pinned to each socket,
  into the same far tier, and the kernel (move_pages) finds each process's
  blocks on its own socket's far node, never the other's; ``explain`` names
  the choice.

Small on purpose (TCG): two 8 MiB pools, DRAM capped at 4 MiB.
"""

from __future__ import annotations

import contextlib
import os
import textwrap

import numpy as np
import pytest

from kvtier.kernel import native
from vmhelpers import GuestKvtierd, MiB, wait_for

pytestmark = pytest.mark.vm2s

PAGE = native.PAGE_SIZE
NEAR = {0: 2, 1: 3}  # CPU -> the far node beside its socket (run.py TWO_SOCKET_NODES)
POOL, BLOCK = 8 * MiB, 2 * MiB


@contextlib.contextmanager
def pinned(cpu: int):
    """This process (and children started meanwhile) on one CPU only."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def page_nodes(pid: int, addr: int, length: int) -> np.ndarray:
    return native.move_pages(pid, np.arange(addr, addr + length, PAGE, dtype=np.uint64), None)


@pytest.fixture
def kvtierd(tmp_path):
    config = textwrap.dedent(f"""\
        [policy]
        capacity = {{ 0 = {4 * MiB} }}
        [hotness.perf_fault]
        enabled = false
        """)
    with GuestKvtierd(tmp_path, config, daemon={"tick_interval": 0.2}, name="test_affinity_vm") as d:
        yield d


def far_tier(d: GuestKvtierd) -> dict:
    tiers = d.tiers()
    assert [t["kind"] for t in tiers][:2] == ["dram", "far"], tiers
    assert tiers[0]["nodes"] == [0, 1] and tiers[1]["nodes"] == [2, 3], tiers
    return tiers[1]


def test_allocate_binds_to_the_far_node_of_the_callers_socket(kvtierd):
    far = far_tier(kvtierd)
    for cpu, node in NEAR.items():
        with pinned(cpu):
            pool = kvtierd.client.allocate(4 * MiB, BLOCK, tier=far["name"], name=f"cpu{cpu}")
            pool.numpy(np.uint8)[::PAGE] = 1  # first touch, still pinned
        assert pool.placement["node"] == node, pool.placement
        assert "distance" in pool.placement["reason"], pool.placement
        where = page_nodes(os.getpid(), pool.start, pool.length)
        assert (where == node).all(), np.unique(where, return_counts=True)


def test_demotion_lands_on_the_far_node_of_the_owners_socket(kvtierd, child_factory):
    far = far_tier(kvtierd)
    kv = kvtierd.client
    owners = {}
    for cpu in NEAR:
        with pinned(cpu):  # the child inherits the mask: its pool is first touched on its own socket
            child = child_factory(POOL)
        assert os.sched_getaffinity(child.pid) == {cpu}
        assert (page_nodes(child.pid, child.addr, POOL) == cpu).all()
        owners[cpu] = (child, kv.register(addr=child.addr, length=POOL, block_size=BLOCK, pid=child.pid,
                                          name=f"cpu{cpu}"))

    def demoted() -> bool:
        # 16 MiB registered, DRAM capped at 4 MiB: at least 5 of the 8 blocks in the far tier.
        return sum(int((r.query() == far["index"]).sum()) for _, r in owners.values()) >= 5

    wait_for(demoted, "blocks demoted into the far tier", timeout=120, interval=0.2)
    for cpu, (child, region) in owners.items():
        near, other = NEAR[cpu], NEAR[1 - cpu]
        where = page_nodes(child.pid, child.addr, POOL).reshape(-1, BLOCK // PAGE)
        in_far = np.flatnonzero(region.query() == far["index"])
        assert in_far.size, f"no block of the CPU {cpu} process demoted"
        assert (where[in_far] == near).all(), (cpu, where[in_far])
        assert not (where == other).any(), f"CPU {cpu} process has pages on node {other}"
        why = kv.request("explain", region=region.id, block=int(in_far[0]))["text"]
        assert f"node {near}: nearest to the process's CPU node(s) [{cpu}]" in why, why
