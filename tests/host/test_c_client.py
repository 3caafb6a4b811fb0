"""docs/protocol.md is enough to write a client: a C one, against a real kvtierd (root).

tests/clients/kvtier_client.c was written from docs/protocol.md alone (one
file, its own MessagePack encoder and decoder, no library). It is built
here with the system C compiler and run against a real kvtierd on a real
unix socket; it checks every answer it gets against the page (section
numbers in its comments) and exits non-zero on the first broken promise.
While it holds its region (``--pause``) this test asks the daemon, through
the Python client, what it saw: the hinted blocks counted, the phase, the
moves; after it, the region is gone.

The example frames of the page's section 8 are then sent byte for byte to
the same daemon by a process that maps the example's range
(0x7f0000000000, 1 GiB), and the answers compared with the page's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtierd import acting
from kvtier.client import Client
from protocol_doc import doc_examples
from test_daemon import DaemonProc, workdir  # noqa: F401  (fixture)
from waiting import wait_for

pytestmark = pytest.mark.root

SOURCE = Path(__file__).resolve().parent.parent / "clients" / "kvtier_client.c"
DEADLINE = 60.0
NBLOCKS = 8  # kvtier_client.c's NBLOCKS
# The C client hints once, in a burst, and reads the temperatures seconds
# later: hotness.end_of_run = 0 keeps a burst from being taken as a
# finished run (temperature 0) meanwhile, as docs/protocol.md advises for a
# client that hints only now and then. min_residence_s holds the operator's
# moves: at 0 the policy promoted block 3, hinted hot, from swap straight
# back to DRAM (MADV_WILLNEED and process_vm_readv 50 ms after the pageout,
# under strace) before the client's own "migrate back", which then answered
# `already`: one fresh-clone CI run in three failed so.
CONFIG = f"""\
    tick_interval = 0.1
    residency_interval = 0.5
    [policy]
    capacity = {{ "0" = {1 << 30} }}
    min_residence_s = 60.0
    [hotness]
    end_of_run = 0
    """


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def client_binary(tmp_path_factory) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if _in_ci():
            pytest.fail("no C compiler (cc/gcc) to build tests/clients/kvtier_client.c")
        pytest.skip("no C compiler (cc/gcc): the C client cannot be built")
    out = tmp_path_factory.mktemp("cclient") / "kvtier_client"
    r = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-o", str(out), str(SOURCE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{cc} failed:\n{r.stderr}"
    return str(out)


@pytest.fixture(scope="module")
def kvtierd(tmp_path_factory, swapfile):
    """One daemon for the module, with a swap tier (the C client migrates a
    block to swap and back) and DRAM room for everything."""
    with acting(tmp_path_factory.mktemp("kvtierd"), CONFIG, DEADLINE) as daemon:
        yield daemon


def test_c_client_against_kvtierd(client_binary, kvtierd):
    with Client(kvtierd.socket) as py:
        before = py.stats()
        proc = subprocess.Popen([client_binary, "--pause", kvtierd.socket], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("PAUSE "):
                    break
            else:
                proc.wait(DEADLINE)
                pytest.fail(f"the C client ended before pausing (exit {proc.returncode}):\n"
                            f"{''.join(lines)}{proc.stderr.read()}")
            fields = dict(kv.split("=") for kv in line.split()[1:])
            region, hinted = int(fields["region"]), int(fields["hinted"])

            # The daemon's view while the C process holds its region.
            (reg,) = [r for r in py.regions(pid=proc.pid) if r["id"] == region]
            assert (reg["nblocks"], reg["block_size"], reg["name"], reg["priority"]) == (
                NBLOCKS, 4 * os.sysconf("SC_PAGE_SIZE"), "c-client", -5)
            # 39 good pipelined frames of 3 entries (the bad one counted
            # nothing), then 300 good entries of 301 through the hint ring
            assert hinted == 39 * 3 + 300
            assert reg["block_hints"] == hinted
            blocks = py.request("blocks", region=region)
            temps = np.frombuffer(blocks["temps"], "<f4")
            flags = np.frombuffer(blocks["flags"], "u1")
            assert (temps > 0).all(), temps  # every block was hinted
            assert ((flags >> 3) & 1).tolist() == [0] * 6 + [1, 1]  # phase prefill_done on 6, 7
            assert np.frombuffer(py.request("query", region=region)["tiers"], "i1").tolist() == [0] * NBLOCKS

            proc.stdin.write("\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=DEADLINE)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = "".join(lines) + out
        assert proc.returncode == 0, f"C client exit {proc.returncode}:\n{out}{err}"
        assert out.rstrip().endswith("OK"), out

        # After unregister the region is gone, and what the client did is counted.
        assert [r for r in py.regions(pid=proc.pid)] == []
        after = py.stats()
        delta = {k: after[k] - before[k] for k in ("block_hints_total", "regions_registered_total",
                                                  "regions_unregistered_total", "engine_moves_sent_total",
                                                  "engine_moves_dropped_total")}
        # its KV region and its engine-mode region; the client skips the
        # engine region where the daemon's swap tier has no room for it (the
        # host's swap is shared: another user may have filled it)
        engine = "(no swap tier)" not in out
        if not engine:  # then the daemon says so to Python too, not only to the C client
            length = NBLOCKS * 4 * os.sysconf("SC_PAGE_SIZE")
            assert not [t for t in py.request("tiers")["tiers"] if t["kind"] == "swap" and t["free"] > length]
        assert delta == {"block_hints_total": hinted, "regions_registered_total": 1 + engine,
                         "regions_unregistered_total": 1 + engine, "engine_moves_sent_total": int(engine),
                         "engine_moves_dropped_total": 0}
        errors = {k: after["errors"].get(k, 0) - before["errors"].get(k, 0) for k in after["errors"]}
        assert errors["register:overlap"] == 1
        assert errors["hint:invalid_argument"] == 3  # past the end, counts length, bin length
        assert errors["frame:bad_frame"] == 1 and errors["frame:message_too_large"] == 1
        ring = {k: after["hint_ring_entries"].get(k, 0) - before["hint_ring_entries"].get(k, 0)
                for k in after["hint_ring_entries"]}
        assert {k: v for k, v in ring.items() if v} == {"accepted": 300, "bad_block": 1}
        assert after["hint_rings_open"] == before["hint_rings_open"]  # gone with the C client's connection
        # block 3 went to swap and back (migrate --wait both ways), and the
        # engine region's block 1 was moved to swap by its owner (move_done)
        swap = {t["kind"]: t["index"] for t in py.request("tiers")["tiers"]}["swap"]
        moved = {k: after["migrations"].get(k, 0) - before["migrations"].get(k, 0) for k in after["migrations"]}
        assert {k: v for k, v in moved.items() if v} == {f"0:{swap}": 2, f"{swap}:0": 1}, moved
        assert f"migrated block 3 to swap tier {swap} and back" in out
        assert "block 1 moved by its owner" in out


# Runs in a child process with address-space randomisation off (setarch -R),
# so that the example's range 0x7f0000000000 + 1 GiB is free: it maps it (no
# page touched), sends the page's example frames as they are and prints the
# raw answers.
REPLAY = r"""
import ctypes, json, os, socket, struct, sys
sys.path.insert(0, sys.argv[2])
from protocol_doc import doc_examples
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE, MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x4000, 0x100000
addr = libc.mmap(0x7F0000000000, 1 << 30, 3, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0)
if addr != 0x7F0000000000:
    sys.exit(f"cannot map 0x7f0000000000 + 1 GiB: {os.strerror(ctypes.get_errno())} (got {addr})")
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
def answer():
    head = s.recv(4, socket.MSG_WAITALL)
    (n,) = struct.unpack(">I", head)
    return head + s.recv(n, socket.MSG_WAITALL)
