"""Top-level pytest plugin: runs `vm`-marked tests inside the QEMU guest.

On the host, each selected `vm` test is replaced by a proxy item with the same
node id. The first proxy to run starts ONE guest (scripts/vm/run.py) that runs
``pytest -m vm <all selected vm node ids>``. The guest's pytest streams each
test's result to the host the moment the test ends (scripts/vm/results.py:
one JSON line per event in the read-write 9p share), and each proxy reports
its own test's result as soon as it has arrived: pass, fail with the guest's
failure text, or skip / xfail with the guest's reason. Inside the guest
(KVTIER_IN_VM=1, set by run.py) the tests run as ordinary tests.

If the guest times out or crashes, only the tests without a result fail:
the one that was running says so (and how long it had run) with the tail of
the guest console, the ones that never started say that.

All wall-clock limits scale with how slow the guest runs (scripts/vm/speed.py
measures it at boot and before each test): run.py's timeout for the whole
run, the per-test timeout in the guest (tests/vm/conftest.py) and the tests'
own deadlines (tests/vm/vmhelpers.py: scaled, wait_for).

A run that selects no vm test (``-m 'not vm'``, a unit-test path) never
boots the guest: booting happens only when a proxy runs.

Without QEMU or a prepared guest kernel the vm tests are skipped with the
reason, except under CI (env CI set and not false): there a test-bed that
cannot boot fails every vm test loudly. A guest that fails its set-up fails
every vm test with the tail of its console.

`vmsystemd` tests (systemd as PID 1 in the guest) get their own boot through
run.py --systemd, the same way, `vm2s` tests theirs in the two-socket
guest (run.py --shape two-socket), and `vmidle` tests theirs on the kernel
with idle page tracking (run.py --kernel idle); where that kernel is not
built (scripts/vm/build-kernel.sh), they skip saying so, also under CI.

Knobs (quiet-host seconds, multiplied by the guest's slowness):
KVTIER_VM_TIMEOUT (whole guest run; default 300 + 60 per test),
KVTIER_VM_MAX_TIMEOUT (the cap on that after scaling, default 1800).
The per-test one is in tests/vm/conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "scripts" / "vm" / "run.py"
sys.path.insert(0, str(RUN_PY.parent))

from results import ENV as RESULTS_ENV, Outcome, StreamReader, StreamWriter  # noqa: E402

GUEST_SHARE = "/mnt/kvtier"  # where run.py mounts the share in the guest
RESULTS_FILE = "results.jsonl"
IN_VM = os.environ.get("KVTIER_IN_VM") == "1"
# Nominal (quiet-host) seconds for one guest run: boot and pytest start-up,
# then per test; a quiet run of 14 tests took 85 s. The guest's own per-test
# timeout catches a hung test long before this.
BASE_TIMEOUT, PER_TEST_TIMEOUT = 300, 60
# After scaling, never more than this per guest run (CI has 90 minutes).
MAX_TIMEOUT = 1800
# A console silent this long (scaled) is a hung guest: every test prints its
# result line, and the guest's per-test timeout is 300 s nominal.
STALL = 600
TAIL_LINES = 40

# Guest modes: marker -> extra run.py flags. Each mode with selected tests
# costs one boot.
# vmhotplug: the vm guest's shape in a boot of its own, so that a memory
# offline wedged in the guest kernel (seen once on a loaded host) fails that
# test alone, not every vm test after it.
MODES = {"vm": [], "vmsystemd": ["--systemd"], "vm2s": ["--shape", "two-socket"], "vmidle": ["--kernel", "idle"],
         "vmhotplug": []}
# Modes whose kernel scripts/setup.sh does not provide: where it is not
# built, their tests skip with the reason, under CI too. The idle kernel
# (idle page tracking; scripts/vm/build-kernel.sh) took 35 minutes to build
# on the busy 2-core development host (844 CPU seconds; docs/benchmarks.md,
# "Access-bit source on the idle guest kernel"), more than CI's budget
# allows; where it is in the cache, CI runs its tests like any other.
OPTIONAL_KERNELS = {"vmidle": "idle"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class GuestRun:
    """One guest boot serving every selected test of one mode.

    ``start`` launches run.py in the background; ``poll`` takes in what the
    guest streamed since; ``outcome_for`` waits for one test's result.
    """

    mode: str
    nodeids: list[str]
    share: Path | None = None
    status: str = ""  # run.py's status; "" until started, "running" while it runs
    exit_code: int | None = None
    reason: str = ""
    tail: str = ""
    results: dict[str, Outcome] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # nodeid -> guest time.time()
    collect_errors: dict[str, str] = field(default_factory=dict)
    garbled: list[str] = field(default_factory=list)
    slowness: float = 1.0
    # ``-s`` on the host: the guest's pytest does not capture either, so a
    # test's prints reach run.out in the share (the figures some tests print).
    no_capture: bool = False
    boot_seconds: float | None = None
    run_seconds: float | None = None
    wall_seconds: float = 0.0
    _proc: subprocess.Popen | None = None
    _reader: StreamReader | None = None
    _t0: float = 0.0
    _ended: float = 0.0  # host time.time() when the guest run ended
    _hard_deadline: float = 0.0

    def command(self, rootdir: Path, timeout: float, max_timeout: float) -> list[str]:
        guest_cmd = [
            sys.executable, "-m", "pytest", "-m", self.mode, "-v", "-p", "no:cacheprovider",
            # Importing these two plugins over 9p under TCG costs ~13 s of a
            # ~17 s guest collection; vm tests use neither (benchmarks live in
            # scripts/bench, and @given works without the pytest plugin).
            "-p", "no:hypothesispytest", "-p", "no:benchmark", *(["-s"] if self.no_capture else []),
            *self.nodeids,
        ]
        return [
            sys.executable, str(RUN_PY), *MODES[self.mode], "--share", str(self.share),
            "--timeout", str(timeout), "--max-timeout", str(max_timeout), "--stall", str(STALL),
            "--env", f"{RESULTS_ENV}={GUEST_SHARE}/{RESULTS_FILE}",
            "--cwd", str(rootdir), "--", *guest_cmd,
        ]

    def start(self, rootdir: Path) -> None:
        # Whatever happens below, this mode never boots a second time.
        self.status, self.reason = "crash", "the harness failed before the guest reported"
        kernel = OPTIONAL_KERNELS.get(self.mode)
        if kernel is not None:
            import run as vmrun  # scripts/vm/run.py

            try:
                vmrun.GuestImage.find(kernel)
            except vmrun.KernelNotBuilt as e:
                self.status, self.reason = "no_kernel", str(e)
                return
            except vmrun.Unavailable:
                pass  # run.py reports it like any other mode's
        self.share = Path(tempfile.mkdtemp(prefix=f"kvtier-{self.mode}-"))
        self._reader = StreamReader(self.share / RESULTS_FILE)
        timeout = float(os.environ.get("KVTIER_VM_TIMEOUT", BASE_TIMEOUT + PER_TEST_TIMEOUT * len(self.nodeids)))
        max_timeout = float(os.environ.get("KVTIER_VM_MAX_TIMEOUT", MAX_TIMEOUT))
        cmd = self.command(rootdir, timeout, max_timeout)
        self._t0 = time.monotonic()
        # run.py bounds the guest itself; this only guards against run.py hanging.
        self._hard_deadline = self._t0 + max_timeout + 120
        with open(self.share / "run.out", "w") as out:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.status = "running"

    def take(self, events: list[dict]) -> None:
        """Fold streamed events into the run's state."""
        for ev in events:
            kind = ev.get("event")
            if kind == "start":
                self.started[ev["nodeid"]] = float(ev.get("t", 0.0))
            elif kind == "result":
                text = ev.get("text", "")
                self.results[ev["nodeid"]] = Outcome(ev["outcome"], text)
                if ev.get("slowness"):
                    self.slowness = max(self.slowness, float(ev["slowness"]))
            elif kind == "collect_error":
                self.collect_errors[ev["nodeid"]] = ev.get("text", "")
            elif kind == "garbled":
                self.garbled.append(ev.get("line", ""))

    def poll(self) -> bool:
        """Take in new results; True while the guest still runs."""
        if self.status != "running":
            return False
        assert self._proc is not None and self._reader is not None
        self.take(self._reader.poll())
        if self._proc.poll() is None:
            if time.monotonic() < self._hard_deadline:
                return True
            self._proc.kill()  # run.py kills QEMU on SIGTERM only; it is stuck
            self._proc.wait()
        self._finish()
        return False

    def _finish(self) -> None:
        self.wall_seconds = time.monotonic() - self._t0
        self._ended = time.time()
        self.take(self._reader.rest())
        try:
            res = json.loads((self.share / "result.json").read_text())
        except (OSError, ValueError) as e:
            self.status, self.reason = "crash", f"run.py exited {self._proc.returncode} without a result ({e})"
            self.tail = _tail(self.share / "run.out")
            return
        self.status, self.exit_code, self.reason = res["status"], res["exit_code"], res["reason"]
        self.boot_seconds, self.run_seconds = res.get("boot_seconds"), res.get("run_seconds")
        self.slowness = max(self.slowness, float(res.get("slowness") or 1.0))
        self.tail = _tail(Path(res["console_log"]))

    def stop(self, interrupted: bool) -> None:
        """The host session ends: let the guest power off (its last test has
        reported, or run.py's deadline ends it), or, if the host session was
        interrupted, kill it. No guest outlives the session."""
        while not interrupted and self.poll():
            time.sleep(0.2)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # run.py kills its QEMU on the way out
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._finish()

    def wait_for(self, nodeid: str, interval: float = 0.2) -> Outcome:
        """This test's result as soon as the guest streamed it, or why there is none."""
        while nodeid not in self.results and self.poll():
            time.sleep(interval)
        return self.outcome_for(nodeid)

    def outcome_for(self, nodeid: str) -> Outcome:
        got = self.results.get(nodeid)
        if got is not None:
            return got
        if self.status == "no_kernel":
            return Outcome("skipped", f"guest kernel {OPTIONAL_KERNELS[self.mode]!r} not built: {self.reason}")
        if self.status == "unavailable":
            why = f"VM test-bed unavailable: {self.reason}"
            return Outcome("failed" if in_ci() else "skipped", why + (" (CI: not skipping)" if in_ci() else ""))
        console = f"--- guest console ({self.share}) ---\n{self.tail}"
        for prefix, text in self.collect_errors.items():
            if nodeid == prefix or nodeid.startswith(prefix + "::"):
                return Outcome("failed", f"[guest collection error in {prefix}]\n{text}")
        if self.status == "setup_failed":
            return Outcome("failed", f"guest set-up failed: {self.reason}\n{console}")
        if self.status != "ok":
            what = f"guest {self.status} ({self.reason}; slowness {self.slowness:.2f})"
            finished = f"{len(self.results)} of {len(self.nodeids)} tests had finished"
            if nodeid in self.started:
                # The guest's wall clock is the host's (RTC at boot, HPET after).
                ran = max(0.0, self._ended - self.started[nodeid])
                return Outcome("failed", f"{what} while this test was running (for {ran:.0f}s); "
                                         f"{finished}\n{console}")
            return Outcome("failed", f"{what} before this test started; {finished}; "
                                     f"see {self.running_text()} for the guest console")
        torn = f"\nunreadable stream lines: {self.garbled}" if self.garbled else ""
        return Outcome("failed", f"no result for this test from the guest (guest pytest exit {self.exit_code}){torn}"
                                 f"\n{console}")

    def running_text(self) -> str:
        running = [n for n in self.started if n not in self.results]
        return running[-1] if running else "the first vm test"


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no console log: {e})"


