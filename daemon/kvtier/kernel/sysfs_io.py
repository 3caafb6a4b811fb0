"""All DAMON sysfs I/O, through one object that can run dry and records writes.

Following damo's _damon_sysfs: the DAMON source never opens a sysfs file
itself. It calls ``SysfsIO.write``/``read``/``listdir`` with paths relative
to the sysfs root, so

- unit tests run the source against a fixture tree with ``dry_run=True`` and
  assert ``io.writes``, the exact sequence of (path, value) DAMON would see;
- on the real kernel the same list is kept (bounded), which is what to look
  at when the kernel rejects a configuration;
- EBUSY is handled in one place. DAMON's sysfs answers EBUSY while a command
  is in flight (e.g. right after ``state=on`` the kdamond is not ready to
  take ``update_schemes_tried_regions``), and when its global lock is held by
  another writer. Both clear within milliseconds to one aggregation
  interval, so writes are retried with a bounded exponential backoff.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from typing import Callable

from kvtier.errors import FeatureUnavailable, KvtierOSError, os_error
from kvtier.kernel.sysfs import read_bytes

# Backoff for EBUSY: 5 ms doubling to 320 ms, at most 10 tries (~1.3 s in all).
# A kdamond that stays busy longer than that is stuck; the caller gets the
# EBUSY error rather than a hang.
BUSY_FIRST_DELAY_S = 0.005
BUSY_MAX_DELAY_S = 0.32
BUSY_MAX_TRIES = 10

# Writes kept in ``writes`` outside dry-run (a long-running daemon must not
# grow without bound); dry-run keeps everything for tests.
WRITE_LOG_LIMIT = 4096


def busy_delays(first: float = BUSY_FIRST_DELAY_S, cap: float = BUSY_MAX_DELAY_S, tries: int = BUSY_MAX_TRIES) -> list[float]:
    """Sleeps between the ``tries`` attempts of one write (``tries - 1`` of them)."""
    return [min(cap, first * (2**i)) for i in range(max(0, tries - 1))]


class SysfsIO:
    """Reads and writes below one sysfs root; records every write in order.

    ``dry_run`` records writes without performing them; reads still go to the
    tree (a fixture tree in tests, the real /sys when previewing a config).
    """

    def __init__(
        self,
        sys_root: str = "/sys",
        *,
        dry_run: bool = False,
        sleep: Callable[[float], None] = time.sleep,
        delays: list[float] | None = None,
    ):
        self.root = sys_root
        self.dry_run = dry_run
        self._sleep = sleep
        self._delays = busy_delays() if delays is None else list(delays)
        self.writes: deque[tuple[str, str]] = deque(maxlen=None if dry_run else WRITE_LOG_LIMIT)
        self.busy_retries = 0  # EBUSY answers absorbed so far (a health metric)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    # -- writes -------------------------------------------------------------

    def write(self, rel: str, value: object) -> None:
        """Write ``value`` (str() of it) to ``rel``; retries EBUSY with backoff."""
        text = str(value)
        self.writes.append((rel, text))
        if self.dry_run:
            return
        path = self.path(rel)
        for attempt in range(len(self._delays) + 1):
            try:
                self._raw_write(path, text)
                return
            except OSError as e:
                if e.errno == errno.EBUSY and attempt < len(self._delays):
                    self.busy_retries += 1
                    self._sleep(self._delays[attempt])
                    continue
                if isinstance(e, KvtierOSError):
                    raise
                if e.errno == errno.ENOENT:
                    raise FeatureUnavailable(e.errno, f"write {text!r} to {path}", "no such sysfs file") from None
                raise os_error(e.errno, f"write {text!r} to {path}") from None

    def _raw_write(self, path: str, text: str) -> None:
        # One write(2) per value: sysfs stores take the whole buffer at once
        # and a buffered file object would report the error only at close.
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    # -- reads --------------------------------------------------------------

    def read(self, rel: str) -> str:
        """Contents of ``rel``, stripped. DAMON's show functions take the same
        lock as its stores (mutex_trylock), so reads retry EBUSY too."""
        path = self.path(rel)
        for attempt in range(len(self._delays) + 1):
            try:
                return self._raw_read(path).strip()
            except FileNotFoundError:
                raise FeatureUnavailable(errno.ENOENT, f"read {path}", "no such sysfs file") from None
            except OSError as e:
                if e.errno == errno.EBUSY and attempt < len(self._delays):
                    self.busy_retries += 1
                    self._sleep(self._delays[attempt])
                    continue
                raise os_error(e.errno, f"read {path}") from None
        raise AssertionError("unreachable")

    def _raw_read(self, path: str) -> str:
        return read_bytes(path).decode()

    def read_int(self, rel: str) -> int:
        return int(self.read(rel))

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def listdir_numeric(self, rel: str) -> list[int]:
        """The numbered subdirectories of ``rel`` (DAMON's 0, 1, 2...), sorted."""
        try:
            names = os.listdir(self.path(rel))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise os_error(e.errno, f"list {self.path(rel)}") from None
        return sorted(int(n) for n in names if n.isdigit())

    def clear_log(self) -> None:
        self.writes.clear()
