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

A daemon that restarts is handled as the blocking client does: the calls
waiting when the connection drops, and any call made while it is down,
reconnect (waiting up to ``reconnect_timeout``, one coroutine connecting
for all; once such a wait ran out, calls fail at once until a connection is
made again) and are sent again once; the daemon re-adopts registrations from
its state file, so region handles stay valid, and engine regions are
re-attached. Hints made meanwhile are queued (at most ``hint_queue_max``
block hints, oldest dropped and counted in ``hints_dropped``), a hint
starts one reconnect attempt without waiting, and the queue is sent first
on the new connection. A client that never reached a daemon fails at once.

Hints go on the socket here (written without waiting for the answer): the
shared-memory hint ring that kvtier.client.Client uses is not asked for.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import time
from typing import Any, AsyncIterator, Callable, Iterable

import msgspec
import numpy as np

from kvtier import protocol
from kvtier.client import (ENV_SOCKET, DaemonUnavailable, EngineRegion, KvtierClientError, PoolMemory, Region,
                           _prefetch_selection, moved_mask, next_page, register_range)


class _ConnectionLost(DaemonUnavailable):
    """The connection dropped under a request: ``call`` reconnects and sends
    it again (once), as the blocking client does."""


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
        parts = [np.frombuffer(r["tiers"], dtype=protocol.TIERS_DTYPE)
                 async for r in self.client.pages("query", region=self.id, first=first, count=count)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def prefetch(self, blocks: Iterable[int] | np.ndarray | None = None, *, wait: bool = False,  # type: ignore[override]
                       timeout: float = 30.0) -> dict:
        self.flush()
        t0 = time.monotonic()
        r = await self.client.call(protocol.Prefetch(region=self.id, blocks=_packed(blocks)))
        if wait and r["queued"] and not r.get("dry_run"):  # the queued ones, as Region.prefetch
            sel = _prefetch_selection(blocks)
            while np.count_nonzero((await self.query())[sel] == 0) < r["already"] + r["queued"]:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"region {self.id}: {r['queued']} prefetched blocks not in tier 0 after {timeout}s")
                await asyncio.sleep(0.001)
            r["seconds"] = time.monotonic() - t0
        return r

    async def release(self, blocks: Iterable[int] | np.ndarray | None = None) -> dict:  # type: ignore[override]
        self.flush()
        return await self.client.call(protocol.Release(region=self.id, blocks=_packed(blocks)))

    async def unregister(self) -> None:  # type: ignore[override]
        if self.closed:
            return
        self._drop_pending()
        self._close_hint_sets()
        await self.client.call(protocol.Unregister(region=self.id))
        self._forget()


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

    def __init__(self, path: str | None = None, *, timeout: float = 10.0, reconnect_timeout: float = 30.0,
                 hint_batch: int = 65536, hint_interval: float = 0.05, hint_queue_max: int = 1 << 22,
                 name: str = ""):
        self.path = path or os.environ.get(ENV_SOCKET) or protocol.DEFAULT_SOCKET
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.hint_batch = hint_batch
        self.hint_interval = hint_interval
        self.hint_queue_max = hint_queue_max
        self.hints_dropped = 0
        self.reconnects = 0
        self.connected_once = False  # reconnect_timeout applies only after a connection existed
        self.unreachable = False  # a reconnect's wait ran out, no connection since: the next ones try once
        self._held_hints: collections.deque[tuple[protocol.Hint, int]] = collections.deque()  # while disconnected
        self._held_blocks = 0
        self._connecting: asyncio.Lock | None = None
        self._hint_reconnect: asyncio.Task | None = None
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
        self.server = await self._call_once(protocol.Hello(client=self.name))
        self.connected_once = True
        self.unreachable = False
        # A new connection executes the engine regions' moves from now on
        # (the daemon dropped the moves pending on the old one).
        for r in list(self._regions.values()):
            if isinstance(r, AsyncEngineRegion) and not r.closed:
                await self._call_once(protocol.Attach(region=r.id,
                                                      tiers=r.tiers.astype(protocol.TIERS_DTYPE).tobytes()))
        # Hints made while disconnected go first, in their order.
        while self._held_hints and self._writer is not None:
            req, n = self._held_hints.popleft()
            self._held_blocks -= n
            self._write(req, None)
        return self

    async def _reconnect(self) -> None:
        """Connect again after the daemon went away: one coroutine connects
        (the others wait for it), retrying with backoff for up to
        reconnect_timeout. Never having connected fails at once: that is a
        daemon that is not there, not one restarting."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None:
                return  # another coroutine reconnected meanwhile
            if not self.connected_once:
                await self.connect()
                return
            # Once a wait ran out, the next ones try once (as Client._reconnect).
            deadline = time.monotonic() + (0.0 if self.unreachable else self.reconnect_timeout)
            delay = 0.01
            while True:
                try:
                    await self.connect()
                    self.reconnects += 1
                    return
                except DaemonUnavailable:
                    self._drop_connection()
                    if time.monotonic() >= deadline:
                        self.unreachable = True
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)

    def _drop_connection(self, exc: BaseException | None = None) -> None:
        """Close the current connection; the calls waiting on it fail with
        ``exc`` (_ConnectionLost: they are sent again on the next one)."""
        exc = exc or DaemonUnavailable(self.path, "connection closed")
        self._lost = exc
        for op, fut in self._waiting.values():
            if fut is None:  # a hint in flight: advisory, reported, never retried
                self.async_errors.append(KvtierClientError(op, protocol.E_UNAVAILABLE, "kvtierd closed the connection"))
            elif not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def close(self) -> None:
        if self._hint_reconnect is not None:
            self._hint_reconnect.cancel()
            self._hint_reconnect = None
        if self._writer is not None:
            try:
                await self.flush()
            except (KvtierClientError, OSError):
                pass
        self._drop_connection(DaemonUnavailable(self.path, "client closed"))
        self.connected_once = False  # closed on purpose: no reconnecting

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
            if self._reader_task is asyncio.current_task():  # not a connection dropped already
                self._reader_task = None
                self._drop_connection(_ConnectionLost(self.path, f"connection lost: {e}"))

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

    def _ring_put(self, word: int, packed: bytes, checked: bool = False) -> bool:
        """Region._send tries the hint ring first; the asyncio client has
        none (kvtier.client.Client's ``hint_ring``), so every batch goes to
        ``_send_hint``: written on the socket at once, its answer collected
        by the reader task."""
        return False

    def _send_hint(self, req: protocol.Hint, nblocks: int) -> None:
        """Region.flush's transport: written now, answer collected by the
        reader; while disconnected, held for the next connection."""
        if self._writer is not None:
            self._write(req, None)
            return
        self._held_hints.append((req, nblocks))
        self._held_blocks += nblocks
        while self._held_blocks > self.hint_queue_max and len(self._held_hints) > 1:
            _, n = self._held_hints.popleft()  # oldest first: hints age
            self._held_blocks -= n
            self.hints_dropped += n
        if self.connected_once and (self._hint_reconnect is None or self._hint_reconnect.done()):
            # One attempt, not waited for: hints never block the engine.
            self._hint_reconnect = asyncio.get_running_loop().create_task(self._try_reconnect())

    async def _try_reconnect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        if self._connecting.locked():
            return  # a call is reconnecting; it sends the held hints
        async with self._connecting:
            if self._writer is not None:
                return
            try:
                await self.connect()
                self.reconnects += 1
            except DaemonUnavailable:
                self._drop_connection()

    async def _call_once(self, req: protocol.Request) -> Any:
        """Send on the current connection and wait; _ConnectionLost if it drops."""
        fut = asyncio.get_running_loop().create_future()
        self._write(req, fut)
        try:
            await self._writer.drain()
        except ConnectionError as e:
            self._waiting.pop(req.id, None)
            lost = _ConnectionLost(self.path, f"connection lost: {e}")
            self._drop_connection(lost)
            raise lost from None
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

    async def call(self, req: protocol.Request) -> Any:
        """Send one request and wait for its answer; reconnect and send it
        again once if the daemon went away (it may be restarting)."""
        for attempt in (0, 1):
            if self._writer is None:
                await self._reconnect()
            try:
                return await self._call_once(req)
            except _ConnectionLost:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def pages(self, op: str, **fields: Any) -> AsyncIterator[dict]:
        """Every answer of a paged op (see kvtier.client.Client.pages)."""
        req: dict | None = fields
        while req is not None:
            r = await self.request(op, **req)
            yield r
            req = next_page(op, req, r)

    async def regions(self, pid: int | None = None) -> AsyncIterator[dict]:
        """The regions this caller may see, by ascending id, a page at a time."""
        async for page in self.pages("regions", **({} if pid is None else {"pid": pid})):
            for r in page["regions"]:
                yield r

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
