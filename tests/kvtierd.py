"""A real kvtierd as a subprocess, stopped with SIGTERM: ``Kvtierd`` for
unprivileged tests (dry run, private socket, no state file), ``acting`` for
root host tests (it moves pages; config given, metrics on loopback)."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path
from typing import Iterator

from waiting import wait_for

PY = sys.executable
TIMEOUT = 60


def free_port() -> int:
    """A TCP port free on loopback now (the daemon binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kvtierd:
    def __init__(self, workdir: Path, extra_config: str = ""):
        self.dir = Path(workdir)
        self.sock = str(self.dir / "kvtierd.sock")
        self.log = self.dir / "kvtierd.log"
        conf = self.dir / "kvtierd.toml"
        conf.write_text(textwrap.dedent(f"""\
            [daemon]
            socket = "{self.sock}"
            state_file = ""
            tick_interval = 0.05
            socket_mode = 0o666
            dry_run = true
            """) + textwrap.dedent(extra_config))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([PY, "-m", "kvtier.daemon", "-c", str(conf)], stdout=log, stderr=log)
        wait_for(self._listening, "kvtierd to listen", timeout=TIMEOUT, interval=0.05)

    def _listening(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.sock)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(TIMEOUT)


@contextlib.contextmanager
def acting(tmp_path: Path, config: str, deadline: float = 60.0, *args: str) -> Iterator[Namespace]:
    """kvtierd with ``config`` (the [daemon] socket and state_file and the
    [metrics] exporter on a free loopback port are added) and command line
    ``args``, until the block ends. Yields socket, url (of /metrics), log,
    conf and proc."""
    sock = tmp_path / "kvtierd.sock"
    conf = tmp_path / "kvtierd.toml"
    conf.write_text(textwrap.dedent(f"""\
        [daemon]
        socket = "{sock}"
        state_file = ""
        """) + textwrap.dedent(config) + textwrap.dedent("""\
        [metrics]
        address = "127.0.0.1"
        port = 0
        """))
    log = tmp_path / "kvtierd.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([PY, "-m", "kvtier.daemon", "-c", str(conf), *args], stdout=logf, stderr=logf)

    def url():
        if proc.poll() is not None:
            raise AssertionError(f"kvtierd exited {proc.returncode}: {log.read_text()}")
        m = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
        return m and m.group(1)

    try:
        metrics_url = wait_for(url, "kvtierd to start its metrics exporter", timeout=deadline, interval=0.1)
        wait_for(lambda: sock.exists(), "the control socket", timeout=deadline, interval=0.1)
        yield Namespace(socket=str(sock), url=metrics_url, log=log, conf=conf, proc=proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
