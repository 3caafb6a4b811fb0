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


def test_no_one_letter_module_aliases():
    """STYLE: names explain what (`from kvtier import protocol`, not `as P`).
    numpy's `np` is the one alias every reader knows."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bad = []
    for path in [*root.glob("daemon/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("scripts/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bad += [f"{path.relative_to(root)}:{node.lineno} as {a.asname}" for a in node.names
                        if a.asname and len(a.asname) == 1]
    assert not bad, bad
