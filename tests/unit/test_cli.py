"""kvtierd, kvtierctl and kvtier-sim as an operator runs them: --version,
exit statuses, JSON errors under --json, and no traceback for bad
arguments, a daemon that is not running, a closed socket, a daemon that
does not answer, or a reader that closed the pipe (``| head``).

Commands run as subprocesses, against a real kvtierd (dry run, private
socket) where an answer is needed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvtier
from kvtier import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtierd import Kvtierd  # noqa: E402

PY = sys.executable
BIN = Path(PY).parent
TIMEOUT = 60


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=TIMEOUT, **kw)


def ctl(*args: str, **kw) -> subprocess.CompletedProcess:
    return run("-m", "kvtier.ctl", *args, **kw)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr


@pytest.fixture(scope="module")
def kvtierd(tmp_path_factory):
    d = Kvtierd(tmp_path_factory.mktemp("kvtierd"), "[metrics]\nenabled = false\n")
    yield d.sock
    d.stop()


# -- --version --------------------------------------------------------------


@pytest.mark.parametrize("module, prog", [
    ("kvtier.daemon", "kvtierd"), ("kvtier.ctl", "kvtierctl"), ("kvtier.sim.cli", "kvtier-sim"),
    ("kvtier.top", "kvtierctl top"),
])
def test_every_binary_has_version(module, prog):
    r = run("-m", module, "--version")
    assert (r.returncode, r.stdout) == (0, f"{prog} {kvtier.__version__}\n"), r.stderr


@pytest.mark.parametrize("name", ["kvtierd", "kvtierctl", "kvtier-sim"])
def test_installed_entry_points_have_version(name):
    exe = BIN / name
    if not exe.exists():
        pytest.skip(f"{name} not installed next to {PY}")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stdout) == (0, f"{name} {kvtier.__version__}\n")


# -- bad arguments ----------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("--timeout", "-1", "status"), ("status", "--timeout", "nan"), ("top", "-n", "-1"), ("top", "--count", "-3"),
    ("nosuchcommand",),
])
def test_bad_arguments_are_usage_errors(args):
    r = ctl(*args)
    assert r.returncode == cli.EXIT_USAGE
    assert "usage:" in r.stderr and "error:" in r.stderr
    no_traceback(r)
    r = ctl("--json", *args)
    assert r.returncode == cli.EXIT_USAGE
    assert json.loads(r.stdout)["error"]["code"] == "usage"
    no_traceback(r)


# -- daemon not running -----------------------------------------------------


@pytest.mark.parametrize("args", [("status",), ("blocks", "1"), ("top", "--once")])
def test_daemon_not_running_is_exit_3_everywhere(tmp_path, args):
    sock = str(tmp_path / "none.sock")
    r = ctl("--socket", sock, *args)
    assert r.returncode == cli.EXIT_UNAVAILABLE, (r.stdout, r.stderr)
    assert sock in r.stderr and "is kvtierd running?" in r.stderr
    assert r.stdout == ""
    no_traceback(r)
    r = ctl("--json", "--socket", sock, *args)
    assert r.returncode == cli.EXIT_UNAVAILABLE
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "unavailable" and err["errno"] == 2 and sock in err["message"]
    no_traceback(r)


def test_refused_socket_is_exit_3(tmp_path):
    """A socket file nobody listens on (kvtierd died without cleaning up)."""
    path = str(tmp_path / "dead.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    r = ctl("--socket", path, "status")
    assert r.returncode == cli.EXIT_UNAVAILABLE and "Connection refused" in r.stderr
    no_traceback(r)


class OneShotServer:
    """A unix socket that accepts and then either closes the connection at
    once or never answers: what a client sees from a daemon that died or
    hangs mid-conversation."""

    def __init__(self, path: str, close: bool):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(8)
        self.close_at_once = close
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.close_at_once:
                conn.close()
            else:
                self.held.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_closed_socket_is_exit_3_without_traceback(tmp_path, json_flag):
    path = str(tmp_path / "closing.sock")
    srv = OneShotServer(path, close=True)
    try:
        r = ctl(*json_flag, "--socket", path, "status")
    finally:
        srv.stop()
    assert r.returncode == cli.EXIT_UNAVAILABLE, r.stderr
    no_traceback(r)
    text = json.loads(r.stdout)["error"]["message"] if json_flag else r.stderr
    assert "closed the connection" in text


def test_daemon_that_does_not_answer_times_out(tmp_path):
    path = str(tmp_path / "silent.sock")
    srv = OneShotServer(path, close=False)
    try:
        r = ctl("--socket", path, "--timeout", "0.3", "status")
    finally:
        srv.stop()
    assert r.returncode == cli.EXIT_UNAVAILABLE
    assert "did not answer in time" in r.stderr
    no_traceback(r)


# -- with a real kvtierd ----------------------------------------------------


def test_refusal_is_exit_1_and_json_under_json(kvtierd):
    r = ctl("--socket", kvtierd, "blocks", "999")
    assert r.returncode == cli.EXIT_REFUSED and "region" in r.stderr
    no_traceback(r)
    r = ctl("--json", "--socket", kvtierd, "blocks", "999")
    assert r.returncode == cli.EXIT_REFUSED
    err = json.loads(r.stdout)["error"]
    assert err["op"] == "blocks" and err["code"] and "999" in err["message"]


def test_answers_are_json(kvtierd):
    r = ctl("--json", "--socket", kvtierd, "status")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["server"] == "kvtierd"


def test_top_json_prints_one_sample_per_line(kvtierd):
    r = ctl("top", "--json", "--socket", kvtierd, "--count", "2", "-n", "0.05")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    samples = [json.loads(ln) for ln in lines]
    for s in samples:
        assert set(s) == {"t", "status", "stats", "tiers", "regions"}
        assert s["status"]["server"] == "kvtierd" and s["tiers"]
    assert samples[1]["t"] > samples[0]["t"]
    assert "\x1b[" not in r.stdout  # no screen control codes in JSON mode


def _with_closed_stdout(args: list[str]) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader has already gone: the first write
    fails with EPIPE, as in ``kvtierctl ... | head`` once head has exited."""
    rfd, wfd = os.pipe()
    os.close(rfd)
    try:
        return subprocess.run([PY, "-m", "kvtier.ctl", *args], stdout=wfd, stderr=subprocess.PIPE, text=True,
                              timeout=TIMEOUT)
    finally:
        os.close(wfd)


@pytest.mark.parametrize("args", [
    ["--json", "stats"], ["stats"], ["top", "--once"], ["top", "--json", "--count", "3", "-n", "0.05"],
])
def test_broken_pipe_ends_quietly(kvtierd, args):
    r = _with_closed_stdout(["--socket", kvtierd, *args])
    assert r.returncode == cli.EXIT_PIPE
    assert r.stderr == ""


def test_broken_pipe_without_daemon(tmp_path):
    r = _with_closed_stdout(["--json", "topology"])
    assert r.returncode == cli.EXIT_PIPE and r.stderr == ""
