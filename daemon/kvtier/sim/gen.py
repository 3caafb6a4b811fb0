"""Synthetic KV-block traces shaped like LLM serving.

The model, one record step (``steps_per_record`` decode iterations) at a time:

- Conversations arrive as a Poisson process; bursts (themselves Poisson, of
  ``burst_len_s``) multiply the rate by ``burst_factor``.
- Every conversation starts with one of a few shared system prompts (their
  blocks are allocated on first use and shared by everyone, like a prefix
  cache); with probability ``p_doc`` it also attaches a document chosen by a
  Zipf law from ``ndocs`` (shared, allocated on first use).
- A turn: prefill allocates the user prompt's blocks and reads the whole
  context once; then each decode iteration reads every block of the context
  (attention over all of it) and a new block is allocated every
  ``tokens_per_block`` generated tokens. At most ``max_batch`` sequences
  decode at once; the rest queue.
- After a turn the conversation thinks (exponential, ``think_mean_s``) and
  comes back for another turn, reusing its own earlier blocks, until its
  geometric number of turns is done; then its own blocks are freed.
- When the pool runs out, idle conversations are evicted oldest first (the
  engine drops their cache), then documents nobody holds.

Decode reads of one record step are aggregated into one record per block
with ``count`` = iterations x sequences reading it. Freed ids are reused
first-in first-out after a quarantine of ``quarantine_s`` so an id never
comes back within a simulator tick of its free.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..errors import InvalidArgument
from .trace import OP_ACCESS, OP_ALLOC, OP_FREE, Trace, concat


@dataclass(frozen=True)
class GenParams:
    seed: int = 1
    nblocks: int = 65536  # KV pool size in blocks (the id space)
    block_bytes: int = 2 << 20
    tokens_per_block: int = 16
    max_accesses: int = 2_000_000  # stop after this many access records
    max_duration_s: float = 3600.0
    step_s: float = 0.05  # one decode iteration
    steps_per_record: int = 10
    arrival_rate: float = 2.0  # conversations per second outside bursts
    burst_rate: float = 1 / 60.0  # bursts per second
    burst_factor: float = 4.0
    burst_len_s: float = 10.0
    max_batch: int = 64
    system_prompts: int = 4
    system_prompt_blocks: int = 32
    prompt_blocks_mean: float = 24.0  # new user-prompt blocks per turn
    decode_tokens_mean: float = 256.0
    turns_mean: float = 4.0
    think_mean_s: float = 20.0
    ndocs: int = 0
    doc_blocks_min: int = 16
    doc_blocks_max: int = 256
    zipf_s: float = 1.1
    p_doc: float = 0.0
    quarantine_s: float = 8.0


PRESETS: dict[str, GenParams] = {
    # multi-turn assistant chat: shared system prompts, long-lived conversations
    "chat": GenParams(),
    # retrieval: Zipf-popular documents as shared prefixes, mostly single turn
    "rag": GenParams(
        arrival_rate=4.0,
        turns_mean=1.3,
        prompt_blocks_mean=4.0,
        decode_tokens_mean=192.0,
        ndocs=2000,
        p_doc=0.9,
        zipf_s=1.1,
    ),
    # spiky traffic: short chats, strong bursts
    "bursty": GenParams(
        arrival_rate=1.5,
        burst_rate=1 / 30.0,
        burst_factor=8.0,
        burst_len_s=8.0,
        turns_mean=2.0,
        think_mean_s=10.0,
        max_batch=96,
    ),
}


class _Conv:
    __slots__ = ("prefix", "own", "turns_left", "tokens_left", "fill", "_ctx", "doc")

    def __init__(self, prefix: np.ndarray, turns: int, doc: int):
        self.prefix = prefix
        self.own: list[int] = []
        self.turns_left = turns
        self.tokens_left = 0
        self.fill = 0  # tokens in the last own block
        self._ctx: np.ndarray | None = None
        self.doc = doc

    def ctx(self) -> np.ndarray:
        if self._ctx is None:
            self._ctx = np.concatenate([self.prefix, np.asarray(self.own, dtype=np.int64)])
        return self._ctx

    def grow(self, ids) -> None:
        self.own.extend(ids)
        self._ctx = None


class _Pool:
    """Block-id allocator: FIFO reuse after quarantine."""

    def __init__(self, n: int):
        self.free: deque[int] = deque(range(n))
        self.cooling: deque[tuple[float, list[int]]] = deque()
        self.ncooling = 0

    def thaw(self, now: float) -> None:
        while self.cooling and self.cooling[0][0] <= now:
            ids = self.cooling.popleft()[1]
            self.ncooling -= len(ids)
            self.free.extend(ids)

    def soon(self) -> int:
        """Ids free now or once their quarantine ends."""
        return len(self.free) + self.ncooling

    def take(self, k: int) -> list[int] | None:
        if k > len(self.free):
            return None
        return [self.free.popleft() for _ in range(k)]

    def give(self, ids: list[int], ready_at: float) -> None:
        if ids:
            self.cooling.append((ready_at, list(ids)))
            self.ncooling += len(ids)


def generate(p: GenParams | str, **overrides) -> Trace:
    if isinstance(p, str):
        if p not in PRESETS:
            raise InvalidArgument(f"unknown trace preset {p!r}; choose from {', '.join(PRESETS)}")
        p = PRESETS[p]
    if overrides:
        p = replace(p, **overrides)
    rng = np.random.default_rng(p.seed)
    pool = _Pool(p.nblocks)
    dt = p.step_s * p.steps_per_record
    T, B, O, C = [], [], [], []

    sys_ids: list[np.ndarray | None] = [None] * p.system_prompts
    doc_ids: OrderedDict[int, np.ndarray] = OrderedDict()  # LRU order
    doc_refs: dict[int, int] = {}
    doc_sizes = rng.integers(p.doc_blocks_min, p.doc_blocks_max + 1, max(p.ndocs, 1))
    zipf_w = 1.0 / np.arange(1, max(p.ndocs, 1) + 1) ** p.zipf_s
    zipf_w /= zipf_w.sum()
    doc_perm = rng.permutation(max(p.ndocs, 1))  # popularity rank -> doc id

    queue: deque[_Conv] = deque()
    active: list[_Conv] = []
    idle: OrderedDict[int, tuple[float, _Conv]] = OrderedDict()  # id(conv) -> (wake, conv)
    burst_until = -1.0
    n_acc = 0
    live_blocks = 0
    seq_samples: list[float] = []
    now = 0.0

    def emit(ids, op, count, at):
        nonlocal live_blocks
        ids = np.asarray(ids, dtype=np.int64)
        live_blocks += ids.size if op == OP_ALLOC else -ids.size if op == OP_FREE else 0
        if ids.size:
            T.append(np.full(ids.size, at))
            B.append(ids)
            O.append(np.full(ids.size, op, dtype=np.uint8))
            C.append(np.broadcast_to(np.float32(count), ids.shape).copy() if np.isscalar(count) else count)

    frees_now: list[int] = []

    def release(conv: _Conv) -> None:
        frees_now.extend(conv.own)
        conv.own = []
        if conv.doc >= 0:
            doc_refs[conv.doc] -= 1

    def alloc(k: int) -> list[int] | None:
        ids = pool.take(k)
        if ids is None:
            # Out of ids: evict idle conversations (oldest first), then
            # documents nobody holds, until enough ids are free or cooling.
            # Evicted ids still sit out their quarantine, so the caller waits
            # (the request stays queued, the sequence does not grow this step).
            while pool.soon() + len(frees_now) < k and idle:
                _, (_, victim) = idle.popitem(last=False)
                release(victim)
            while pool.soon() + len(frees_now) < k:
                unref = next((d for d in doc_ids if doc_refs.get(d, 0) == 0), None)
                if unref is None:
                    break
                frees_now.extend(doc_ids.pop(unref).tolist())
            flush_frees()
            return None
        emit(ids, OP_ALLOC, 0.0, now)
        return ids

    def flush_frees() -> None:
        if frees_now:
            emit(frees_now, OP_FREE, 0.0, now)
            pool.give(list(frees_now), now + p.quarantine_s)
            frees_now.clear()

    def new_conv() -> _Conv | None:
        s = int(rng.integers(p.system_prompts)) if p.system_prompts else -1
        parts = []
        if s >= 0:
            if sys_ids[s] is None:
                got = alloc(p.system_prompt_blocks)
                if got is None:
                    return None
                sys_ids[s] = np.asarray(got, dtype=np.int64)
            parts.append(sys_ids[s])
        doc = -1
        if p.ndocs and rng.random() < p.p_doc:
            doc = int(doc_perm[rng.choice(p.ndocs, p=zipf_w)])
            if doc not in doc_ids:
                got = alloc(int(doc_sizes[doc]))
                if got is None:
                    return None
                doc_ids[doc] = np.asarray(got, dtype=np.int64)
            doc_ids.move_to_end(doc)
            doc_refs[doc] = doc_refs.get(doc, 0) + 1
            parts.append(doc_ids[doc])
        turns = int(rng.geometric(1.0 / max(p.turns_mean, 1.0)))
        prefix = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return _Conv(prefix, turns, doc)

    while n_acc < p.max_accesses and now < p.max_duration_s:
        pool.thaw(now)
        if now >= burst_until and rng.random() < p.burst_rate * dt:
            burst_until = now + p.burst_len_s
        lam = p.arrival_rate * (p.burst_factor if now < burst_until else 1.0)
        for _ in range(int(rng.poisson(lam * dt))):
            c = new_conv()
            if c is not None:
                queue.append(c)
        for key in [k for k, (wake, _) in idle.items() if wake <= now]:
            queue.append(idle.pop(key)[1])

        step_access: list[np.ndarray] = []
        # admit and prefill
        while queue and len(active) < p.max_batch:
            c = queue[0]
            k = max(1, int(rng.poisson(p.prompt_blocks_mean)))
            got = alloc(k)
            if got is None:
                break
            queue.popleft()
            c.grow(got)
            c.fill = 0
            c.tokens_left = max(1, int(rng.exponential(p.decode_tokens_mean)))
            c.turns_left -= 1
            step_access.append(c.ctx())  # prefill reads the whole context once
            active.append(c)
        # decode
        still = []
        for c in active:
            toks = min(p.steps_per_record, c.tokens_left)
            c.fill += toks
            c.tokens_left -= toks
            while c.fill >= p.tokens_per_block:
                got = alloc(1)
                if got is None:
                    break
                c.grow(got)
                c.fill -= p.tokens_per_block
            ctx = c.ctx()
            step_access.append(np.repeat(ctx, toks) if toks != 1 else ctx)
            if c.tokens_left > 0:
                still.append(c)
            elif c.turns_left > 0:
                idle[id(c)] = (now + float(rng.exponential(p.think_mean_s)), c)
            else:
                release(c)
        active = still
        if step_access:
            ids, cnt = np.unique(np.concatenate(step_access), return_counts=True)
            emit(ids, OP_ACCESS, cnt.astype(np.float32), now)
            n_acc += ids.size
        flush_frees()
        convs = len(active) + len(idle)
        if convs:
            seq_samples.append(live_blocks / convs)
        now += dt

    meta = asdict(p)
    meta["duration_s"] = now
    # live blocks per live conversation (shared prefixes amortised): the
    # footprint that sizes "max concurrent sequences" in the cost model
    meta["blocks_per_seq"] = float(np.mean(seq_samples)) if seq_samples else 0.0
    return concat(T, B, O, C, p.nblocks, p.block_bytes, meta)