dumps = doc_examples()
out = {}
s.sendall(dumps[0]); out["register"] = answer()
print(json.dumps({"register": out["register"].hex(), "pid": os.getpid()}), flush=True)
region = int(sys.stdin.readline())
hint = bytearray(dumps[2])
at = hint.index(b"\xa6region") + 7
assert hint[at] == 7 and region < 128
hint[at] = region
s.sendall(bytes(hint)); out["hint"] = answer()
s.sendall(dumps[4]); out["regions"] = answer()
unknown = bytes.fromhex("83a26f70aa756e7265676973746572a26964" "04" "a6726567696f6e" "09")
s.sendall(struct.pack(">I", len(unknown)) + unknown); out["unregister"] = answer()
print(json.dumps({k: v.hex() for k, v in out.items()}), flush=True)
"""


def test_doc_examples_against_kvtierd(kvtierd):
    """Section 8's frames on the wire of a real daemon: the requests are
    taken as they are and the answers are what the page shows (the
    register answer with this run's region id and pid)."""
    docs = doc_examples()
    setarch = ["setarch", "-R"] if shutil.which("setarch") else []
    tests_dir = str(Path(__file__).resolve().parent.parent)
    child = subprocess.Popen([*setarch, sys.executable, "-c", REPLAY, kvtierd.socket, tests_dir],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        assert first, f"replay child failed: {child.stderr.read()}"
        got = json.loads(first)
        reg_answer = bytes.fromhex(got["register"])
        dec = msgspec.msgpack.decode(reg_answer[4:])
        assert dec["ok"], dec
        region = dec["result"]["region"]
        # The page's answer with this run's region and pid, in the page's key
        # order, is byte for byte what the daemon sent.
        want = msgspec.msgpack.decode(docs[1][4:])
        want["result"].update(region=region, pid=got["pid"])
        payload = msgspec.msgpack.encode(want)
        assert reg_answer.hex() == (len(payload).to_bytes(4, "big") + payload).hex()
        child.stdin.write(f"{region}\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=DEADLINE)
        assert child.returncode == 0, err
        answers = {k: bytes.fromhex(v) for k, v in json.loads(out).items()}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert answers["hint"].hex() == docs[3].hex()  # {"id": 3, "ok": true, "result": {"accepted": 3}}
    assert answers["unregister"].hex() == docs[5].hex()  # not_found "no region 9", id 4
    page = msgspec.msgpack.decode(answers["regions"][4:])
    assert page["id"] == 6 and page["ok"], page
    ids = [r["id"] for r in page["result"]["regions"]]
    assert len(ids) <= 2 and all(i > 7 for i in ids) and ids == sorted(ids), ids
    assert "next" not in page["result"] or page["result"]["next"] == ids[-1]
    # the child's exit dropped its region (1 GiB of never-touched memory)
    with Client(kvtierd.socket) as py:
        wait_for(lambda: all(r["id"] != region for r in py.regions()), "the replay child's region dropped",
                 timeout=DEADLINE, interval=0.1)


# A second C client, tests/host/c_client/doc_client.c, written from
# docs/protocol.md alone by another hand: it walks every op's answer
# schema, the paging of query/blocks/regions, the hint ring (layout, wrap
# around, bad words, the unread-answers refusal), regions that go away,
# someone else's region (a child as uid 65534) and the error rows of
# section 6.1; in "limits" mode, against a daemon with small limits, the
# rate limit, the frame and idle timeouts, the frame size edge, paging at a
# small max_message_bytes and the per-uid connection limit. It prints one
# "ok"/"FAIL" line a check and exits with the number of failures.
DOC_CLIENT = Path(__file__).resolve().parent / "c_client" / "doc_client.c"
DOC_CLIENT_LIMITS = """\
    [limits]
    max_message_bytes = 8192
    request_burst = 3
    requests_per_second = 20
    frame_timeout = 0.5
    idle_timeout = 3
    max_connections_per_uid = 4
    """


@pytest.fixture(scope="module")
def doc_client(tmp_path_factory) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc: tests/host/c_client/doc_client.c cannot be built")
    out = tmp_path_factory.mktemp("docclient") / "doc_client"
    r = subprocess.run([gcc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-o", str(out), str(DOC_CLIENT), "-lm"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"gcc failed:\n{r.stderr}"
    return str(out)


def _run_doc_client(binary: str, workdir: str, config: str, *args: str) -> str:
    d = DaemonProc(workdir, config).start()  # a world-traversable dir: the uid 65534 child connects too
    try:
        r = subprocess.run([binary, d.sock, *args], capture_output=True, text=True, timeout=240)
    finally:
        rc = d.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"doc_client {' '.join(args)} failed (exit {r.returncode}):\n" + "\n".join(
        line for line in out.splitlines() if not line.startswith("ok "))
    assert out.rstrip().endswith("0 failures"), out
    assert rc == 0 and "Traceback" not in d.read_log(), d.read_log()
    return out


def test_doc_client_against_kvtierd(doc_client, workdir):
    out = _run_doc_client(doc_client, workdir, "")
    assert out.count("\nok ") > 300, out  # every check ran
    assert "skip other-uid checks" not in out


def test_doc_client_limits_against_kvtierd(doc_client, workdir):
    out = _run_doc_client(doc_client, workdir, DOC_CLIENT_LIMITS, "limits")
    assert out.count("\nok ") > 30, out
