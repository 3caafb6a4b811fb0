"""Tenant ids: int16 in the block table, so a daemon can name at most 32,767
tenants at once. A client naming a new tenant per request (each failing, or
each registered and unregistered) took every id, and every later register
with a new tenant was refused until restart. Ids are now made only for
regions that exist and taken back when the space runs out from names no
region and no quota uses. Real pieces: this process's own mappings, the
real Registry, BlockTable and /proc."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvtier.blocks import BlockTable
from kvtier.hotness import Temperature
from kvtier.kernel.procmap import ProcProcesses
from kvtier.registry import TENANT_ID_MAX, LimitExceeded, Limits, Registry
from kvtier.stats import DaemonStats

BLOCK = 64 << 10


def _registry() -> tuple[Registry, BlockTable]:
    table = BlockTable()
    return Registry(table, Limits(), DaemonStats(), Temperature(30.0), ProcProcesses("/proc")), table


def _buf(nblocks: int = 2) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, BLOCK * nblocks, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8).ctypes.data


def test_names_nothing_uses_give_their_ids_back_and_used_ones_keep_theirs():
    reg, table = _registry()
    gold = reg.quota_tenant_id("gold")  # a quota the config names: never handed to another name
    m, addr = _buf()
    live = reg.add(os.getpid(), addr, len(m), BLOCK, tenant="live")
    for i in range(TENANT_ID_MAX + 10):  # far more names than ids: none of them has a region
        reg.tenant_id(f"gone-{i}")
    m2, addr2 = _buf()
    new = reg.add(os.getpid(), addr2, len(m2), BLOCK, tenant="new")  # refused before the fix
    assert reg.tenants["gold"] == gold and reg.tenants["live"] == live.tenant_id
    assert new.tenant_id not in (0, gold, live.tenant_id)
    assert (table.region_view(live.id, "tenant") == live.tenant_id).all()
    assert (table.region_view(new.id, "tenant") == new.tenant_id).all()
    assert len(set(reg.tenants.values())) == len(reg.tenants)  # one id, one name


def test_every_id_in_use_is_a_clear_limit_not_a_reused_id():
    reg, _ = _registry()
    reg.tenants.update({f"q{i}": i for i in range(1, TENANT_ID_MAX + 1)})  # all kept by quotas
    reg.tenants_kept.update(f"q{i}" for i in range(1, TENANT_ID_MAX + 1))
    reg._tenant_next = TENANT_ID_MAX + 1
    with pytest.raises(LimitExceeded, match="tenants"):
        reg.tenant_id("one-more")
    assert reg.tenants["q1"] == 1


def test_a_staged_region_takes_its_tenant_id_when_it_is_added():
    reg, table = _registry()
    m, addr = _buf(4)
    st = reg.stage(os.getpid(), addr, len(m), BLOCK, tenant="fresh")
    assert "fresh" not in reg.tenants  # no id for a region that does not exist yet
    while not table.fill(st, 1):
        pass
    r = reg.add(os.getpid(), addr, len(m), BLOCK, tenant="fresh", staged=st)
    assert reg.tenants["fresh"] == r.tenant_id != 0
    assert (table.region_view(r.id, "tenant") == r.tenant_id).all()
