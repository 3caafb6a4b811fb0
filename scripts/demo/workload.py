#!/usr/bin/env python3
"""A synthetic LLM inference server's KV cache, for the kvtier demo.

The process owns a KV pool (default 256 MiB in 2 MiB blocks), registers it
with kvtierd through kvtier.client and serves a stream of sessions:

* sessions arrive at random (Poisson) and each brings a prompt that is
  prefilled into fresh blocks taken from the free list;
* every decode step reads the KV blocks of every active session: the
  shared prefix blocks (a system prompt every session attends to), the
  session's newest blocks always, and older ones with a probability that
  halves every ``--halflife`` blocks of age (recency bias, as in
  attention-sink/sliding-window serving); a step appends a token, and every
  ``--tokens-per-block`` tokens the session takes a new block;
* a finished session returns its blocks to the free list, FIFO (the block
  freed longest ago is taken first, like vLLM's free block queue). Their
  contents are dead (the workload has no prefix cache for session blocks),
  so by default (``--on-finish discard``) the workload drops their pages
  (``kvtier.client.drop_blocks``, madvise in this process: the same in
  every mode) and tells the daemon (``Region.discard``, phase
  ``discard``): nothing moves dead data, and a slot taken again is written
  as a new block into fresh pages, where the kernel's first touch puts
  them. ``--on-finish free`` keeps the pages (phase ``free``: contents
  kept, as for a prefix cache), the behaviour before.

Reads really touch the memory (one byte per page of each block read), so a
block in swap is faulted back and a block on a slow node is read there.
Every block read is also sent to the daemon as a hint, batched by the
client library.

Once a second the workload measures where each of its blocks really is
(move_pages status and /proc/self/pagemap, the kernel's answer rather than
the daemon's belief; each block counts in the tier holding most of its
pages) and records, from its own ground truth of which blocks it read, how
many block reads found their block in each tier: the hot-set residency the
demo plots. One JSON line per second goes to ``--timeline``; a one-line
status goes to stdout.

Without a daemon (``--no-daemon``, the demo's baselines: no tiering, and the
kernel's own numa_balancing=2) the same workload runs unchanged except that
nothing is registered or hinted; the tiers it measures against come from
``--tiers-json``. Bytes moved are counted the same way in every mode, from
the kernel: /proc/vmstat pages migrated (pgmigrate_success) plus pages
swapped out and in (pswpout, pswpin), as deltas since the workload started.

``--start-node N`` moves the whole pool to NUMA node N after filling it,
i.e. the shared prefix (and with ``--on-finish free`` every block) starts in
a capacity tier and kvtier must bring it up into DRAM; without it the pool
starts wherever the kernel puts it. With ``--on-finish discard`` the free
list's slots are dropped at the start (they hold nothing yet).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvtier.kernel import native
from kvtier.client import Client, drop_blocks
from kvtier.kernel.migrator import Migrator

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
VMSTAT = "/proc/vmstat"
# Every page any mechanism moved: migrations (move_pages, NUMA balancing
# promotion, kswapd demotion all count in pgmigrate_success) and swap I/O.
MOVED_PAGE_COUNTERS = ("pgmigrate_success", "pswpout", "pswpin")


# What node 0 (DRAM) holds besides the pool, per second: which memory the
# kernel gives the pool beyond what the driver left free.
NODE_MEMINFO = "/sys/devices/system/node/node{}/meminfo"
NODE_FIELDS = {"MemFree": "free", "FilePages": "file", "AnonPages": "anon", "Shmem": "shmem",
               "Unevictable": "unevictable", "SReclaimable": "slab_reclaimable", "SUnreclaim": "slab_unreclaimable"}


def node_memory(node: int) -> dict[str, int]:
    """Bytes of NODE_FIELDS on ``node`` (the node's meminfo; {} if absent)."""
    out: dict[str, int] = {}
    try:
        with open(NODE_MEMINFO.format(node)) as f:
            for line in f:
                parts = line.split()  # "Node 0 MemFree: 123 kB"
                if len(parts) >= 4 and parts[2].rstrip(":") in NODE_FIELDS:
                    out[NODE_FIELDS[parts[2].rstrip(":")]] = int(parts[3]) * 1024
    except OSError:
        pass
    return out


def node_zone_pages(node: int, zoneinfo: str = "/proc/zoneinfo") -> dict[str, int]:
    """Bytes of ``node``'s zones, summed: the min, low and high watermarks,
    and ``pcp``, the free pages sitting in the per-CPU lists, which MemFree
    does not count (in the guest up to ~24 MiB, moving with every burst of
    frees: a session's discarded blocks go there first)."""
    pages, here, key = {"min": 0, "low": 0, "high": 0, "pcp": 0}, False, {"count:": "pcp"}
    with open(zoneinfo) as f:
        for line in f:
            parts = line.split()
            if line.startswith("Node "):
                here = parts[1].rstrip(",") == str(node)
            elif here and len(parts) == 2 and (parts[0] in pages or parts[0] in key):
                pages[key.get(parts[0], parts[0])] += int(parts[1])
    return {k: v * PAGE for k, v in pages.items()}


def kernel_moved_pages() -> int:
    with open(VMSTAT) as f:
        counts = dict(line.split() for line in f)
    return sum(int(counts.get(k, 0)) for k in MOVED_PAGE_COUNTERS)


class _NoRegion:
    """Stands in for a registered region when no daemon runs: the baselines
    do exactly the same reads and writes, they just tell nobody."""

    id = None

    def phase(self, *_a, **_k) -> None:
        pass

    def hint(self, *_a, **_k) -> None:
        pass

    def discard(self, *_a, **_k) -> None:
        pass

    def unregister(self) -> None:
        pass


@dataclass
class Session:
    sid: int
    blocks: list[int]
    tokens: int  # tokens in the last block
    steps_left: int
    reads: int = 0


@dataclass
class Pool:
    """The KV pool: an anonymous mapping cut into blocks, and its free list."""

    size: int
    block: int
    prefix: int  # blocks 0..prefix-1 hold the shared prefix
    buf: mmap.mmap = field(init=False)
    arr: np.ndarray = field(init=False)
    free: list[int] = field(init=False)

    def __post_init__(self):
        self.buf = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # 2 MiB blocks would each become one THP; kvtier moves base pages
        # here so that per-block placement is exact (the kernel splits THPs
        # on partial moves anyway).
        self.buf.madvise(mmap.MADV_NOHUGEPAGE)
        self.arr = np.frombuffer(self.buf, dtype=np.uint8)
        self.free = list(range(self.prefix, self.nblocks))

    @property
    def nblocks(self) -> int:
        return self.size // self.block

    @property
    def addr(self) -> int:
        return self.arr.ctypes.data

    def place(self, node: int) -> None:
        """Move every page of the pool to ``node`` (move_pages), leaving no
        memory policy behind. Not mbind: in the guest (6.12) a process that
        had mbind(2) applied to a range was never scanned by NUMA balancing
        again (numa_pte_updates stayed 0, even after MPOL_DEFAULT), which
        would rig the numa_balancing baseline; a policy naming the slow
        node would also tell the kernel the pages belong there."""
        page_addrs = self.addr + np.arange(self.size // PAGE, dtype=np.uint64) * np.uint64(PAGE)
        native.move_pages(os.getpid(), page_addrs, node)

    def fill(self) -> None:
        # Touch every page so the whole pool is resident from the start
        # (a real engine preallocates and zeroes its KV pool).
        self.arr[::PAGE] = 1

    def pages(self, blocks: np.ndarray) -> np.ndarray:
        """Byte offsets of one byte per page of the given blocks."""
        per = self.block // PAGE
        return (blocks[:, None] * self.block + np.arange(per) * PAGE).ravel()

    def read(self, blocks: np.ndarray, stride: int = PAGE) -> int:
        """Read the blocks, one byte every ``stride`` bytes: PAGE touches each
        page once (cheap, enough for placement), 64 every cache line as an
        attention kernel does (costs CPU time the way real decode does, which
        matters to NUMA balancing: its scanner runs per CPU-second of the
        task, not per wall-clock second)."""
        rows = self.arr.reshape(self.nblocks, self.block)
        return int(sum(int(rows[b, ::stride].sum()) for b in blocks.tolist()))

    def write(self, blocks: np.ndarray, value: int) -> None:
        self.arr[self.pages(blocks)] = value


class Workload:
    def __init__(self, args: argparse.Namespace, client: Client | None):
        self.a = args
        self.rng = np.random.default_rng(args.seed)
        self.pool = Pool(args.pool_mib * MIB, args.block_mib * MIB, args.prefix_blocks)
        self.pool.fill()
        self.dropped = np.zeros(self.pool.nblocks, dtype=bool)
        if args.on_finish == "discard":
            # The free list's slots hold nothing yet: their pages are dropped
            # before the pool is registered (the daemon finds them never
            # touched), so the first session to take each writes a new block
            # where first touch puts it; only the shared prefix starts on the
            # start node with its data.
            drop_blocks(self.pool.addr, self.pool.block, self.pool.free)
            self.dropped[self.pool.free] = True
        if args.start_node is not None:
            self.pool.place(args.start_node)
        self.client = client
        if client is None:
            self.region = _NoRegion()
        else:
            self.region = client.register(addr=self.pool.addr, length=self.pool.size,
                                          block_size=self.pool.block, name="kv-pool", tenant="demo")
        self.moved_pages0 = kernel_moved_pages()
        self.migrator = Migrator()
        self.starts = (np.arange(self.pool.nblocks, dtype=np.uint64) * np.uint64(self.pool.block)
                       + np.uint64(self.pool.addr))
        self.sessions: list[Session] = []
        self.next_sid = 1
        self.finished = 0
        self.rejected = 0
        self.interval_reads = np.zeros(self.pool.nblocks, dtype=np.int64)
        # Ground truth for the report's turnover reference, per second:
        # blocks written as new blocks (into dropped, i.e. fresh, slots or
        # into slots whose old pages are still wherever they were) and
        # blocks whose contents died.
        self.interval_alloc: list[int] = []
        self.interval_alloc_fresh: list[int] = []
        self.interval_discard: list[int] = []
        # when each fresh block of the interval was written (time.time()),
        # for the demo test's bound on DRAM between the daemon's plans
        self.interval_fresh_at: list[float] = []

    # -- session lifecycle ---------------------------------------------------

    def arrive(self) -> None:
        a = self.a
        prompt = int(self.rng.integers(a.prompt_blocks[0], a.prompt_blocks[1] + 1))
        if len(self.pool.free) < prompt + 2 or len(self.sessions) >= a.max_sessions:
            self.rejected += 1
            return
        blocks = [self.pool.free.pop(0) for _ in range(prompt)]
        self.touch_new(blocks, self.next_sid)  # prefill writes the prompt's KV
        steps = int(self.rng.integers(a.decode_steps[0], a.decode_steps[1] + 1))
        self.sessions.append(Session(self.next_sid, blocks, 0, steps))
        self.next_sid += 1

    def touch_new(self, blocks: list[int], sid: int) -> None:
        """A block taken from the free list is written (its KV) and, being
        written, is hot: say so at once rather than at the next read."""
        arr = np.array(blocks)
        self.interval_alloc += blocks
        fresh = [b for b in blocks if self.dropped[b]]
        self.interval_alloc_fresh += fresh
        self.interval_fresh_at += [time.time()] * len(fresh)
        self.dropped[arr] = False
        self.pool.write(arr, sid & 0xFF)
        self.region.phase("active", arr)
        self.region.hint(arr)
        np.add.at(self.interval_reads, arr, 1)

    def finish(self, s: Session) -> None:
        self.sessions.remove(s)
        if self.a.on_finish == "discard":
            self.discard(s.blocks)
        else:
            self.region.phase("free", s.blocks)
        # Freed blocks go to the back: the most recently freed are reused last,
        # like a FIFO block allocator (vLLM's free block queue).
        self.pool.free.extend(s.blocks)
        self.finished += 1

    def discard(self, blocks: list[int]) -> None:
        """Dead contents: the pages first (madvise here, in every mode), then
        the daemon, so it never takes the dead pages for data."""
        drop_blocks(self.pool.addr, self.pool.block, blocks)
        self.dropped[blocks] = True
        self.interval_discard += blocks
        self.region.discard(blocks, drop=False)

    # -- one decode step ------------------------------------------------------

    def step(self) -> None:
        a = self.a
        reads: list[np.ndarray] = []
        prefix = np.arange(a.prefix_blocks)
        for s in list(self.sessions):
            own = np.asarray(s.blocks)
            age = np.arange(len(own))[::-1]  # 0 = newest
            p = np.where(age < a.window, 1.0, 0.5 ** ((age - a.window + 1) / a.halflife))
            picked = own[self.rng.random(len(own)) < p]
            reads.append(prefix)
            reads.append(picked)
            s.tokens += 1
            s.steps_left -= 1
            if s.tokens >= a.tokens_per_block:
                s.tokens = 0
                if self.pool.free:
                    nb = self.pool.free.pop(0)
                    self.touch_new([nb], s.sid)
                    s.blocks.append(nb)
            if s.steps_left <= 0:
                self.finish(s)
        if not reads:
            return
        blocks = np.concatenate(reads)
        self.pool.read(np.unique(blocks), self.a.read_stride)
        uniq, counts = np.unique(blocks, return_counts=True)
        self.region.hint(uniq, counts)
        np.add.at(self.interval_reads, uniq, counts)

    # -- the run ----------------------------------------------------------------

    def run(self, timeline, stop) -> dict:
        a = self.a
        t0 = self.t0 = time.time()
        next_sample = t0 + 1.0
        next_step = t0
        tiers = self.tiers()
        names = [t["name"] for t in tiers]
        where = self.measure(tiers)
        steps = 0
        while not stop["now"]:
            now = time.time()
            if now - t0 >= a.duration:
                break
            # Poisson arrivals at a.arrival_rate per second, checked per step.
            if self.rng.random() < a.arrival_rate / a.step_rate or not self.sessions:
                self.arrive()
            self.step()
            steps += 1
            if now >= next_sample:
                where = self.sample(now - t0, where, tiers, names, steps, timeline)
                steps = 0
                next_sample = max(next_sample + 1.0, time.time() + 0.5)  # no catch-up bursts
            next_step += 1.0 / a.step_rate
            delay = next_step - time.time()
            if delay > 0:
                time.sleep(delay)
            else:
                next_step = time.time()  # running behind (TCG): do not burst
        if self.client is not None:
            self.client.flush()
        return {"elapsed_s": time.time() - t0, "cpu_s": time.process_time(), "sessions_started": self.next_sid - 1,
                "sessions_finished": self.finished, "sessions_rejected": self.rejected}

    @staticmethod
    def dram_node_memory(tiers: list[dict]) -> dict[str, int]:
        """The DRAM node's meminfo fields and its per-CPU free pages (``pcp``)."""
        if not tiers or not tiers[0]["nodes"]:
            return {}
        node = int(tiers[0]["nodes"][0])
        out = node_memory(node)
        try:
            out["pcp"] = node_zone_pages(node)["pcp"]
        except OSError:
            pass
        return out

    def tiers(self) -> list[dict]:
        if self.client is not None:
            return self.client.request("tiers")["tiers"]
        with open(self.a.tiers_json) as f:
            return json.load(f)

    def measure(self, tiers: list[dict]) -> np.ndarray:
        """Tier index of each block from the kernel (move_pages + pagemap):
        the tier holding most of its pages, swap included; -1 if none."""
        r = self.migrator.residency(os.getpid(), self.starts, self.pool.block)
        per_tier = np.zeros((self.pool.nblocks, len(tiers)), dtype=np.int64)
        for t in tiers:
            for node in t["nodes"]:
                if node < r.node_pages.shape[1]:
                    per_tier[:, t["index"]] += r.node_pages[:, node]
            if t["kind"] == "swap":
                per_tier[:, t["index"]] += r.swapped
        return np.where(per_tier.sum(axis=1) > 0, per_tier.argmax(axis=1), -1)

    def sample(self, t: float, where: np.ndarray, tiers: list[dict], names: list[str], steps: int,
               timeline) -> np.ndarray:
        """Record the last second against the placement measured at its
        start, then measure the placement for the next one."""
        reads = self.interval_reads
        self.interval_reads = np.zeros_like(reads)
        alloc, fresh, discard = self.interval_alloc, self.interval_alloc_fresh, self.interval_discard
        fresh_at, self.interval_fresh_at = self.interval_fresh_at, []
        self.interval_alloc, self.interval_alloc_fresh, self.interval_discard = [], [], []
        if self.client is not None:
            self.client.flush()
        by_tier: dict[str, int] = {}
        for tier in np.unique(where):
            by_tier[_tier_name(names, int(tier))] = int(reads[where == tier].sum())
        total = int(reads.sum())
        hot = reads > 0
        hot_bytes = int(hot.sum()) * self.pool.block
        hot_dram = int((hot & (where == 0)).sum()) * self.pool.block
        daemon_tiers = self.client.request("tiers")["tiers"] if self.client is not None else []
        stats = self.client.stats() if self.client is not None else {}
        status_t = time.time() - self.t0
        engine = self.client.status()["engine"] if self.client is not None else {}
        now_where = self.measure(tiers)
        rec = {
            "t": round(t, 2),
            "sessions": len(self.sessions),
            "steps": steps,
            "reads": total,
            "reads_by_tier": by_tier,
            "residency": (by_tier.get(names[0], 0) / total) if total else None,
            "hot_bytes": hot_bytes,
            "hot_bytes_dram": hot_dram,
            # where the pool is now, measured (bytes per tier) and as the daemon believes
            "pool_bytes": {_tier_name(names, int(x)): int((now_where == x).sum()) * self.pool.block
                           for x in np.unique(now_where)},
            "tier_bytes": {d["name"]: d["kvtier_bytes"] for d in daemon_tiers},
            "migrated_bytes": stats.get("migrated_bytes", {}),
            "migration_failed_pages": stats.get("migration_failed_pages", {}),
            # the daemon's ticks so far (None without one): which samples a tick came between
            "ticks": stats.get("ticks_total"),
            "ticks_skipped_busy": stats.get("ticks_skipped_busy"),
            # when (s, as "t") the daemon made the newest plan whose moves were
            # all done, asked just before pool_bytes was measured (None: none yet)
            "plan_settled_t": (None if engine.get("plan_settled_age_s") is None
                               else round(status_t - engine["plan_settled_age_s"], 3)),
            "kernel_moved_bytes": (kernel_moved_pages() - self.moved_pages0) * PAGE,
            # the DRAM node's memory (MemFree, FilePages, ... of its meminfo), bytes
            "dram_node": self.dram_node_memory(tiers),
            # the workload's ground truth of the second (report.py's turnover reference)
            "read_blocks": np.flatnonzero(reads).tolist(),
            "read_counts": reads[reads > 0].tolist(),
            "alloc_blocks": alloc,
            "alloc_fresh": fresh,
            "alloc_fresh_t": [round(x - self.t0, 3) for x in fresh_at],
            "discarded": discard,
            "where": where.tolist(),
        }
        timeline.write(json.dumps(rec) + "\n")
        timeline.flush()
        moved = rec["kernel_moved_bytes"]
        occ = "  ".join(f"{n} {rec['pool_bytes'].get(n, 0) / MIB:3.0f}" for n in names)
        res = "  -" if rec["residency"] is None else f"{100 * rec['residency']:3.0f}%"
        print(f"[{t:5.0f}s] sessions {len(self.sessions):2d}  hot set {hot_bytes / MIB:4.0f} MiB, "
              f"reads served from {names[0]} {res}  | pool MiB: {occ}  | moved {moved / MIB:4.0f} MiB",
              flush=True)
        return now_where


def _tier_name(names: list[str], t: int) -> str:
    if 0 <= t < len(names):
        return names[t]
    return {-1: "unknown", -2: "mixed"}.get(t, str(t))


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="kvtierd socket (default $KVTIER_SOCKET)")
    ap.add_argument("--no-daemon", action="store_true",
                    help="baseline run: register nothing, send no hints (needs --tiers-json)")
    ap.add_argument("--tiers-json", help="with --no-daemon: the tiers to measure against (kvtierd's tiers list)")
    ap.add_argument("--timeline", required=True, help="JSON lines, one per second")
    ap.add_argument("--summary", help="JSON summary at the end")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of serving")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--prefix-blocks", type=int, default=4, help="shared prefix blocks every session reads")
    ap.add_argument("--prompt-blocks", type=_range, default=(2, 6), help="blocks per prompt, LO-HI")
    ap.add_argument("--decode-steps", type=_range, default=(60, 240), help="decode steps per session, LO-HI")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--window", type=int, default=2, help="newest blocks every step reads")
    ap.add_argument("--halflife", type=float, default=2.0, help="blocks of age that halve the read probability")
    ap.add_argument("--max-sessions", type=int, default=6)
    ap.add_argument("--arrival-rate", type=float, default=1.0, help="sessions per second")
    ap.add_argument("--step-rate", type=float, default=10.0, help="decode steps per second")
    ap.add_argument("--start-node", type=int, help="move the filled pool to this NUMA node (it starts there)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--on-finish", choices=("discard", "free"), default="discard",
                    help="a finished session's blocks: discard (drop the pages, phase discard: contents dead) "
                         "or free (keep them, phase free: contents kept as for a prefix cache)")
    ap.add_argument("--wait-go", action="store_true",
                    help="after setting up the pool, print 'workload: ready' and wait for a line on stdin "
                         "(the driver then leaves DRAM as scarce as the run needs)")
    ap.add_argument("--read-stride", type=int, default=64,
                    help="bytes between the bytes a block read touches (64: every cache line; 4096: every page)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.no_daemon and not args.tiers_json:
        print("workload: --no-daemon needs --tiers-json", file=sys.stderr)
        return 2
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    with contextlib.ExitStack() as stack:
        client = None if args.no_daemon else stack.enter_context(Client(args.socket, name="kvtier demo workload"))
        timeline = stack.enter_context(open(args.timeline, "w"))
        w = Workload(args, client)
        if args.wait_go:
            print("workload: ready", flush=True)
            sys.stdin.readline()
            w.moved_pages0 = kernel_moved_pages()
        summary = w.run(timeline, stop)
        summary.update(pool_bytes=w.pool.size, block_bytes=w.pool.block, region=w.region.id,
                       kernel_moved_bytes=(kernel_moved_pages() - w.moved_pages0) * PAGE)
        w.region.unregister()
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"workload: {summary['sessions_started']} sessions in {summary['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
