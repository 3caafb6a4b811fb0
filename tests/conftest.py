"""Top-level pytest plugin: runs `vm`-marked tests inside the QEMU guest.

On the host, each selected `vm` test is replaced by a proxy item with the same
node id. The first proxy to run boots ONE guest (scripts/vm/run.py) that runs
``pytest -m vm <all selected vm node ids> --junitxml=<share>/junit.xml``;
every proxy then reports the guest's result for its own test: pass, fail with
the guest's failure text, or skip with the guest's reason. Inside the guest
(KVTIER_IN_VM=1, set by run.py) the tests run as ordinary tests.

A run that selects no vm test (``-m 'not vm'``, a unit-test path) never
boots the guest: booting happens only when a proxy runs.

Without QEMU or a prepared guest kernel the vm tests are skipped with the
reason, except under CI (env CI set and not false): there a test-bed that
cannot boot fails every vm test loudly. A guest that crashes, times out or
fails its set-up fails every vm test with the tail of its console.

`vmsystemd` tests (systemd as PID 1 in the guest) get their own boot through
run.py --systemd, the same way.

Knobs: KVTIER_VM_TIMEOUT (seconds for the whole guest run, default 540).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "scripts" / "vm" / "run.py"
GUEST_SHARE = "/mnt/kvtier"  # where run.py mounts the share in the guest
IN_VM = os.environ.get("KVTIER_IN_VM") == "1"
# The whole suite's guest time must stay under 10 minutes on 2 cores.
DEFAULT_TIMEOUT = 540
TAIL_LINES = 40

# Guest modes: marker -> extra run.py flags. Each mode with selected tests
# costs one boot.
MODES = {"vm": [], "vmsystemd": ["--systemd"]}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) that pytest's junitxml writes for ``nodeid``.

    Mirrors _pytest.junitxml.mangle_test_address: the file path becomes a
    dotted module path, classes join it, the last part (with its
    parametrisation) is the name.
    """
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


@dataclass
class Outcome:
    kind: str  # passed | failed | skipped | xfailed
    text: str = ""


@dataclass
class GuestRun:
    """One guest boot serving every selected test of one mode."""

    mode: str
    nodeids: list[str]
    share: Path | None = None
    status: str = ""  # run.py's status; "" until booted
    exit_code: int | None = None
    reason: str = ""
    tail: str = ""
    outcomes: dict[tuple[str, str], Outcome] = field(default_factory=dict)
    boot_seconds: float | None = None
    run_seconds: float | None = None
    wall_seconds: float = 0.0

    def boot(self, rootdir: Path) -> None:
        # Whatever happens below, this mode never boots a second time.
        self.status, self.reason = "crash", "the harness failed before the guest reported"
        self.share = Path(tempfile.mkdtemp(prefix=f"kvtier-{self.mode}-"))
        timeout = float(os.environ.get("KVTIER_VM_TIMEOUT", DEFAULT_TIMEOUT))
        guest_cmd = [
            sys.executable, "-m", "pytest", "-m", self.mode, "-v", "-p", "no:cacheprovider",
            # Importing these two plugins over 9p under TCG costs ~13 s of a
            # ~17 s guest collection; vm tests use neither (benchmarks live in
            # scripts/bench, and @given works without the pytest plugin).
            "-p", "no:hypothesispytest", "-p", "no:benchmark",
            f"--junitxml={GUEST_SHARE}/junit.xml", "-o", "junit_logging=no", *self.nodeids,
        ]
        host_cmd = [
            sys.executable, str(RUN_PY), *MODES[self.mode], "--share", str(self.share),
            "--timeout", str(timeout), "--cwd", str(rootdir), "--", *guest_cmd,
        ]
        t0 = time.monotonic()
        try:
            with open(self.share / "run.out", "w") as out:
                # Outer timeout only guards against run.py itself hanging.
                proc = subprocess.run(host_cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            self.status, self.reason = "timeout", f"run.py did not return within {timeout + 60:.0f}s"
            self.tail = _tail(self.share / "run.out")
            return
        finally:
            self.wall_seconds = time.monotonic() - t0
        try:
            res = json.loads((self.share / "result.json").read_text())
        except (OSError, ValueError) as e:
            self.status, self.reason = "crash", f"run.py exited {proc.returncode} without a result ({e})"
            self.tail = _tail(self.share / "run.out")
            return
        self.status, self.exit_code, self.reason = res["status"], res["exit_code"], res["reason"]
        self.boot_seconds, self.run_seconds = res.get("boot_seconds"), res.get("run_seconds")
        self.tail = _tail(Path(res["console_log"]))
        if self.status == "ok":
            self.outcomes = parse_junit(self.share / "junit.xml")

    def outcome_for(self, nodeid: str) -> Outcome:
        if self.status == "unavailable":
            why = f"VM test-bed unavailable: {self.reason}"
            return Outcome("failed" if in_ci() else "skipped", why + (" (CI: not skipping)" if in_ci() else ""))
        if self.status != "ok":
            return Outcome("failed", f"guest {self.status}: {self.reason}\n--- guest console ({self.share}) ---\n{self.tail}")
        got = self.outcomes.get(junit_key(nodeid))
        if got is None:
            return Outcome(
                "failed",
                f"no result for this test in the guest's junit XML (guest pytest exit {self.exit_code})\n"
                f"--- guest console ({self.share}) ---\n{self.tail}",
            )
        return got


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no console log: {e})"


