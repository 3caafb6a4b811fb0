"""procfs readers against fixture trees shaped like this host's /proc."""

from __future__ import annotations

from kvtier.kernel import procfs

# Two mappings of a kvchild pool after `mlock` of its second 2 MiB, as
# /proc/PID/smaps showed them on 6.18 (lines the reader ignores trimmed).
SMAPS = """\
7f9b23800000-7f9b23a00000 rw-p 00000000 00:00 0
Size:               2048 kB
Locked:                0 kB
VmFlags: rd wr mr mw me ac nh
7f9b23a00000-7f9b23c00000 rw-p 00000000 00:00 0
Size:               2048 kB
Locked:             2048 kB
VmFlags: rd wr mr mw me lo ac nh
7f9b23c00000-7f9b24200000 rw-p 00000000 00:00 0
Size:               6144 kB
Locked:                0 kB
VmFlags: rd wr mr mw me ac nh
"""


def tree(tmp_path, vmlck_kb: int, smaps: str = SMAPS):
    d = tmp_path / "proc" / "42"
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nVmLck:\t    {vmlck_kb} kB\nVmPin:\t       0 kB\n")
    (d / "smaps").write_text(smaps)
    return str(tmp_path / "proc")


def test_locked_ranges_from_smaps_vmflags(tmp_path):
    assert procfs.read_locked_ranges(42, tree(tmp_path, 2048)) == [(0x7F9B23A00000, 0x7F9B23C00000)]


def test_no_locked_memory_reads_no_smaps(tmp_path):
    """Kills: reading smaps (a walk of every page of every mapping) when
    /proc/PID/status says nothing is locked."""
    root = tree(tmp_path, 0, smaps="not smaps at all\nVmFlags: lo\n")
    assert procfs.read_locked_ranges(42, root) == []


def test_status_fields(tmp_path):
    root = tree(tmp_path, 0)
    with open(f"{root}/42/status", "a") as f:
        f.write("Uid:\t1000\t1001\t1001\t1001\nCpus_allowed_list:\t0-2,5\n")
    assert procfs.read_uids(42, root) == (1000, 1001)
    assert procfs.read_cpus_allowed(42, root) == [0, 1, 2, 5]
