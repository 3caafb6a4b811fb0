"""Record what kvtierd saw, in kvtier-sim's CSV trace format, so an
operator can replay their own traffic with another policy or DRAM size
(``kvtier-sim run --trace RECORDING_DIR``; kvtier/sim/recording.py reads it).

What is written, one line per block event (``time,block,op,count``, time in
seconds since recording started, block id = region id << 24 | block index):

* registrations: ``alloc`` of every block of the region, ``free`` of every
  block when it goes (unregistered, process exited);
* client hints: ``access`` lines with the hinted counts — the accesses the
  daemon's own hit ratio (kvtier_tier_hit_ratio) counts, so a replay of the
  recorded configuration can be checked against it;

and as ``#`` comment lines, which the plain trace reader skips and the
recording reader understands:

* ``# obs T SOURCE BLOCK COUNT``: hotness-source observations (DAMON,
  access bits, perf) with their weight applied;
* ``# place T BLOCK TIER CAUSE``: each block's tier when it changes; CAUSE
  ``move`` (a move job's results), ``seen`` (a residency measurement found it
  there: the kernel moved it, e.g. a read faulted it back from swap) or
  ``start`` (the state a file starts with);
* ``# tick T BUSY [DECAYED STEP]``: each tick of the engine, BUSY 1 when
  the mover was still running the previous job so no plan was made: the
  tick clock as it ran, late and skipped ticks included. DECAYED and STEP
  (the temperatures' clock before this tick: when they last decayed, and
  that step's length) where the tick before it is not in the file: the
  file's first tick, a tick after ticks with no block registered (those are
  not recorded). A replay ages its temperatures from there, as the daemon
  did (a read that starts a run counts as one STEP old);
* ``# job T0 SRC DST BLOCKS BYTES``: a move job handed to the mover, one
  line per source and destination tier (so a job still running when the
  recording ends is known), and when it is done
  ``# move T0 T1 SRC DST BLOCKS BYTES OK_BLOCKS OK_BYTES FAILED_PAGES
  SECONDS``: T0 when the job was planned, T1 when its results reached the
  block table, SECONDS the mover's own time on that pair's batches;
* ``# region T REGION BLOCK_BYTES BLOCKS``: each registered region's block
  size (the header's ``block_bytes`` is only the most common size among the
  blocks live when the file was opened: none, at the daemon's start);
* ``# tiers T name:kind:capacity ...`` and ``# policy T key=value ...``: the
  configuration in force (at the start of each file and when it changes).

Bounded: the current file is ``kvtier.csv``; past ``max_bytes`` it becomes
``kvtier.csv.1`` (older ones shift to .2, ...; ``files`` are kept) and the
new file starts with ``alloc`` lines of every live block, so each file
replays on its own. A file rotates once it holds ``max_bytes`` and at least
as much that is new as that opening repeat: with more live blocks than
``max_bytes`` of lines (a user may register millions) each rotation still
costs no more than the records it follows, and the disk used stays within
``files`` x max(max_bytes, twice the live blocks' lines). Writes are buffered on the loop thread, one
``np.savetxt`` per batch (a hint message, a job's results).
"""

from __future__ import annotations

import io
import logging
import os
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from kvtier import logs

log = logging.getLogger("kvtier.record")

FILE_NAME = "kvtier.csv"
CSV_MAGIC = "# kvtier-trace"  # kvtier.sim.trace.CSV_MAGIC: the same header the sim reads
INDEX_BITS = 24  # block index bits in a recorded id (limits.max_blocks_per_region <= 2**30; 2**24 here is plenty)


def block_ids(region: np.ndarray, index: np.ndarray) -> np.ndarray:
    return (region.astype(np.int64) << INDEX_BITS) | index.astype(np.int64)


