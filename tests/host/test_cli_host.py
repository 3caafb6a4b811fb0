"""kvtierctl against a root kvtierd whose socket the caller may not open:
the error names the group to join (needs root to run the client as nobody)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from test_daemon import DROP, NOBODY, DaemonProc

from kvtier import cli

PY = sys.executable
# The interpreter and its stdlib live under /root (closed to nobody): import
# kvtierctl as root, then drop to nobody before it runs.
AS_NOBODY = DROP + f"import locale\nfrom kvtier.ctl import main\ndrop({NOBODY}, {NOBODY})\nsys.exit(main(sys.argv[1:]))\n"


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", AS_NOBODY, *args], capture_output=True, text=True, timeout=60)


def test_permission_denied_names_the_group():
    # pytest's tmp_path sits below a 0700 directory; this one is open to all,
    # like /run/kvtierd, and the socket is 0660 root:daemon.
    tmp_path = tempfile.mkdtemp(prefix="kvtier-cli-", dir="/tmp")
    os.chmod(tmp_path, 0o755)
    d = DaemonProc(tmp_path, extra_config="", args=("-s", "daemon.socket_group=daemon",
                                                          "-s", "daemon.socket_mode=0o660"))
    d.start()
    try:
        st = os.stat(d.sock)
        assert st.st_mode & 0o777 == 0o660
        r = as_nobody("--socket", d.sock, "status")
        assert r.returncode == cli.EXIT_UNAVAILABLE, r.stderr
        assert "Permission denied" in r.stderr and "join group 'daemon'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        r = as_nobody("--json", "--socket", d.sock, "status")
        err = json.loads(r.stdout)["error"]
        assert r.returncode == cli.EXIT_UNAVAILABLE and err["errno"] == 13 and "join group 'daemon'" in err["message"]
        # a closed directory: the hint names the directory's group instead
        os.chmod(tmp_path, 0o750)
        r = as_nobody("--socket", d.sock, "status")
        assert r.returncode == cli.EXIT_UNAVAILABLE and f"group of {tmp_path}," in r.stderr, r.stderr
    finally:
        d.stop()
        shutil.rmtree(tmp_path)
