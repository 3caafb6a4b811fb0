"""Memory the kernel will not move, against the real kvtierd on this host.

Two real kinds, no GPU needed:

- mlock'ed memory: MADV_PAGEOUT refuses a VM_LOCKED mapping with EINVAL
  for the whole call, so one locked block used to fail the pageout of every
  block batched with it, and nothing said why.
- long-term pinned memory: io_uring fixed buffers (IORING_REGISTER_BUFFERS)
  pin with FOLL_LONGTERM, as CUDA host registrations and RDMA memory
  regions do. Reclaim skips such pages: every pageout leaves them present.

The daemon must say which blocks are stuck and why (``kvtierctl blocks``,
``explain``, the metric), not retry them every tick, try them again after
``policy.unmovable_reprobe_s`` (a pin can be dropped) and keep the data.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from kvchild import KVChild
from test_daemon import DaemonProc, ctl, wait_for, workdir  # noqa: F401  (fixture)

from kvtier.client import Client

pytestmark = pytest.mark.root

MIB = 1 << 20
BLOCK = 2 * MIB


def start(workdir, policy: str) -> DaemonProc:
    d = DaemonProc(workdir, extra_config="[policy]\nmin_residence_s = 0.0\n" + policy)
    # Metrics on an ephemeral port (the base config turns them off).
    d.args = ("--set", "metrics.enabled=true", "--set", "metrics.address=127.0.0.1", "--set", "metrics.port=0")
    return d.start()


def scrape(d: DaemonProc, name: str, **labels: str) -> float | None:
    m = re.search(r"metrics on (http://\S+/metrics)", d.read_log())
    assert m, d.read_log()
    text = urllib.request.urlopen(m.group(1), timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    hit = re.search(rf"^{name}(?:{{{want}}})? (\S+)$", text, re.M)
    return float(hit.group(1)) if hit else None


def blocks(d: DaemonProc, rid: int) -> list[dict]:
    r = ctl(d, "--json", "blocks", str(rid))
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)
    # (a daemon without reasons answers no "stuck": every block "none")
    names, why = a.get("stuck_names", ["none"]), a.get("stuck", [0] * len(a["tiers"]))
    return [{"tier": t, "flags": f, "why": names[w]} for t, f, w in zip(a["tiers"], a["flags"], why)]


def swap_index(d: DaemonProc) -> int:
    tiers = json.loads(ctl(d, "--json", "tiers").stdout)["tiers"]
    return next(t["index"] for t in tiers if t["kind"] == "swap")


def register(d: DaemonProc, child: KVChild) -> int:
    with Client(d.sock) as c:
        rid = c.register(addr=child.addr, length=child.size, block_size=BLOCK, pid=child.pid).id
    wait_for(lambda: -1 not in [b["tier"] for b in blocks(d, rid)], "residency measured")
    return rid


def hold_and_send_to_swap(d: DaemonProc, child: KVChild, hold: str, *send: str) -> tuple[int, int]:
    """``hold`` a range in the child (mlock / pin), register its pool and
    run ``kvtierctl SEND REGION swap``: (region id, swap tier index)."""
    assert child.ask(hold) == "ok"
    rid = register(d, child)
    swap = swap_index(d)
    r = ctl(d, send[0], str(rid), *send[1:], str(swap))
    assert r.returncode == 0, r.stderr
    return rid, swap


def failed_pages(d: DaemonProc, reason: str) -> int:
    with Client(d.sock) as c:
        fails = c.stats()["migration_failed_pages"]
    return sum(n for k, n in fails.items() if k.endswith(":" + reason))


def test_mlocked_block_is_unmovable_and_does_not_stop_its_batch(swapfile, workdir):
    """Fails on main: the batch's process_madvise answers EINVAL, so none of
    the four blocks reaches swap and the locked one has no reason."""
    d = start(workdir, "unmovable_reprobe_s = 3600.0\n")
    try:
        with KVChild(4 * BLOCK) as child:
            before = child.checksum()
            rid, swap = hold_and_send_to_swap(d, child, f"mlock {BLOCK} {BLOCK}", "migrate")
            wait_for(lambda: [b["tier"] for b in blocks(d, rid)] == [swap, 0, swap, swap],
                     "every block but the locked one in swap")
            b = blocks(d, rid)[1]
            assert b["flags"] & 1 and b["why"] == "locked", b
            assert "locked" in ctl(d, "blocks", str(rid)).stdout
            text = ctl(d, "explain", str(rid), "1").stdout
            assert "unmovable: locked" in text and "mlock" in text, text
            assert failed_pages(d, "LOCKED") == BLOCK // 4096
            assert scrape(d, "kvtier_blocks_unmovable_by_reason", reason="locked") == 1
            assert child.checksum() == before
    finally:
        assert d.stop() == 0, d.read_log()


def test_long_term_pinned_block_is_detected_not_retried_and_reprobed(swapfile, workdir):
    """io_uring fixed buffers pin block 0 long-term; an operator pins the
    region to swap, so the policy wants block 0 there on every tick.

    Fails on main: the block is marked unmovable without a reason (blocks
    shows none, explain names no pin), and for good: after the pin is
    dropped it never reaches swap."""
    reprobe = 6.0
    # A pinned block's pageout leaves this process's pages behind, as one
    # its reader held does: retried after return_backoff_s (held as a
    # return, engine._moved_back), here as short as the failure backoff.
    d = start(workdir, f"backoff_base_s = 0.2\nreturn_backoff_s = 0.2\nunmovable_after = 3\n"
                       f"unmovable_reprobe_s = {reprobe}\n")
    try:
        with KVChild(2 * BLOCK) as child:
            before = child.checksum()
            rid, swap = hold_and_send_to_swap(d, child, f"pin 0 {BLOCK}", "pin", "--tier")
            wait_for(lambda: blocks(d, rid)[0]["why"] == "pinned", "block 0 marked pinned")
            assert blocks(d, rid)[1]["tier"] == swap  # its neighbour is not held back
            tries = failed_pages(d, "NOT_PAGED_OUT") // (BLOCK // 4096)
            # Three pageouts, 0.2 s and 0.4 s apart: not one per 50 ms tick.
            assert 3 <= tries <= 4, tries
            text = ctl(d, "explain", str(rid), "0").stdout
            assert "unmovable: pinned" in text and "long-term pinned" in text, text
            assert scrape(d, "kvtier_blocks_unmovable_by_reason", reason="pinned") == 1
            # No retry while unmovable: 60 ticks later, not one more pageout.
            with Client(d.sock) as c:
                ticks = c.stats()["ticks_total"]
                wait_for(lambda: c.stats()["ticks_total"] >= ticks + 60, "60 more ticks")
            assert failed_pages(d, "NOT_PAGED_OUT") // (BLOCK // 4096) == tries
            assert blocks(d, rid)[0]["tier"] == 0
            assert child.checksum() == before
            # The pin is dropped: the re-probe pages the block out.
            assert child.ask("unpin") == "ok"
            wait_for(lambda: blocks(d, rid)[0]["tier"] == swap, "block 0 in swap after the re-probe",
                     timeout=reprobe + 20)
            assert blocks(d, rid)[0]["why"] == "none" and not blocks(d, rid)[0]["flags"] & 1
            assert child.checksum() == before
    finally:
        assert d.stop() == 0, d.read_log()
