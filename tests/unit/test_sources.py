"""Hotness sources without root: the block index, perf record parsing and ring
arithmetic, and the access-bit readers against fixture files laid out like
the kernel's (pagemap, kpageflags, page_idle bitmap are u64 per index)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from kvtier.blocks import BlockTable
from kvtier.kernel.native import PAGE_SIZE
from kvtier.kernel.procfs import PM_PRESENT
from kvtier.kernel.sources import accessbits as ab
from kvtier.kernel.sources import perf as pf
from kvtier.kernel.sources.base import BlockIndex, Observation, Source

P = PAGE_SIZE


def table_of(*regions):
    t = BlockTable()
    for rid, pid, start, length, bs in regions:
        t.add_region(rid, pid, start, length, bs)
    return t


# -- BlockIndex ------------------------------------------------------------------


def test_index_lookup_across_pids_and_regions():
    # Two processes using the same virtual addresses; regions added out of order.
    t = table_of((1, 10, 0x20000, 4 * P, P), (2, 20, 0x20000, 2 * P, P), (3, 10, 0x10000, 2 * P, 2 * P))
    idx = BlockIndex(t)
    assert idx.pids == [10, 20]
    addrs = np.array([0x10000, 0x11FFF, 0x12000, 0x20000 + 3 * P + 5, 0x20000 + 4 * P, 0x0], dtype=np.uint64)
    # region 3 (pid 10) is row 6; region 1 rows 0..3
    assert idx.lookup(10, addrs).tolist() == [6, 6, -1, 3, -1, -1]
    assert idx.lookup(20, addrs).tolist() == [-1, -1, -1, -1, -1, -1]
    assert idx.lookup(20, np.array([0x20000 + P], dtype=np.uint64)).tolist() == [5]
    assert idx.lookup(99, addrs).tolist() == [-1] * 6


def test_index_ranges_merge_adjacent_and_align():
    t = table_of((1, 1, 0x10000, 3 * P, P), (2, 1, 0x10000 + 3 * P, 100, 100), (3, 1, 0x40000 + 10, 50, 50))
    r = BlockIndex(t).ranges(1, P)
    assert r.tolist() == [[0x10000, 0x10000 + 4 * P], [0x40000, 0x40000 + P]]
    assert BlockIndex(t).ranges(2).shape == (0, 2)


def test_index_neighbours_stay_inside_the_region():
    t = table_of((1, 1, 0x10000, 4 * P, P), (2, 1, 0x10000 + 4 * P, 4 * P, P))  # adjacent regions
    idx = BlockIndex(t)
    assert idx.neighbours(np.array([2]), 3).tolist() == [3]  # region 1 ends at row 3
    assert idx.neighbours(np.array([4, 5]), 2).tolist() == [6, 7]
    assert idx.neighbours(np.array([], dtype=np.int64), 2).tolist() == []


def test_observation_drops_zero_counts():
    class S(Source):
        name = "x"
        weight = 0.5

        def probe(self): ...
        def set_targets(self, table): ...
        def collect(self, now): ...

    obs = S().observation(np.array([3, 4, 5]), np.array([0.0, 2.0, 0.0]))
    assert isinstance(obs, Observation)
    assert obs.rows.tolist() == [4] and obs.counts.tolist() == [2.0] and obs.weight == 0.5
    assert obs.rows.dtype == np.int64 and obs.counts.dtype == np.float32


# -- perf records ------------------------------------------------------------------


def sample(pid, tid, t, addr):
    return struct.pack("<IHHIIQQ", pf.PERF_RECORD_SAMPLE, 0, 32, pid, tid, t, addr)


def lost(n):
    return struct.pack("<IHHQQ", pf.PERF_RECORD_LOST, 0, 24, 77, n)


def throttle():
    return struct.pack("<IHHQQQ", 5, 0, 32, 1, 2, 3)  # PERF_RECORD_THROTTLE: time, id, stream_id


def test_parse_plain_samples_is_one_view():
    buf = b"".join(sample(1, 2, i, 0x1000 * i) for i in range(5))
    recs, n_lost = pf.parse_records(buf)
    assert recs["addr"].tolist() == [0x1000 * i for i in range(5)]
    assert recs["tid"].tolist() == [2] * 5 and n_lost == 0


def test_parse_mixed_records():
    # A THROTTLE record is 32 bytes too: only the header type tells it apart.
    buf = sample(1, 1, 0, 0xA000) + lost(7) + throttle() + sample(1, 1, 1, 0xB000) + lost(3)
    recs, n_lost = pf.parse_records(buf)
    assert recs["addr"].tolist() == [0xA000, 0xB000] and n_lost == 10
    recs, _ = pf.parse_records(sample(1, 1, 0, 1) + throttle())
    assert recs["addr"].tolist() == [1]


def test_parse_stops_at_a_torn_record():
    buf = sample(1, 1, 0, 0xA000) + sample(1, 1, 0, 0xB000)[:20]
    recs, _ = pf.parse_records(buf)
    assert recs["addr"].tolist() == [0xA000]


def fake_ring(tmp_path, data_pages, tail, records):
    """A file laid out as struct perf_event_mmap_page + data pages, with
    ``records`` written from ``tail`` on, wrapping at the end of the data."""
    path = tmp_path / "ring"
    size = data_pages * P
    data = bytearray(size)
    blob = b"".join(records)
    for i, b in enumerate(blob):
        data[(tail + i) % size] = b
    meta = bytearray(P)
    struct.pack_into("<QQQQ", meta, pf.MMAP_DATA_HEAD, tail + len(blob), tail, P, size)
    path.write_bytes(bytes(meta) + bytes(data))
    return os.open(path, os.O_RDWR)


def test_ring_read_wraps_and_advances_tail(tmp_path):
    tail = 3 * P - 64  # two records fit before the end, three wrap to the start
    fd = fake_ring(tmp_path, 2, tail + P, [sample(1, 1, i, 0x100 * i) for i in range(5)])
    ring = pf.PerfRing(fd, 2)
    assert (ring.data_offset, ring.data_size) == (P, 2 * P)
    addrs = ring.read()[0]["addr"].tolist()
    assert addrs == [0x100 * i for i in range(5)]
    head, new_tail = struct.unpack_from("<QQ", ring.mm, pf.MMAP_DATA_HEAD)
    assert new_tail == head
    assert len(ring.read()[0]) == 0  # nothing new
    ring.close()


def test_ring_pages_must_be_power_of_two(tmp_path):
    with pytest.raises(ValueError):
        pf.PerfRing(os.open(tmp_path, os.O_RDONLY), 3)


def test_load_sampling_probe_reasons(tmp_path):
    devs = tmp_path / "bus/event_source/devices"
    for d in ("software", "tracepoint"):
        (devs / d).mkdir(parents=True)
    av = pf.LoadSampleSource(str(tmp_path)).probe()
    assert not av.ok and av.reason == f"no PEBS/IBS: PMU absent ({devs} has: software tracepoint)"
    # An AMD machine whose IBS type the kernel does not know (here: a bogus one).
    (devs / "ibs_op").mkdir()
    (devs / "ibs_op/type").write_text("4000\n")
    src = pf.LoadSampleSource(str(tmp_path), sample_period=100003)
    ev, what = src.pmu_event()
    assert what == "AMD IBS op" and ev.type == 4000 and ev.sample_period % 16 == 0
    av = src.probe()
    assert not av.ok and av.reason.startswith("AMD IBS op: perf_event_open")


# -- access bits ---------------------------------------------------------------------


def test_runs_coalesce_small_gaps():
    keys = np.array([5, 6, 7, 50, 200, 201, 1000], dtype=np.int64)
    starts, counts = ab.runs(keys, max_gap=64)
    assert starts.tolist() == [5, 200, 1000] and counts.tolist() == [46, 2, 1]
    starts, counts = ab.runs(keys, max_gap=0)
    assert starts.tolist() == [5, 50, 200, 1000] and counts.tolist() == [3, 1, 2, 1]


def u64_file(path, words: dict[int, int], size_words: int):
    arr = np.zeros(size_words, dtype=np.uint64)
    for k, v in words.items():
        arr[k] = v
    path.write_bytes(arr.tobytes())


def test_pfn_file_reads_in_runs(tmp_path):
    u64_file(tmp_path / "f", {i: i * 3 for i in range(0, 4096, 7)}, 4096)
    f = ab.PfnFile(str(tmp_path / "f"))
    idx = np.array([4095, 0, 7, 7, 2002, 13], dtype=np.int64)
    assert f.read(idx).tolist() == [4095 * 3, 0, 21, 21, 2002 * 3, 0]
    assert f.syscalls == 3  # {0,7,13}, {2002}, {4095}
    f.close()


def test_page_idle_reset_writes_one_bit_per_pfn(tmp_path):
    sys_root = tmp_path / "sys"
    (sys_root / "kernel/mm/page_idle").mkdir(parents=True)
    bitmap = sys_root / ab.PAGE_IDLE_BITMAP
    u64_file(bitmap, {}, 64)
    bits = ab.AccessBits(ab.MODE_PAGE_IDLE, str(sys_root), str(tmp_path))
    pfns = np.array([130, 3, 64, 65, 1, 64 * 40 + 63], dtype=np.int64)
    bits.reset(0, pfns)
    words = np.frombuffer(bitmap.read_bytes(), dtype=np.uint64)
    assert int(words[0]) == (1 << 1) | (1 << 3)
    assert int(words[1]) == (1 << 0) | (1 << 1)
    assert int(words[2]) == 1 << 2
    assert int(words[40]) == 1 << 63
    assert bits.file.syscalls == 2  # runs: words 0..2 and word 40 (gap > MAX_GAP)
    # The kernel clears the idle bit of a page that was accessed: here 64.
    u64_file(bitmap, {0: (1 << 1) | (1 << 3), 1: 1 << 1, 2: 1 << 2, 40: 1 << 63}, 64)
    assert bits.accessed(pfns).tolist() == [False, False, True, False, False, False]


def pagemap_fixture(proc, pid, base, entries):
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "clear_refs").write_text("")
    arr = np.asarray(entries, dtype=np.uint64)
    with open(d / "pagemap", "wb") as f:
        f.seek(base // P * 8)
        f.write(arr.tobytes())


def test_kpageflags_source_reports_fraction_of_pages_referenced(tmp_path):
    proc = tmp_path / "proc"
    pid, base = 4242, 0x7F0000000000
    # 4 blocks of 4 pages; PFNs 1000.. except page 15 absent.
    pfn = np.arange(1000, 1016, dtype=np.uint64)
    ent = pfn | PM_PRESENT
    ent[15] = 0
    pagemap_fixture(proc, pid, base, ent)
    u64_file(proc / "kpageflags", {}, 2048)
    t = table_of((1, pid, base, 16 * P, 4 * P))
    src = ab.AccessBitSource(str(tmp_path / "sys"), str(proc))
    src.bits = ab.AccessBits(ab.MODE_KPAGEFLAGS, str(tmp_path / "sys"), str(proc))  # probe needs a real kernel
    src.set_targets(t)
    assert len(src.collect(0.0)) == 0  # first pass only arms (clear_refs)
    assert (proc / str(pid) / "clear_refs").read_text() == "1"
    ref = 1 << ab.KPF_REFERENCED
    u64_file(proc / "kpageflags", {1004: ref, 1005: ref, 1006: ref, 1007: ref, 1012: ref, 1013: ref | 1}, 2048)
    obs = src.collect(1.0)
    assert obs.rows.tolist() == [1, 3] and obs.counts.tolist() == [1.0, 0.5]
    assert obs.source == "access_bits"
    src.close()


def test_access_bits_source_unavailable_without_root_or_files(tmp_path):
    av = ab.AccessBitSource(str(tmp_path), str(tmp_path)).probe()
    assert not av.ok
    assert f"{tmp_path}/kernel/mm/page_idle/bitmap absent (CONFIG_IDLE_PAGE_TRACKING)" in av.reason
    assert f"{tmp_path}/kpageflags absent" in av.reason
    with pytest.raises(ValueError):
        ab.AccessBitSource(mode="young")


# -- the source table ------------------------------------------------------------------


def test_build_from_config_and_probe_table(tmp_path):
    from kvtier.kernel import sources
    from kvtier.errors import ConfigError

    srcs = sources.build({"damon": {"aggr_us": 200_000}, "perf": {"enabled": False}},
                         str(tmp_path), str(tmp_path), dry_run=True)
    assert [s.name for s in srcs] == ["damon", "access_bits", "perf_fault"]
    assert srcs[0].params.aggr_us == 200_000 and srcs[0].io.dry_run
    # Nothing of the kernel's below these roots: every source says why not,
    # except perf faults, which need only perf_event_open on this machine.
    table = sources.probe_all(srcs[:2])
    assert not table["damon"].ok and "CONFIG_DAMON_SYSFS" in table["damon"].reason
    assert not table["access_bits"].ok and "kpageflags absent" in table["access_bits"].reason
    with pytest.raises(ConfigError, match=r"hotness.damon: unknown key\(s\) aggr_ms"):
        sources.build({"damon": {"aggr_ms": 5}})
    with pytest.raises(ConfigError, match="min_nr_regions"):
        sources.build({"damon": {"min_nr_regions": 1}})
    with pytest.raises(ConfigError, match="hotness.perf.enabled"):
        sources.build({"perf": {"enabled": "yes"}})


def test_access_bits_stand_down_where_damon_runs():
    from kvtier.kernel import sources
    from kvtier.kernel.sources.base import Availability

    class Fake(Source):
        def __init__(self, name, ok):
            self.name, self.ok, self.probed = name, ok, False

        def probe(self):
            self.probed = True
            return Availability(self.ok, "")

        def set_targets(self, table): ...
        def collect(self, now): ...

    d, a = Fake("damon", True), Fake("access_bits", True)
    table = sources.probe_all([d, a])
    assert table["damon"].ok and not table["access_bits"].ok and not a.probed
    assert "DAMON vaddr runs" in table["access_bits"].reason


def _per_block_index(t, rows):
    """What BlockIndex answers, from per-block arrays (how it was once stored)."""
    pid, addr = t.pid[rows], t.addr[rows]
    order = np.lexsort((addr, pid))
    r = rows[order]
    return r, t.pid[r].astype(np.int64), t.addr[r], t.addr[r] + t.nbytes[r]


@pytest.mark.parametrize("seed", range(4))
def test_index_by_runs_answers_as_a_per_block_index(seed):
    # Random regions of three pids (short last blocks, regions back to back),
    # indexed whole and by a random subset of rows (DAMON's), against the
    # same questions asked of a sorted per-block array.
    rng = np.random.default_rng(seed)
    regions, nxt = [], {10: 0x10000, 20: 0x10000, 30: 0x7000_0000}
    for rid in rng.permutation(12) + 1:
        pid = int(rng.choice([10, 20, 30]))
        bs = int(rng.choice([P, 2 * P, 3000]))
        length = int(rng.integers(1, 9)) * bs - int(rng.choice([0, 0, 100]))
        start = nxt[pid] + int(rng.choice([0, 0, 5 * P]))
        nxt[pid] = start + length
        regions.append((int(rid), pid, start, length, bs))
    t = table_of(*regions)
    for rows in (None, np.flatnonzero(rng.random(len(t)) < 0.6)):
        idx = BlockIndex(t, rows)
        r, pid, s, e = _per_block_index(t, np.arange(len(t)) if rows is None else rows)
        assert len(idx) == r.size
        assert idx.pids == sorted(set(pid.tolist()))
        for p in (10, 20, 30, 99):
            got = idx.blocks(p)
            m = pid == p
            for a, b in zip(got, (r[m], s[m], e[m])):
                assert a.tolist() == b.tolist()
            probe = np.concatenate([s[m], e[m] - 1, e[m], s[m] - 1, rng.integers(0, 1 << 31, 50).astype(np.uint64)])
            k = np.searchsorted(s[m], probe, side="right") - 1
            want = np.where((k >= 0) & (probe < e[m][np.clip(k, 0, None)] if m.any() else False),
                            r[m][np.clip(k, 0, None)] if m.any() else -1, -1)
            assert idx.lookup(p, probe).tolist() == want.tolist()
            a = np.uint64(P)  # ranges: blocks widened to pages, then merged where they touch
            bs, be = (s[m] // a) * a, ((e[m] + a - np.uint64(1)) // a) * a
            merged = []
            for x, y in zip(bs.tolist(), be.tolist()):
                if merged and x <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], y)
                else:
                    merged.append([x, y])
            assert idx.ranges(p, P).tolist() == merged
        some = rng.choice(len(t), 10)
        pos = {int(x): i for i, x in enumerate(r)}
        want = set()
        for x in some.tolist():
            if x in pos:
                for i in range(pos[x] + 1, min(pos[x] + 4, r.size)):
                    if t.region[r[i]] == t.region[x]:
                        want.add(int(r[i]))
        assert idx.neighbours(some, 3).tolist() == sorted(want - set(some.tolist()))
