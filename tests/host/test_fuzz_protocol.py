"""Property test: hostile bytes never crash kvtierd or disturb other clients.

A forked child drops to an unprivileged user (so it cannot touch the other
client's regions legitimately) and sends >= 10,000 generated messages:
msgpack maps with any op and any field values (wrong types, out-of-range
integers, packed arrays of wrong lengths, indices past the region's end),
raw garbage payloads, truncated frames, zero-length and oversized frames.
Every complete frame must be answered with a well-formed response (an error
code from the documented list, or a success for the few valid ones) unless
the frame was one the protocol says closes the connection. Meanwhile a
well-behaved client process registers, hints, queries and unregisters in a
loop and must see no error at all, and the daemon must never log an
internal error.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback

import msgspec
import numpy.random  # noqa: F401  (hypothesis seeds it lazily; import before dropping root)
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import hypothesis.internal.conjecture as _conjecture
import importlib
import pkgutil

# The fuzzing child drops root; a CI checkout may sit in a directory only
# root can read (mktemp -d is 0700), so every module hypothesis imports lazily
# (optimiser, shrinker, ...) is imported now, while we can still read it.
for _m in pkgutil.walk_packages(_conjecture.__path__, _conjecture.__name__ + "."):
    importlib.import_module(_m.name)

from kvtier import protocol
from kvtier.client import Client

from test_daemon import DROP, NOBODY, DaemonProc, workdir  # noqa: F401  (fixture)

pytestmark = pytest.mark.root

MAX_MSG = 65536
EXAMPLES = 1700  # x 4..12 messages each: comfortably over 10,000 messages
MIN_MESSAGES = 10_000

OPS = list(protocol.OPS)
FIELD_NAMES = sorted({f for t in protocol.REQUEST_TYPES for f in t.__struct_fields__} | {"op", "id"})

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, 300),
    st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
packed = st.one_of(
    st.binary(max_size=64),
    st.lists(st.integers(0, 2**32 - 1), max_size=32).map(lambda xs: protocol.pack_blocks(xs)),
    st.lists(st.integers(0, 40), max_size=32).map(lambda xs: protocol.pack_blocks(xs)),
)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=40), packed)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=6,
)


@st.composite
def request_map(draw, own_region: int):
    op = draw(st.one_of(st.sampled_from(OPS), st.sampled_from(OPS), st.text(max_size=12), values))
    d = {"op": op}
    if draw(st.booleans()):
        d["id"] = draw(st.one_of(ints, values))
    # Mostly the op's own fields (so validation gets past the tag), some junk.
    typ = protocol.OPS.get(op) if isinstance(op, str) else None
    names = list(typ.__struct_fields__) if typ else []
    for name in draw(st.lists(st.sampled_from(names or FIELD_NAMES), max_size=6, unique=True)):
        if name == "region":
            d[name] = draw(st.one_of(st.just(own_region), st.just(own_region), ints, values))
        elif name in ("blocks", "counts"):
            d[name] = draw(st.one_of(packed, packed, values))
        else:
            d[name] = draw(st.one_of(ints, values))
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), max_size=2)):
        d[name] = draw(values)
    return d


# (kind, bytes): "frame" = complete frame, must be answered; "fatal" = the
# daemon answers and closes; "truncated" = we close mid-frame.
@st.composite
def message(draw, own_region: int):
    kind = draw(st.sampled_from(["map"] * 6 + ["garbage", "truncated", "oversized", "empty"]))
    if kind == "map":
        return "frame", protocol.frame(msgspec.msgpack.encode(draw(request_map(own_region))))
    if kind == "garbage":
        return "frame", protocol.frame(draw(st.binary(min_size=1, max_size=200)))
    if kind == "truncated":
        full = protocol.frame(msgspec.msgpack.encode(draw(request_map(own_region))))
        return "truncated", full[: draw(st.integers(1, len(full) - 1))]
    if kind == "oversized":
        return "fatal", protocol.HEADER.pack(draw(st.integers(MAX_MSG + 1, 2**32 - 1))) + draw(st.binary(max_size=16))
    return "fatal", b"\0\0\0\0"


class Conn:
    def __init__(self, path: str):
        self.path = path
        self.s: socket.socket | None = None
        self.reader = protocol.FrameReader(1 << 30)
        self.pending: list[bytes] = []

    def sock(self) -> socket.socket:
        if self.s is None:
            self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.s.settimeout(20)
            self.s.connect(self.path)
            self.reader = protocol.FrameReader(1 << 30)
            self.pending = []
        return self.s

    def close(self) -> None:
        if self.s is not None:
            self.s.close()
            self.s = None

    def response(self) -> protocol.Response | None:
        """Next response, or None if the daemon closed the connection."""
        while not self.pending:
            data = self.s.recv(65536)
            if not data:
                return None
            self.pending += self.reader.feed(data)
        return protocol.decode_response(self.pending.pop(0))


def check_response(resp: protocol.Response) -> None:
    if resp.ok:
        assert resp.error is None
    else:
        assert resp.error is not None and resp.error.code in protocol.ERROR_CODES, resp
        assert resp.error.code != protocol.E_INTERNAL, resp.error.message


def fuzz_child(path: str, tx) -> None:
    """Runs in a forked child: drop privileges, register own memory, fuzz."""
    counts = {"messages": 0, "answered": 0, "closed": 0, "ok": 0}
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        buf = mmap.mmap(-1, 8 << 20)
        buf.write(b"\1" * len(buf))
        own = Client(path).register(buf, block_size=1 << 20).id
        conn = Conn(path)

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(message(own), min_size=4, max_size=12))
        def run(msgs):
            for kind, data in msgs:
                s = conn.sock()
                counts["messages"] += 1
                s.sendall(data)
                if kind == "truncated":
                    conn.close()
                    continue
                resp = conn.response()
                if resp is None:
                    assert kind == "fatal", f"connection closed after a non-fatal frame {data[:64]!r}"
                    counts["closed"] += 1
                    conn.close()
                    continue
                check_response(resp)
                counts["answered"] += 1
                counts["ok"] += resp.ok
                if kind == "fatal":
                    assert not resp.ok
                    assert conn.response() is None, "fatal frame must close the connection"
                    counts["closed"] += 1
                    conn.close()

        run()
        counts["error"] = None
    except BaseException:
        counts["error"] = traceback.format_exc()
    tx.send(counts)
    tx.close()


GOOD = DROP.replace("import os, sys", "import os, sys, json, mmap, time") + r"""
import numpy as np
from kvtier.client import Client, KvtierClientError
sock, stop = sys.argv[1], sys.argv[2]
buf = mmap.mmap(-1, 4 << 20); buf.write(b"\1" * len(buf))
c = Client(sock)
ops = errors = 0
msgs = []
while not os.path.exists(stop):
    try:
        with c.register(buf, block_size=1 << 16, name="good") as r:
            r.hint(np.arange(64) % r.nblocks); r.flush()
            errs = c.flush()
            errors += len(errs); msgs += [str(e) for e in errs]
            assert len(r.query()) == r.nblocks
            r.phase("prefill_done", [0, 1])
        ops += 1
        time.sleep(0.002)  # a client, not a load generator: leave the fuzzer the CPU
    except Exception as e:
        errors += 1; msgs.append(repr(e))
