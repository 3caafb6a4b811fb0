"""Request traces (Mooncake, Alibaba Qwen-Bailian) replayed as KV-block ticks.

A request trace lists requests, not block accesses: arrival time, prompt and
output lengths in tokens, and ``hash_ids``, one id per prompt block of
``block_tokens`` tokens, equal ids meaning equal prefix content (a prefix
cache hit). ``RequestTrace.ticks`` turns it into the engine's ``Tick``s
lazily, one tick at a time, so memory is bounded by the KV pool (the block
table), never by the trace's length.

Formats (one JSON object per line, sorted by arrival):

- ``mooncake`` (kvcache-ai/Mooncake FAST25-release/traces): ``timestamp``
  (integer milliseconds), ``input_length``, ``output_length``, ``hash_ids``
  of 512-token blocks.
- ``bailian`` (Alibaba's Qwen-Bailian usage traces): ``timestamp`` (seconds,
  float), ``input_length``, ``output_length``, ``hash_ids`` of 16-token
  blocks, plus ``chat_id`` / ``parent_chat_id`` (a turn and the turn it
  follows; -1 for a first turn). The chat ids add nothing to the replay: the
  turns of one chat share their prefix through ``hash_ids`` already. Other
  keys (``turn``, ``type``, ...) are ignored.
- ``auto``: ``bailian`` if the first record has ``chat_id``, else ``mooncake``.

The serving model, chosen to be what an inference operator would recognise
(vLLM's and SGLang's prefix caches work this way):

- Block bytes = ``block_tokens`` x KV bytes per token of the model
  (``MODELS``: 2 (K and V) x layers x KV heads x head dim x 2 bytes, fp16).
- A request's prefill happens at its arrival: every prompt block is touched
  once (a cached block is read, a new one is allocated and written).
- Decode then produces ``decode_tps`` tokens per second per request, and each
  decode step reads every block of the request (attention over the whole
  context), prompt and generated ones; the reads of one tick are summed per
  block, never emitted per token. A generated block is allocated when the
  context crosses a block boundary; it has no hash id (no later request in
  the trace can name it), so it is freed when its request finishes.
- Prompt blocks live in a bounded KV pool of ``pool_blocks`` as a prefix
  cache: referenced blocks are pinned in it while requests use them; when the
  last request using a block finishes, the block stays cached (``released``:
  a client sends phase ``free``), and is reused if a later request names its
  hash id (``acquired``: phase ``active``). When a new block finds the pool
  full, the cached block released longest ago is evicted (LRU over released
  blocks, as vLLM's free-block queue). A pool too small for the blocks in use
  is an error, not a silent drop.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from .trace import Tick, TimedReads

# name -> (layers, KV heads, head dim); fp16. From the models' published configs.
MODELS: dict[str, tuple[int, int, int]] = {
    "llama-3-8b": (32, 8, 128),  # GQA
    "llama-3-70b": (80, 8, 128),  # GQA
    "llama-3.1-405b": (126, 8, 128),
    "llama-2-7b": (32, 32, 128),  # MHA
    "llama-2-13b": (40, 40, 128),
    "mistral-7b": (32, 8, 128),
    "mixtral-8x7b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "qwen2-72b": (80, 8, 128),
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (80, 8, 128),
    "llama-3.2-1b": (16, 8, 64),
    "llama-3.2-3b": (28, 8, 128),
    "llama-2-70b": (80, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen2.5-14b": (48, 8, 128),
    "qwen2.5-32b": (64, 8, 128),
    "qwen2.5-72b": (80, 8, 128),
    "mistral-nemo-12b": (40, 8, 128),
    "gemma-2-9b": (42, 8, 256),
    "gemma-2-27b": (46, 16, 128),
    "phi-3-mini": (32, 32, 96),  # MHA
}
# Hugging Face names name the same models: "meta-llama/Meta-Llama-3-8B-Instruct"
_ORG_PREFIXES = ("meta-",)
_VARIANT_SUFFIXES = ("-instruct", "-chat", "-it", "-hf", "-base")


def model_name(model: str) -> str:
    """The table's name for ``model``: case, an organisation's path and
    variant suffixes (instruct, chat, hf...) do not change the KV cache."""
    name = model.strip().lower().rsplit("/", 1)[-1]
    while name not in MODELS and name.endswith(_VARIANT_SUFFIXES):
        name = name[: name.rfind("-")]
    for prefix in _ORG_PREFIXES:
        if name not in MODELS and name.removeprefix(prefix) in MODELS:
            name = name.removeprefix(prefix)
    return name


FORMATS = ("auto", "mooncake", "bailian")
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}
DEFAULT_MODEL = "llama-3-8b"
DEFAULT_DECODE_TPS = 30.0


def kv_bytes_per_token(model: str) -> int:
    name = model_name(model)
    if name not in MODELS:
        raise InvalidArgument(f"unknown model {model!r}; known: {', '.join(MODELS)} (or give KV bytes per token)")
    layers, heads, dim = MODELS[name]
    return 2 * layers * heads * dim * 2


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def detect_format(path: Path) -> str:
    with open(path) as f:
        for line in f:
            if line.strip():
                return "bailian" if "chat_id" in json.loads(line) else "mooncake"
    return "mooncake"


def read_requests(path: Path, fmt: str, limit: int | None = None):
    """Yield ``Request``s one line at a time, checking order and fields."""
    scale = 1e-3 if fmt == "mooncake" else 1.0
    last = -math.inf
    n = 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            try:
                d = json.loads(line)
                r = Request(float(d["timestamp"]) * scale, int(d["input_length"]), int(d["output_length"]),
                            tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidArgument(f"{path}:{lineno}: not a {fmt} request record ({type(e).__name__}: {e})") from None
            if r.t < last:
                raise InvalidArgument(f"{path}:{lineno}: timestamp goes back ({r.t} after {last}); sort the trace by time")
            if r.input_length < 0 or r.output_length < 0:
                raise InvalidArgument(f"{path}:{lineno}: negative length")
            last = r.t
            n += 1
            yield r


class _Active:
    __slots__ = ("t0", "out", "inlen", "nh", "prompt", "gen", "gen_born")

    def __init__(self, r: Request, prompt: np.ndarray):
        self.t0 = r.t
        self.out = r.output_length
        self.inlen = r.input_length
        self.nh = len(r.hash_ids)
        self.prompt = prompt  # pool ids of the prompt blocks
        self.gen: list[int] = []  # pool ids of generated blocks
        self.gen_born: list[int] = []  # decode step at which each was created

    def done(self, t: float, rate: float) -> int:
        """Decode steps before time ``t`` (step i is at t0 + i/rate)."""
        return min(self.out, max(0, math.ceil((t - self.t0) * rate) - 1))


class RequestTrace:
    """A request trace file as a tick source for the engine (``ticks(tick_s)``)."""

    has_arrivals = True  # ticks(timed=True) says what each request finds cached at its arrival

    def __init__(
        self,
        path: str | Path,
        fmt: str = "auto",
        model: str = DEFAULT_MODEL,
        kv_bytes: int | None = None,
        block_tokens: int | None = None,
        decode_tps: float = DEFAULT_DECODE_TPS,
        pool_blocks: int | None = None,
        limit: int | None = None,
    ):
        self.path = Path(path)
        if fmt not in FORMATS:
            raise InvalidArgument(f"trace format must be one of {', '.join(FORMATS)}")
        self.fmt = detect_format(self.path) if fmt == "auto" else fmt
        self.block_tokens = int(block_tokens or BLOCK_TOKENS[self.fmt])
        self.model = model if kv_bytes is None else f"{kv_bytes} B/token"
        self.kv_bytes = int(kv_bytes) if kv_bytes is not None else kv_bytes_per_token(model)
        if self.kv_bytes <= 0 or self.block_tokens <= 0 or not decode_tps > 0:
            raise InvalidArgument("KV bytes per token, block tokens and decode rate must be > 0")
        self.block_bytes = self.block_tokens * self.kv_bytes
        self.decode_tps = float(decode_tps)
        self.limit = limit
        self._scan()
        self.nblocks = int(pool_blocks) if pool_blocks else self.footprint_blocks
        self.meta = {"blocks_per_seq": self.blocks_per_request, "format": self.fmt, "model": self.model}

    def requests(self):
        return read_requests(self.path, self.fmt, self.limit)

    def _scan(self) -> None:
        """One streaming pass: the footprint the pool must hold and the span.

        Footprint = distinct prompt blocks (all stay cached when the pool
        holds them) + the peak of generated blocks alive at once. Memory: the
        set of hash ids (the block table's size) and the running requests.
        """
        seen: set[int] = set()
        ends: list[tuple[float, int]] = []  # heap of (finish time, generated blocks)
        live_gen = peak_gen = 0
        n = 0
        blocks = 0
        end = 0.0
        for r in self.requests():
            while ends and ends[0][0] <= r.t:
                live_gen -= heapq.heappop(ends)[1]
            seen.update(r.hash_ids)
            g = self._gen_blocks(r.input_length, len(r.hash_ids), r.output_length)
            fin = r.t + r.output_length / self.decode_tps
            heapq.heappush(ends, (fin, g))
            live_gen += g
            peak_gen = max(peak_gen, live_gen)
            n += 1
            blocks += len(r.hash_ids) + g
            end = max(end, fin)
        if n == 0:
            raise InvalidArgument(f"{self.path}: no {self.fmt} request records (an empty trace)")
        self.requests_n = n
        self.unique_prompt_blocks = len(seen)
        self.footprint_blocks = max(1, len(seen) + peak_gen)
        self.blocks_per_request = blocks / max(n, 1)
        self.duration = end

    def _gen_blocks(self, inlen: int, nh: int, steps: int) -> int:
        """Generated blocks after ``steps`` decode steps (the prompt's last block fills first)."""
        return max(0, -(-(inlen + steps) // self.block_tokens) - nh)

    def ticks(self, tick_s: float, timed: bool = False):
        """The engine's ``Tick``s; ``timed`` adds the arrivals' cache hits and
        the prompt blocks' read times (``Tick.prefetch_rows``, ``Tick.reads``)."""
        bt = self.block_tokens
        rate = self.decode_tps
        pool = self.nblocks
        free_ids: deque[int] = deque(range(pool))
        slot_of: dict[int, int] = {}
        hash_of = np.full(pool, -1, dtype=np.int64)
        ref = np.zeros(pool, dtype=np.int64)
        cached: OrderedDict[int, int] = OrderedDict()  # released slot -> tick of release, oldest first
        active: list[_Active] = []
        it = self.requests()
        nxt = next(it, None)
        k = 0
        while nxt is not None or active:
            t0, t1 = k * tick_s, (k + 1) * tick_s
            alloc: list[int] = []
            evict: list[int] = []
            free: list[int] = []
            acquired: list[int] = []
            released: list[int] = []
            parts_r: list[np.ndarray] = []
            parts_c: list[np.ndarray] = []
            parts_t: list[np.ndarray] = []
            hits: list[int] = []  # cached blocks the tick's arrivals find, with their arrival times
            hits_t: list[float] = []
            timed_parts: list[tuple[np.ndarray, float, float, float]] = []  # prompt reads: rows, first, every, count

            def slot() -> int:
                if free_ids:
                    return free_ids.popleft()
                if cached:
                    s, when = next(iter(cached.items()))
                    if when < k:  # released in an earlier tick: nobody reads it in this one
                        del cached[s]
                        del slot_of[int(hash_of[s])]
                        hash_of[s] = -1
                        evict.append(s)
                        return s
                raise InvalidArgument(
                    f"{self.path.name}: KV pool of {pool} blocks is full of blocks in use at t={t0:.0f}s; "
                    "give a larger pool"
                )

            while nxt is not None and nxt.t < t1:
                r = nxt
                ids = np.empty(len(r.hash_ids), dtype=np.int64)
                for i, h in enumerate(r.hash_ids):
                    s = slot_of.get(h)
                    if s is None:
                        s = slot()
                        slot_of[h] = s
                        hash_of[s] = h
                        alloc.append(s)
                    else:
                        hits.append(s)
                        hits_t.append(r.t)
                        if ref[s] == 0:
                            cached.pop(s, None)
                            acquired.append(s)
                    ref[s] += 1
                    ids[i] = s
                active.append(_Active(r, ids))
                parts_r.append(ids)  # prefill touches every prompt block once
                parts_c.append(np.ones(ids.size))
                parts_t.append(np.full(ids.size, r.t))
                if timed:
                    timed_parts.append((ids, r.t, 0.0, 1.0))
                nxt = next(it, None)

            still: list[_Active] = []
            for a in active:
                # decode step i (1..out) happens at arrival + i / rate
                before, after = a.done(t0, rate), a.done(t1, rate)
                steps = after - before
                need = self._gen_blocks(a.inlen, a.nh, after)
                while len(a.gen) < need:
                    s = slot()
                    alloc.append(s)
                    a.gen.append(s)
                    # created by the step that crosses the boundary
                    a.gen_born.append((a.nh + len(a.gen) - 1) * bt - a.inlen + 1)
                if steps:
                    last = min(t1, a.t0 + after / rate)
                    parts_r.append(a.prompt)
                    parts_c.append(np.full(a.prompt.size, float(steps)))
                    parts_t.append(np.full(a.prompt.size, last))
                    if timed:
                        timed_parts.append((a.prompt, a.t0 + (before + 1) / rate, 1.0 / rate, float(steps)))
                    if a.gen:
                        g = np.asarray(a.gen, dtype=np.int64)
                        born = np.asarray(a.gen_born)
                        c = (after - np.maximum(before, born - 1)).astype(np.float64)
                        m = c > 0
                        parts_r.append(g[m])
                        parts_c.append(c[m])
                        parts_t.append(np.full(int(m.sum()), last))
                if after >= a.out:
                    free.extend(a.gen)
                    for s in a.prompt.tolist():
                        ref[s] -= 1
                        if ref[s] == 0:
                            cached[s] = k
                            released.append(s)
                else:
                    still.append(a)
            active = still

            if parts_r:
                allr = np.concatenate(parts_r)
                rows, inv = np.unique(allr, return_inverse=True)
                counts = np.bincount(inv, weights=np.concatenate(parts_c), minlength=rows.size)
                last_t = np.full(rows.size, -np.inf)
                np.maximum.at(last_t, inv, np.concatenate(parts_t))
            else:
                rows, counts, last_t = np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
            # released slots and freed generated blocks become free for the next tick
            free_ids.extend(free)
            tick = Tick(
                np.asarray(alloc, dtype=np.int64), rows, counts, last_t, np.asarray(free, dtype=np.int64),
                np.asarray(evict, dtype=np.int64), np.asarray(acquired, dtype=np.int64),
                np.asarray(released, dtype=np.int64),
            )
            if timed:
                tick.prefetch_rows = np.asarray(hits, dtype=np.int64)
                tick.prefetch_t = np.asarray(hits_t, dtype=np.float64)
                if timed_parts:
                    sizes = [p[0].size for p in timed_parts]
                    tick.reads = TimedReads(
                        np.concatenate([p[0] for p in timed_parts]),
                        np.repeat([p[1] for p in timed_parts], sizes),
                        np.repeat([p[2] for p in timed_parts], sizes),
                        np.repeat([p[3] for p in timed_parts], sizes))
            yield tick
            k += 1
