"""Structured logging: one logfmt line per state change worth knowing.

Under systemd (``JOURNAL_STREAM`` names our stderr) each line starts with a
``<N>`` syslog priority prefix, which journald strips and stores as the
entry's PRIORITY, and carries no timestamp (the journal stamps every entry
itself). Anywhere else lines start with an ISO-8601 UTC timestamp. Either
way the rest is logfmt, ``key=value`` pairs that ``grep``, Loki and
``journalctl -o cat`` users can filter without a parser:

    ts=2026-12-01T06:43:17.123Z level=info logger=kvtier.kernel.topology event=tier_discovered tier=cxl0 nodes=2

``event(log, "region_registered", region=3, pid=1234)`` is the one call
sites use for state changes; ordinary ``log.info("...")`` calls still work
and become ``msg="..."``. The daemon logs per region, per tier, per batch;
never per page or per block (a decode step touches thousands).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Mapping, TextIO

# syslog priorities (sd-daemon(3)): what journald reads from "<N>".
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

EVENT_ATTR = "kvtier_event"
FIELDS_ATTR = "kvtier_fields"
ROOT_LOGGER = "kvtier"


def syslog_priority(levelno: int) -> int:
    """The syslog priority for a logging level (custom levels round down)."""
    for lvl in sorted(_PRIORITY, reverse=True):
        if levelno >= lvl:
            return _PRIORITY[lvl]
    return 7


def quote(value: Any) -> str:
    """One logfmt value: bare when safe, else double-quoted with escapes."""
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        s = f"{value:.6g}"
    else:
        s = str(value)
    if s and not any(c in s for c in ' ="\\\n\t') and s.isprintable():
        return s
    esc = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    if not esc.isprintable():
        # terminal escapes, carriage returns, bidi overrides in a client's
        # region name or tenant: shown as escapes, never sent to the reader
        esc = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in esc)
    return f'"{esc}"'


def logfmt(pairs: Mapping[str, Any] | list[tuple[str, Any]]) -> str:
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return " ".join(f"{k}={quote(v)}" for k, v in items)


class LogfmtFormatter(logging.Formatter):
    """``journal=True``: ``<N>`` prefix and no timestamp; else ``ts=`` first."""

    def __init__(self, journal: bool = False):
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        pairs: list[tuple[str, Any]] = []
        if not self.journal:
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            pairs.append(("ts", f"{ts}.{int(record.msecs):03d}Z"))
        pairs.append(("level", record.levelname.lower()))
        pairs.append(("logger", record.name))
        event = getattr(record, EVENT_ATTR, None)
        if event is not None:
            pairs.append(("event", event))
            pairs.extend(getattr(record, FIELDS_ATTR, {}).items())
        else:
            pairs.append(("msg", record.getMessage()))
        if record.exc_info:
            # One line per record even for tracebacks: the journal and grep
            # both keep a multi-line entry together only if it is one line.
            pairs.append(("exc", self.formatException(record.exc_info)))
        line = logfmt(pairs)
        if self.journal:
            return f"<{syslog_priority(record.levelno)}>{line}"
        return line


def journal_stream(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journal: systemd sets JOURNAL_STREAM to
    "dev:inode" of the stderr it connected, and a stream redirected
    elsewhere (a child with 2>file) no longer matches (systemd.exec(5))."""
    env = os.environ if env is None else env
    value = env.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        # io.UnsupportedOperation (an in-memory stream) is an OSError too.
        return False
    return st.st_dev == dev and st.st_ino == ino


def setup(level: str | int = "info", stream: TextIO | None = None, *, journal: bool | None = None,
          logger_name: str = ROOT_LOGGER) -> logging.Handler:
    """Route the ``kvtier`` loggers to ``stream`` (stderr by default).

    ``journal=None`` detects the journal from JOURNAL_STREAM. Calling again
    replaces the previous handler (kvtierd re-runs it on a config reload
    that changes ``daemon.log_level``). Returns the handler.
    """
    stream = sys.stderr if stream is None else stream
    if journal is None:
        journal = journal_stream(stream)
    if isinstance(level, str):
        try:
            level = LEVELS[level.lower()]
        except KeyError:
            raise ValueError(f"unknown log level {level!r} (known: {', '.join(LEVELS)})") from None
    logger = logging.getLogger(logger_name)
    for h in list(logger.handlers):
        if getattr(h, "_kvtier", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream)
    handler._kvtier = True  # type: ignore[attr-defined]
    handler.setFormatter(LogfmtFormatter(journal=journal))
    logger.addHandler(handler)
    logger.setLevel(level)
    # Our lines are complete; the root logger's handlers would print them twice.
    logger.propagate = False
    return handler


def event(logger: logging.Logger, name: str, level: int = logging.INFO, /, **fields: Any) -> None:
    """Log one state change: ``event(log, "source_unavailable", logging.WARNING,
    source="damon", reason=...)``. The first three are positional-only so a
    field may itself be called ``name`` or ``level``."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={EVENT_ATTR: name, FIELDS_ATTR: fields}, stacklevel=2)