print(json.dumps({"ops": ops, "errors": errors, "messages": msgs[:5]}))
"""


def test_fuzzed_messages_never_crash_the_daemon(workdir):  # noqa: F811
    d = DaemonProc(workdir, extra_config=f"""
        [limits]
        max_message_bytes = {MAX_MSG}
        requests_per_second = 1e9
        request_burst = 1000000000
        """, args=("--set", "daemon.state_flush_delay=0.05", "--set", "daemon.tick_interval=0.2")).start()
    stop = os.path.join(workdir, "stop")
    good = subprocess.Popen([sys.executable, "-c", GOOD, d.sock, stop], stdout=subprocess.PIPE, text=True)
    ctx = multiprocessing.get_context("fork")
    rx, tx = ctx.Pipe(duplex=False)
    try:
        p = ctx.Process(target=fuzz_child, args=(d.sock, tx))
        t0 = time.monotonic()
        p.start()
        assert rx.poll(600), "fuzzer did not finish"
        counts = rx.recv()
        p.join(60)
        elapsed = time.monotonic() - t0
        assert p.exitcode == 0
        assert counts["error"] is None, counts["error"]
        assert counts["messages"] >= MIN_MESSAGES, counts
        assert counts["closed"] > 0 and counts["answered"] > counts["ok"] > 0
        assert d.proc.poll() is None, "kvtierd died"
        open(stop, "w").close()
        out = json.loads(good.communicate(timeout=60)[0])
        assert out["ops"] > 0 and out["errors"] == 0, out
        with d.client() as c:
            st_ = c.stats()
        assert not any(k.endswith(":internal_error") for k in st_["errors"]), st_["errors"]
        print(f"fuzz: {counts} in {elapsed:.1f}s; good client {out['ops']} cycles")
    finally:
        if good.poll() is None:
            good.kill()
        assert d.stop() == 0
    log = d.read_log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
