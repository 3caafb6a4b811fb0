#!/usr/bin/env python3
"""Python overhead of the migrator against the kernel's own time, per batch.

For one process with a KV pool of SIZE MiB in 2 MiB blocks this times:
  kernel   the bare syscalls for the batch with pre-built arrays
           (move_pages query + pagemap pread for residency; move_pages to
           node 0 for a move), i.e. what any caller must pay;
  kvtier   Migrator.residency() / Migrator.move() end to end: building the
           page-address array, the same syscalls, folding per-page status
           into per-block answers.
The overhead ratio is (kvtier - kernel) / kernel; target < 0.05.
With --shared-swap (needs an active swap of SIZE) it also times residency of
a MAP_SHARED pool paged out to swap, where pagemap shows nothing and the
migrator counts the swap entries in the object (kernel/shmem.py): with
cachestat, and with the smaps fallback used where cachestat is missing or
filtered. Median of REPEAT runs. Run as root:

    .venv/bin/python scripts/bench/migrate_overhead.py [--size-mib 1024] [--repeat 15] [--shared-swap]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from kvchild import KVChild  # noqa: E402

from kvtier.kernel import native, shmem  # noqa: E402
from kvtier.kernel.migrator import Migrator, page_layout  # noqa: E402
from kvtier.kernel.procfs import Pagemap  # noqa: E402

BLOCK = 2 << 20


def median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shared-swap", action="store_true", help="also residency of shared memory in swap")
    args = ap.parse_args()
    size = args.size_mib << 20
    rows = overhead(size, args.repeat)
    if args.shared_swap:
        rows += shared_swap(size, args.repeat)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"# {platform.node()} {platform.machine()} {os.cpu_count()} cpus, kernel {platform.release()}, "
          f"pool {args.size_mib} MiB in 2 MiB blocks, 4 KiB pages, median of {args.repeat}")
    print("| operation | pages | kernel ms | kvtier ms | Python ns/page | overhead ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['operation']} | {r['pages']} | {r.get('kernel_ms', '-')} | {r['kvtier_ms']} | "
              f"{r.get('python_ns_per_page', '-')} | {r.get('overhead_ratio', '-')} |")


def blocks_of(child: KVChild, size: int) -> tuple[np.ndarray, np.ndarray]:
    nb = size // BLOCK
    return child.addr + np.arange(nb, dtype=np.uint64) * np.uint64(BLOCK), np.full(nb, BLOCK, dtype=np.uint64)


def shared_swap(size: int, repeat: int) -> list[dict]:
    """Residency of a MAP_SHARED pool all in swap, both ways of counting."""
    rows = []
    with KVChild(size, "--shared") as child:
        starts, lengths = blocks_of(child, size)
        mig = Migrator()
        out = mig.pageout(child.pid, starts, lengths)
        if out.done != size // native.PAGE_SIZE:
            raise SystemExit(f"pageout put {out.done} of {size // native.PAGE_SIZE} pages in swap: swap too small?")
        for way, missing in (("cachestat", False), ("smaps", True)):
            shmem._cachestat_missing = missing
            r = mig.residency(child.pid, starts, lengths)
            assert int(r.swapped.sum()) == out.done, r.to_dict()
            f = median_time(lambda: mig.residency(child.pid, starts, lengths), repeat)
            rows.append({"operation": f"residency, shared memory in swap ({way})", "pages": out.done,
                         "kvtier_ms": round(f * 1e3, 3)})
        shmem._cachestat_missing = False
    return rows


def overhead(size: int, repeat: int) -> list[dict]:
    with KVChild(size) as child:
        starts, lengths = blocks_of(child, size)
        mig = Migrator()
        lay = page_layout(starts, lengths, native.PAGE_SIZE)
        npages = len(lay.addrs)
        status = np.empty(npages, dtype=np.int32)

        def kernel_residency():
            native.move_pages(child.pid, lay.addrs, None, status=status)
            with Pagemap(child.pid) as pm:
                pm.read(child.addr, npages, native.PAGE_SIZE)

        def kernel_move():
            native.move_pages(child.pid, lay.addrs, 0, status=status)

        rows = []
        for name, kern, full in (
            ("residency", kernel_residency, lambda: mig.residency(child.pid, starts, lengths)),
            ("move_pages to node 0", kernel_move, lambda: mig.move(child.pid, starts, lengths, 0)),
        ):
            full()  # warm up
            k = median_time(kern, repeat)
            f = median_time(full, repeat)
            rows.append(
                {
                    "operation": name,
                    "pages": npages,
                    "kernel_ms": round(k * 1e3, 3),
                    "kvtier_ms": round(f * 1e3, 3),
                    "python_ns_per_page": round((f - k) / npages * 1e9, 2),
                    "overhead_ratio": round((f - k) / k, 4),
                }
            )
    return rows


if __name__ == "__main__":
    main()
