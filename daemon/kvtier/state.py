"""The registration state file: what a restarted kvtierd re-adopts.

One JSON document, replaced atomically: write to a temporary file in the
same directory, fsync it, rename over the old file, fsync the directory. A
crash at any point leaves either the old or the new document, never a torn
one. Only region metadata is kept (a few hundred bytes per region); per-block
temperatures rebuild within a few ticks.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from kvtier.errors import os_error

STATE_VERSION = 1
log = logging.getLogger("kvtier.state")


def save(path: str, regions: list[dict], next_id: int) -> None:
    doc = {"version": STATE_VERSION, "next_id": next_id, "regions": regions}
    data = json.dumps(doc, separators=(",", ":")).encode()
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, mode=0o750, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".state.", dir=d)
    except OSError as e:
        raise os_error(e.errno, f"create temporary state file in {d}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise os_error(e.errno, f"write state file {path}") from None


def load(path: str) -> tuple[list[dict], int]:
    """(regions, next_id); a missing file is an empty state, a corrupt or
    foreign-version one is logged and ignored (the daemon must still start)."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return [], 1
    except (OSError, ValueError) as e:
        log.error("ignoring unreadable state file %s: %s", path, e)
        return [], 1
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        log.error("ignoring state file %s: unknown version %r", path,
                  doc.get("version") if isinstance(doc, dict) else None)
        return [], 1
    regions = doc.get("regions")
    next_id = doc.get("next_id", 1)
    if not isinstance(regions, list) or not isinstance(next_id, int):
        log.error("ignoring malformed state file %s", path)
        return [], 1
    return [r for r in regions if isinstance(r, dict)], max(1, next_id)
