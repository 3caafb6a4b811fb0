"""The real adapters satisfy the Protocols the engine and metrics are typed
against (kvtier.ports): a renamed attribute or method fails here, not in a
tick on a production host."""

from pathlib import Path

from kvtier import ports
from kvtier.blocks import BlockTable
from kvtier.kernel import sources
from kvtier.kernel import topology
from kvtier.kernel.migrator import Migrator

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures"


def test_topology_and_its_tiers():
    for machine in ("host-1node", "qemu-cxl"):
        topo = topology.discover(str(FIXTURE / machine / "sys"), str(FIXTURE / machine / "proc"))
        assert isinstance(topo, ports.TopologyView), machine
        assert topo.tiers and all(isinstance(t, ports.TierInfo) for t in topo.tiers)
        assert all(isinstance(n, ports.NodeFree) for n in topo.nodes.values())


def test_migrator():
    assert isinstance(Migrator(dry_run=True), ports.MigratorPort)


def test_every_hotness_source_and_its_observation():
    root = str(FIXTURE / "host-1node")
    built = sources.build({}, root + "/sys", root + "/proc", dry_run=True)
    assert {s.name for s in built} == set(sources.SECTIONS)
    for source in built:
        assert isinstance(source, ports.HotnessSource), source.name
    obs = sources.Observation("hint")
    assert len(obs) == 0 and {"rows", "counts", "weight"} <= set(dir(obs))


def test_a_missing_member_is_seen():
    """The check is not vacuous: an object lacking one method fails it."""

    class NoPageout:
        dry_run = False

        def residency(self, pid, starts, lengths): ...

        def move(self, pid, starts, lengths, node): ...

        def pagein(self, pid, starts, lengths, node): ...

    assert not isinstance(NoPageout(), ports.MigratorPort)
    assert not isinstance(BlockTable(), ports.TopologyView)


def test_recorder(tmp_path):
    from kvtier.record import Recorder

    rec = Recorder(str(tmp_path), 1 << 20, 2, BlockTable())
    try:
        assert isinstance(rec, ports.RecorderPort)
    finally:
        rec.close()
