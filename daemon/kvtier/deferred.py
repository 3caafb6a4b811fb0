"""Answers that come later, and carrying a worker's result to them.

A control-plane handler that cannot answer at once returns ``AfterWrite``:
the connection sends the result once its future is done and answers nothing
else meanwhile. The work behind it runs elsewhere (a worker thread's
concurrent future, OpSteps' steps, the state file's write), and ``relay``
is the one place that carries such a future's outcome to the answer's
future: cancelled, failed, or a result turned into the answer, which may
itself have to wait for another future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable


class AfterWrite:
    """A result to send once ``future`` is done (None: at once); a result of
    None sends the future's own result. The connection answers nothing else
    meanwhile, so answers stay in order."""

    __slots__ = ("future", "result")

    def __init__(self, future: "asyncio.Future | None", result: Any):
        self.future = future
        self.result = result


def _same(result: Any) -> Any:
    return result


def relay(source: "asyncio.Future | concurrent.futures.Future", out: asyncio.Future,
          answer: Callable[[Any], Any] = _same) -> None:
    """Settle ``out`` (on the loop thread) from ``source``, which is done:
    cancelled if it was, its exception if it failed, else
    ``answer(source.result())``, an exception raised by ``answer`` included
    (the client is told; the loop goes on). An ``AfterWrite`` from
    ``answer`` is waited for in turn: its result, or its future's own when
    that is None. Nothing is done if ``out`` is done already (the request's
    client hung up and it was cancelled)."""
    if out.done():
        return
    if source.cancelled():
        out.cancel()
        return
    exc = source.exception()
    if exc is not None:
        out.set_exception(exc)
        return
    try:
        res = answer(source.result())
    except Exception as exc:
        out.set_exception(exc)
        return
    if not isinstance(res, AfterWrite):
        out.set_result(res)
    elif res.future is None:
        out.set_result(res.result)
    else:
        later = res.result
        res.future.add_done_callback(lambda f: relay(f, out, _same if later is None else lambda _: later))