class GuestProxy(pytest.Item):
    """Stands in on the host for a test that runs in the guest."""

    def __init__(self, *, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    def runtest(self) -> None:
        run = self.config.stash[_RUNS_KEY][self.mode]
        if run.status == "":
            run.start(self.config.rootpath)
        got = run.wait_for(self.nodeid)
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


def pytest_configure(config):
    # In the guest, under the host's harness: stream each result to the share.
    path = os.environ.get(RESULTS_ENV)
    if IN_VM and path:
        config.pluginmanager.register(StreamWriter(path), "kvtier-vm-results")


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
            # bounds itself (KVTIER_VM_TIMEOUT); neither a per-test timeout
            # from the command line nor the test's own timeout marker (the
            # guest applies that one, scaled) may cut it short: first in line.
            proxy.add_marker(pytest.mark.timeout(0), append=False)
        items[i] = proxy
        runs.setdefault(mode, GuestRun(mode, [], no_capture=config.getoption("capture") == "no")).nodeids.append(item.nodeid)
    config.stash[_RUNS_KEY] = runs


def pytest_sessionfinish(session, exitstatus):
    for run in (session.config.stash.get(_RUNS_KEY, None) or {}).values():
        # Ctrl-C or -x / --maxfail: the rest of the guest's results are not wanted.
        stopping = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldfail or session.shouldstop
        run.stop(interrupted=bool(stopping))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    runs = config.stash.get(_RUNS_KEY, None)
    for run in (runs or {}).values():
        if run.status == "":
            continue
        timing = f"wall {run.wall_seconds:.1f}s, slowness {run.slowness:.2f}"
        if run.boot_seconds is not None:
            timing += f", boot+setup {run.boot_seconds:.1f}s"
        if run.run_seconds is not None:
            timing += f", guest pytest {run.run_seconds:.1f}s"
        terminalreporter.write_line(
            f"kvtier {run.mode} guest: {run.status} ({len(run.results)} of {len(run.nodeids)} tests reported; "
            f"{timing}); console, {RESULTS_FILE} and logs in {run.share}"
        )
