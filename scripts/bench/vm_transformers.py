#!/usr/bin/env python3
"""A real transformers model decoding from KvtierCache in the QEMU guest while
kvtierd places its KV blocks on node 0 (DRAM), node 1 (far), node 2 (CXL) and
swap in turn: token ids against an untiered run, per-token latency per
placement.

    flock /tmp/kvtier-vm.lock .venv/bin/python scripts/bench/vm_transformers.py [--tokens 6] [--json FILE]

On the host this boots the guest (scripts/vm/run.py) and runs itself there
with --in-guest (torch and transformers come from the repository's .venv,
which the guest sees over 9p: nothing is downloaded); the host prints the
table of docs/benchmarks.md ("transformers in the guest").

The model is tests/host/test_transformers.py's tiny random Llama (config
only, fixed seed: 4 layers, hidden 128, 4 KV heads of 32, fp32, so 1 KiB of
K+V per token per layer, 16 tokens per 16 KiB block), one torch thread. A
64-token prompt, then --tokens new tokens per placement, greedy, in ONE
generate call:

  untiered  transformers' StaticCache, no kvtierd (the reference tokens)
  dram      KvtierCache, its region pinned to the DRAM tier (node 0)
  far       pinned to the far tier: the daemon moves the blocks to node 1
  cxl       pinned to the CXL tier: node 2, the emulated CXL type-3 device
  swap      unpinned, every block with tokens paged out (``migrate`` to the
            swap tier); the next step faults them back in

Between placements decoding waits (a streamer callback) until the daemon
reports every block holding tokens in the new tier and the kernel agrees
(move_pages for nodes, /proc/self/pagemap for swap); that wait is not in the
latencies. Latency = time from one token to the next. The token ids of the
tiered run must equal the untiered run's (exit status 1 otherwise).

What TCG can and cannot show: QEMU emulates no NUMA latency (node 0 and
node 1 are the same host RAM), so far ~ dram here; CXL type-3 memory is
emulated access by access (slow, as on no real machine); swap is the
first-step fault-in cost. Keep --tokens small: the CXL steps are slow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tinyllama (the transformers tests' model)
sys.path.insert(0, str(REPO / "tests" / "vm"))  # vmhelpers (GuestKvtierd, scaled waits)
sys.path.insert(0, str(REPO / "scripts" / "vm"))  # guestjob

import guestjob  # noqa: E402

PROMPT = 64
PLACEMENTS = ("dram", "far", "cxl", "swap")
PM_SWAP, PM_PRESENT = 1 << 62, 1 << 63


# -- guest side --------------------------------------------------------------------


def guest_main(args) -> None:
    t0 = time.monotonic()
    import torch
    from transformers import StaticCache
    from transformers.generation.streamers import BaseStreamer

    from kvtier.integrations.transformers import KvtierCache
    from kvtier.kernel import native
    import tinyllama
    import vmhelpers

    import_s = time.monotonic() - t0
    torch.set_num_threads(1)
    page = native.PAGE_SIZE

    class Steps(BaseStreamer):
        """Times each new token; runs ``actions[n]`` once n tokens exist,
        and starts the next token's clock only after it."""

        def __init__(self, actions=None):
            self.actions = dict(actions or {})
            self.seen = -1  # the first put() is the prompt
            self.times: list[float] = []

        def put(self, value):
            self.seen += 1
            act = self.actions.pop(self.seen, None)
            if act is not None:
                act()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model, prompt = tinyllama.tiny_llama(PROMPT, max_positions=512)
    cfg = model.config
    per = args.tokens
    placements = args.placements
    new = 1 + per * len(placements)  # token 1 comes from the prefill
    total = PROMPT + new

    def generate(cache, steps):
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 past_key_values=cache, streamer=steps)
        return out[0, PROMPT:].tolist(), np.diff(np.array(steps.times[1:])) * 1e3  # ms per token after the first

    ref_steps = Steps()
    reference, ref_gaps = generate(StaticCache(config=cfg, max_cache_len=total), ref_steps)

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vm-tf-"))
    d = vmhelpers.GuestKvtierd(tmp, "[metrics]\nenabled = false\n", daemon={"tick_interval": 0.2},
                               name="vm_transformers")
    out = {"kernel": os.uname().release, "torch": torch.__version__, "prompt": PROMPT, "tokens_per_placement": per,
           "import_s": round(import_s, 1), "slowness": vmhelpers.slowness(),
           "untiered": stats(ref_gaps), "placements": {}}
    try:
        c = d.client
        tiers = {t["kind"]: t for t in c.request("tiers")["tiers"]}
        cache = KvtierCache(cfg, max_cache_len=total, client=c, name="tiny-llama")
        where: dict[str, dict] = {}

        def kernel_view(live: np.ndarray) -> dict:
            r = cache.region
            addrs = (np.uint64(r.start) + np.repeat(live.astype(np.uint64) * np.uint64(r.block_size),
                                                      r.block_size // page)
                     + np.tile(np.arange(0, r.block_size, page, dtype=np.uint64), live.size))
            nodes = native.move_pages(os.getpid(), addrs, None)
            with open("/proc/self/pagemap", "rb") as f:
                pm = np.frombuffer(b"".join(os.pread(f.fileno(), 8, int(a) // page * 8) for a in addrs), "<u8")
            vals, counts = np.unique(nodes[nodes >= 0], return_counts=True)
            # "pages": the ones that exist (present or swapped); a block's
            # tail pages stay untouched until tokens are written there.
            swapped = int(((pm & PM_SWAP) != 0).sum())
            return {"pages": int(counts.sum()) + swapped, "nodes": {int(v): int(n) for v, n in zip(vals, counts)},
                    "swapped": swapped}

        def place(kind: str):
            def act():
                live = cache.live_blocks()
                tier = tiers[kind]
                t_req = time.monotonic()
                # The operator's move now, and (but for swap, which the next
                # step reads back) a pin that keeps later blocks there too.
                c.request("unpin", region=cache.region.id)
                c.request("migrate", region=cache.region.id, tier=tier["index"],
                          blocks=live.astype("<u4").tobytes())
                if kind == "swap":
                    want = lambda k: k["pages"] > 0 and k["swapped"] == k["pages"]  # noqa: E731
                else:
                    c.request("pin", region=cache.region.id, tier=tier["index"])
                    node = tier["nodes"][0]
                    want = lambda k: k["pages"] > 0 and k["nodes"].get(node, 0) == k["pages"]  # noqa: E731
                vmhelpers.wait_for(lambda: (cache.region.query()[live] == tier["index"]).all(),
                                   f"kvtierd to report the blocks in {kind}", timeout=120, interval=0.05)
                vmhelpers.wait_for(lambda: want(kernel_view(live)), f"the kernel to show the pages in {kind}",
                                   timeout=60, interval=0.05)
                where[kind] = {"blocks": int(live.size), "move_s": round(time.monotonic() - t_req, 2),
                               "kernel_before": kernel_view(live)}
            return act

        steps = Steps({1 + i * per: place(k) for i, k in enumerate(placements)})
        tokens, gaps = generate(cache, steps)
        for i, kind in enumerate(placements):
            g = gaps[i * per:(i + 1) * per]  # the steps after the placement
            out["placements"][kind] = {**stats(g), "first_ms": round(float(g[0]), 1),
                                       "untiered_same_steps": stats(ref_gaps[i * per:(i + 1) * per]),
                                       **where.get(kind, {})}
        out["kernel_after"] = kernel_view(cache.live_blocks())
        out["identical"] = tokens == reference
        out["distinct_tokens"] = len(set(reference))
        st = c.stats()
        out["daemon_migrations"] = st["migrations"]
        cache.close()
    finally:
        d.stop()
    Path(args.out).write_text(json.dumps(out, indent=1))


def stats(gaps: np.ndarray) -> dict:
    g = np.asarray(gaps, dtype=float)
    return {"p50_ms": round(float(np.percentile(g, 50)), 1), "max_ms": round(float(g.max()), 1), "n": int(g.size)}


# -- host side -------------------------------------------------------------------------


def table(res: dict) -> str:
    rows = ["| placement | steps | p50 ms/token | first step ms | max ms | untiered p50, same steps | "
            "pages where the kernel found them |",
            "|---|---|---|---|---|---|---|"]
    u = res["untiered"]
    rows.append(f"| untiered (StaticCache, no kvtierd) | {u['n']} | {u['p50_ms']} | - | {u['max_ms']} | - | "
                "malloc heap |")
    for kind, p in res["placements"].items():
        k = p.get("kernel_before", {})
        seen = ", ".join(f"node {n}: {c}" for n, c in k.get("nodes", {}).items())
        if k.get("swapped"):
            seen = ", ".join(filter(None, [seen, f"swap: {k['swapped']}"]))
        rows.append(f"| {kind} | {p['n']} | {p['p50_ms']} | {p['first_ms']} | {p['max_ms']} | "
                    f"{p['untiered_same_steps']['p50_ms']} | "
                    f"{seen} of {k.get('pages', 0)} ({p.get('blocks', 0)} blocks, placed in {p.get('move_s')} s) |")
    return "\n".join(rows)


def host_main(args) -> int:
    res = guestjob.run(Path(__file__).resolve(), ["--tokens", str(args.tokens), "--placements", *args.placements],
                       "transformers.json", timeout=900, save=args.json)
    print(f"guest kernel {res['kernel']}, torch {res['torch']}, import {res['import_s']} s, slowness "
          f"{res['slowness']:.2f}; prompt {res['prompt']} tokens, {res['tokens_per_placement']} tokens per placement")
    print(table(res))
    print(f"token ids identical to the untiered run: {res['identical']} ({res['distinct_tokens']} distinct); "
          f"daemon migrations (from:to blocks): {res['daemon_migrations']}")
    return 0 if res["identical"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=6, help="new tokens decoded per placement")
    ap.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS),
                    help="tiers to decode from, in this order")
    guestjob.add_args(ap)
    args = ap.parse_args()
    if args.in_guest:
        guest_main(args)
        return 0
    return host_main(args)


if __name__ == "__main__":
    sys.exit(main())
