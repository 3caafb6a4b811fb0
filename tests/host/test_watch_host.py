"""Zero-integration mode with the real kvtierd: an unmodified Python program
(no kvtier import) is adopted by a ``[[watch]]`` rule, followed as its
mappings come and go, shown as adopted by ``kvtierctl regions``, and dropped
when it exits. This host has one NUMA node, so placement across tiers is the
guest's test; here every adopted block must be measured in DRAM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest
from test_daemon import PY, DaemonProc, wait_for, workdir  # noqa: F401  (fixture)

pytestmark = pytest.mark.root

MIB = 1 << 20

# Plain Python: bytearrays this large are malloc'ed with mmap, so each one is
# its own anonymous mapping; reading a 32 MiB part keeps it warm.
PROGRAM = textwrap.dedent("""
    import sys
    pools = {"a": bytearray(256 << 20)}
    pools["a"][::4096] = b"\\1" * (256 << 20 >> 12)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "more":
            pools["b"] = bytearray(128 << 20)
            pools["b"][::4096] = b"\\2" * (128 << 20 >> 12)
        elif cmd == "drop":
            del pools["a"]
        elif cmd == "read":
            sum(pools["a"][: 32 << 20:4096])
        print("ok", flush=True)
    # Exit with the pool still mapped, as an engine that stops does: a normal
    # interpreter exit frees the bytearrays first, and the daemon would then
    # drop the region as unmapped (its own test) before seeing the exit.
    import os
    os._exit(0)
""")


def ctl(d, *args):
    out = subprocess.run([PY, "-m", "kvtier.ctl", "--socket", d.sock, *args], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out) if "--json" in args else out


def test_unmodified_program_is_adopted_followed_and_dropped(workdir):
    tag = f"kvtier-watch-host-{uuid.uuid4().hex[:12]}"
    d = DaemonProc(workdir, extra_config=f"""
        [[watch]]
        name = "plain"
        cmdline = "{tag}"
        min_mapping = {100 * MIB}
        block_size = {4 * MIB}
        tenant = "zero-int"
        """, args=("--set", "daemon.watch_interval=0.2")).start()
    prog = subprocess.Popen([PY, "-c", PROGRAM, tag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert prog.stdout.readline().strip() == "ready"

        def do(cmd):
            prog.stdin.write(cmd + "\n")
            prog.stdin.flush()
            assert prog.stdout.readline().strip() == "ok"

        def mine():
            return sorted((r for r in d.regions() if r["pid"] == prog.pid), key=lambda r: r["start"])

        wait_for(lambda: len(mine()) == 1, "the 256 MiB pool to be adopted")
        (r,) = mine()
        assert (r["adopted_by"], r["tenant"], r["block_size"]) == ("plain", "zero-int", 4 * MIB)
        # The region starts at the first whole block inside the mapping; the
        # kernel may have merged the pool's VMA with neighbouring anonymous
        # memory of the interpreter, so it is at least the pool, a bit more.
        assert r["start"] % (4 * MIB) == 0 and 252 * MIB < r["length"] < 300 * MIB
        do("read")
        # The pool's blocks measured, in DRAM (tier 0) on this one-node host.
        wait_for(lambda: mine()[0]["blocks_by_tier"].get("0", 0) >= 63, "the adopted blocks to be measured")
        text = ctl(d, "regions")
        assert "watch:plain" in text and "ORIGIN" in text, text

        # The second pool is mapped right below the first and the kernel
        # merges the two VMAs: the region grows downwards to cover both.
        do("more")
        wait_for(lambda: sum(x["length"] for x in mine()) > 380 * MIB, "the second pool to be adopted")
        do("drop")
        wait_for(lambda: 124 * MIB < sum(x["length"] for x in mine()) < 252 * MIB,
                 "the freed pool's blocks to be released")
        # Adopted regions never enter the state file (the next scan adopts again).
        with open(d.state) as f:
            assert not json.load(f).get("regions"), "adopted regions were persisted"
        prog.stdin.close()
        prog.wait(timeout=20)
        wait_for(lambda: mine() == [], "the exited program's regions to go")
    finally:
        if prog.poll() is None:
            prog.kill()
            prog.wait()
        rc = d.stop()
    log = d.read_log()
    assert rc == 0 and "Traceback" not in log, log
    for event in ("watch_adopted", "watch_resized", "regions_dropped"):
        assert event in log, (event, log)
