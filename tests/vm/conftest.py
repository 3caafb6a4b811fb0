"""Fixtures for the tests that run inside the QEMU guest (see vmhelpers.py
for the guest's shape; the host only proxies these tests, tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from vmhelpers import DAMON_ADMIN, KVChild


@pytest.fixture(autouse=True)
def _guest_only():
    # The host replaces these tests by proxies; reaching here outside the
    # guest means someone ran them by hand on the wrong machine.
    if os.environ.get("KVTIER_IN_VM") != "1":
        pytest.fail("tests/vm run only inside the guest (scripts/vm/run.py sets KVTIER_IN_VM=1)")


@pytest.fixture
def kdamond():
    """One kdamond with one context, removed again afterwards."""
    kd = DAMON_ADMIN / "kdamonds"
    (kd / "nr_kdamonds").write_text("1")
    (kd / "0/contexts/nr_contexts").write_text("1")
    yield kd / "0"
    (kd / "nr_kdamonds").write_text("0")


@pytest.fixture
def child_factory():
    """Start kvchild.py processes (a stand-in inference process); all are closed after."""
    started: list[KVChild] = []

    def start(size: int, *extra: str) -> KVChild:
        c = KVChild(size, *extra)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()
