#!/usr/bin/env python3
"""Per-token decode latency of a transformers model: its own cache against
``KvtierCache`` under a real kvtierd, and the cost of a pause/resume through
swap (release, then prefetch) in the middle of decoding.

The model is a random-initialised Llama (config only, nothing downloaded),
larger than the CI test's so a step costs what a small real model's does on
a CPU: 8 layers, hidden 512, 8 KV heads of 64, fp32: 4 KiB of K+V per token
per layer, 16 tokens per block (64 KiB blocks). One torch thread.

Runs, each ``--tokens`` new tokens after a 64-token prompt, greedy:
  * ``dynamic``: transformers' DynamicCache (the default);
  * ``static``: transformers' StaticCache;
  * ``kvtier``: KvtierCache, the daemon hinting and measuring;
  * ``kvtier+swap``: KvtierCache, and halfway through the session is
    released (its blocks go to swap) and prefetched back before the next
    step; reports the release and the prefetch (request to residency).

Token ids must be identical in all runs (checked). Prints p50/p90/max of
the per-token latency (ms) per run.

    sudo .venv/bin/python scripts/bench/transformers_tokens.py [--tokens 200] [--json out.json]

Needs root for the swap file (created and removed if no swap is active) and
for kvtierd's pageout of this process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.generation.streamers import BaseStreamer

from kvtier.client import Client
from kvtier.integrations.transformers import KvtierCache

PROMPT = 64


class Clock(BaseStreamer):
    def __init__(self, at_half=None, half=0):
        self.times: list[float] = []
        self.at_half, self.half = at_half, half

    def put(self, value):
        self.times.append(time.perf_counter())
        if self.at_half is not None and len(self.times) == self.half + 1:
            self.at_half()

    def end(self):
        pass


def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def decode(m, prompt, n, cache, streamer):
    with torch.no_grad():
        out = m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         past_key_values=cache, streamer=streamer)
    gaps = np.diff(np.array(streamer.times[1:])) * 1e3  # ms per token after the first
    return out[0, PROMPT:].tolist(), gaps


def summary(gaps: np.ndarray) -> dict:
    return {"p50_ms": float(np.percentile(gaps, 50)), "p90_ms": float(np.percentile(gaps, 90)),
            "max_ms": float(gaps.max()), "tokens": int(gaps.size + 1)}


def ensure_swap(tmp: str) -> str | None:
    with open("/proc/swaps") as f:
        if len(f.read().splitlines()) > 1:
            return None
    path = os.path.join(tmp, "swap")
    subprocess.run(["fallocate", "-l", "512M", path], check=True)
    os.chmod(path, 0o600)
    subprocess.run(["mkswap", path], check=True, capture_output=True)
    subprocess.run(["swapon", path], check=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = model()
    prompt = torch.randint(0, 2048, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    total = PROMPT + a.tokens
    results, tokens = {}, {}
    tokens["dynamic"], g = decode(m, prompt, a.tokens, DynamicCache(config=m.config), Clock())
    results["dynamic"] = summary(g)
    tokens["static"], g = decode(m, prompt, a.tokens, StaticCache(config=m.config, max_cache_len=total), Clock())
    results["static"] = summary(g)

    tmp = tempfile.mkdtemp(prefix="kvtier-tf-bench-")
    swap = ensure_swap(tmp)
    sock = os.path.join(tmp, "kvtierd.sock")
    conf = os.path.join(tmp, "kvtierd.toml")
    with open(conf, "w") as f:
        f.write(textwrap.dedent(f"""\
            [daemon]
            socket = "{sock}"
            state_file = ""
            [metrics]
            enabled = false
            """))
    daemon = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", conf],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        with Client(sock) as c:
            cache = KvtierCache(m.config, max_cache_len=total, client=c)
            tokens["kvtier"], g = decode(m, prompt, a.tokens, cache, Clock())
            results["kvtier"] = summary(g)
            cache.close()

            swap_idx = next(t["index"] for t in c.request("tiers")["tiers"] if t["kind"] == "swap")
            cache = KvtierCache(m.config, max_cache_len=total, client=c)
            pause = {}

            def pause_resume():
                live = cache.live_blocks()
                while (cache.region.query()[live] < 0).any():
                    time.sleep(0.01)
                t0 = time.perf_counter()
                cache.release()
                while not (cache.region.query()[live] == swap_idx).all():
                    time.sleep(0.001)
                pause["release_s"] = time.perf_counter() - t0
                pause["bytes"] = int(live.size * cache.region.block_size)
                pause["prefetch_s"] = cache.region.prefetch(live, wait=True)["seconds"]

            clock = Clock(pause_resume, a.tokens // 2)
            tokens["kvtier+swap"], g = decode(m, prompt, a.tokens, cache, clock)
            # the step that waited for the pause is not decode latency
            g = np.delete(g, a.tokens // 2 - 1)
            results["kvtier+swap"] = {**summary(g), **pause}
            cache.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        if swap:
            subprocess.run(["swapoff", swap], check=False)
        subprocess.run(["rm", "-rf", tmp], check=False)
    same = all(t == tokens["dynamic"] for t in tokens.values())
    for name, r in results.items():
        extra = ""
        if "prefetch_s" in r:
            extra = (f"  pause: release {r['release_s'] * 1e3:.1f} ms, prefetch {r['prefetch_s'] * 1e3:.1f} ms "
                     f"for {r['bytes'] >> 20} MiB")
        print(f"{name:12s} p50 {r['p50_ms']:6.2f} ms  p90 {r['p90_ms']:6.2f} ms  max {r['max_ms']:7.2f} ms{extra}")
    print(f"token ids identical in all runs: {same}")
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "identical": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
