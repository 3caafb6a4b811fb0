"""asyncio client for kvtierd: the same API as kvtier.client, awaitable.

    from kvtier.aio import AsyncClient
    async with AsyncClient() as kv:
        region = await kv.allocate(1 << 30, block_size=2 << 20, name="kv", tenant="team-a")
        region.hint([3, 4, 9])          # not a coroutine: buffered, sent without waiting
        await region.prefetch([7, 8])   # a session resumes
        tiers = await region.query()

For engines that run an event loop (vLLM's and SGLang's servers). One
connection, one reader task: answers complete the futures of their requests
(so any number of coroutines may call at once), and ``move`` events of
engine-mode regions are served as they arrive, without polling: the
region's ``on_move`` may be a plain function or a coroutine function.
Unlike the blocking client it does not reconnect by itself: a lost daemon
fails the pending calls with ``DaemonUnavailable`` and the next call too,
until ``connect()`` is awaited again (which re-attaches engine regions).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from typing import Any, Callable, Iterable

import msgspec
import numpy as np

from kvtier import protocol
from kvtier.client import (ENV_SOCKET, DaemonUnavailable, EngineRegion, KvtierClientError, PoolMemory, Region,
                           moved_mask, register_range)


class AsyncRegion(Region):
    """A registered region of an AsyncClient. ``hint``/``flush`` are plain
    methods (they only queue and write); everything that waits is a coroutine."""

    client: "AsyncClient"

    async def __aenter__(self) -> "AsyncRegion":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.unregister()

    async def phase(self, phase: str, blocks: Iterable[int] | np.ndarray | None = None) -> int:  # type: ignore[override]
        self.flush()
        return (await self.client.call(protocol.Phase(region=self.id, phase=phase, blocks=_packed(blocks))))["blocks"]

    async def query(self, first: int = 0, count: int | None = None) -> np.ndarray:  # type: ignore[override]
        r = await self.client.call(protocol.Query(region=self.id, first=first, count=count))
        return np.frombuffer(r["tiers"], dtype=protocol.TIERS_DTYPE)

    async def prefetch(self, blocks: Iterable[int] | np.ndarray | None = None, *, wait: bool = False,  # type: ignore[override]
                       timeout: float = 30.0) -> dict:
        self.flush()
        t0 = time.monotonic()
        r = await self.client.call(protocol.Prefetch(region=self.id, blocks=_packed(blocks)))
        if wait and r["queued"]:
            sel = slice(None) if blocks is None else np.asarray(blocks, dtype=np.int64).ravel()
            while not ((await self.query())[sel] == 0).all():
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"region {self.id}: prefetched blocks not in tier 0 after {timeout}s")
                await asyncio.sleep(0.001)
            r["seconds"] = time.monotonic() - t0
        return r

    async def release(self, blocks: Iterable[int] | np.ndarray | None = None) -> dict:  # type: ignore[override]
        self.flush()
        return await self.client.call(protocol.Release(region=self.id, blocks=_packed(blocks)))

    async def unregister(self) -> None:  # type: ignore[override]
        if self.closed:
            return
        self._blocks, self._counts, self._pending = [], [], 0
        await self.client.call(protocol.Unregister(region=self.id))
        self.closed = True
        self._keepalive = None
        self.client._regions.pop(self.id, None)


class AsyncEngineRegion(AsyncRegion, EngineRegion):
    """A mode-"engine" region (see kvtier.client.EngineRegion); ``on_move``
    may return an awaitable."""

    async def _move(self, body: dict) -> tuple[np.ndarray, str]:  # type: ignore[override]
        blocks = np.frombuffer(body["blocks"], dtype=protocol.BLOCKS_DTYPE)
        error = ""
        try:
            r = self.on_move(blocks, int(body["src"]), int(body["dst"]))
            ok = moved_mask(await r if inspect.isawaitable(r) else r, blocks.size)
        except Exception as e:  # the engine's failure is the daemon's news
            ok, error = np.zeros(blocks.size, dtype=bool), f"{type(e).__name__}: {e}"
        return self._record(blocks, ok, int(body["dst"])), error


def _packed(blocks: Iterable[int] | np.ndarray | None) -> bytes | None:
    return None if blocks is None else protocol.pack_blocks(np.asarray(blocks).ravel())


class AsyncClient:
    """One connection to kvtierd on the running event loop."""

    def __init__(self, path: str | None = None, *, timeout: float = 10.0, hint_batch: int = 65536,
                 hint_interval: float = 0.05, name: str = ""):
        self.path = path or os.environ.get(ENV_SOCKET) or protocol.DEFAULT_SOCKET
        self.timeout = timeout
        self.hint_batch = hint_batch
        self.hint_interval = hint_interval
        self.name = name or f"python asyncio pid {os.getpid()}"
        self.server: dict = {}
        self.async_errors: list[KvtierClientError] = []  # answers to hints
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._next_id = 1
        self._waiting: dict[int, tuple[str, asyncio.Future | None]] = {}  # id -> (op, future; None: a hint)
        self._regions: dict[int, AsyncRegion] = {}
        self._served: set[asyncio.Task] = set()
        self._lost: BaseException | None = None

    # -- connection ------------------------------------------------------

    async def connect(self) -> "AsyncClient":
        try:
            reader, self._writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), self.timeout)
        except (OSError, asyncio.TimeoutError) as e:
            why = os.strerror(e.errno) if getattr(e, "errno", None) else (str(e) or type(e).__name__)
            raise DaemonUnavailable(self.path, why) from None
        self._lost = None
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
        self.server = {}
        self.server = await self.call(protocol.Hello(client=self.name))
        for r in list(self._regions.values()):
            if isinstance(r, AsyncEngineRegion) and not r.closed:
                await self.call(protocol.Attach(region=r.id, tiers=r.tiers.astype(protocol.TIERS_DTYPE).tobytes()))
        return self

    async def close(self) -> None:
        if self._writer is not None:
            try:
                await self.flush()
            except (KvtierClientError, OSError):
                pass
            self._writer.close()
            self._writer = None
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (size,) = protocol.HEADER.unpack(await reader.readexactly(protocol.HEADER_SIZE))
                resp = protocol.decode_response(await reader.readexactly(size))
                if resp.event is not None:
                    task = asyncio.get_running_loop().create_task(self._serve(resp))
                    self._served.add(task)
                    task.add_done_callback(self._served.discard)
                    continue
                op, fut = self._waiting.pop(resp.id, ("?", None))
                if fut is None:
                    if not resp.ok:
                        e = resp.error
                        self.async_errors.append(KvtierClientError(op, e.code, e.message, e.errno, e.retry_after_ms))
                elif not fut.done():
                    fut.set_result(resp)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._fail_all(DaemonUnavailable(self.path, f"connection lost: {e}"))
        except asyncio.CancelledError:
            self._fail_all(DaemonUnavailable(self.path, "client closed"))
            raise

    def _fail_all(self, exc: BaseException) -> None:
        self._lost = exc
        for op, fut in self._waiting.values():
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _serve(self, ev: protocol.Response) -> None:
        if ev.event != "move":
            return
        region = self._regions.get(int(ev.result["region"]))
        if isinstance(region, AsyncEngineRegion):
            ok, error = await region._move(ev.result)
        else:
            ok, error = np.zeros(len(ev.result["blocks"]) // 4, dtype=bool), "region not served here"
        try:
            await self.call(protocol.MoveDone(move=int(ev.result["move"]), ok=ok.astype(np.uint8).tobytes(),
                                              error=error))
        except KvtierClientError as e:
            self.async_errors.append(e)

    # -- requests --------------------------------------------------------

    def _write(self, req: protocol.Request, fut: asyncio.Future | None) -> None:
        if self._writer is None:
            raise self._lost or DaemonUnavailable(self.path, "not connected")
        req.id = self._next_id
        self._next_id += 1
        self._waiting[req.id] = (req.__struct_config__.tag, fut)
        self._writer.write(protocol.encode_request(req))

    def _send_hint(self, req: protocol.Hint, nblocks: int) -> None:
        """Region.flush's transport: written now, answer collected by the reader."""
        try:
            self._write(req, None)
        except DaemonUnavailable as e:
            self.async_errors.append(e)  # hints are advisory: never raised to the engine

    async def call(self, req: protocol.Request) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._write(req, fut)
        await self._writer.drain()
        try:
            resp = await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(req.id, None)
            raise KvtierClientError(req.__struct_config__.tag, protocol.E_UNAVAILABLE,
                                    f"no answer within {self.timeout}s") from None
        if not resp.ok:
            e = resp.error
            raise KvtierClientError(req.__struct_config__.tag, e.code, e.message, e.errno, e.retry_after_ms)
        return resp.result

    async def request(self, op: str, **fields: Any) -> Any:
        try:
            t = protocol.OPS[op]
        except KeyError:
            raise ValueError(f"unknown op {op!r}") from None
        return await self.call(msgspec.convert(fields, t) if fields else t())

    async def flush(self) -> list[KvtierClientError]:
        """Send every region's pending hints and wait for all their answers."""
        for r in list(self._regions.values()):
            r.flush()
        if self._writer is not None:
            await self._writer.drain()
        deadline = time.monotonic() + self.timeout
        while any(fut is None for _, fut in self._waiting.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        errs, self.async_errors = self.async_errors, []
        return errs

    async def stats(self) -> dict:
        return await self.call(protocol.Stats())

    async def status(self) -> dict:
        return await self.call(protocol.Status())

    # -- API (as kvtier.client.Client) ---------------------------------------

    async def register(self, obj: Any = None, length: int | None = None, *, addr: int | None = None,
                       block_size: int, name: str = "", tenant: str = "", priority: int = 0,
                       constraints: Iterable[str] = (), pid: int | None = None) -> AsyncRegion:
        addr, length, keep = register_range(obj, length, addr)
        info = await self.call(protocol.Register(
            start=addr, length=length, block_size=block_size, name=name, tenant=tenant, priority=priority,
            constraints=list(constraints), pid=pid))
        region = AsyncRegion(self, info, addr, length, keep)  # type: ignore[arg-type]
        self._regions[region.id] = region
        return region

    async def allocate(self, nbytes: int, block_size: int, *, tier: str | int = "auto", name: str = "",
                       tenant: str = "", priority: int = 0, constraints: Iterable[str] = (),
                       pinned: bool = False, populate: bool = True) -> AsyncRegion:
        """See kvtier.client.Client.allocate."""
        mem = PoolMemory(int(nbytes))
        region = AsyncRegion(self, await self.call(mem.request(  # type: ignore[arg-type]
            block_size, tier, pinned, name=name, tenant=tenant, priority=priority, constraints=constraints)),
            mem.addr, mem.length, mem)
        self._regions[region.id], region.memory = region, mem
        try:
            mem.place(region.placement["node"], pinned, populate)
        except BaseException:
            await region.unregister()
            raise
        return region

    async def register_engine(self, nblocks: int, block_size: int, tiers: Iterable[int] | np.ndarray,
                              on_move: Callable, *, name: str = "", tenant: str = "", priority: int = 0,
                              constraints: Iterable[str] = ()) -> AsyncEngineRegion:
        """See kvtier.client.Client.register_engine; moves are served by the
        reader task as they arrive (no poll)."""
        t = np.array(tiers, dtype=protocol.TIERS_DTYPE).ravel()
        info = await self.call(protocol.RegisterEngine(
            blocks=nblocks, block_size=block_size, tiers=t.tobytes(), name=name, tenant=tenant,
            priority=priority, constraints=list(constraints)))
        region = AsyncEngineRegion(self, info, t.copy(), on_move)
        self._regions[region.id] = region
        return region
