"""Fixtures for host integration tests: these run as root against the real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_collection_modifyitems(config, items):
    # Outside CI a developer without root gets skips; under CI a host test
    # that cannot run is a failure, never a silent skip (as the vm tests).
    if os.geteuid() == 0 or _in_ci():
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason="host integration tests need root"))


@pytest.fixture(autouse=True)
def _root_under_ci():
    if os.geteuid() != 0:
        pytest.fail("host integration tests need root (CI: not skipping)")


@pytest.fixture(scope="session")
def swapfile():
    """A swap file enabled for the session (removed afterwards).

    Uses an existing active swap if the machine has one; otherwise creates
    a 1 GiB file with real blocks (fallocate; swap files may not be sparse).
    """
    with open("/proc/swaps") as f:
        active = f.read().splitlines()[1:]
    if active:
        yield active[0].split()[0]
        return
    path = f"/var/tmp/kvtier-test-swap-{uuid.uuid4().hex[:8]}"
    subprocess.run(["fallocate", "-l", "1G", path], check=True)
    os.chmod(path, 0o600)
    subprocess.run(["mkswap", path], check=True, capture_output=True)
    r = subprocess.run(["swapon", path], capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(path)
        pytest.fail(f"swapon {path} failed: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["swapoff", path], check=False)
        os.unlink(path)
