"""A real kvtierd for unprivileged tests: dry run, private socket, no state
file; started as a subprocess and stopped with SIGTERM."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

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
