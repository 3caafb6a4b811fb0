"""Client.allocate against the real kvtierd on this (one-node) host: the
memory is aligned, bound to the node the daemon chose before its first
touch, registered, usable as numpy and torch, and a pinned pool is counted
but never moved. Cross-node choices are in tests/vm/test_engines_vm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_daemon import DaemonProc, daemon, workdir  # noqa: F401  (fixtures)

from kvtier.client import HUGE_PAGE, KvtierClientError
from kvtier.kernel import native

pytestmark = pytest.mark.root

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def nodes_of(addr: int, length: int) -> np.ndarray:
    """The kernel's answer: node of each page (move_pages query)."""
    addrs = np.arange(addr, addr + length, PAGE, dtype=np.uint64)
    return native.move_pages(os.getpid(), addrs, None)


def vma_policy(start: int) -> str:
    """The kernel's memory policy of the mapping starting at ``start``
    (mbind splits the mapping, so the bound range is a VMA of its own)."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            addr, policy = line.split()[:2]
            if int(addr, 16) == start:
                return policy
    raise AssertionError(f"no mapping starts at 0x{start:x}")


def test_allocate_places_registers_and_exposes_the_pool(daemon):
    with daemon.client() as c:
        r = c.allocate(8 * MIB, MIB, name="pool", tenant="team-a")
        assert r.start % HUGE_PAGE == 0 and r.length == 8 * MIB and r.nblocks == 8
        assert r.placement["node"] == 0 and r.placement["tier"] == 0
        assert (nodes_of(r.start, r.length) == 0).all()  # populated on the chosen node
        small = c.allocate(3 * PAGE, PAGE)
        assert small.start % PAGE == 0 and small.length == 3 * PAGE
        # The mempolicy the client applied is the one the daemon chose.
        assert vma_policy(r.start) == "prefer:0"
        a = r.numpy(np.float32)
        a[:] = np.arange(a.size, dtype=np.float32)
        torch = pytest.importorskip("torch")
        t = torch.frombuffer(r.buffer, dtype=torch.float32)
        assert t.data_ptr() == r.start and float(t[12345]) == 12345.0
        listed = {x["id"]: x for x in c.request("regions")["regions"]}
        assert listed[r.id]["placement"]["node"] == 0 and listed[r.id]["tenant"] == "team-a"
        assert listed[r.id]["pinned"] is False
        r.unregister()
        assert r.id not in {x["id"] for x in c.request("regions")["regions"]}
        assert float(t[12345]) == 12345.0  # the memory outlives the registration while views exist


def test_pinned_pool_is_counted_never_moved_and_listed(daemon):
    with daemon.client() as c:
        r = c.allocate(4 * MIB, MIB, pinned=True, name="pinned-pool")
        assert vma_policy(r.start) == "bind:0"  # a pinned pool must stay where it was counted
        with pytest.raises(KvtierClientError) as e:
            c.request("migrate", region=r.id, tier=0)
        assert e.value.code == "invalid_argument" and "pinned" in str(e.value)

        def counted():
            t = c.request("tiers")["tiers"][0]
            return t if t["kvtier_bytes"] >= 4 * MIB else None

        import waiting
        waiting.wait_for(counted, "pinned pool counted in tier 0", timeout=20, interval=0.02)
        blocks = c.request("blocks", region=r.id)
        assert all(f & 1 for f in blocks["flags"])  # F_UNMOVABLE: the policy never plans them
        kvtierctl = [sys.executable, "-m", "kvtier.ctl", "--socket", daemon.sock, "regions"]
        out = subprocess.run([*kvtierctl, "--json"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        (listed,) = json.loads(out.stdout)["regions"]
        assert listed["pinned"] is True and listed["placement"]["node"] == 0
        out = subprocess.run(kvtierctl, capture_output=True, text=True)
        assert "dram/node0 pinned" in out.stdout, out.stdout


def test_bad_allocations_are_refused_and_leave_nothing(daemon):
    with daemon.client() as c:
        for tier, code in (("nope", "invalid_argument"), ("7", "invalid_argument")):
            with pytest.raises(KvtierClientError) as e:
                c.allocate(MIB, MIB, tier=tier)
            assert e.value.code == code
        free = c.request("tiers")["tiers"][0]["free"]
        with pytest.raises(KvtierClientError) as e:
            c.allocate(free + (1 << 30), 1 << 30)  # more than the node has free: mapped, never touched
        assert e.value.code == "limit_exceeded" and "dram" in str(e.value)
        with pytest.raises(KvtierClientError) as e:
            c.allocate(MIB, 1024)  # below the minimum block size
        assert e.value.code == "invalid_argument"
        assert c.request("regions")["regions"] == []


def test_swap_tier_is_refused_for_allocation(swapfile, workdir):
    d = DaemonProc(workdir).start()
    try:
        with d.client() as c:
            swap = next(t for t in c.request("tiers")["tiers"] if t["kind"] == "swap")
            for pinned in (False, True):
                with pytest.raises(KvtierClientError) as e:
                    c.allocate(MIB, MIB, tier=swap["name"], pinned=pinned)
                assert e.value.code == "invalid_argument" and "swap" in str(e.value)
    finally:
        assert d.stop() == 0
