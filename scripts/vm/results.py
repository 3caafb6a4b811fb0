"""Per-test results streamed from the guest's pytest to the host, as they happen.

The guest pytest (tests/conftest.py registers ``StreamWriter`` there when
``$KVTIER_VM_RESULTS`` names a file in the read-write 9p share) appends one
JSON line per event and flushes it, so the host sees each test's result the
moment the test ends, not in a file written at the end of the run: a guest
that times out or crashes later loses nothing that had finished. The host
(tests/conftest.py) tails the file with ``StreamReader``.

Events, one JSON object per line:
  {"event": "start", "nodeid", "t"}           a test's set-up begins
  {"event": "result", "nodeid", "outcome", "text", "duration", "slowness"}
      outcome: passed | failed | skipped | xfailed; text: the failure (all
      failing phases), the skip or xfail reason, else ""
  {"event": "collect_error", "nodeid", "text"} a module that did not import
  {"event": "end", "exitstatus"}                the guest pytest finished
``t`` is the guest's time.time() (HPET-backed, so it is the host's clock).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "KVTIER_VM_RESULTS"


@dataclass
class Outcome:
    kind: str  # passed | failed | skipped | xfailed
    text: str = ""


def final_outcome(reports) -> Outcome:
    """One test's outcome from its setup/call/teardown reports (pytest's TestReport).

    Every failing phase contributes its text (a teardown error after a failed
    call keeps both); a skip in set-up or call gives its reason; xfail is
    reported as such, an unexpected pass of a non-strict xfail as a pass.
    """
    failures = [f"[guest {r.when} {'failure' if r.when == 'call' else 'error'}]\n{r.longreprtext}"
                for r in reports if r.failed]
    if failures:
        return Outcome("failed", "\n".join(failures))
    for r in reports:
        if r.skipped:
            if hasattr(r, "wasxfail"):
                return Outcome("xfailed", r.wasxfail)
            return Outcome("skipped", _skip_reason(r))
    return Outcome("passed")


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        msg = lr[2]
        return msg[len("Skipped: "):] if msg.startswith("Skipped: ") else msg
    return report.longreprtext


class StreamWriter:
    """pytest plugin for the guest: appends each event to ``path`` and flushes it."""

    def __init__(self, path: str | Path):
        self._f = open(path, "a", buffering=1)
        self._reports: dict[str, list] = {}

    def _emit(self, **rec) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        # The share is 9p without a cache: the write is on the host now;
        # fsync only makes that explicit for any other transport.
        os.fsync(self._f.fileno())

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._emit(event="collect_error", nodeid=report.nodeid, text=report.longreprtext)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._reports[nodeid] = []
        self._emit(event="start", nodeid=nodeid, t=time.time())

    def pytest_runtest_logreport(self, report) -> None:
        self._reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        reports = self._reports.pop(nodeid, [])
        got = final_outcome(reports)
        props = dict(p for r in reports for p in r.user_properties)
        self._emit(event="result", nodeid=nodeid, outcome=got.kind, text=got.text,
                   duration=round(sum(r.duration for r in reports), 3), slowness=props.get("slowness"))

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._emit(event="end", exitstatus=int(exitstatus))
        self._f.close()


class StreamReader:
    """Host side: the events appended to ``path`` since the last ``poll``.

    Reads only whole lines (a line the guest is still writing waits for the
    next poll); a line that is not JSON (a guest killed mid-write leaves a
    torn last line) becomes {"event": "garbled", "line": ...}.
    """

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [self._parse(line) for line in lines if line.strip()]

    def rest(self) -> list[dict]:
        """After the guest is gone: a last poll, and a torn last line too."""
        out = self.poll()
        if self._partial.strip():
            out.append(self._parse(self._partial))
            self._partial = b""
        return out

    @staticmethod
    def _parse(line: bytes) -> dict:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            return {"event": "garbled", "line": line.decode("utf-8", "replace")}
        return rec
