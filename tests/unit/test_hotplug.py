"""Memory hot-plug: topology re-discovery against fixture trees, the uevent
codec and debounce, and the engine renumbering block tiers.

The trees are copies of the captured QEMU guest (tests/fixtures/qemu-cxl:
dram node 0, CXL node 2 in memory tier 22, far node 1 in tier 45, NVMe
swap) edited the way the kernel changes sysfs when the CXL region's memory
goes offline (node 2 stays online without memory, its memory tier goes) and
when the node is removed entirely (kmem unbound: node 2 leaves ``online``),
as seen in the guest (offline of memory34/35, then unbind of dax0.0).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from pyroute2.netlink.uevent import MarshalUevent

from kvtier import logs
from kvtier.blocks import F_STALE, TIER_UNKNOWN, BlockTable
from kvtier.engine import Engine
from kvtier.hotness import Temperature
from kvtier.kernel import topology as topo
from kvtier.kernel import uevents
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.procmap import ProcProcesses
from kvtier.policy import PolicyConfig
from kvtier.registry import Limits, Registry
from kvtier.stats import DaemonStats

QEMU = Path(__file__).resolve().parent.parent / "fixtures" / "qemu-cxl"
NODE = "sys/devices/system/node"
MIB = 1 << 20


@pytest.fixture
def tree(tmp_path):
    dest = tmp_path / "qemu"
    shutil.copytree(QEMU, dest, symlinks=True)
    return dest


def discover(tree: Path, memory_tiers=None) -> topo.Topology:
    return topo.discover(str(tree / "sys"), str(tree / "proc"), hotplug=True, memory_tiers=memory_tiers)


def offline_memory(tree: Path, node: int = 2) -> None:
    """All memory blocks of ``node`` offline: no memory, no memory tier."""
    nd = tree / NODE
    (nd / "has_memory").write_text("0-1\n")
    (nd / f"node{node}/meminfo").write_text(
        f"Node {node} MemTotal:       0 kB\nNode {node} MemFree:        0 kB\nNode {node} MemUsed:        0 kB\n")
    shutil.rmtree(tree / "sys/devices/virtual/memory_tiering/memory_tier22")


def remove_node(tree: Path, node: int = 2) -> None:
    offline_memory(tree, node)
    nd = tree / NODE
    (nd / "online").write_text("0-1\n")
    shutil.rmtree(nd / f"node{node}")
    for n in (0, 1):  # one distance per online node
        d = (nd / f"node{n}/distance").read_text().split()
        (nd / f"node{n}/distance").write_text(" ".join(d[:2]) + "\n")


def names(t: topo.Topology) -> list[str]:
    return [x.name for x in t.tiers]


def test_fixture_shape():
    t = discover(QEMU)
    assert names(t) == ["dram", "cxl0", "far0", "swap"]
    assert [x.nodes for x in t.tiers[:3]] == [(0,), (2,), (1,)]


@pytest.mark.parametrize("take_away", [offline_memory, remove_node])
def test_cxl_going_and_coming_back_renumbers_tiers(tree, take_away):
    full = discover(tree)
    take_away(tree)
    assert full.changed_on_disk()
    gone = discover(tree)
    assert names(gone) == ["dram", "far0", "swap"]
    assert not gone.changed_on_disk()

    down = topo.compare(full, gone)
    # dram stays 0, cxl0 is gone, far0 and swap move up one.
    assert down.index_map.tolist() == [0, TIER_UNKNOWN, 1, 2]
    assert [t.name for t in down.removed] == ["cxl0"] and down.added == []
    assert down.nodes_removed == (2,) and down.nodes_added == () and down.reshaped

    up = topo.compare(gone, full)
    assert up.index_map.tolist() == [0, 2, 3]  # a far block is not a CXL block
    assert [(t.name, t.nodes, t.kind) for t in up.added] == [("cxl0", (2,), topo.KIND_CXL)]
    assert up.nodes_added == (2,) and up.removed == []
    # The new tier comes with its place in the kernel's memory tiers.
    assert up.added[0].total == 256 * MIB


def test_same_shape_is_not_reshaped_and_sizes_follow(tree):
    a = discover(tree)
    meminfo = tree / NODE / "node2/meminfo"
    meminfo.write_text(meminfo.read_text().replace("262144 kB", "131072 kB", 2))  # one block offline
    b = discover(tree)
    ch = topo.compare(a, b)
    assert not ch.reshaped and ch.index_map.tolist() == [0, 1, 2, 3]
    assert b.tiers[1].total == 128 * MIB
    assert not a.changed_on_disk()  # a block of a node that keeps memory: only uevents tell


def test_override_with_a_node_gone_drops_its_tier_only_when_rediscovering(tree):
    ov = {"tiers": [{"name": "dram", "nodes": [0]}, {"name": "slow", "nodes": [1, 2], "kind": "far"}]}
    remove_node(tree)
    with pytest.raises(topo.ConfigError, match="node 2 is not an online memory node"):
        topo.discover(str(tree / "sys"), str(tree / "proc"), ov)
    t = topo.discover(str(tree / "sys"), str(tree / "proc"), ov, hotplug=True)
    assert [(x.name, x.nodes) for x in t.tiers[:2]] == [("dram", (0,)), ("slow", (1,))]
    assert any("node 2 is offline" in w for w in t.warnings)
    ov["tiers"][1]["nodes"] = [2]
    t = topo.discover(str(tree / "sys"), str(tree / "proc"), ov, hotplug=True)
    assert names(t) == ["dram", "swap"]


# -- uevents ------------------------------------------------------------------


def kernel_message(action: str, devpath: str, subsystem: str, seq: int = 1) -> bytes:
    """A uevent datagram as the kernel sends it (lib/kobject_uevent.c)."""
    fields = [f"{action}@{devpath}", f"ACTION={action}", f"DEVPATH={devpath}", f"SUBSYSTEM={subsystem}",
              f"SEQNUM={seq}"]
    return "\0".join(fields).encode() + b"\0"


def decoded(data: bytes):
    return list(MarshalUevent().parse(data))


def test_parse_keeps_memory_topology_events_only():
    ev = uevents.parse(decoded(kernel_message("online", "/devices/system/memory/memory34", "memory"))[0])
    assert ev == uevents.Uevent("online", "memory", "/devices/system/memory/memory34") and ev.name == "memory34"
    assert uevents.parse(decoded(kernel_message("add", "/devices/system/node/node2", "node"))[0]).subsystem == "node"
    assert uevents.parse(decoded(kernel_message("add", "/devices/virtual/net/lo", "net"))[0]) is None
    assert uevents.parse({"ACTION": "online"}) is None


def test_listener_coalesces_a_burst_into_one_callback():
    async def run():
        loop = asyncio.get_running_loop()
        bursts = []
        listener = uevents.UeventListener(loop, bursts.append, debounce=0.05)
        for i, b in enumerate((34, 35)):
            listener.feed(decoded(kernel_message("add", f"/devices/system/memory/memory{b}", "memory", 2 * i)))
            listener.feed(decoded(kernel_message("online", f"/devices/system/memory/memory{b}", "memory", 2 * i + 1)))
            listener.feed(decoded(kernel_message("bind", "/devices/dax0.0", "dax")))
        await asyncio.sleep(0.2)
        listener.feed(decoded(kernel_message("add", "/devices/system/node/node2", "node")))
        await asyncio.sleep(0.2)
        listener.close()
        return bursts, listener

    bursts, listener = asyncio.run(run())
    assert [len(b) for b in bursts] == [4, 1]
    assert listener.events_total == 5 and listener.bursts_total == 2


def test_listener_without_netlink_degrades_to_polling():
    class NoNetlink:
        async def bind(self, groups):
            raise PermissionError(1, "Operation not permitted")

    async def run():
        listener = uevents.UeventListener(asyncio.get_running_loop(), lambda e: None, socket_factory=NoNetlink)
        return await listener.start()

    assert asyncio.run(run()) is False


# -- the engine renumbers blocks; the follower logs and counts ---------------


@pytest.fixture
def engine_on(tree):
    """A real Engine over a real registry holding 4 blocks of this process's
    memory, dry-run migrator, topology from the tree."""
    buf = mmap.mmap(-1, 8 * MIB)
    table = BlockTable()
    stats = DaemonStats()
    temp = Temperature(10.0)
    reg = Registry(table, Limits(), stats, temp, ProcProcesses())
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    reg.add(os.getpid(), addr, 8 * MIB, 2 * MIB)
    loop = asyncio.new_event_loop()
    eng = Engine(table, reg, discover(tree), Migrator(dry_run=True), temp, PolicyConfig(), stats, loop)
    yield eng, stats
    eng.shutdown()
    loop.close()
    buf.close()


def tick(eng) -> None:
    """One real tick on a running loop, its (dry-run) job finished and applied."""
    async def once():
        eng.tick()
        await asyncio.get_running_loop().run_in_executor(None, eng.wait_idle, 30.0)
        await asyncio.sleep(0.05)  # the job's done-callback runs on the loop

    eng.loop.run_until_complete(once())
    assert eng.stats.tick_errors_total == 0


def test_follower_renumbers_block_tiers_and_counts_events(tree, engine_on, caplog):
    eng, stats = engine_on
    follower = uevents.TopologyFollower(eng, stats, lambda **kw: discover(tree, **kw))
    t = eng.table
    t.tier[:] = [0, 1, 2, 3]  # dram, cxl0, far0, swap
    t.pin_tier[:] = [-1, 1, 2, -1]
    eng.manual.append((t.region[:1].copy(), t.index[:1].copy(), 2))
    remove_node(tree)
    follower.poll()  # the node list changed on disk
    assert names(eng.topology) == ["dram", "far0", "swap"]
    # The CXL block is unknown until measured; far and swap keep what they are.
    assert t.tier.tolist() == [0, TIER_UNKNOWN, 1, 2]
    assert t.pin_tier.tolist() == [-1, TIER_UNKNOWN, 1, -1]
    assert [m[2] for m in eng.manual] == [1]
    # every block is measured again at once, in full
    assert eng._urgent and (t.flags & F_STALE).all()
    assert stats.topology_events == {"tier_removed": 1, "rediscovered": 1}
    (removed,) = [r for r in caplog.records if r.getMessage() == "tier_removed"]
    assert getattr(removed, logs.FIELDS_ATTR)["tier"] == "cxl0"
    follower.poll()
    assert stats.topology_events["rediscovered"] == 1  # nothing changed since


def test_a_change_during_a_migration_waits_for_it(tree, engine_on):
    eng, stats = engine_on
    follower = uevents.TopologyFollower(eng, stats, lambda **kw: discover(tree, **kw))
    t = eng.table
    t.tier[:] = [0, 2, 2, 3]
    t.pin_tier[:] = [-1, 2, 2, 3]
    eng.mover.future = object()  # a move is running: its tier numbers are the old ones
    offline_memory(tree)
    follower.on_burst([uevents.Uevent("offline", "memory", "/devices/system/memory/memory34")])
    assert names(eng.topology) == ["dram", "cxl0", "far0", "swap"] and t.tier.tolist() == [0, 2, 2, 3]
    assert names(eng.latest_topology()) == ["dram", "far0", "swap"]
    follower.poll()  # compares with the pending topology: no second change
    assert stats.topology_events["rediscovered"] == 1
    eng.mover.future = None
    tick(eng)
    # Renumbered once the move is over (pin_tier: the tick then measures
    # every block for real, and this buffer's pages were never touched).
    assert names(eng.topology) == ["dram", "far0", "swap"] and t.pin_tier.tolist() == [-1, 1, 1, 2]


def blocking_nodelist(tree: Path, tier: str = "memory_tier45") -> Path:
    """That memory tier's nodelist made a FIFO: opening it for reading
    blocks until a writer comes, as reading the kernel's does while an
    offline unregisters the tier (topology.discover)."""
    f = tree / "sys/devices/virtual/memory_tiering" / tier / "nodelist"
    f.unlink()
    os.mkfifo(f)
    return f


def finishes(fn, fifo: Path, timeout: float = 10.0) -> bool:
    """Run ``fn`` on a thread; False if it is still blocked after ``timeout``
    (then the FIFO gets a writer, so the thread ends)."""
    import threading

    th = threading.Thread(target=fn, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        with open(fifo, "w") as w:
            w.write("1\n")
        th.join(timeout)
        return False
    return True


@pytest.mark.parametrize("how", ["poll", "burst"])
def test_memory_going_away_never_reads_a_memory_tier_nodelist(tree, engine_on, how):
    # The guest's kernel wedged for good: an offline holding memory_tier_lock
    # waited for kvtierd's read of a nodelist, which waited for the lock. A
    # re-discovery while memory goes keeps the tiers it knew instead.
    eng, stats = engine_on
    follower = uevents.TopologyFollower(eng, stats, lambda **kw: discover(tree, **kw))
    fifo = blocking_nodelist(tree)
    offline_memory(tree)  # node 2 leaves has_memory, its memory tier goes
    if how == "poll":
        go = follower.poll
    else:
        go = lambda: follower.on_burst([uevents.Uevent("offline", "memory", "/devices/system/memory/memory34"),
                                        uevents.Uevent("remove", "memory_tiering",
                                                       "/devices/virtual/memory_tiering/memory_tier22")])
    assert finishes(go, fifo), "the re-discovery read a memory tier's nodelist while memory went away"
    new = eng.latest_topology()
    assert names(new) == ["dram", "far0", "swap"]
    assert new.memory_tier_map() == {0: 4, 1: 45}  # the tiers known before, node 2 gone
    assert stats.topology_events["tier_removed"] == 1


def test_memory_coming_reads_the_memory_tiers(tree, engine_on):
    # Onlining registers a tier (no wait on readers): the new node's kernel
    # tier is read, so the CXL tier comes back in its place before far0.
    eng, stats = engine_on
    follower = uevents.TopologyFollower(eng, stats, lambda **kw: discover(tree, **kw))
    saved = tree.parent / "tier22"
    shutil.copytree(tree / "sys/devices/virtual/memory_tiering/memory_tier22", saved)
    offline_memory(tree)
    follower.poll()
    assert names(eng.latest_topology()) == ["dram", "far0", "swap"]
    shutil.copytree(saved, tree / "sys/devices/virtual/memory_tiering/memory_tier22")
    (tree / NODE / "has_memory").write_text("0-2\n")
    (tree / NODE / "node2/meminfo").write_text(
        "Node 2 MemTotal:       262144 kB\nNode 2 MemFree:        262144 kB\nNode 2 MemUsed:        0 kB\n")
    follower.on_burst([uevents.Uevent("online", "memory", "/devices/system/memory/memory34")])
    new = eng.latest_topology()
    assert names(new) == ["dram", "cxl0", "far0", "swap"]
    assert new.memory_tier_map() == {0: 4, 1: 45, 2: 22}


def test_lost_nodes_compares_the_node_lists():
    assert not uevents._lost_nodes(("0-2\n", "0-2\n"), ("0-2\n", "0-3\n"))
    assert uevents._lost_nodes(("0-2\n", "0-2\n"), ("0-2\n", "0-1\n"))
    assert uevents._lost_nodes(("0-2\n", "0-2\n"), ("0,2\n", "0-2\n"))
    assert uevents._lost_nodes(("0-2\n", "0-2\n"), None)
    assert uevents._lost_nodes(("0-2\n", None), ("0-2\n", "0-2\n"))


def test_pending_changes_compose(tree, engine_on):
    eng, stats = engine_on
    t = eng.table
    t.tier[:] = [0, 1, 2, 3]
    t.pin_tier[:] = [0, 1, 2, 3]
    full = eng.topology
    eng.mover.future = object()
    remove_node(tree)
    gone = discover(tree)
    eng.set_topology(gone, topo.compare(full, gone).index_map)
    eng.set_topology(full, topo.compare(gone, full).index_map)  # and back before the job ended
    eng.mover.future = None
    tick(eng)
    # far and swap pins are back at their old numbers; the CXL one is
    # unknown (its tier was gone meanwhile). Every block is then measured:
    # none has a page, so all are never touched (the swap block too: the
    # migrator counts shared memory in swap, so no page means none).
    assert t.pin_tier.tolist() == [0, TIER_UNKNOWN, 2, 3]
    assert t.tier.tolist() == [TIER_UNKNOWN] * 4


# -- per-process far-node affinity -------------------------------------------


def two_socket_tree(root: Path, hmat: dict[int, int] | None = None) -> Path:
    """Two CPU nodes (0: CPUs 0-1, 1: CPUs 2-3) and two CPU-less far nodes
    in one kernel memory tier: node 2 hangs off socket 0 (SLIT 20 from it,
    30 from socket 1), node 3 off socket 1. ``hmat``: far node -> the CPU
    node its access0/initiators names (links as the kernel makes them)."""
    sysd = root / "sys/devices/system/node"
    dist = {0: "10 20 20 30", 1: "20 10 30 20", 2: "20 30 10 30", 3: "30 20 30 10"}
    for f, v in (("online", "0-3"), ("possible", "0-3"), ("has_memory", "0-3"), ("has_cpu", "0-1")):
        (sysd).mkdir(parents=True, exist_ok=True)
        (sysd / f).write_text(v + "\n")
    for n in range(4):
        d = sysd / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text({0: "0-1", 1: "2-3"}.get(n, "") + "\n")
        free_kb = 1 << 20 if n != 3 else 2 << 20  # node 3 has more free memory
        (d / "meminfo").write_text(f"Node {n} MemTotal: {4 << 20} kB\nNode {n} MemFree: {free_kb} kB\n")
        (d / "distance").write_text(dist[n] + "\n")
    for far, cpu_node in (hmat or {}).items():
        ini = sysd / f"node{far}/access0/initiators"
        ini.mkdir(parents=True)
        (ini / f"node{cpu_node}").symlink_to(f"../../../node{cpu_node}")
        (ini / "read_latency").write_text("200\n")
    mt = root / "sys/devices/virtual/memory_tiering"
    for tier, nodes in ((4, "0-1"), (22, "2-3")):
        (mt / f"memory_tier{tier}").mkdir(parents=True)
        (mt / f"memory_tier{tier}/nodelist").write_text(nodes + "\n")
    (root / "proc").mkdir()
    (root / "proc/swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    (root / "proc/meminfo").write_text("MemTotal: 16777216 kB\n")
    return root


def test_a_multi_node_tier_places_blocks_near_the_process(tmp_path):
    tree = two_socket_tree(tmp_path)
    t = topo.discover(str(tree / "sys"), str(tree / "proc"))
    assert [(x.name, x.nodes) for x in t.tiers] == [("dram", (0, 1)), ("far0", (2, 3))]
    assert t.nearest_node(1, [0, 1])[0] == 2
    assert t.nearest_node(1, [2])[0] == 3
    node, why = t.nearest_node(1, [1])
    assert node == 2 and "SLIT 20" in why and "3 SLIT 30" in why
    # CPUs on both sockets: equal distance, the node with more free memory.
    assert t.nearest_node(1, [0, 1, 2, 3])[0] == 3
    assert t.nearest_node(1, None)[0] == 3 and "CPUs unknown" in t.nearest_node(1, None)[1]
    assert t.nearest_node(0, [0]) == (0, "node 0: nearest to the process's CPU node(s) [0] "
                                        "(SLIT 10; 1 SLIT 20)")


def test_hmat_initiators_outrank_slit(tmp_path):
    # HMAT says node 3 is best reached from socket 0, whatever SLIT says.
    tree = two_socket_tree(tmp_path, hmat={3: 0, 2: 1})
    t = topo.discover(str(tree / "sys"), str(tree / "proc"))
    assert t.nodes[3].initiators == (0,)
    node, why = t.nearest_node(1, [0])
    assert node == 3 and "HMAT best initiator" in why


def test_node_for_reads_the_process_affinity(tmp_path):
    tree = two_socket_tree(tmp_path)
    (tree / "proc/4242").mkdir()
    (tree / "proc/4242/status").write_text("Name:\tvllm\nCpus_allowed:\tc\nCpus_allowed_list:\t2-3\n")
    t = topo.discover(str(tree / "sys"), str(tree / "proc"))
    assert t.node_for(1, 4242)[0] == 3
    assert "CPUs unknown" in t.node_for(1, 999999)[1]  # gone: most free memory, no error


def test_explain_shows_the_node_choice_and_moves_use_it(tmp_path):
    tree = two_socket_tree(tmp_path)
    me = os.getpid()
    (tree / f"proc/{me}").mkdir()
    # Socket 0's CPUs: node 2 is nearest, node 3 has more free memory.
    (tree / f"proc/{me}/status").write_text("Name:\tpytest\nCpus_allowed_list:\t0-1\n")
    buf = mmap.mmap(-1, 4 * MIB)
    table, stats, temp = BlockTable(), DaemonStats(), Temperature(10.0)
    reg = Registry(table, Limits(), stats, temp, ProcProcesses())
    reg.add(me, np.frombuffer(buf, dtype=np.uint8).ctypes.data, 4 * MIB, 2 * MIB)
    loop = asyncio.new_event_loop()
    mig = Migrator(dry_run=True)
    mig.max_node = 3  # the fixture's machine has nodes 0-3; this one may not
    eng = Engine(table, reg, topo.discover(str(tree / "sys"), str(tree / "proc")), mig, temp,
                 PolicyConfig(), stats, loop)
    try:
        text = eng.explain(0)
        assert "node in far0: node 2: nearest to the process's CPU node(s) [0]" in text, text
        eng.request_move(np.array([0, 1]), 1)
        table.tier[:] = 0
        tick(eng)
        # The dry-run migrator records the node each batch was sent to.
        assert {op["node"] for op in mig.record if op["op"] == "move_pages"} == {2}, mig.record
    finally:
        eng.shutdown()
        loop.close()
        buf.close()
