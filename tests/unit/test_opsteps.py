"""server.OpSteps: large block ops in steps across loop iterations, the
uids taking turns, a hung-up client's op stopped between steps; and the
row slice a whole-region op works on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvtier.blocks import BlockTable, row_count, row_select
from kvtier.hotness import apply_phase
from kvtier.server import OpSteps


def test_steps_go_round_robin_between_uids_and_sum_their_results():
    order: list[tuple[str, int]] = []

    def op(name):
        def apply(chunk):
            order.append((name, chunk))
            return {"blocks": chunk}
        return apply

    async def main():
        st = OpSteps()
        a1 = st.add("a", 1, [1, 2, 3], op("a1"))
        a2 = st.add("a2", 1, [10], op("a2"))  # uid 1's second op: after its first
        b = st.add("b", 2, [100, 200], op("b"))
        return await a1, await a2, await b, st.pending

    ra1, ra2, rb, left = asyncio.run(main())
    assert (ra1, ra2, rb, left) == ({"blocks": 6}, {"blocks": 10}, {"blocks": 300}, 0)
    # uid 2's op is not queued behind all of uid 1's steps
    assert order == [("a1", 1), ("b", 100), ("a1", 2), ("b", 200), ("a1", 3), ("a2", 10)]


def test_a_hung_up_client_keeps_the_steps_taken_and_no_more():
    done: list[int] = []
    gone = {"x": False}

    def apply(chunk):
        done.append(chunk)
        if chunk == 2:
            gone["x"] = True  # the client hangs up after its second step
        return {"blocks": 1}

    async def main():
        st = OpSteps(hung_up=lambda owner: gone[owner])
        fut = st.add("x", 1, [1, 2, 3, 4], apply)
        with pytest.raises(asyncio.CancelledError):
            await fut
        return st.pending

    assert asyncio.run(main()) == 0
    assert done == [1, 2]


def test_an_error_midway_fails_the_op_and_stops_it():
    done: list[int] = []

    def apply(chunk):
        if chunk == 2:
            raise KeyError("region gone")
        done.append(chunk)
        return {}

    async def main():
        fut = OpSteps().add("x", 1, [1, 2, 3], apply)
        with pytest.raises(KeyError):
            await fut

    asyncio.run(main())
    assert done == [1]


def test_a_region_slice_selects_and_phases_like_its_indices():
    t = BlockTable()
    t.add_region(1, 10, 0, 64 * 4096, 4096)
    t.add_region(2, 10, 1 << 30, 100 * 4096, 4096)
    s = t.slices[2]
    sl, idx = slice(s.start, s.stop), np.arange(s.start, s.stop)
    mask = (np.arange(100) % 3) == 0
    assert row_count(sl) == row_count(idx) == 100
    assert (row_select(sl, mask) == row_select(idx, mask)).all()
    t.flags[s.start + 5] |= 1  # F_UNMOVABLE: its backoff stays
    t.retry_at[s.start + 5] = 7.0
    t.retry_at[s.start + 6] = 7.0
    before = t.snapshot()
    apply_phase(t, idx, "discard")
    want = t.snapshot()
    for k, v in before.items():
        t._a[k][: len(v)] = v
    apply_phase(t, sl, "discard")
    got = t.snapshot()
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    assert got["retry_at"][s.start + 5] == 7.0 and got["retry_at"][s.start + 6] == -np.inf


def test_pins_are_saved_as_runs_and_come_back_the_same():
    """A whole-region pin is one run in the state file (it listed every
    block: 4 Mi ints, 0.56-0.68 s of the loop per write); pins of another
    daemon version's per-block format are still restored."""
    import mmap
    import os

    from kvtier.hotness import Temperature
    from kvtier.kernel.procmap import ProcProcesses
    from kvtier.registry import Limits, Registry
    from kvtier.stats import DaemonStats

    buf = mmap.mmap(-1, 64 * 4096)
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data

    def registry():
        return Registry(BlockTable(), Limits(), DaemonStats(), Temperature(10.0), ProcProcesses())

    try:
        reg = registry()
        r = reg.add(os.getpid(), addr, 64 * 4096, 4096)
        reg.pin(r.id, None, 1)
        reg.unpin(r.id, np.array([5, 6], dtype=np.uint32))
        reg.pin(r.id, np.array([6, 40], dtype=np.uint32), None)
        state = reg.to_state()
        assert state[0]["pins"] == {"runs": [[0, 5, 1], [6, 1, -1], [7, 33, 1], [40, 1, -1], [41, 23, 1]]}
        want = (reg.table.region_view(r.id, "flags").copy(), reg.table.region_view(r.id, "pin_tier").copy())
        for pins in (state[0]["pins"], {"blocks": [i for i in range(64) if i != 5],
                                        "tiers": [-1 if i in (6, 40) else 1 for i in range(64) if i != 5]}):
            again = registry()
            assert again.adopt([{**state[0], "pins": pins}]) == (1, 0)
            assert np.array_equal(again.table.region_view(r.id, "flags"), want[0])
            assert np.array_equal(again.table.region_view(r.id, "pin_tier"), want[1])
    finally:
        buf.close()


def test_relay_carries_a_result_a_failure_and_a_later_answer():
    """deferred.relay, the one path from a worker's or steps' future to a
    deferred answer: the answer made from the result, an exception raised
    making it, and an AfterWrite answer waited for in turn, its own future's
    failure included (the stepped migrate's relay left that answer pending)."""
    import concurrent.futures

    from kvtier.deferred import AfterWrite, relay

    def boom(_):
        raise ValueError("region gone")

    async def main():
        loop = asyncio.get_running_loop()
        worker = concurrent.futures.Future()
        worker.set_result(("a", 2))
        made = loop.create_future()
        relay(worker, made, lambda r: r[0] * r[1])
        failed = loop.create_future()
        relay(worker, failed, boom)
        later, durable = loop.create_future(), loop.create_future()
        relay(worker, later, lambda _: AfterWrite(durable, {"queued": 3}))
        broken, write = loop.create_future(), loop.create_future()
        relay(worker, broken, lambda _: AfterWrite(write, None))
        assert not later.done() and not broken.done()
        durable.set_result(None)
        write.set_exception(OSError(28, "no space"))
        await asyncio.sleep(0)
        cancelled = concurrent.futures.Future()
        cancelled.cancel()
        gone = loop.create_future()
        relay(cancelled, gone)
        return made.result(), failed.exception(), later.result(), broken.exception(), gone.cancelled()

    made, failed, later, broken, gone = asyncio.run(main())
    assert made == "aa" and isinstance(failed, ValueError) and later == {"queued": 3}
    assert isinstance(broken, OSError) and broken.errno == 28 and gone
