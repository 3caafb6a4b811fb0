"""The vm-test plugin (tests/conftest.py) without booting a guest.

Its result mapping is checked against junit XML that pytest itself writes, and
its selection rules against real pytest runs of tests/vm in a subprocess with
the guest image made unavailable (so nothing can boot).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent


def _load_plugin():
    spec = importlib.util.spec_from_file_location("kvtier_vm_plugin", TESTS / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


plugin = _load_plugin()
# The inner runs need neither plugin, and importing them is most of their start-up.
FAST = ("-p", "no:hypothesispytest", "-p", "no:benchmark")

SAMPLE = '''
import pytest

def test_ok():
    pass

def test_bad():
    assert 1 == 2, "one is not two"

def test_skip():
    pytest.skip("no CXL here")

@pytest.mark.xfail(reason="known kernel quirk", strict=True)
def test_xfail():
    assert False

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1

class TestGroup:
    def test_in_class(self):
        pass
'''


def test_junit_results_map_back_to_node_ids(tmp_path):
    d = tmp_path / "pkg" / "sub"
    d.mkdir(parents=True)
    (d / "test_sample.py").write_text(SAMPLE)
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST, "-c", os.devnull,
         "--rootdir", str(tmp_path), f"--junitxml={xml}", "pkg/sub/test_sample.py"],
        cwd=tmp_path, capture_output=True, check=False,
    )
    got = plugin.parse_junit(xml)
    base = "pkg/sub/test_sample.py::"
    expect = {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skip": "skipped",
        "test_xfail": "xfailed",
        "test_param[1]": "passed",
        "test_param[2]": "failed",
        "TestGroup::test_in_class": "passed",
    }
    assert {name: got[plugin.junit_key(base + name)].kind for name in expect} == expect
    assert len(got) == len(expect)
    assert "one is not two" in got[plugin.junit_key(base + "test_bad")].text
    assert got[plugin.junit_key(base + "test_skip")].text.endswith("no CXL here")


def test_unreadable_junit_gives_no_results(tmp_path):
    (tmp_path / "junit.xml").write_text("<testsuites><testsuite>")  # cut short by a crash
    assert plugin.parse_junit(tmp_path / "junit.xml") == {}
    assert plugin.parse_junit(tmp_path / "missing.xml") == {}


def _pytest(tmp_path, *args, ci: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVTIER_IN_VM")}
    env["KVTIER_VM_CACHE"] = str(tmp_path / "no-guest-here")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *FAST, "-rA", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


def test_not_vm_selection_never_boots(tmp_path):
    r = _pytest(tmp_path, "-m", "not vm", "tests/vm/test_guest_basics.py")
    assert r.returncode == 5, r.stdout  # everything deselected
    assert "kvtier vm guest" not in r.stdout


@pytest.mark.parametrize("ci, outcome", [(None, "SKIPPED"), ("true", "FAILED")])
def test_missing_guest_skips_except_under_ci(tmp_path, ci, outcome):
    node = "tests/vm/test_guest_basics.py::test_numa_balancing_is_off_for_a_stable_baseline"
    r = _pytest(tmp_path, node, ci=ci)
    assert f"{outcome}" in r.stdout, r.stdout
    assert "VM test-bed unavailable: no guest kernel in" in r.stdout
    assert r.returncode == (0 if ci is None else 1), r.stdout
