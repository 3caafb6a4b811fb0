"""A real transformers model decoding from a kvtier cache while the real
kvtierd moves the cache's blocks to swap and back.

A tiny random Llama (config only: nothing is downloaded; fixed seed; an init
range wide enough that greedy decoding does not settle on one token)
generates the same tokens with ``KvtierCache`` as with transformers' own
cache, while the daemon pages the KV blocks out (process_madvise
MADV_PAGEOUT) and back in, and the kernel's /proc/self/pagemap shows the
pages really left memory and came back.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyllama  # noqa: E402
import waiting  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from test_daemon import DaemonProc, workdir  # noqa: E402,F401  (fixture)

from kvtier.integrations.transformers import KvtierCache, tokens_per_block  # noqa: E402

pytestmark = pytest.mark.root

PROMPT, NEW = 16, 120
PAGE = os.sysconf("SC_PAGE_SIZE")
PM_SWAP, PM_PRESENT = 1 << 62, 1 << 63
wait_for = functools.partial(waiting.wait_for, timeout=30.0, interval=0.01)


def tiny_llama():
    return tinyllama.tiny_llama(PROMPT)


def generate(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)[0, PROMPT:]


def pagemap(start: int, length: int) -> np.ndarray:
    with open("/proc/self/pagemap", "rb") as f:
        raw = os.pread(f.fileno(), 8 * (length // PAGE), (start // PAGE) * 8)
    return np.frombuffer(raw, dtype="<u8")


def block_pages(cache: KvtierCache, blocks: np.ndarray) -> np.ndarray:
    """pagemap entries of the given region blocks, one row per block."""
    r = cache.region
    pm = pagemap(r.start, r.length).reshape(r.nblocks, r.block_size // PAGE)
    return pm[blocks]


class OnToken(BaseStreamer):
    """Calls ``actions[n]`` once n new tokens exist (generate is paused meanwhile)."""

    def __init__(self, actions):
        self.actions = dict(actions)
        self.seen = -PROMPT  # the first put() is the prompt

    def put(self, value):
        self.seen += int(value.numel()) if self.seen < 0 else 1
        act = self.actions.pop(self.seen, None)
        if act is not None:
            act()

    def end(self):
        pass


def test_pool_layout_is_whole_pages():
    # 4 heads x (64 + 64) x fp32 = 2 KiB per token: 2 tokens per page.
    assert tokens_per_block(2048, 16) == 16
    assert tokens_per_block(2048, 1) == 2
    # 3000 bytes per token (gcd with 4096 is 8): only multiples of 512 tokens fill whole pages.
    assert tokens_per_block(3000, 16) == 512
    assert (tokens_per_block(3000, 16) * 3000) % 4096 == 0


def test_generate_with_kvtier_cache_while_blocks_go_to_swap_and_back(swapfile, workdir):
    torch.set_num_threads(1)
    model, prompt = tiny_llama()
    reference = generate(model, prompt)
    assert len(set(reference.tolist())) > NEW // 4, "greedy decoding repeats itself: widen initializer_range"

    # swap is on before start: the daemon has a swap tier. The blocks move
    # by the engine's ops here (release, prefetch, migrate) and by the
    # kernel's faults; the policy's own promotions are held off: a block
    # the operator's migrate sent to swap may come back at the next tick
    # (docs/protocol.md, migrate), 50 ms here, and the check that they all
    # reached swap first then raced it (fresh-clone CI, 2026-12-08: 30 s
    # without seeing them all there at once).
    d = DaemonProc(workdir, args=("--set", "policy.promote_temp=1e9")).start()
    try:
        with d.client() as c:
            tiers = c.request("tiers")["tiers"]
            swap = next(t["index"] for t in tiers if t["kind"] == "swap")
            cache = KvtierCache(model.config, max_cache_len=PROMPT + NEW, client=c, name="tiny-llama")
            seen = {}

            def tiers_of(blocks):
                return cache.region.query()[blocks]

            def pause_and_resume():
                # The session pauses: every block holding tokens now, in every
                # layer, may go down (DRAM's next tier here is swap).
                live = cache.live_blocks()
                seen["out"] = live
                # at once, measured or not: the blocks the last steps wrote
                # are queued too (they were `skipped` before they were measured)
                assert cache.release() == {"queued": live.size, "already": 0, "skipped": 0}
                wait_for(lambda: (tiers_of(live) == swap).all(), "daemon reports the blocks in swap")
                pm = block_pages(cache, live)
                # The kernel agrees: the pages are swap entries, not in memory.
                assert not (pm & PM_PRESENT).any() and (pm & PM_SWAP).all(), "pages not swapped out"
                # It resumes: the daemon brings them back before the next step.
                r = cache.region.prefetch(live, wait=True)
                assert r["queued"] == live.size and r["seconds"] > 0
                pm = block_pages(cache, live)
                assert (pm & PM_PRESENT).all() and not (pm & PM_SWAP).any(), "pages not back in memory"

            def out_and_read():
                # Out again (an operator's move), and this time decoding
                # itself faults the pages back in.
                live = cache.live_blocks()
                seen["read"] = live
                c.request("migrate", region=cache.region.id, tier=swap, blocks=live.astype("<u4").tobytes())
                wait_for(lambda: (tiers_of(live) == swap).all(), "blocks in swap before reading on")
                assert (block_pages(cache, live) & PM_SWAP).all()

            got = generate(model, prompt, past_key_values=cache,
                           streamer=OnToken({40: pause_and_resume, 80: out_and_read}))
            assert "out" in seen and "read" in seen, "the streamer never reached its moves"
            assert got.tolist() == reference.tolist()
            # The blocks read after the second page-out are resident again.
            assert (block_pages(cache, seen["read"]) & PM_PRESENT).all()

            c.flush()
            st = c.stats()
            # (from "unknown": released before the daemon had measured them)
            moved_out = st["migrations"].get(f"0:{swap}", 0) + st["migrations"].get(f"-1:{swap}", 0)
            moved_in = st["migrations"].get(f"{swap}:0", 0)
            assert moved_out >= seen["out"].size + seen["read"].size
            assert moved_in >= seen["out"].size
            out_bytes = st["migrated_bytes"].get(f"0:{swap}", 0) + st["migrated_bytes"].get(f"-1:{swap}", 0)
            assert out_bytes >= moved_out * cache.region.block_size
            # Both scheduler hints were timed from request to residency.
            assert st["release_seconds_hist"]["count"] == seen["out"].size
            assert st["prefetch_seconds_hist"]["count"] == seen["out"].size
            # Every step hinted exactly the blocks attention read: per layer,
            # ceil(length / tokens per block) blocks at each of its lengths.
            n = cache.tokens_per_block
            lengths = np.r_[PROMPT, PROMPT + np.arange(1, NEW)]
            expect = int(np.sum(-(-lengths // n))) * len(cache.layers)
            region = next(r for r in c.request("regions")["regions"] if r["id"] == cache.region.id)
            assert region["block_hints"] == expect
            assert region["placement"]["tier_name"] == tiers[0]["name"]
            cache.close()
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()


def test_cache_grows_crops_and_takes_a_new_batch_after_reset(workdir):
    """What a DynamicCache allows, KvtierCache allows: a generate longer than
    max_cache_len (the pool doubles, the tokens are copied, the old pool is
    unregistered), assisted/prompt-lookup decoding (crop, which raised
    AttributeError), and a reset cache reused for another batch size (which
    failed with a tensor size mismatch deep in attention). The tokens are
    transformers' own in each case."""
    torch.set_num_threads(1)
    model, _ = tiny_llama()
    batch = torch.randint(0, 512, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    d = DaemonProc(workdir).start()
    try:
        with d.client() as c:
            cache = KvtierCache(model.config, max_cache_len=PROMPT, client=c)
            got = generate(model, batch, past_key_values=cache, attention_mask=torch.ones_like(batch))
            assert got.tolist() == generate(model, batch, attention_mask=torch.ones_like(batch)).tolist()
            assert cache.capacity_tokens >= PROMPT + NEW - 1
            listed = list(c.regions())
            assert [r["id"] for r in listed] == [cache.region.id]  # the outgrown pools are gone
            c.flush()
            assert next(iter(c.regions()))["block_hints"] > 0  # the new pool is hinted

            cache.reset()  # the same cache, three sequences now
            three = torch.randint(0, 512, (3, PROMPT), generator=torch.Generator().manual_seed(3))
            got = generate(model, three, past_key_values=cache, attention_mask=torch.ones_like(three))
            assert got.tolist() == generate(model, three, attention_mask=torch.ones_like(three)).tolist()
            assert [r["id"] for r in c.regions()] == [cache.region.id]
            cache.close()

            # Prompt lookup proposes draft tokens from the prompt and crops the rejected ones.
            repetitive = torch.arange(PROMPT).remainder(5).unsqueeze(0)
            lookup = KvtierCache(model.config, max_cache_len=PROMPT + NEW, client=c)
            got = generate(model, repetitive, past_key_values=lookup, prompt_lookup_num_tokens=3)
            assert got.tolist() == generate(model, repetitive).tolist()
            assert lookup.get_seq_length() == PROMPT + NEW - 1
            lookup.close()
            assert c.flush() == []
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()


def test_generate_and_close_survive_the_daemon_going_away(workdir):
    """kvtier is advisory: a daemon stopped in the middle of generate costs
    the model nothing (the hints queue), and closing the cache afterwards
    neither raises nor waits more than the client's reconnect_timeout once
    (before, close() raised DaemonUnavailable, out of a ``with`` block too,
    and left its own client open)."""
    import time

    from kvtier.client import Client

    torch.set_num_threads(1)
    model, prompt = tiny_llama()
    reference = generate(model, prompt)
    d = DaemonProc(workdir).start()
    try:
        c = Client(d.sock, reconnect_timeout=0.5)
        with KvtierCache(model.config, max_cache_len=PROMPT + NEW, client=c) as cache:
            got = generate(model, prompt, past_key_values=cache, streamer=OnToken({20: d.stop}))
            assert got.tolist() == reference.tolist()
            t0 = time.monotonic()
            cache.close()
            assert time.monotonic() - t0 < 5
            assert cache.region.closed
        # leaving the block closed it again: nothing raised, nothing waited
        c.close()
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.read_log(), d.read_log()
