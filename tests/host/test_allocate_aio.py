"""kvtier.aio against the real kvtierd: the blocking client's API, awaited
on one event loop, with many coroutines calling at once and engine-mode
moves served by the reader task without polling."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest

from test_daemon import DaemonProc, daemon, workdir  # noqa: F401  (fixtures)
from test_allocate_engine import BLOCK, DRAM_SLOTS, daemon_for_engines

from kvtier.aio import AsyncClient
from kvtier.client import DaemonUnavailable, KvtierClientError

pytestmark = pytest.mark.root

MIB = 1 << 20


async def until(cond, what: str, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await cond()
        if got is not None and got is not False:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_async_client_registers_allocates_hints_and_queries(daemon):
    buf = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * (4 * MIB))

    async def main():
        async with AsyncClient(daemon.sock) as kv:
            assert kv.server["server"] == "kvtierd"
            r = await kv.register(buf, block_size=MIB, name="aio", tenant="t")
            pool = await kv.allocate(8 * MIB, MIB, name="aio-pool")
            assert pool.placement["node"] == 0 and pool.numpy(np.uint8).size == 8 * MIB
            r.hint([0, 1, 1, 3])  # not awaited: queued and written
            assert await kv.flush() == []
            # Many coroutines at once on one connection: each gets its own answer.
            answers = await asyncio.gather(*(kv.status() for _ in range(20)), r.query(), pool.query())
            assert all(a["server"] == "kvtierd" for a in answers[:20])
            assert answers[20].size == 4 and answers[21].size == 8
            tiers = await until(lambda: _measured(r), "residency measured")
            assert (tiers == 0).all()
            assert (await r.prefetch())["already"] == 4
            listed = {x["id"]: x for x in (await kv.request("regions"))["regions"]}
            assert listed[r.id]["block_hints"] == 4 and listed[pool.id]["placement"]["tier"] == 0
            with pytest.raises(KvtierClientError) as e:
                await kv.request("query", region=999)
            assert e.value.code == "not_found"
            with pytest.raises(ValueError, match="out of range"):
                r.hint([99])  # a list is checked at the call
            r.hint(np.array([99], dtype=np.uint32))  # the uint32 fast path: the daemon's error, at the next flush
            errs = await kv.flush()
            assert len(errs) == 1 and errs[0].code == "invalid_argument"
            await r.unregister()
            await pool.unregister()
            assert (await kv.request("regions"))["regions"] == []

    asyncio.run(main())


def test_async_region_refuses_hints_once_unregistered(daemon):
    """docs/integrations.md: hint raises ValueError once the region is
    unregistered, as the blocking client's does. The asyncio region's
    uint32 fast path took the hint instead, and it went nowhere: the client
    no longer holds the region, so no flush sends it and no error says so."""

    async def main():
        async with AsyncClient(daemon.sock) as kv:
            pool = await kv.allocate(4 * MIB, MIB)
            await pool.unregister()
            with pytest.raises(ValueError, match="unregistered"):
                pool.hint(np.array([1], dtype=np.uint32))
            with pytest.raises(ValueError, match="unregistered"):
                pool.hint([1])

    asyncio.run(main())


async def _measured(region):
    t = await region.query()
    return t if (t >= 0).all() else None


def test_async_engine_region_is_served_without_polling(swapfile, workdir):
    d = daemon_for_engines(workdir)
    try:
        async def main():
            async with AsyncClient(d.sock) as kv:
                moved = []

                async def on_move(blocks, src, dst):
                    await asyncio.sleep(0)  # an engine's copy may await (e.g. a CUDA stream)
                    moved.append((blocks.tolist(), src, dst))
                    return True

                n = 2 * DRAM_SLOTS
                region = await kv.register_engine(n, BLOCK, [0] * n, on_move)
                # Nobody polls: the reader task serves the daemon's demotions.
                await until(lambda: _count_in(region, 0, lambda k: k <= DRAM_SLOTS), "demotions served")
                assert moved and all(dst != 0 for _, _, dst in moved)
                assert (region.tiers == await region.query()).all()
                st = await kv.stats()
                assert st["engine_moves_sent_total"] >= len(moved)

        asyncio.run(main())
    finally:
        assert d.stop() == 0


async def _count_in(region, tier, ok):
    return ok(int(((await region.query()) == tier).sum()))


def test_async_client_reports_a_missing_daemon(tmp_path):
    async def main():
        with pytest.raises(DaemonUnavailable):
            await AsyncClient(str(tmp_path / "none.sock"), timeout=2).connect()

    asyncio.run(main())


def test_async_client_waits_once_for_a_daemon_that_stays_away(workdir):
    """As the blocking client: the first call after the daemon went away
    waits reconnect_timeout, the next ones fail at once until it is back."""
    import time

    d = DaemonProc(workdir).start()

    async def main():
        kv = AsyncClient(d.sock, reconnect_timeout=1.0)
        await kv.connect()
        assert d.stop() == 0
        await asyncio.sleep(0.2)  # the reader sees the connection end
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            await kv.status()
        assert 0.9 < time.monotonic() - t0 < 10
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            await kv.status()
        assert time.monotonic() - t0 < 0.5
        d.start()
        assert (await kv.status())["server"] == "kvtierd"
        await kv.close()

    try:
        asyncio.run(main())
    finally:
        d.stop()


def test_async_client_reconnects_when_the_daemon_restarts(workdir):
    """Issue 14: like the blocking client, calls made while kvtierd is down
    and calls waiting when it dies reconnect and are answered once it is
    back; the region handle stays valid (re-adopted from the state file) and
    hints made while it was down arrive. Before, every call after the
    restart raised DaemonUnavailable until connect() was awaited again."""
    import os
    import signal

    d = DaemonProc(workdir).start()
    buf = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * (4 * MIB))

    async def main():
        loop = asyncio.get_running_loop()
        kv = AsyncClient(d.sock)
        await kv.connect()
        r = await kv.register(buf, block_size=MIB, name="aio-restart")
        assert (await r.query()).size == 4

        # 1. Down before the call: hints are held, the call waits for it.
        assert d.stop() == 0
        await asyncio.sleep(0.2)  # the reader sees the connection end
        r.hint([1, 1, 2])
        r.flush()
        restart = loop.run_in_executor(None, d.start)
        tiers = await r.query()
        await restart
        assert tiers.size == 4 and kv.reconnects == 1
        assert await kv.flush() == []
        listed = {x["id"]: x async for x in kv.regions()}
        assert listed[r.id]["block_hints"] == 3 and listed[r.id]["name"] == "aio-restart"

        # 2. Dies under waiting calls (stopped, then kill -9): they are sent
        # again on the new connection and answered.
        os.kill(d.proc.pid, signal.SIGSTOP)
        calls = [loop.create_task(kv.status()) for _ in range(10)] + [loop.create_task(r.query())]
        await asyncio.sleep(0.2)
        assert not any(c.done() for c in calls)
        d.stop(signal.SIGKILL)
        restart = loop.run_in_executor(None, d.start)
        answers = await asyncio.gather(*calls)
        await restart
        assert all(a["server"] == "kvtierd" for a in answers[:10]) and answers[10].size == 4
        assert kv.reconnects == 2
        await r.unregister()
        await kv.close()

        # A client that never reached a daemon does not wait to reconnect.
        assert d.stop() == 0
        with pytest.raises(DaemonUnavailable):
            await AsyncClient(d.sock).status()

    try:
        asyncio.run(main())
    finally:
        buf.close()
        d.stop()