class Recorder:
    """Built before the registry and the engine, which receive it: it reads
    only the block table; the engine tells it the tiers and the policy in
    force (``config``), and a rotated file repeats the last ones."""

    def __init__(self, directory: str, max_bytes: int, files: int, table: Any,
                 clock: Callable[[], float] = time.monotonic, meta: dict | None = None,
                 in_force: tuple[list, Any] | None = None):
        self.dir = directory
        self.max_bytes = max_bytes
        self.files = files
        self.table = table
        self.clock = clock
        self.meta = dict(meta or {})  # tick_s, tau_s: what a replay needs besides tiers and policy
        self.t0 = clock()
        self.lines_total = 0
        self.rotations_total = 0
        self.errors_total = 0
        self._known_ids = np.zeros(0, dtype=np.int64)  # sorted ids with a recorded tier
        self._known_tier = np.zeros(0, dtype=np.int8)
        self._config: tuple[str, str] | None = None  # (tiers, settings) last written
        if in_force is not None:
            self._config = self._config_text(*in_force)  # the first file starts with them
        os.makedirs(directory, exist_ok=True)
        self._f: io.TextIOWrapper | None = None
        self._opening = False  # _open's own writes never rotate (the repeat would recurse)
        self._base = 0  # bytes of the current file when its opening repeat was written
        self._last_tick: float | None = None  # the clock time of the file's last tick line
        if os.path.exists(self.path) and os.path.getsize(self.path):
            self._shift()  # a new daemon run starts a new file (its clock starts at 0 again)
        self._open()

    # -- files -----------------------------------------------------------

    @property
    def path(self) -> str:
        return os.path.join(self.dir, FILE_NAME)

    def _now(self) -> float:
        return self.clock() - self.t0

    def _open(self) -> None:
        self._opening = True
        try:
            self._open_file()
        finally:
            self._opening = False
        self._base = self._f.tell() if self._f is not None else 0
        self._last_tick = None  # the file's first tick says where the decay clock stood

    def _open_file(self) -> None:
        # The most common block size among live blocks (a header the plain
        # trace reader needs; a replay of mixed sizes reads nbytes per alloc).
        sizes, counts = np.unique(self.table.nbytes, return_counts=True)
        block_bytes = int(sizes[np.argmax(counts)]) if sizes.size else 2 << 20
        self._f = open(self.path, "a", buffering=1 << 16)
        if self._f.tell() == 0:
            # started: the wall-clock time of time 0, so files of several daemon runs line up.
            self._f.write(f"{CSV_MAGIC} block_bytes={block_bytes} recorder=kvtierd "
                          f"started={time.time() - self._now():.6f}\ntime,block,op,count\n")
        if self.meta:
            self._f.write("# meta " + " ".join(f"{k}={v!r}" for k, v in sorted(self.meta.items())) + "\n")
        if self._config is not None:
            self._write_config(*self._config)
        # Every live block, so this file replays on its own after a rotation.
        t = self.table
        if len(t):
            for rid in sorted(t.slices):
                self._region_line(rid)
            self._rows("alloc", block_ids(t.region, t.index), np.zeros(len(t)))
            self._places(block_ids(t.region, t.index), t.tier.copy(), "start", force=True)

    def _rotate(self) -> None:
        self._f.close()
        self._shift()
        self.rotations_total += 1
        self._known_ids = self._known_ids[:0]
        self._known_tier = self._known_tier[:0]
        self._open()

    def _shift(self) -> None:
        """kvtier.csv -> .1 -> .2 ...; the oldest beyond ``files`` goes."""
        for i in range(self.files - 1, 0, -1):
            src = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i}")
        if self.files <= 1:
            os.unlink(self.path)

    def _write(self, text: str) -> None:
        if self._f is None:
            return
        try:
            self._f.write(text)
            if not self._opening:
                at = self._f.tell()
                if at >= self.max_bytes and at - self._base >= self._base:
                    self._rotate()
        except OSError as e:
            # A full disk must not stop the daemon; recording stops instead.
            self.errors_total += 1
            logs.event(log, "recording_stopped", logging.ERROR, path=self.path, error=str(e))
            self.close()

    def _rows(self, op: str, ids: np.ndarray, counts: np.ndarray) -> None:
        if ids.size == 0:
            return
        self._lines(f"{self._now():.6f},%d,{op},%g", ids, counts)

    def _lines(self, fmt: str, ids: np.ndarray, values: np.ndarray) -> None:
        # Ids < 2**53 are exact as float64, so one numeric array feeds savetxt.
        buf = io.StringIO()
        np.savetxt(buf, np.column_stack([ids.astype(np.float64), np.asarray(values, dtype=np.float64)]), fmt=fmt)
        self.lines_total += int(ids.size)
        self._write(buf.getvalue())

    # -- what the daemon reports -----------------------------------------

    def config(self, tiers: list, policy: Any) -> None:
        """Tiers (TierState) and policy (PolicyConfig) in force; written when they change."""
        text = self._config_text(tiers, policy)
        if text != self._config:
            self._config = text
            self._write_config(*text)

    @staticmethod
    def _config_text(tiers: list, policy: Any) -> tuple[str, str]:
        return (" ".join(f"{t.name}:{t.kind}:{int(t.capacity_bytes)}" for t in tiers),
                " ".join(f"{k}={v!r}".replace(" ", "") for k, v in sorted(asdict(policy).items())))

    def _write_config(self, tiers: str, settings: str) -> None:
        self._write(f"# tiers {self._now():.6f} {tiers}\n# policy {self._now():.6f} {settings}\n")

    def _region_line(self, region_id: int) -> None:
        s = self.table.slices[region_id]
        nbytes = int(self.table.nbytes[s.start]) if s.count else 0
        self._write(f"# region {self._now():.6f} {region_id} {nbytes} {s.count}\n")

    def region_added(self, region_id: int) -> None:
        s = self.table.slices[region_id]
        self._region_line(region_id)
        self._rows("alloc", block_ids(self.table.region[s.start:s.stop], self.table.index[s.start:s.stop]),
                   np.zeros(s.count))

    def region_removed(self, region_id: int) -> None:
        s = self.table.slices[region_id]
        ids = block_ids(self.table.region[s.start:s.stop], self.table.index[s.start:s.stop])
        self._rows("free", ids, np.zeros(s.count))
        keep = ~np.isin(self._known_ids, ids)
        self._known_ids, self._known_tier = self._known_ids[keep], self._known_tier[keep]

    def hint(self, region_id: int, blocks: np.ndarray, counts: np.ndarray | None) -> None:
        ids = (np.int64(region_id) << INDEX_BITS) | blocks.astype(np.int64)
        self._rows("access", ids, np.ones(ids.size) if counts is None else counts)

    def observed(self, source: str, rows: np.ndarray, counts: np.ndarray, weight: float) -> None:
        if rows.size == 0:
            return
        t = self.table
        self._lines(f"# obs {self._now():.6f} {source} %d %g", block_ids(t.region[rows], t.index[rows]),
                    counts.astype(np.float64) * weight)

    def placed(self, cause: str = "move") -> None:
        """Tiers of blocks that changed since the last call (after a job):
        ``move`` after a move job, ``seen`` after a measurement."""
        t = self.table
        self._places(block_ids(t.region, t.index), t.tier.copy(), cause)

    def ticked(self, at: float, busy: bool, decayed: tuple[float | None, float] | None = None) -> None:
        """An engine tick at clock time ``at``; ``busy``: the mover still ran
        the last job, so this tick made no plan. ``decayed``: the
        temperatures' last decay before this tick (clock time, or None: never)
        and that step's length, written where the file's last tick line is
        not that decay. A replay that started its temperature clock at its
        first tick line instead aged every first run by a default 1 s step
        against the daemon's 0.5 s, enough to swap one near-tied block for
        another and a different hot set after it (tests/vm/test_record_vm.py,
        replayed 0.647 against 0.746 live)."""
        line = f"# tick {at - self.t0:.6f} {int(busy)}"
        if decayed is not None and decayed[0] is not None and decayed[0] != self._last_tick:
            line += f" {decayed[0] - self.t0:.6f} {decayed[1]:.6f}"
        self._last_tick = at  # before the write: a rotation it causes starts the next file afresh
        self._write(line + "\n")

    def move_started(self, started: float, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """A move job handed to the mover (planned at clock time ``started``)."""
        uniq, blocks, total = self._pairs(src, dst, nbytes, np.zeros(src.size))[:3]
        self._write("".join(f"# job {started - self.t0:.6f} {s} {d} {int(blocks[k])} {int(total[k])}\n"
                            for k, (s, d) in enumerate(uniq)))

    @staticmethod
    def _pairs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, ok: np.ndarray):
        """Per (source, destination) tier pair: blocks, bytes, ok blocks, ok bytes."""
        pair = src.astype(np.int64) * 256 + dst.astype(np.int64)
        uniq, inv = np.unique(pair, return_inverse=True)
        inv = inv.ravel()
        nb = nbytes.astype(np.float64)
        okf = ok.astype(np.float64)
        sums = [np.bincount(inv, weights=w, minlength=uniq.size) for w in (None, nb, okf, nb * okf)]
        # floor division: a source of -1 (unknown) comes back as -1
        return [divmod(p, 256) for p in uniq.tolist()], *sums

    def moved(self, started: float, finished: float, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
              ok: np.ndarray, seconds: dict, failures: dict) -> None:
        """A finished move job (clock times ``started``: planned,
        ``finished``: applied), per tier pair: what was asked, what arrived,
        the pages that failed and the mover's time on the pair
        (``seconds[(src, dst)]``; ``failures[(src, dst, reason)]`` pages)."""
        if src.size == 0:
            return
        uniq, blocks, total, ok_blocks, ok_bytes = self._pairs(src, dst, nbytes, ok)
        failed: dict = {}
        for (s, d, _reason), pages in failures.items():
            failed[(s, d)] = failed.get((s, d), 0) + pages
        t0, t1 = started - self.t0, finished - self.t0
        lines = []
        for k, (s, d) in enumerate(uniq):
            lines.append(f"# move {t0:.6f} {t1:.6f} {s} {d} {int(blocks[k])} {int(total[k])} {int(ok_blocks[k])} "
                         f"{int(ok_bytes[k])} {int(failed.get((s, d), 0))} {float(seconds.get((s, d), 0.0)):.6f}\n")
        self._write("".join(lines))

    def _places(self, ids: np.ndarray, tiers: np.ndarray, cause: str, force: bool = False) -> None:
        order = np.argsort(ids)
        ids, tiers = ids[order], tiers[order]
        if force or self._known_ids.size == 0:
            changed = np.ones(ids.size, dtype=bool)
        else:
            pos = np.searchsorted(self._known_ids, ids)
            pos_c = np.minimum(pos, max(self._known_ids.size - 1, 0))
            seen = (pos < self._known_ids.size) & (self._known_ids[pos_c] == ids)
            changed = ~seen | (self._known_tier[pos_c] != tiers)
        self._known_ids, self._known_tier = ids, tiers
        if changed.any():
            self._lines(f"# place {self._now():.6f} %d %d {cause}", ids[changed], tiers[changed])

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None
