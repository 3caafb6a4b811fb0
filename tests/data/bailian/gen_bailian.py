#!/usr/bin/env python3
"""A small Qwen-Bailian-format request trace, deterministic from its seed.

One JSON object per line, sorted by arrival: ``chat_id``, ``parent_chat_id``
(-1, or an earlier chat whose ``hash_ids`` this turn extends), ``timestamp``
(seconds), ``input_length`` (16 tokens per hash id), ``output_length``,
``hash_ids``, ``turn``, ``type``. Arrivals are Poisson; each request brings
``--new-min``..``--new-max`` new 16-token blocks after its parent's prefix
and generates ``--out-min``..``--out-max`` tokens. No real Bailian file is on
this machine: the shape (continuous arrivals, half the turns reusing an
earlier prefix, short outputs) is what the simulator's oracle is tested on,
not a claim about Alibaba's traffic.

    python3 tests/data/bailian/gen_bailian.py -o tests/data/bailian/small.jsonl --requests 120 --seed 7
"""

from __future__ import annotations

import argparse
import json
import random

BLOCK_TOKENS = 16


def generate(requests: int, rate: float, seed: int, new_min: int, new_max: int,
             out_min: int, out_max: int, p_child: float) -> list[dict]:
    rng = random.Random(seed)
    t = 0.0
    next_hash = 1
    out: list[dict] = []
    for cid in range(requests):
        t += rng.expovariate(rate)
        parent = out[rng.randrange(len(out))] if out and rng.random() < p_child else None
        new = rng.randint(new_min, new_max)
        hashes = (list(parent["hash_ids"]) if parent else []) + list(range(next_hash, next_hash + new))
        next_hash += new
        out.append({
            "chat_id": cid,
            "parent_chat_id": parent["chat_id"] if parent else -1,
            "timestamp": round(t, 3),
            "input_length": BLOCK_TOKENS * len(hashes),
            "output_length": rng.randint(out_min, out_max),
            "hash_ids": hashes,
            "turn": parent["turn"] + 1 if parent else 1,
            "type": "text",
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--new-min", type=int, default=20)
    ap.add_argument("--new-max", type=int, default=200)
    ap.add_argument("--out-min", type=int, default=10)
    ap.add_argument("--out-max", type=int, default=400)
    ap.add_argument("--p-child", type=float, default=0.5, help="share of turns that extend an earlier chat")
    a = ap.parse_args()
    recs = generate(a.requests, a.rate, a.seed, a.new_min, a.new_max, a.out_min, a.out_max, a.p_child)
    with open(a.out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
