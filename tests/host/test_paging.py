"""Answers in pages against a real kvtierd: `regions` with `after`/`limit`
and `next` (issue 12: a user with thousands of regions got one answer of
all of them), and kvtierctl following the pages of `regions` and `blocks`
(it printed the first page only), printing each page as it arrives."""

from __future__ import annotations

import json
import mmap
import socket
import subprocess
import time

import msgspec
import pytest

from kvtier import protocol

from test_daemon import DEADLINE, PY, DaemonProc, wait_for, workdir  # noqa: F401  (fixture)

pytestmark = pytest.mark.root

MAX_MESSAGE = 65536
LIMITS = f"""
    [limits]
    max_message_bytes = {MAX_MESSAGE}
    requests_per_second = 1e9
    request_burst = 1000000000
    """


def _call(s: socket.socket, reader: protocol.FrameReader, req: dict) -> tuple[int, dict]:
    """(frame bytes, result) of one request."""
    s.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    frames: list[bytes] = []
    while not frames:
        frames += reader.feed(s.recv(1 << 20))
    r = protocol.decode_response(frames[0])
    assert r.ok, r.error
    return len(frames[0]) + protocol.HEADER_SIZE, r.result


def ctl(d: DaemonProc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvtier.ctl", "--socket", d.sock, *args], capture_output=True, text=True,
                          timeout=120)


def test_regions_come_in_pages_and_kvtierctl_lists_every_one(workdir):
    n = 600
    d = DaemonProc(workdir, LIMITS).start()
    buf = mmap.mmap(-1, n * 4096)
    try:
        with d.client() as c:
            base = _addr(buf)
            ids = [c.register(addr=base + i * 4096, length=4096, block_size=4096, name=f"r{i:04d}").id
                   for i in range(n)]
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(DEADLINE)
            s.connect(d.sock)
            reader = protocol.FrameReader(1 << 30)
            size, first = _call(s, reader, {"op": "regions", "id": 1})
            assert len(first["regions"]) < n and "next" in first, (
                f"{len(first['regions'])} regions in one answer, next={first.get('next')}")
            assert size <= MAX_MESSAGE
            # Every region once, ascending, each page within the frame limit
            # and the limit asked for.
            seen: list[int] = []
            after = 0
            pages = 0
            while True:
                size, page = _call(s, reader, {"op": "regions", "id": 2, "after": after, "limit": 100})
                pages += 1
                assert size <= MAX_MESSAGE and 0 < len(page["regions"]) <= 100
                seen += [r["id"] for r in page["regions"]]
                if "next" not in page:
                    break
                assert page["next"] == seen[-1]
                after = page["next"]
            assert seen == sorted(ids) and pages == 6
            # The pid filter pages the same way; the library follows the pages.
            _, mine = _call(s, reader, {"op": "regions", "id": 3, "pid": 1, "limit": 5})
            assert mine["regions"] == [] and "next" not in mine
            assert [r["id"] for r in c.regions()] == sorted(ids)
            s.close()

            text = ctl(d, "regions")
            assert text.returncode == 0, text.stderr
            lines = text.stdout.splitlines()
            assert lines[0].split()[:3] == ["ID", "PID", "NAME"]
            assert [line.split()[2] for line in lines[1:]] == [f"r{i:04d}" for i in range(n)]
            doc = json.loads(ctl(d, "--json", "regions").stdout)
            assert [r["id"] for r in doc["regions"]] == sorted(ids)
    finally:
        buf.close()
        assert d.stop() == 0


def _addr(buf: mmap.mmap) -> int:
    from kvtier.client import buffer_address

    return buffer_address(buf)[0]


def test_kvtierctl_blocks_follows_the_pages_printing_each_as_it_arrives(workdir):
    nblocks = 50_000
    per_page = (min(MAX_MESSAGE, protocol.MAX_ANSWER_BYTES) - protocol.ANSWER_OVERHEAD) // protocol.BLOCK_ANSWER_BYTES
    pages = -(-nblocks // per_page)
    d = DaemonProc(workdir, LIMITS).start()
    buf = mmap.mmap(-1, nblocks * 4096)  # never touched: costs no memory
    try:
        with d.client() as c:
            rid = str(c.register(buf, block_size=4096).id)
            r = ctl(d, "blocks", rid)
            assert r.returncode == 0, r.stderr
            rows = r.stdout.splitlines()[1:-1]  # header and legend
            assert [int(x.split()[0]) for x in rows] == list(range(nblocks))
            doc = json.loads(ctl(d, "--json", "blocks", rid).stdout)
            assert doc["count"] == nblocks and len(doc["tiers"]) == len(doc["flags"]) == nblocks and "next" not in doc
            part = ctl(d, "blocks", rid, "--first", str(nblocks - per_page - 7), "--count", str(per_page + 5))
            got = [int(x.split()[0]) for x in part.stdout.splitlines()[1:-1]]
            assert got == list(range(nblocks - per_page - 7, nblocks - 2))

            # Streaming: with nobody reading its output, kvtierctl stops in a
            # write to the full pipe (64 KiB, under one page of rows) having
            # asked for one or two pages, not all of them.
            before = c.stats()["requests"].get("blocks", 0)
            p = subprocess.Popen([PY, "-m", "kvtier.ctl", "--socket", d.sock, "blocks", rid],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                def settled():
                    a = c.stats()["requests"].get("blocks", 0)
                    time.sleep(0.3)
                    return a - before if a > before and a == c.stats()["requests"].get("blocks", 0) else None

                asked = wait_for(settled, "kvtierctl to block on its full stdout")
                assert asked <= 2 < pages, f"{asked} of {pages} pages fetched before any was read"
                out, err = p.communicate(timeout=120)
            finally:
                p.kill()
            assert p.returncode == 0, err
            assert len(out.splitlines()) == nblocks + 2
            assert c.stats()["requests"]["blocks"] - before == pages
    finally:
        buf.close()
        assert d.stop() == 0