def parse_junit(path: Path) -> dict[tuple[str, str], Outcome]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out: dict[tuple[str, str], Outcome] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        outcome = Outcome("passed")
        for child in case:
            text = (child.text or child.get("message", "")).strip()
            if child.tag in ("failure", "error"):
                # A teardown error after a failure adds a second entry: keep both.
                prev = outcome.text + "\n" if outcome.kind == "failed" else ""
                outcome = Outcome("failed", prev + f"[guest {child.tag}] {text}")
            elif child.tag == "skipped" and outcome.kind == "passed":
                kind = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                outcome = Outcome(kind, child.get("message", "") or text)
        out[key] = outcome
    return out


class GuestProxy(pytest.Item):
    """Stands in on the host for a test that runs in the guest."""

    def __init__(self, *, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    def runtest(self) -> None:
        run = self.config.stash[_RUNS_KEY][self.mode]
        if run.status == "":
            run.boot(self.config.rootpath)
        got = run.outcome_for(self.nodeid)
        if got.kind == "skipped":
            pytest.skip(got.text)
        if got.kind == "xfailed":
            pytest.xfail(got.text)
        if got.kind == "failed":
            raise GuestFailure(got.text)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GuestFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"[{self.mode} guest] {self.name}"


class GuestFailure(Exception):
    pass


_RUNS_KEY = pytest.StashKey[dict]()


def _mode_of(item: pytest.Item) -> str | None:
    for mode in MODES:
        if item.get_closest_marker(mode) is not None:
            return mode
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Swap selected vm tests for proxies (after -m/-k deselection ran)."""
    if IN_VM:
        return
    runs: dict[str, GuestRun] = {}
    for i, item in enumerate(items):
        mode = _mode_of(item)
        if mode is None:
            continue
        proxy = GuestProxy.from_parent(item.parent, name=item.name, mode=mode)
        proxy.own_markers = list(item.own_markers)
        proxy.keywords.update(item.keywords)
        if config.pluginmanager.hasplugin("timeout"):
            # The first proxy waits for the whole guest run, which run.py
            # bounds itself (KVTIER_VM_TIMEOUT); a per-test timeout from the
            # command line must not cut it short.
            proxy.add_marker(pytest.mark.timeout(0))
        items[i] = proxy
        runs.setdefault(mode, GuestRun(mode, [])).nodeids.append(item.nodeid)
    config.stash[_RUNS_KEY] = runs


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    runs = config.stash.get(_RUNS_KEY, None)
    for run in (runs or {}).values():
        if run.status == "":
            continue
        timing = f"wall {run.wall_seconds:.1f}s"
        if run.boot_seconds is not None:
            timing += f", boot+setup {run.boot_seconds:.1f}s"
        if run.run_seconds is not None:
            timing += f", guest pytest {run.run_seconds:.1f}s"
        terminalreporter.write_line(
            f"kvtier {run.mode} guest: {run.status} ({len(run.nodeids)} tests; {timing}); "
            f"console, junit and logs in {run.share}"
        )
