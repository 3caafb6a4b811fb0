"""Facts and helpers shared by the tests that run inside the QEMU guest.

The guest's shape is fixed by scripts/vm/run.py (node 0: CPUs + 1 GiB,
node 1: 1 GiB CPU-less, node 2: 256 MiB CXL region via dax kmem, swap on
/dev/nvme0n1). Imported by the guest tests as a plain module (tests/vm is on
sys.path under pytest's default import mode).

Wall-clock limits: write a quiet host's figure and pass it through
``scaled(seconds)`` (a subprocess or socket timeout) or ``wait_for(...,
timeout=seconds)`` (polling a condition); both multiply by the guest's
measured slowness (scripts/vm/speed.py; tests/vm/conftest.py re-measures it
before each test), and ``wait_for`` measures again before it gives up, so
load that starts mid-test stretches the deadline too. Count-based limits
that stand in for time (daemon ticks) use ``scaled_count``.

A real kvtierd for a test: ``GuestKvtierd`` (private socket and config,
started, waited for, stopped, its log checked for tracebacks).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_TESTS))  # tests/kvchild.py
sys.path.insert(0, str(_TESTS.parent / "scripts" / "vm"))  # speed.py

import speed  # noqa: E402
from kvchild import KVChild  # noqa: E402

SYS = Path("/sys")
NODE_DIR = SYS / "devices/system/node"
CXL_DEVICES = SYS / "bus/cxl/devices"
DAX_DEVICES = SYS / "bus/dax/devices"
MEMORY_TIERS = SYS / "devices/virtual/memory_tiering"
DAMON_ADMIN = SYS / "kernel/mm/damon/admin"

DRAM_NODE, FAR_NODE, CXL_NODE = 0, 1, 2
SWAP_DISK = "nvme0n1"
MiB = 1 << 20


def read(path: Path | str) -> str:
    return Path(path).read_text().strip()


def parse_list(text: str) -> list[int]:
    """Kernel cpu/node list syntax ("0-2,4") to ints; "" is empty."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def node_mem_total(node: int) -> int:
    """Bytes of MemTotal in the node's meminfo."""
    for line in read(NODE_DIR / f"node{node}/meminfo").splitlines():
        if "MemTotal:" in line:
            return int(line.split()[-2]) * 1024
    raise AssertionError(f"node{node}/meminfo has no MemTotal")


def numa_maps_nodes(pid: int, addr: int) -> dict[int, int]:
    """Pages per node of the mapping containing ``addr`` (/proc/PID/numa_maps)."""
    best: tuple[int, dict[int, int]] | None = None
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        parts = line.split()
        start = int(parts[0], 16)
        if start <= addr and (best is None or start > best[0]):
            nodes = {}
            for p in parts[2:]:
                k, _, v = p.partition("=")
                if k[:1] == "N" and k[1:].isdigit():
                    nodes[int(k[1:])] = int(v)
            best = (start, nodes)
    assert best is not None, f"no mapping at 0x{addr:x} in /proc/{pid}/numa_maps"
    return best[1]


def block_ranges(child: KVChild, block: int, first: int = 0, count: int | None = None):
    """(starts, lengths) uint64 arrays of ``count`` blocks of ``block`` bytes."""
    n = child.size // block
    count = n - first if count is None else count
    starts = np.uint64(child.addr) + np.arange(first, first + count, dtype=np.uint64) * np.uint64(block)
    return starts, np.full(count, block, dtype=np.uint64)


def slowness() -> float:
    """How many times slower than a quiet host the guest runs (>= 1)."""
    return speed.current()


def remeasure() -> float:
    """Measure the slowness now, make it current (also for child processes,
    through the environment) and tell run.py, whose whole-run timeout
    follows it."""
    f = speed.measure()
    os.environ[speed.ENV] = f"{f:.2f}"
    speed.report(f)
    return f


def scaled(seconds: float) -> float:
    """A quiet host's ``seconds``, for this guest now."""
    return seconds * slowness()


def scaled_count(n: int) -> int:
    """A count that stands in for time (ticks of a daemon with a fixed
    tick interval), for this guest now."""
    return math.ceil(n * slowness())


def wait_for(pred, what: str, *, timeout: float, interval: float):
    """Call ``pred`` until it returns something truthy and return that; fail
    after ``timeout`` quiet-host seconds times the slowness, measured again
    when that runs out (a deadline only ends once the guest is no slower
    than when it was set)."""
    t0 = time.monotonic()
    factor = slowness()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() - t0 > timeout * factor:
            now = remeasure()
            if now <= factor:
                raise AssertionError(f"timed out after {time.monotonic() - t0:.0f}s waiting for {what} "
                                     f"({timeout:.0f}s nominal x slowness {factor:.2f})")
            factor = now
        time.sleep(interval)


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


class GuestKvtierd:
    """A real kvtierd (``python -m kvtier.daemon``) in ``tmp``, with a
    private socket, no state file, and its log in ``tmp/kvtierd.log``.

    ``daemon`` adds [daemon] keys; ``config`` is the rest of the TOML (other
    sections, verbatim). Starting waits for the socket (60 quiet-host
    seconds), and for ``wait_log`` in the log when given; ``client`` is a
    Client for the test's own requests. ``stop()`` (also on leaving a
    ``with``) terminates it and, with ``check=True``, fails if its log holds
    a traceback."""

    def __init__(self, tmp: Path, config: str = "", *, daemon: dict | None = None, name: str = "vm test",
                 wait_log: str | None = None, client_timeout: float = 60):
        from kvtier.client import Client

        self.sock = tmp / "kvtierd.sock"
        self.log = tmp / "kvtierd.log"
        keys = {"socket": str(self.sock), "state_file": "", **(daemon or {})}
        conf = tmp / "kvtierd.toml"
        conf.write_text("[daemon]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items()) + config)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", str(conf)],
                                         stdout=f, stderr=f)
        self.client = None
        try:
            wait_for(lambda: self.sock.exists() or self.proc.poll() is not None, "kvtierd's socket",
                     timeout=60, interval=0.1)
            assert self.proc.poll() is None, f"kvtierd exited {self.proc.returncode}:\n{self.log_tail()}"
            if wait_log:
                wait_for(lambda: wait_log in self.log.read_text(), repr(wait_log), timeout=60, interval=0.1)
            self.client = Client(str(self.sock), name=name, timeout=scaled(client_timeout))
        except BaseException:
            self.stop(check=False)
            raise

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stats(self) -> dict:
        return self.client.request("stats")

    def ticks(self) -> int:
        return int(self.stats()["ticks_total"])

    def tiers(self) -> list[dict]:
        return self.client.request("tiers")["tiers"]

    def stop(self, check: bool = True) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=scaled(60))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if check:
            assert "Traceback" not in self.log.read_text(errors="replace"), self.log_tail()

    def __enter__(self) -> GuestKvtierd:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)
