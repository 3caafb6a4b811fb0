"""What every kvtier command (kvtierd, kvtierctl, kvtier-sim) does the same way.

- ``--version`` prints ``kvtier.__version__`` (pyproject reads the same).
- Exit status: 0 ok, 1 the daemon refused, 2 usage, 3 the daemon is not
  reachable (not running, no permission, closed the connection, timed out),
  78 bad config (EX_CONFIG), 130 interrupted, 141 stdout closed early
  (``| head``: what a C tool killed by SIGPIPE reports).
- With ``--json`` an error is a JSON document on stdout,
  ``{"error": {"code": ..., "message": ..., "errno": ...}}``, so a script
  that parses stdout sees errors too; usage errors included.
- A broken pipe on stdout ends the command quietly, never with a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, NoReturn

from kvtier import __version__

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_PARTIAL = 4  # the request was carried out in part (the output says what not)
EXIT_CONFIG = 78
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141


def add_version(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--version", action="version", version=f"{ap.prog} {__version__}")


def jsonable(x: Any) -> Any:
    """Daemon answers as JSON: bytes as hex, non-finite floats as null
    (JSON has no Infinity: "never accessed" becomes null)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _number(text: str, conv: type, ok, bound: str) -> Any:
    try:
        v = conv(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if conv is int else 'a number'}, "
                                         f"got {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a timeout, an interval)."""
    return _number(text, float, lambda v: v > 0 and math.isfinite(v), "a number > 0")


def nonneg_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, ">= 0")


def printable(text: str) -> str:
    """``text`` for a terminal: every character that is not printable but a
    line break (escape sequences, carriage returns, bidi overrides) shown as
    its Python escape. Region names, tenants and daemon messages come from
    any client of the socket: printed as they are, a name could retitle,
    clear or rewrite the operator's terminal (OSC, CSI), or hide a line."""
    if text.isprintable():
        return text
    return "\n".join(line if line.isprintable() else
                     "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line)
                     for line in text.split("\n"))


def report(as_json: bool, prog: str, code: str, message: str, *, errno: int = 0, op: str = "") -> None:
    """One error, as text on stderr or as JSON on stdout."""
    if as_json:
        err: dict[str, Any] = {"code": code, "message": message}
        if errno:
            err["errno"] = errno
        if op:
            err["op"] = op
        emit_json({"error": err})
    else:
        print(printable(f"{prog}: {message}"), file=sys.stderr)


def emit_json(doc: Any) -> None:
    json.dump(jsonable(doc), sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def stdout_closed() -> int:
    """Call on BrokenPipeError from writing stdout: the reader is gone, so
    nothing more is said; stdout points at /dev/null so the interpreter's
    final flush does not raise the same error again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except OSError:
        pass
    return EXIT_PIPE


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are JSON when the command line has --json."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            report(True, self.prog, "usage", message)
            self.exit(EXIT_USAGE)
        super().error(message)


def parser_class(argv: list[str]) -> type[Parser]:
    """A Parser class for this command line (subparsers are built from the
    class, so the JSON choice must live on it, not on one instance)."""
    return type("Parser", (Parser,), {"json_errors": "--json" in argv})
