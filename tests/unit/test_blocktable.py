"""BlockTable: rows written in steps (stage/fill/publish) end up exactly as
add_region writes them, whatever happens to the table between the steps,
and no reader sees a region before it is published."""

from __future__ import annotations

import numpy as np

from kvtier.blocks import FIELDS, BlockTable

KW = dict(flags=4, priority=2, tenant=3)


def _rows(t: BlockTable, region: int) -> dict[str, np.ndarray]:
    return {name: t.region_view(region, name).copy() for name in FIELDS}


def _same(a: dict, b: dict) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_filled_in_steps_is_what_add_region_writes_and_invisible_until_published():
    ref = BlockTable()
    ref.add_region(1, 10, 0x1000, 4096 * 2, 4096)
    ref.add_region(2, 11, 0x100000, 4096 * 1000 + 17, 4096, **KW)
    t = BlockTable()
    t.add_region(1, 10, 0x1000, 4096 * 2, 4096)
    st = t.stage(11, 0x100000, 4096 * 1000 + 17, 4096, **KW)
    steps = 0
    while not t.fill(st, 128):
        steps += 1
        assert len(t) == 2 and 2 not in t.slices  # nothing visible yet
    assert steps == 7 and st.restarts == 0
    t.publish(st, 2)
    assert len(t) == len(ref)
    _same(_rows(t, 2), _rows(ref, 2))
    _same(_rows(t, 1), _rows(ref, 1))


def test_a_region_added_or_removed_between_steps_restarts_the_rows():
    t = BlockTable()
    t.add_region(1, 10, 0x1000, 4096 * 300, 4096)
    # stale rows past n (from a removed region) must not leak into the staged one
    t.add_region(9, 99, 0x9000000, 4096 * 5000, 4096, flags=1, priority=7, tenant=5)
    t.remove_region(9)
    st = t.stage(11, 0x100000, 4096 * 1000, 4096, **KW)
    t.fill(st, 400)
    t.add_region(3, 12, 0x200000, 4096 * 50, 4096)  # written where the staged rows were
    t.fill(st, 400)
    assert st.restarts == 1
    t.fill(st, 400)
    t.remove_region(1)  # shifts the table down under the staged rows
    t.fill(st, 400)
    assert st.restarts == 2
    t.publish(st, 2)
    ref = BlockTable()
    ref.add_region(3, 12, 0x200000, 4096 * 50, 4096)
    ref.add_region(2, 11, 0x100000, 4096 * 1000, 4096, **KW)
    _same(_rows(t, 2), _rows(ref, 2))
    _same(_rows(t, 3), _rows(ref, 3))
    assert len(t) == 1050 and t.slices[2].start == 50


def test_two_stagings_take_turns_without_mixing_rows():
    t = BlockTable()
    a = t.stage(11, 0x100000, 4096 * 600, 4096, **KW)
    b = t.stage(12, 0x900000, 4096 * 600, 4096)
    t.fill(a, 300)
    t.fill(b, 300)  # takes the rows past n: a starts again
    t.fill(a, 600)
    assert a.restarts == 1 and a.complete
    t.publish(a, 1)
    t.publish(b, 2)  # restarted at the new end and written in full
    ref = BlockTable()
    ref.add_region(1, 11, 0x100000, 4096 * 600, 4096, **KW)
    ref.add_region(2, 12, 0x900000, 4096 * 600, 4096)
    _same(_rows(t, 1), _rows(ref, 1))
    _same(_rows(t, 2), _rows(ref, 2))


def test_capacity_is_reserved_so_adding_never_copies_the_table():
    t = BlockTable(1 << 20)
    t.add_region(1, 10, 0, 4096 * 1000, 4096)
    arrays = {name: t._a[name] for name in FIELDS}
    for r in range(2, 40):
        t.add_region(r, 10, r << 32, 4096 * 20_000, 4096)
    assert all(t._a[name] is arrays[name] for name in FIELDS)
    assert t.version == 39  # one layout change per region added, none for growing


def test_removing_several_regions_at_once_keeps_every_other_row_as_removing_them_one_by_one():
    def table() -> BlockTable:
        t = BlockTable()
        for r, (n, kw) in enumerate([(7, {}), (300, KW), (1, {}), (45, dict(flags=1, priority=5, tenant=9)),
                                     (128, {}), (3, KW)]):
            t.add_region(10 + r, 100 + r, 0x10000000 * (r + 1), 4096 * n, 4096, **kw)
            t.region_view(10 + r, "temp")[:] = np.arange(n, dtype=np.float32) + r  # per-row state moves too
        return t

    drop = [15, 11, 13, 11]  # unsorted, the first region's neighbour, the last one, a repeat
    one_by_one = table()
    for r in dict.fromkeys(drop):
        one_by_one.remove_region(r)
    at_once = table()
    version = at_once.version
    at_once.remove_regions(drop)
    assert at_once.version > version  # a staged region starts again
    assert len(at_once) == len(one_by_one) == 7 + 1 + 128
    assert at_once.slices == one_by_one.slices
    assert {r: (v.start, v.count) for r, v in at_once.slices.items()} == {10: (0, 7), 12: (7, 1), 14: (8, 128)}
    assert at_once.addr[8 + 5] == 0x10000000 * 5 + 5 * 4096 and at_once.pid[7] == 102
    for r in at_once.slices:
        _same(_rows(at_once, r), _rows(one_by_one, r))
    rows = at_once.rows_of(np.array([10, 12, 14, 11]), np.array([6, 0, 127, 0]))
    np.testing.assert_array_equal(rows, [6, 7, 8 + 127, -1])
    assert at_once.temp[rows[2]] == 127 + 4
