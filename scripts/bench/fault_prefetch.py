#!/usr/bin/env python3
"""Prefetch on major faults: a sequential reader of a swapped pool, with and
without hotness.perf_fault.prefetch_blocks (root, a swap device).

    .venv/bin/python scripts/bench/fault_prefetch.py [--mib 64] [--prefetch 0,4] [--think 0.2]
    scripts/vm/run.py -- .venv/bin/python scripts/bench/fault_prefetch.py     # in the QEMU guest

For each prefetch_blocks value: a real kvtierd (perf_fault its only hotness
source, a tick every 50 ms) and a stand-in inference process
(tests/kvchild.py) whose pool is put in swap with nothing left in the swap
cache (kvchild.page_out). The pool is registered and measured in swap, then
the process reads it block by block in order, one byte per page, pausing
--think seconds after each block (a decode step's compute). Reported per
value: the reader's major faults during the scan (/proc/PID/stat), the
blocks the daemon paged in ahead (fault_prefetch_blocks_total), the blocks
it paged in in all, and the scan's wall time. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvchild import KVChild, page_out  # noqa: E402
from protocol_bench import wait_ready  # noqa: E402

from kvtier.client import Client  # noqa: E402

BLOCK = 2 << 20


def majflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])


def wait(pred, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"fault_prefetch: timed out waiting for {what}")
        time.sleep(0.05)


def one(prefetch: int, mib: int, think: float, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-prefetch-")
    sock, log = os.path.join(work, "kvtierd.sock"), os.path.join(work, "log")
    cfg = os.path.join(work, "kvtierd.toml")
    with open(cfg, "w") as f:
        f.write(f'[daemon]\nsocket = "{sock}"\nstate_file = ""\ntick_interval = 0.05\n'
                "[hotness.damon]\nenabled = false\n[hotness.access_bits]\nenabled = false\n"
                f"[hotness.perf_fault]\nprefetch_blocks = {prefetch}\n[metrics]\nenabled = false\n")
    daemon = wait_ready(subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", cfg],
                                         stderr=open(log, "w")), sock, log, timeout)
    try:
        with KVChild(mib << 20) as child, Client(sock, name="fault_prefetch") as c:
            swap = next(t["index"] for t in c.request("tiers")["tiers"] if t["kind"] == "swap")
            page_out(child)
            region = c.register(addr=child.addr, length=child.size, block_size=BLOCK, name="pool", pid=child.pid)
            c.request("measure", region=region.id, blocks=None)
            wait(lambda: (region.query() == swap).all(), "the pool measured in swap", timeout)
            n = c.status()["engine"]["sources"]["perf_fault"]["collects"]
            wait(lambda: c.status()["engine"]["sources"]["perf_fault"]["collects"] >= n + 2,
                 "the perf source to follow the reader", timeout)
            st0 = c.stats()
            before = majflt(child.pid)
            t0 = time.monotonic()
            for b in range(child.size // BLOCK):
                assert child.ask(f"touch {b * BLOCK} {BLOCK}").startswith("ok")
                time.sleep(think)
            seconds = time.monotonic() - t0
            faults = majflt(child.pid) - before
            st1 = c.stats()
            pagein = sum(v for k, v in st1["migrations"].items() if k.startswith(f"{swap}:")) - \
                sum(v for k, v in st0["migrations"].items() if k.startswith(f"{swap}:"))
            return {"prefetch_blocks": prefetch, "blocks": child.size // BLOCK, "major_faults": faults,
                    "prefetched_blocks": st1["fault_prefetch_blocks_total"] - st0["fault_prefetch_blocks_total"],
                    "paged_in_blocks": pagein, "scan_s": round(seconds, 2)}
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout)
        subprocess.run(["rm", "-rf", work], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="pool size")
    ap.add_argument("--prefetch", default="0,4", help="prefetch_blocks values to compare")
    ap.add_argument("--think", type=float, default=0.2, help="seconds between blocks")
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    with open("/proc/sys/vm/page-cluster") as f:
        cluster = int(f.read())
    out = {"kernel": os.uname().release, "in_vm": os.environ.get("KVTIER_IN_VM") == "1",
           "page_cluster": cluster, "mib": a.mib, "think_s": a.think,
           "runs": [one(int(k), a.mib, a.think, a.timeout) for k in a.prefetch.split(",")]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
