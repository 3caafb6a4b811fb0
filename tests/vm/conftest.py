"""Fixtures for the tests that run inside the QEMU guest (see vmhelpers.py
for the guest's shape; the host only proxies these tests, tests/conftest.py).

Before each test the guest's slowness is measured again (vmhelpers.remeasure)
and the test gets a timeout of TEST_TIMEOUT quiet-host seconds times it
(pytest-timeout; an explicit ``@pytest.mark.timeout(s)`` is scaled the same
way), so a hung test fails with its own stack and the next test runs. The
factor is recorded in the test's ``slowness`` user property, which the host
shows.
"""

from __future__ import annotations

import os

import pytest

from vmhelpers import DAMON_ADMIN, KVChild, remeasure

# Nominal seconds for one test, set-up and tear-down included (the slowest,
# test_damon_alone_converges, takes ~60-100 s on a quiet host).
TEST_TIMEOUT = float(os.environ.get("KVTIER_VM_TEST_TIMEOUT", 300))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # tryfirst: around pytest-timeout's own wrapper, which reads the marker.
    if os.environ.get("KVTIER_IN_VM") == "1":
        f = remeasure()
        given = item.get_closest_marker("timeout")
        base = float(given.args[0]) if given and given.args else TEST_TIMEOUT
        item.add_marker(pytest.mark.timeout(round(base * f, 1)), append=False)
        item.user_properties.append(("slowness", round(f, 2)))
    yield


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
