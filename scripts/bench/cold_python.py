#!/usr/bin/env python3
"""What a few lines of Python cost with cold caches: the hint path's case.

    .venv/bin/python scripts/bench/cold_python.py [--calls 3000]
    flock /tmp/kvtier-vm.lock scripts/vm/run.py -- .venv/bin/python scripts/bench/cold_python.py

Between two decode steps an engine reads its KV cache; a hint call then
runs with cold caches. Here each timed snippet follows a read of one byte
per page of 32 MiB (the guest comparison's hot set, vm_tiering_compare.py)
and is timed between two clock reads; "nothing" is the two reads alone.
Prints p50 and mean in microseconds: a six-operation float expression, the
same in ints, a clock read and its comparison with a deadline, the clock
alone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    pool = np.zeros(32 << 20, np.uint8)
    pc = time.perf_counter

    class State:
        pass

    o = State()
    o.lf, o.li, o.t, o.lt = 1000.123, 1_000_123_456_789, 5000, 4968
    o.sent_f, o.sent_i, o.iv_i = 999.99, 999_990_000_000, 200_000_000

    def floats():
        now, iv = 1000.2, 0.2
        wait = min(o.sent_f + iv - now, iv / 4)
        span = now - o.lf
        return int((o.t - o.lt) * wait / span) + 1

    def ints():
        now, iv = 1_000_200_000_000, o.iv_i
        wait = min(o.sent_i + iv - now, iv >> 2)
        span = now - o.li
        return (o.t - o.lt) * wait // span + 1

    def compare():
        return time.monotonic() < o.sent_f

    snippets = {"float expression": floats, "int expression": ints, "clock and compare": compare,
                "clock": time.monotonic, "empty call": lambda: None}
    res: dict[str, list[float]] = {k: [] for k in ("nothing", *snippets)}
    for _ in range(args.calls):
        pool[::4096] += 1
        t0 = pc()
        t1 = pc()
        res["nothing"].append(t1 - t0)
        for name, f in snippets.items():
            pool[::4096] += 1
            t0 = pc()
            f()
            t1 = pc()
            res[name].append(t1 - t0)
    for name, v in res.items():
        us = np.array(v) * 1e6
        print(f"{name:18s} p50 {np.median(us):7.1f} us  mean {us.mean():7.1f} us")


if __name__ == "__main__":
    main()
