"""The architecture as the import graph must show it.

The pure core decides without touching the kernel, so the simulator and the
unit tests run it anywhere: importing it must pull in nothing from
``kvtier.kernel`` (the adapters), and ``kvtier.stats`` nothing from
prometheus_client. Checked in a fresh interpreter so that what another test
imported cannot hide a dependency.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["kvtier.blocks", "kvtier.hotness", "kvtier.policy", "kvtier.registry", "kvtier.sim.runner",
        "kvtier.sim.policies", "kvtier.stats",
        # not pure (threads, prometheus_client) but they reach the kernel only
        # through the Protocols in kvtier.ports, handed in by the daemon
        "kvtier.engine", "kvtier.metrics", "kvtier.ports"]


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_kernel_adapter(module):
    leaked = sorted(m for m in _loaded_after_import(module) if m.startswith("kvtier.kernel"))
    assert not leaked, f"{module} pulls in kernel adapters: {leaked}"


def test_stats_imports_no_prometheus_client():
    leaked = sorted(m for m in _loaded_after_import("kvtier.stats") if m.startswith("prometheus_client"))
    assert not leaked, f"kvtier.stats pulls in {leaked[:3]}"
