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
import time

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


MAX_ID = (1 << 31) - 1  # the wire's region id type


def move_aside(path: str, reason: str) -> str | None:
    """Keep a state file the daemon cannot use next to it (``state.json.bad-
    <unix time>``) for a human to look at, instead of overwriting it with the
    first registration; log why."""
    dest = f"{path}.bad-{int(time.time())}"
    try:
        os.rename(path, dest)
    except OSError as e:
        log.error("state file %s is unusable (%s) and could not be moved aside: %s", path, reason, e.strerror)
        return None
    log.error("state file %s is unusable (%s): moved to %s, starting with no registrations", path, reason, dest)
    return dest


def load(path: str) -> tuple[list[dict], int]:
    """(regions, next_id). A missing file is an empty state; an unusable one
    (unreadable, not JSON, nested too deeply, another version, wrong shape)
    is moved aside with the reason logged, and the daemon starts empty.
    Entries that are not objects, or whose id is not a valid region id, are
    dropped and counted in the log; a next_id outside 1..2^31-1 is ignored."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return [], 1
    except OSError as e:
        log.error("ignoring unreadable state file %s: %s", path, e.strerror)
        return [], 1
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        move_aside(path, f"not JSON: {e}")
        return [], 1
    except RecursionError:
        move_aside(path, "nested too deeply")
        return [], 1
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        move_aside(path, f"unknown version {doc.get('version') if isinstance(doc, dict) else None!r}")
        return [], 1
    regions = doc.get("regions")
    if not isinstance(regions, list):
        move_aside(path, "no list of regions")
        return [], 1
    entries = [r for r in regions if isinstance(r, dict) and _valid_id(r.get("id"))]
    if len(entries) != len(regions):
        log.error("state file %s: dropped %d of %d entries that are not objects with an id in 1..%d",
                  path, len(regions) - len(entries), len(regions), MAX_ID)
    next_id = doc.get("next_id", 1)
    if not _valid_id(next_id):
        log.error("state file %s: ignoring next_id %r (not in 1..%d)", path, next_id, MAX_ID)
        next_id = 1
    return entries, next_id


def _valid_id(v: object) -> bool:
    return type(v) is int and 1 <= v <= MAX_ID
