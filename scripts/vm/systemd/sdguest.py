"""Host side of run.py's systemd mode: systemd as PID 1 in the guest.

The standard initramfs stays as it is; this appends a second, tiny cpio
archive holding ``/sdinit`` (the ``init`` beside this file) and boots it with
``rdinit=/sdinit``. The kernel unpacks concatenated archives in order, so the
guest gets the standard image (busybox, early modules) plus the variant init,
and no initramfs has to be rebuilt when this mode changes.

The guest command is wrapped in prepare-root.sh, which guest_setup.sh runs
after the usual set-up (CXL region, NVMe swap); it stores the command for
units/kvtier-test.service, which runs it under systemd and powers off.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
INIT = HERE / "init"
RDINIT = "/sdinit"
TARGET = "kvtier-test.target"

# Units that only cost boot time (or wait forever) in a guest without udev
# rules of its own, a real clock or a persistent disk.
MASKED = (
    "systemd-udevd.service", "systemd-udevd-control.socket", "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service", "systemd-udev-settle.service", "systemd-hwdb-update.service",
    "systemd-timesyncd.service", "systemd-pstore.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "man-db.timer", "fstrim.timer", "e2scrub_all.timer",
)


def wrap(cmd: list[str]) -> list[str]:
    """What run.sh hands to guest_setup.sh instead of the command itself."""
    return ["/bin/bash", str(HERE / "prepare-root.sh"), *cmd]


def kernel_args() -> list[str]:
    return [
        f"rdinit={RDINIT}",
        f"systemd.unit={TARGET}",
        *(f"systemd.mask={u}" for u in MASKED),
        # Only failures on the console: it also carries the tests' output.
        "systemd.show_status=error",
        # clocksource=hpet (for systemd's start/watchdog timeouts) is in
        # run.py's common kernel arguments: both modes need real time.
    ]


def initrd(base: Path, workdir: Path) -> Path:
    """``base`` with the systemd-mode init appended, written into ``workdir``."""
    with tempfile.TemporaryDirectory(prefix="kvtier-sdinit-") as tmp:
        root = Path(tmp)
        (root / RDINIT.lstrip("/")).write_bytes(INIT.read_bytes())
        os.chmod(root / RDINIT.lstrip("/"), 0o755)
        archive = subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
            cwd=root, input=RDINIT.lstrip("/").encode() + b"\n", check=True, capture_output=True,
        ).stdout
    data = base.read_bytes()
    # An archive after a compressed one must start on a 4-byte boundary
    # (init/initramfs.c skips NUL padding between archives).
    out = workdir / "initrd-systemd.cpio.gz"
    out.write_bytes(data + b"\0" * (-len(data) % 4) + gzip.compress(archive))
    return out
