"""The vm-test plugin (tests/conftest.py, scripts/vm/results.py, run.py's
limits) without booting a guest.

The stream is written by the real StreamWriter inside a real pytest run in a
subprocess (standing in for the guest's pytest) and read back while that run
is still going; the selection rules are checked against real pytest runs of
tests/vm with the guest image made unavailable (so nothing can boot).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
VM_SCRIPTS = REPO / "scripts" / "vm"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


plugin = _load("kvtier_vm_plugin", TESTS / "conftest.py")
results = sys.modules["results"]  # what the plugin imported from scripts/vm
run_py = _load("kvtier_vm_run", VM_SCRIPTS / "run.py")
# The inner runs need neither plugin, and importing them is most of their start-up.
FAST = ("-p", "no:hypothesispytest", "-p", "no:benchmark")

SAMPLE = '''
import os, time
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

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_fails_twice(broken_teardown):
    assert False, "call broke"

class TestGroup:
    def test_in_class(self):
        pass

def test_waits_for_go():
    # Holds the run open until the host side has seen the results above.
    go = os.environ["GO_FILE"]
    end = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.05)
    assert os.path.exists(go)
'''

WRITER_CONFTEST = '''
import os
from results import StreamWriter

def pytest_configure(config):
    config.pluginmanager.register(StreamWriter(os.environ["KVTIER_VM_RESULTS"]), "stream")
'''


def _start_sample(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    d = tmp_path / "pkg" / "sub"
    d.mkdir(parents=True)
    (d / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "conftest.py").write_text(WRITER_CONFTEST)
    stream, go = tmp_path / "results.jsonl", tmp_path / "go"
    env = {**os.environ, "KVTIER_VM_RESULTS": str(stream), "GO_FILE": str(go),
           "PYTHONPATH": str(VM_SCRIPTS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST, "-c", os.devnull,
         "--rootdir", str(tmp_path), "pkg/sub/test_sample.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, stream, go


def test_results_stream_to_the_host_while_the_guest_run_goes_on(tmp_path):
    proc, stream, go = _start_sample(tmp_path)
    run = plugin.GuestRun("vm", [])
    reader = results.StreamReader(stream)
    base = "pkg/sub/test_sample.py::"
    try:
        end = time.monotonic() + 60
        # Until the last test has started: the one before it ending is not
        # enough, its start event comes after (one run in five under load).
        while base + "TestGroup::test_in_class" not in run.results or base + "test_waits_for_go" not in run.started:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < end, "no results streamed within 60 s"
            run.take(reader.poll())
            time.sleep(0.05)
        # The last test is still running: it started, and has no result yet.
        assert base + "test_waits_for_go" not in run.results
        go.touch()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    events = reader.rest()
    run.take(events)
    assert events[-1] == {"event": "end", "exitstatus": 1}
    expect = {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skip": "skipped",
        "test_xfail": "xfailed",
        "test_param[1]": "passed",
        "test_param[2]": "failed",
        "test_fails_twice": "failed",
        "TestGroup::test_in_class": "passed",
        "test_waits_for_go": "passed",
    }
    assert {n[len(base):]: o.kind for n, o in run.results.items()} == expect
    assert "one is not two" in run.results[base + "test_bad"].text
    assert run.results[base + "test_skip"].text == "no CXL here"
    assert run.results[base + "test_xfail"].text == "known kernel quirk"
    both = run.results[base + "test_fails_twice"].text
    assert "[guest call failure]" in both and "call broke" in both
    assert "[guest teardown error]" in both and "teardown broke" in both


def test_reader_waits_for_whole_lines_and_flags_a_torn_one(tmp_path):
    f = tmp_path / "results.jsonl"
    reader = results.StreamReader(f)
    assert reader.poll() == []  # not there yet
    f.write_text('{"event": "start", "nodeid": "a", "t": 1.0}\n{"event": "res')
    assert reader.poll() == [{"event": "start", "nodeid": "a", "t": 1.0}]
    with open(f, "a") as out:
        out.write('ult", "nodeid": "a", "outcome": "passed", "text": ""}\n{"event": "sta')
    assert reader.poll() == [{"event": "result", "nodeid": "a", "outcome": "passed", "text": ""}]
    assert reader.poll() == []
    assert reader.rest() == [{"event": "garbled", "line": '{"event": "sta'}]


def _timed_out_run() -> "plugin.GuestRun":
    run = plugin.GuestRun("vm", ["t.py::done", "t.py::failed", "t.py::hung", "t.py::never"])
    run.take([
        {"event": "start", "nodeid": "t.py::done", "t": 100.0},
        {"event": "result", "nodeid": "t.py::done", "outcome": "passed", "text": "", "slowness": 2.5},
        {"event": "start", "nodeid": "t.py::failed", "t": 110.0},
        {"event": "result", "nodeid": "t.py::failed", "outcome": "failed", "text": "[guest call failure]\nboom"},
        {"event": "start", "nodeid": "t.py::hung", "t": 120.0},
    ])
    run.status, run.reason, run.tail = "timeout", "guest did not finish within 900s", "console tail here"
    run._ended = 420.0
    return run


def test_a_guest_timeout_fails_only_the_tests_without_a_result():
    run = _timed_out_run()
    assert run.outcome_for("t.py::done").kind == "passed"
    got = run.outcome_for("t.py::failed")
    assert (got.kind, got.text) == ("failed", "[guest call failure]\nboom")
    hung = run.outcome_for("t.py::hung")
    assert hung.kind == "failed"
    assert "guest timeout (guest did not finish within 900s; slowness 2.50)" in hung.text
    assert "while this test was running (for 300s)" in hung.text and "console tail here" in hung.text
    assert "2 of 4 tests had finished" in hung.text
    never = run.outcome_for("t.py::never")
    assert never.kind == "failed" and "before this test started" in never.text
    assert "t.py::hung" in never.text  # where to look


def test_a_module_that_does_not_import_fails_its_tests_with_the_error():
    run = plugin.GuestRun("vm", ["tests/vm/test_x.py::test_a"])
    run.take([{"event": "collect_error", "nodeid": "tests/vm/test_x.py", "text": "ImportError: no kvtier.foo"},
              {"event": "end", "exitstatus": 2}])
    run.status, run.exit_code = "ok", 2
    got = run.outcome_for("tests/vm/test_x.py::test_a")
    assert got.kind == "failed" and "ImportError: no kvtier.foo" in got.text


def test_run_limits_scale_with_the_reported_slowness_up_to_the_cap():
    lim = run_py.Limits(timeout=300, max_timeout=1800, stall=100)
    assert lim.overrun(299, 0, 1.0) is None
    assert "300s nominal x slowness 1.00" in lim.overrun(301, 0, 1.0)
    assert lim.overrun(301, 0, 3.0) is None and lim.overrun(899, 0, 3.0) is None
    assert lim.overrun(901, 0, 3.0) is not None
    assert lim.overrun(1799, 0, 9.0) is None and "at most 1800s" in lim.overrun(1801, 0, 9.0)
    assert "silent for 101s" in lim.overrun(200, 101, 1.0)
    assert lim.overrun(200, 101, 2.0) is None


def _pytest(tmp_path, *args, ci: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVTIER_IN_VM")}
    env["KVTIER_VM_CACHE"] = str(tmp_path / "no-guest-here")
    env["KVTIER_VM_IDLE_CACHE"] = str(tmp_path / "no-idle-kernel-here")
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


@pytest.mark.parametrize("ci", [None, "true"])
def test_idle_kernel_tests_skip_where_it_is_not_built_also_under_ci(tmp_path, ci):
    # Building it takes longer than CI can spend (docs/benchmarks.md), so a
    # missing idle kernel is a skip that names the script, never a failure.
    node = "tests/vm/test_accessbits_vm.py::test_kernel_idle_bits_follow_reads_and_the_probe_picks_them"
    r = _pytest(tmp_path, node, ci=ci)
    assert "SKIPPED" in r.stdout and r.returncode == 0, r.stdout
    assert "guest kernel 'idle' not built: no idle guest kernel in" in r.stdout, r.stdout
    assert "scripts/vm/build-kernel.sh builds it" in r.stdout, r.stdout


def test_idle_image_found_from_build_kernels_cache_layout(tmp_path, monkeypatch):
    cache = tmp_path / "idle"
    kver, build = "6.12.95-kvtier-idle", "0123456789ab"
    kdir = cache / build
    (kdir / "boot").mkdir(parents=True)
    (kdir / "boot" / f"vmlinuz-{kver}").write_bytes(b"k")
    (kdir / "lib" / "modules" / kver).mkdir(parents=True)
    (kdir / "lib" / "modules" / kver / "modules.dep").write_text("")
    (cache / "current").write_text(f"{kver}\n{build}\n")
    monkeypatch.setenv("KVTIER_VM_IDLE_CACHE", str(cache))
    with pytest.raises(run_py.KernelNotBuilt, match="initramfs-"):
        run_py.GuestImage.find("idle")
    (kdir / f"initramfs-{run_py.initramfs_hash()}.cpio.gz").write_bytes(b"i")
    img = run_py.GuestImage.find("idle")
    assert (img.kver, img.kernel, img.modules) == (kver, kdir / "boot" / f"vmlinuz-{kver}", kdir / "lib/modules" / kver)
    with pytest.raises(ValueError, match="unknown guest kernel"):
        run_py.GuestImage.find("bogus")


def test_initramfs_skips_early_modules_built_into_the_kernel(tmp_path):
    mk = _load("kvtier_mkinitramfs", VM_SCRIPTS / "mkinitramfs.py")
    moddir = tmp_path
    (moddir / "modules.dep").write_text("kernel/fs/overlayfs/overlay.ko.xz:\n")
    (moddir / "modules.builtin").write_text("kernel/net/9p/9pnet.ko\nkernel/net/9p/9pnet_virtio.ko\nkernel/fs/9p/9p.ko\n")
    table = mk.parse_modules_dep(moddir)
    assert mk.load_order(table, mk.EARLY_MODULES, mk.parse_builtin(moddir)) == ["kernel/fs/overlayfs/overlay.ko.xz"]
    with pytest.raises(SystemExit, match="9pnet_virtio not in modules.dep"):
        mk.load_order(table, mk.EARLY_MODULES)


def test_a_vm_tests_own_timeout_marker_never_times_out_its_host_proxy(tmp_path):
    # The guest applies the marker (scaled); on the host the proxy waits for
    # the guest's result, which run.py bounds: seen cutting a proxy off at
    # the marker's 15 s while the guest test still ran.
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('vmplugin', {str(TESTS / 'conftest.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "import sys; sys.modules['vmplugin'] = mod; spec.loader.exec_module(mod)\n"
        "pytest_collection_modifyitems = mod.pytest_collection_modifyitems\n"
        "def pytest_collection_finish(session):\n"
        "    print('TIMEOUTS', [i.get_closest_marker('timeout').args for i in session.items])\n"
    )
    (tmp_path / "test_guest_side.py").write_text(
        "import pytest\n"
        "@pytest.mark.vm\n@pytest.mark.timeout(15)\ndef test_long():\n    pass\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FAST,
         "-c", os.devnull, "--rootdir", str(tmp_path), "-o", "markers=vm", "test_guest_side.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KVTIER_IN_VM"},
    )
    assert "TIMEOUTS [(0,)]" in r.stdout, r.stdout + r.stderr
