#!/usr/bin/env python3
"""move_pages of a hot set while its reader reads it (QEMU guest): one
thread against several, wall time.

    flock /tmp/kvtier-vm.lock .venv/bin/python scripts/bench/vm_move_under_reader.py [--rounds 4]

On the host this boots the guest (scripts/vm/run.py) and runs itself there
with --in-guest. A stand-in inference process (tests/kvchild.py) holds a
64 MiB pool of 4 KiB pages; a thread of its own reads the first 32 MiB (a
byte per page, as fast as it can: ``read``). The 32 MiB are moved from the
far node 1 to node 0 and back, each move timed in wall time (the guest's
clock), with the page addresses cut into 1, 2, ... equal parts, each part
one move_pages call on its own thread (cffi releases the GIL): the question
is whether a move from beside a reader is bound by one vCPU. The thread
counts alternate within each round so neither gets the quieter host.
Placement is checked after every move.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "daemon"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts" / "vm"))

MiB = 1 << 20
POOL = 64 * MiB
HOT = 32 * MiB
DRAM, FAR = 0, 1


def guest(rounds: int, threads: list[int], reader: bool) -> dict:
    from kvchild import KVChild
    from kvtier.kernel import native

    import speed

    page = native.PAGE_SIZE
    child = KVChild(POOL)
    pool = child.addr + np.arange(POOL // page, dtype=np.uint64) * np.uint64(page)
    hot = pool[: HOT // page]
    native.move_pages(child.pid, pool, FAR)
    if reader:
        assert child.ask(f"read 0 {HOT}").startswith("ok")
    times: dict[int, list[float]] = {n: [] for n in threads}
    pool_ex = ThreadPoolExecutor(max(threads))
    try:
        for r in range(rounds):
            order = threads if r % 2 == 0 else threads[::-1]
            for n in order:
                for node in (DRAM, FAR):
                    parts = np.array_split(hot, n)
                    t0 = time.monotonic()
                    sts = list(pool_ex.map(lambda a: native.move_pages(child.pid, a, node), parts))
                    dt = time.monotonic() - t0
                    st = native.move_pages(child.pid, hot, None)
                    moved = float((st == node).mean())
                    if node == DRAM:
                        times[n].append(round(dt, 4))
                    print(f"round {r} threads {n} to {node}: {dt:.3f} s, {moved:.3f} on node "
                          f"({sum(int((s == node).sum()) for s in sts)} pages said so)", flush=True)
        passes = child.ask("stop") if reader else ""
    finally:
        pool_ex.shutdown()
        child.close()
    return {"slowness": speed.current(), "reader": reader, "passes": passes,
            "seconds_to_dram": {str(n): v for n, v in times.items()},
            "mib_per_s_median": {str(n): round(HOT / MiB / float(np.median(v)), 1) for n, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-reader", action="store_true", help="move with nothing reading the pages")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the guest's result here too")
    args = ap.parse_args()
    if args.in_guest:
        res = guest(args.rounds, args.threads, not args.no_reader)
        out = Path(os.environ.get("KVTIER_SHARE", "/mnt/kvtier")) / "move_under_reader.json"
        out.write_text(json.dumps(res))
        print(json.dumps(res, indent=1))
        return
    import tempfile

    share = Path(tempfile.mkdtemp(prefix="kvtier-vm-mur-"))
    cmd = [sys.executable, str(REPO / "scripts/vm/run.py"), "--share", str(share), "--",
           sys.executable, str(Path(__file__).resolve()), "--in-guest", "--rounds", str(args.rounds),
           "--threads", *map(str, args.threads)] + (["--no-reader"] if args.no_reader else [])
    rc = subprocess.run(cmd).returncode
    res_file = share / "move_under_reader.json"
    if rc != 0 or not res_file.exists():
        raise SystemExit(f"guest run failed ({rc}); see {share}/console.log")
    res = json.loads(res_file.read_text())
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
