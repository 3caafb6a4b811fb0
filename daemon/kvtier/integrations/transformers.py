"""A Hugging Face transformers KV cache that lives in kvtier-placed memory.

One line in ``generate``::

    from kvtier.integrations.transformers import KvtierCache
    out = model.generate(ids, max_new_tokens=200,
                         past_key_values=KvtierCache(model.config, max_cache_len=ids.shape[1] + 200))

What it does, and why each part matters to the daemon:

* **Layout: one kvtier block = N consecutive tokens of one layer, K and V
  together.** A StaticCache keeps ``keys[batch, head, position, dim]``: a
  token's K sits in one place per head and its V in another tensor, so the
  pages of "tokens 0..N" are scattered and shared with other tokens. Here
  each layer's storage is ``[position, batch, head, k_dim + v_dim]`` and the
  model sees K and V as strided views of it, so N tokens are one contiguous,
  page-aligned run of bytes. N is rounded up so a block is a whole number of
  pages: a block never shares a page with another block, and moving one
  never drags a neighbour along.
* **Memory from ``Client.allocate``**: one pool for all layers, mapped, placed
  on the node the daemon chose (mbind before first touch) and registered,
  when the first forward step shows the batch size, head count and dtype.
* **Hints are exactly what attention reads**: every layer's update returns
  the keys and values of positions ``0 .. length`` (not the whole
  preallocated length, as StaticCache does) and counts one read of each of
  those blocks: each layer keeps a hint set (``Region.hint_set``) of its
  blocks holding tokens, grown by a block when the sequence crosses into
  one, and touches it once per step (a countdown; the counts go to the
  daemon every ``hint_interval``, as a hint of those blocks per step would
  have). Hints naming fewer blocks than are read make the daemon demote
  blocks that are read every step; naming more keeps cold ones in DRAM.
* ``release()`` / ``prefetch()``: a paused session's blocks may go down now;
  a returning session's come back to DRAM before its next step.
* **Capacity**: ``max_cache_len`` tokens per layer at first. A step that
  needs more (a longer generate, another turn of a chat on the same cache)
  makes a pool of twice the capacity (or what the step needs), copies the
  tokens over and unregisters the old pool, as a DynamicCache grows; size
  ``max_cache_len`` for the whole session to never pay that copy. The batch
  size, head count and dtype are fixed by the first step; after
  ``reset()`` a step with another layout makes a new pool for it.
* ``crop()`` (assisted and prompt-lookup decoding drop rejected draft
  tokens) shortens every layer; the blocks past the new length stop being
  hinted.

Only full-attention decoder layers on the CPU are supported (the pool is host
memory); sliding-window and linear-attention layers are refused at
construction rather than cached wrongly.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from kvtier.client import Client, HintSet, KvtierClientError, Region

PAGE = 4096
DEFAULT_TOKENS_PER_BLOCK = 16


def tokens_per_block(token_bytes: int, wanted: int, page: int = PAGE) -> int:
    """The smallest multiple of the page granule that is >= ``wanted``: a
    block of that many tokens is a whole number of pages."""
    granule = page // math.gcd(page, token_bytes)
    return max(1, -(-max(1, wanted) // granule)) * granule


class KvtierLayer(CacheLayerMixin):
    """One decoder layer's K/V: strided views into the shared pool."""

    is_compileable = False  # returns a growing prefix: shapes change every step
    is_sliding = False
    is_croppable = True  # crop() only moves the length back: the tokens before it are untouched

    def __init__(self, cache: "KvtierCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.length = 0
        self.reads: HintSet | None = None  # the blocks attention reads each step (made with the pool)
        self.read_blocks = 0  # how many: ceil(length / tokens_per_block) at the last step

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = self.cache._layer_views(self.layer_idx, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or not self.length:
            # The first step, or the first after reset() (which may bring another batch size).
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        if end > self.cache.capacity_tokens:
            self.cache._grow(end)
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        self.cache._read(self, end)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.cache.capacity_tokens

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a positive value: keep
        that many, transformers' older form), as DynamicLayer.crop."""
        if tokens_to_remove > 0:
            self.length = min(self.length, tokens_to_remove)
        else:
            self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        if self.is_initialized and self.length:
            self.keys[:, :, : self.length].zero_()
            self.values[:, :, : self.length].zero_()
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:
            n = self.length
            for t in (self.keys, self.values):
                t[:, :, :n].copy_(t[:, :, :n].index_select(0, beam_idx.to(t.device)))


class KvtierCache(Cache):
    """A transformers ``Cache`` whose K/V tensors live in one kvtier pool.

    ``max_cache_len``: tokens per layer of the first pool (a longer
    sequence doubles it, copying the tokens once per doubling).
    ``client``: a connected ``kvtier.client.Client`` (default: a new one on
    ``$KVTIER_SOCKET`` or the system socket, closed with the cache; with no
    daemon there, DaemonUnavailable is raised here).
    ``tokens_per_block``: the block granularity the daemon tracks and moves
    (rounded up to whole pages). ``tier``, ``tenant``, ``priority``,
    ``pinned``, ``constraints``: passed to ``Client.allocate``.
    """

    def __init__(
        self,
        config: Any,
        max_cache_len: int,
        *,
        client: Client | None = None,
        tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
        name: str = "transformers-kv",
        tenant: str = "",
        priority: int = 0,
        tier: str | int = "auto",
        pinned: bool = False,
        constraints: Iterable[str] = (),
    ):
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"KvtierCache supports full-attention layers only; this model also has {other}")
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        super().__init__(layers=[KvtierLayer(self, i) for i in range(len(layer_types))])
        self.capacity_tokens = int(max_cache_len)
        self._own_client = client is None
        self.client = client if client is not None else Client()
        self._wanted_tokens = tokens_per_block
        self._alloc_args = dict(name=name, tenant=tenant, priority=priority, tier=tier, pinned=pinned,
                                constraints=tuple(constraints))
        self.region: Region | None = None
        self.tokens_per_block = 0
        self.blocks_per_layer = 0
        self._storage: torch.Tensor | None = None
        self._shape: tuple[int, int, int, int, torch.dtype] | None = None  # batch, heads, k_dim, v_dim, dtype
        self._blocks: np.ndarray | None = None  # [layer, block] -> region block index

    # -- the pool --------------------------------------------------------

    def _allocate(self, shape: tuple[int, int, int, int, torch.dtype]) -> None:
        batch, heads, k_dim, v_dim, dtype = shape
        itemsize = torch.empty((), dtype=dtype).element_size()
        token_bytes = batch * heads * (k_dim + v_dim) * itemsize
        n = tokens_per_block(token_bytes, self._wanted_tokens)
        per_layer = -(-self.capacity_tokens // n)
        layers = len(self.layers)
        region = self.client.allocate(layers * per_layer * n * token_bytes, n * token_bytes, **self._alloc_args)
        self.region = region
        self.tokens_per_block, self.blocks_per_layer = n, per_layer
        self._storage = torch.frombuffer(region.buffer, dtype=dtype).view(
            layers, per_layer * n, batch, heads, k_dim + v_dim)
        self._shape = (batch, heads, k_dim, v_dim, dtype)
        self._blocks = np.arange(layers * per_layer, dtype=np.uint32).reshape(layers, per_layer)

    def _retire_pool(self) -> None:
        """Send what the layers' hint sets counted, close them and unregister
        the pool (its memory stays valid while tensors use it). A daemon
        that is gone (or refuses) is not the model's failure: it drops the
        region itself once the pool is unmapped or the process exits."""
        for layer in self.layers:
            if layer.reads is not None:
                layer.reads.close()
                layer.reads, layer.read_blocks = None, 0
        if self.region is not None and not self.region.closed:
            try:
                self.region.unregister()
            except KvtierClientError:
                self.region._forget()

    def _grow(self, need: int) -> None:
        """A step needs ``need`` tokens, more than the pool holds: a new pool
        of twice the capacity (at least ``need``), every layer's tokens
        copied into it and its views moved there; the old pool goes."""
        old = self._storage
        self.capacity_tokens = max(need, 2 * self.capacity_tokens)
        old_region = self.region
        self._allocate(self._shape)
        for i, layer in enumerate(self.layers):
            if layer.length:
                self._storage[i, : layer.length].copy_(old[i, : layer.length])
        new_region, self.region = self.region, old_region
        self._retire_pool()
        self.region = new_region
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                layer.keys, layer.values = self._views(i)

    def _views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_dim = self._shape[2]
        s = self._storage[layer]  # [position, batch, head, k_dim + v_dim]
        return s[..., :k_dim].permute(1, 2, 0, 3), s[..., k_dim:].permute(1, 2, 0, 3)

    def _layer_views(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if key_states.device.type != "cpu":
            raise ValueError(f"KvtierCache keeps K/V in host memory; this model runs on {key_states.device}")
        batch, heads, _, k_dim = key_states.shape
        shape = (batch, heads, k_dim, value_states.shape[-1], key_states.dtype)
        if self._storage is not None and shape != self._shape and not any(x.length for x in self.layers):
            # reset() and a new layout (another batch size): a pool for it
            self._retire_pool()
            self.region = self._storage = self._shape = self._blocks = None
        if self._storage is None:
            self._allocate(shape)
        if shape != self._shape:
            raise ValueError(f"layer {layer} has K/V of (batch, heads, k_dim, v_dim, dtype) {shape}; "
                             f"the pool was laid out for {self._shape} by layer 0 "
                             "(reset() the cache to use it for another batch)")
        return self._views(layer)

    def _read(self, layer: KvtierLayer, length: int) -> None:
        """Attention in ``layer`` reads positions 0..length: one read of each
        of those blocks (the layer's hint set changes only when the count of
        blocks does: a new block every tokens_per_block tokens, or a reset)."""
        n = -(-length // self.tokens_per_block)
        have = layer.read_blocks
        if n != have:
            if layer.reads is None:
                layer.reads = self.region.hint_set()
            blocks = self._blocks[layer.layer_idx]
            if n > have:
                layer.reads.extend(blocks[have:n])
            else:
                layer.reads.replace(blocks[:n])
            layer.read_blocks = n
        layer.reads.touch()

    def live_blocks(self) -> np.ndarray:
        """Region block indices that hold tokens now (every layer)."""
        if self._blocks is None:
            return np.zeros(0, dtype=np.uint32)
        n = -(-self.layers[0].length // self.tokens_per_block)
        return self._blocks[:, :n].ravel()

    # -- scheduler hints ---------------------------------------------------

    def release(self) -> int:
        """The session is paused: its blocks may leave DRAM now."""
        return self.region.release(self.live_blocks()) if self.region is not None else 0

    def prefetch(self, *args, **kwargs) -> Any:  # noqa: D401 - Cache.prefetch(layer_idx) is GPU offloading
        """With no arguments: the session resumes, bring its blocks to DRAM
        now. With a layer index: transformers' own offloading prefetch."""
        if args or kwargs:
            return super().prefetch(*args, **kwargs)
        return self.region.prefetch(self.live_blocks()) if self.region is not None else {}

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Unregister the pool (its memory stays valid while tensors use it);
        never raises for a daemon that went away (after the client's
        ``reconnect_timeout`` for one that may be restarting)."""
        self._retire_pool()
        if self._own_client:
            self.client.close()

    def __enter__(self) -> "KvtierCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
