"""Typed errors raised at the kernel edge and by the control API.

Every OS failure becomes a KvtierOSError that carries errno and says what was
attempted, so a caller can both react to the errno and log a sentence a human
understands. Subclasses mark the failures callers treat differently.
"""

from __future__ import annotations

import errno as _errno
import os


class KvtierError(Exception):
    """Base of all kvtier errors."""

    code = "error"


class KvtierOSError(KvtierError, OSError):
    """A system call failed. ``errno`` is set; ``op`` says what was tried."""

    code = "os_error"

    def __init__(self, err: int, op: str, detail: str = ""):
        self.op = op
        self.detail = detail
        name = _errno.errorcode.get(err, str(err))
        msg = f"{op}: {name} ({os.strerror(err)})"
        if detail:
            msg += f" [{detail}]"
        OSError.__init__(self, err, msg)

    def __str__(self) -> str:  # OSError's default prefixes "[Errno n]" twice
        return self.strerror

    @property
    def errno_name(self) -> str:
        return _errno.errorcode.get(self.errno, str(self.errno))


class ProcessGone(KvtierOSError):
    """The target process exited (ESRCH) or was replaced (pid reuse)."""

    code = "process_gone"


class PermissionDenied(KvtierOSError):
    """The caller may not act on that process or memory (EPERM/EACCES)."""

    code = "permission_denied"


class FeatureUnavailable(KvtierOSError):
    """The running kernel lacks a feature (ENOSYS, missing sysfs file...)."""

    code = "feature_unavailable"


class InvalidArgument(KvtierError, ValueError):
    """Bad input from a caller: unknown node, range not mapped, bad size."""

    code = "invalid_argument"


class RangeNotMapped(InvalidArgument):
    """An address range does not lie inside the process's mappings."""

    code = "range_not_mapped"


class ConfigError(KvtierError, ValueError):
    """A configuration value is wrong; the message names the key."""

    code = "config_error"


def os_error(err: int, op: str, detail: str = "") -> KvtierOSError:
    """Build the most specific KvtierOSError subclass for ``err``."""
    if err == _errno.ESRCH:
        return ProcessGone(err, op, detail)
    if err in (_errno.EPERM, _errno.EACCES):
        return PermissionDenied(err, op, detail)
    if err in (_errno.ENOSYS, _errno.EOPNOTSUPP):
        return FeatureUnavailable(err, op, detail)
    return KvtierOSError(err, op, detail)
