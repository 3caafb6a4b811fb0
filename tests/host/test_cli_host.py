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


HOSTILE_NAME = "\x1b]0;owned\x07\x1b[2J\x1b[31mkv\rX\u202eevil"
HOSTILE_TENANT = "t\x1b[H\x1b[8m"


def test_hostile_region_names_reach_no_terminal():
    """Any client of the socket names its regions and tenants. kvtierctl
    regions, ages and top printed them raw: a name of escape sequences
    retitled and cleared the operator's terminal (OSC 0, CSI 2J), hid text
    (CSI 8m) or rewrote the line (a carriage return, a bidi override); the
    daemon's log line of the register carried the ESC bytes too. Now every
    character that is not printable is shown as its escape, in every
    command's text, in top and in the log."""
    import mmap

    from kvtier.client import Client

    tmp_path = tempfile.mkdtemp(prefix="kvtier-cli-", dir="/tmp")
    os.chmod(tmp_path, 0o755)
    d = DaemonProc(tmp_path).start()
    buf = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * (1 << 20))
    try:
        with Client(d.sock) as c:
            region = c.register(buf, block_size=1 << 16, name=HOSTILE_NAME, tenant=HOSTILE_TENANT)
            for cmd in (["regions"], ["ages"], ["blocks", str(region.id)], ["status"]):
                r = subprocess.run([PY, "-m", "kvtier.ctl", "--socket", d.sock, *cmd], capture_output=True,
                                   timeout=60)
                assert r.returncode == 0, r.stderr
                for bad in (b"\x1b", b"\r", b"\x07", "\u202e".encode()):
                    assert bad not in r.stdout, (cmd, r.stdout)
            r = subprocess.run([PY, "-m", "kvtier.ctl", "--socket", d.sock, "regions"], capture_output=True,
                               text=True, timeout=60)
            assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mkv\\rX\\u202eevil" in r.stdout, r.stdout
            assert "t\\x1b[H\\x1b[8m" in r.stdout, r.stdout
            # JSON keeps the names exact (escaped by JSON itself)
            r = subprocess.run([PY, "-m", "kvtier.ctl", "--json", "--socket", d.sock, "regions"],
                               capture_output=True, text=True, timeout=60)
            assert [x["name"] for x in json.loads(r.stdout)["regions"]] == [HOSTILE_NAME], r.stdout
            from kvtier import top
            frame = "\n".join(top.render(top.gather(c)))
            assert "\x1b" not in frame and "\\x1b]0;owned" in frame, frame
    finally:
        assert d.stop() == 0
        log = d.read_log()
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert "event=region_registered" in log and "\x1b" not in log and "\r" not in log, log[-2000:]
