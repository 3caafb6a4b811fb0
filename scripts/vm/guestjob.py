"""Run a benchmark script in the guest and bring its JSON result back (the
host side of scripts/bench/vm_*.py).

    res = guestjob.run(Path(__file__), ["--seconds", "30"], "tiering.json", timeout=600)

boots the guest with scripts/vm/run.py (a fresh share), runs ``SCRIPT
--in-guest --out /mnt/kvtier/NAME ARGS...`` there with the repository's
.venv Python, and returns the parsed JSON; exits with the console's share
named if the guest run failed or wrote nothing. ``save`` also copies the raw
result to a host path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GUEST_SHARE = "/mnt/kvtier"


def run(script: Path, args: list[str], name: str, timeout: float, save: str | None = None,
        run_args: tuple[str, ...] = ()) -> dict:
    share = Path(tempfile.mkdtemp(prefix=f"kvtier-{Path(name).stem}-"))
    cmd = [sys.executable, str(HERE / "run.py"), "--share", str(share), "--timeout", str(int(timeout)), *run_args,
           "--", str(REPO / ".venv/bin/python"), str(script), "--in-guest", "--out", f"{GUEST_SHARE}/{name}", *args]
    r = subprocess.run(cmd)
    out = share / name
    if r.returncode != 0 or not out.exists():
        sys.exit(f"guest run failed (status {r.returncode}); console in {share}")
    res = json.loads(out.read_text())
    res.setdefault("share", str(share))  # where the guest left anything else (logs)
    if save:
        Path(save).write_text(json.dumps(res, indent=1))
    return res


def add_args(ap) -> None:
    """The options every such script takes: --json on the host, and the two
    run() passes it in the guest."""
    ap.add_argument("--json", help="(host) also save the raw results here")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
