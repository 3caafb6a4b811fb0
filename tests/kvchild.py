"""A stand-in inference process for tests: maps a KV pool and obeys commands.

Run as ``python tests/kvchild.py SIZE [--shared] [--memfd] [--shm-file]
[--shm-path=PATH] [--thp] [--sparse]``. It maps SIZE bytes of anonymous
memory (``--shared``: MAP_SHARED, i.e. shmem; ``--memfd``: a memfd mapped
shared; ``--shm-file``: a /dev/shm file; ``--shm-path=PATH``: the named
/dev/shm file PATH, kept, so that other processes map the same pool; only
its first process fills it), fills it with a deterministic pseudo-random pattern,
prints ``ready <address> <size>`` and then reads commands from stdin, one per
line, answering one line each:

    sum                 sha256 of the whole pool (touches every page)
    touch OFF LEN       read one byte per page of [OFF, OFF+LEN)
    write OFF LEN BYTE  fill [OFF, OFF+LEN) with BYTE
    mlock OFF LEN       mlock(2) [OFF, OFF+LEN) (munlock OFF LEN undoes it)
    pin OFF LEN         pin [OFF, OFF+LEN) long-term as io_uring fixed buffers
                        (FOLL_LONGTERM, as CUDA host memory); unpin drops them all
    share OFF LEN       fork a process that maps [OFF, OFF+LEN) too, until exit
    munmap OFF LEN      munmap(2) [OFF, OFF+LEN): the memory is freed under kvtier
    read OFF LEN        start reading [OFF, OFF+LEN) in a loop, a byte per page (a decoder)
    stop                stop that reader; answers "ok N" with the passes made
    exit                quit
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import subprocess
import sys
import threading

import numpy as np

MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_DONTFORK = 10
MADV_DOFORK = 11


def main() -> None:
    size = int(sys.argv[1])
    shared = "--shared" in sys.argv
    thp = "--thp" in sys.argv
    sparse = "--sparse" in sys.argv  # leave the pool untouched (never faulted in)
    named = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--shm-path=")), None)
    if named:  # a named /dev/shm file other processes open too (kept; the first fills it)
        fd = os.open(named, os.O_RDWR | os.O_CREAT, 0o600)
        sparse = sparse or os.fstat(fd).st_size == size
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
    elif "--memfd" in sys.argv or "--shm-file" in sys.argv:
        if "--memfd" in sys.argv:
            fd = os.memfd_create("kvchild")
        else:  # a POSIX shm file, unlinked at once (mapped as /dev/shm/NAME (deleted))
            path = f"/dev/shm/kvchild-{os.getpid()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
    else:
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        buf = mmap.mmap(-1, size, flags=flags | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    buf.madvise(MADV_HUGEPAGE if thp else MADV_NOHUGEPAGE)
    arr = np.frombuffer(buf, dtype=np.uint8)
    rng = np.random.default_rng(1234)
    step = 1 << 24
    for off in range(0, 0 if sparse else size, step):
        n = min(step, size - off)
        arr[off : off + n] = rng.integers(0, 256, n, dtype=np.uint8)
    page = os.sysconf("SC_PAGE_SIZE")
    sharers: list[int] = []  # pipe ends that keep forked sharers alive
    rings: list[int] = []  # io_uring fds holding long-term pins
    print(f"ready {addr} {size}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "sum":
            print(hashlib.sha256(buf).hexdigest(), flush=True)
        elif cmd[0] == "touch":
            off, ln = int(cmd[1]), int(cmd[2])
            s = int(arr[off : off + ln : page].sum())
            print(f"ok {s}", flush=True)
        elif cmd[0] == "write":
            off, ln, b = int(cmd[1]), int(cmd[2]), int(cmd[3])
            arr[off : off + ln] = b
            print("ok", flush=True)
        elif cmd[0] in ("mlock", "munlock"):
            off, ln = int(cmd[1]), int(cmd[2])
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.mlock if cmd[0] == "mlock" else libc.munlock
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            rc = fn(addr + off, ln)
            print("ok" if rc == 0 else f"error {os.strerror(ctypes.get_errno())}", flush=True)
        elif cmd[0] == "pin":
            from kvtier.kernel import native

            off, ln = int(cmd[1]), int(cmd[2])
            try:
                rings.append(native.pin_longterm(native.iovecs(np.array([addr + off], dtype=np.uint64), ln)))
                print("ok", flush=True)
            except OSError as e:
                print(f"error {e}", flush=True)
        elif cmd[0] == "unpin":
            from kvtier.kernel import native

            while rings:
                native.unpin_longterm(rings.pop())
            print("ok", flush=True)
        elif cmd[0] == "share":
            # A forked process maps [OFF, OFF+LEN) too (copy-on-write, as a
            # forked worker would): MADV_PAGEOUT skips pages mapped twice.
            off, ln = int(cmd[1]), int(cmd[2])
            buf.madvise(MADV_DONTFORK, 0, size)
            buf.madvise(MADV_DOFORK, off, ln)
            r, w = os.pipe()
            if os.fork() == 0:
                os.close(w)
                os.read(r, 1)  # until the parent exits
                os._exit(0)
            os.close(r)
            sharers.append(w)
            buf.madvise(MADV_DOFORK, 0, size)
            print("ok", flush=True)
        elif cmd[0] == "munmap":
            off, ln = int(cmd[1]), int(cmd[2])
            libc = ctypes.CDLL(None, use_errno=True)
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            rc = libc.munmap(addr + off, ln)
            print("ok" if rc == 0 else f"error {os.strerror(ctypes.get_errno())}", flush=True)
        elif cmd[0] == "read":
            off, ln = int(cmd[1]), int(cmd[2])
            reader = _Reader(arr[off : off + ln : page])
            reader.start()
            print("ok", flush=True)
        elif cmd[0] == "stop":
            reader.stop.set()
            reader.join()
            print(f"ok {reader.passes}", flush=True)
        elif cmd[0] == "exit":
            print("bye", flush=True)
            return
        else:
            print(f"error unknown command {cmd[0]}", flush=True)


class _Reader(threading.Thread):
    """Reads one byte of every page of a range, over and over (a decode loop
    over its KV blocks): a page paged out comes straight back."""

    def __init__(self, pages: np.ndarray):
        super().__init__(daemon=True)
        self.pages = pages
        self.stop = threading.Event()
        self.passes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            int(self.pages.sum())
            self.passes += 1


def wait_writeback_done(limit_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with open("/proc/meminfo") as f:
            wb = next(int(line.split()[1]) for line in f if line.startswith("Writeback:"))
        if wb == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"swap writeback still running after {limit_s} s")


def page_out(child: KVChild) -> None:
    """Page the child's whole pool out so that reading it back is a major fault.

    One MADV_PAGEOUT of dirty anonymous pages only starts their writeback:
    the pages stay in the swap cache (SwapCached grows by the pool size on
    this host) and reading them is a minor fault. Reading them back maps the
    now clean swap-cache pages again, and a second MADV_PAGEOUT drops those
    at once, with no I/O, leaving only the copy on swap. Pages still under
    writeback at the second pass would stay cached, so it waits for the
    writeback to end first; and folios whose writeback just ended sit in a
    per-CPU LRU batch holding a reference (without a drain the last dozen
    pages stayed cached every time; with it, now and then a few still do),
    so the batches are drained first: migrate_pages(2) drains every CPU's
    batches, and with the same source and destination node it moves nothing.
    Needs root (process_madvise of another process) and a swap device.
    """
    from kvtier.kernel import native
    from kvtier.kernel.procfs import PM_SWAP, Pagemap

    P = native.PAGE_SIZE
    pidfd = native.pidfd_open(child.pid)
    try:
        iov = native.iovecs(np.array([child.addr], dtype=np.uint64), child.size)
        native.process_madvise(pidfd, iov, native.MADV_PAGEOUT)
        wait_writeback_done()
        assert child.ask(f"touch 0 {child.size}").startswith("ok")
        native.migrate_pages(child.pid, [0], [0])
        native.process_madvise(pidfd, iov, native.MADV_PAGEOUT)
    finally:
        os.close(pidfd)
    with Pagemap(child.pid) as pm:
        e = pm.read(child.addr, child.size // P, P)
    assert ((e & PM_SWAP) != 0).all(), "pool not fully paged out"


class KVChild:
    """Host-side handle: starts kvchild.py and talks to it."""

    def __init__(self, size: int, *extra: str, python: str = sys.executable):
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), str(size), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError(f"kvchild failed to start: {line}")
        self.addr = int(line[1])
        self.size = int(line[2])
        self.pid = self.proc.pid

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def checksum(self) -> str:
        return self.ask("sum")

    def smaps_kib(self) -> dict[str, int]:
        """The kernel's Rss and Swap (KiB) of the pool's mapping, from
        /proc/PID/smaps: what the kernel itself counts, shared memory too."""
        out: dict[str, int] = {}
        mine = False
        with open(f"/proc/{self.pid}/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    mine = int(head.split("-")[0], 16) == self.addr
                elif mine and head in ("Rss:", "Swap:"):
                    out[head[:-1]] = int(line.split()[1])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("exit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "KVChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    main()
