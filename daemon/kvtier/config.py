"""kvtierd configuration: one table of every option, parsed from TOML.

``OPTIONS`` is the only place an option is named: its section, key, type,
default, bounds and a one-line doc. The loader, the validator, the sample
config test and ``kvtierctl config`` all read that table, so a new option is
one new row. Validation runs before the daemon's loop starts and every error
names the offending key (``limits.max_message_bytes: must be >= 4096``).

Sections owned by other components (``policy``, ``topology``, ``hotness``)
are passed through as raw tables; their owners validate them.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvtier.errors import ConfigError

DEFAULT_PATH = "/etc/kvtierd/kvtierd.toml"
DEFAULT_SOCKET = "/run/kvtierd/kvtierd.sock"
DEFAULT_STATE = "/var/lib/kvtierd/state.json"

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

# Free-form sections handed to their owning modules unvalidated here.
PASSTHROUGH = ("policy", "topology", "hotness", "metrics")


@dataclass(frozen=True)
class Option:
    section: str
    name: str
    type: type
    default: Any
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


OPTIONS: tuple[Option, ...] = (
    # -- daemon ---------------------------------------------------------
    Option("daemon", "socket", str, DEFAULT_SOCKET,
           "Unix socket path; ignored when systemd passes a socket (LISTEN_FDS)."),
    Option("daemon", "socket_group", str, "",
           "Group owning the socket (clients must be in it); empty = the daemon's group."),
    Option("daemon", "socket_mode", int, 0o660, "Permission bits of the socket.", 0, 0o777),
    Option("daemon", "state_file", str, DEFAULT_STATE,
           "Registrations persist here (atomic rename) so a restart re-adopts them; empty disables."),
    Option("daemon", "state_flush_delay", float, 0.05,
           "Seconds to batch registration changes before one atomic state write.", 0.0, 60.0),
    Option("daemon", "tick_interval", float, 1.0,
           "Seconds between policy ticks (snapshot, plan, migrate).", 0.01, 3600.0),
    Option("daemon", "residency_interval", float, 10.0,
           "Seconds between full re-measurements of where every block's pages are.", 0.1, 86400.0),
    Option("daemon", "proc_root", str, "/proc", "procfs root (tests point it elsewhere)."),
    Option("daemon", "sys_root", str, "/sys", "sysfs root (tests point it elsewhere)."),
    Option("daemon", "dry_run", bool, False,
           "Plan and record migrations but do not move any page."),
    Option("daemon", "log_level", str, "info", "Logging level.",
           choices=("debug", "info", "warning", "error")),
    # -- security -------------------------------------------------------
    Option("security", "admin_group", str, "",
           "Members act as root on the socket: register any process's memory, use any region; root always may."),
    # -- limits ---------------------------------------------------------
    Option("limits", "max_regions_per_process", int, 4096,
           "Registered regions one process may hold.", 1, 1 << 20),
    Option("limits", "max_bytes_per_process", int, 64 * TIB,
           "Registered bytes one process may hold.", 4096, 1 << 62),
    Option("limits", "max_blocks_per_region", int, 1 << 22,
           "Blocks in one region (per-block state costs ~64 bytes of daemon memory).", 1, 1 << 30),
    Option("limits", "max_blocks_total", int, 1 << 24,
           "Blocks across all regions: bounds the daemon's own memory.", 1, 1 << 31),
    Option("limits", "max_message_bytes", int, 16 * MIB,
           "Largest request frame accepted; larger ones close the connection.", 4096, 1 << 30),
    Option("limits", "requests_per_second", float, 50000.0,
           "Sustained requests per second per connection (token bucket).", 1.0, 1e9),
    Option("limits", "request_burst", int, 5000,
           "Token bucket depth: requests a connection may send at once.", 1, 1 << 30),
    Option("limits", "max_connections", int, 1024, "Open client connections.", 1, 1 << 20),
    Option("limits", "max_connections_per_uid", int, 128,
           "Open connections of one user id.", 1, 1 << 20),
)

_BY_KEY = {o.key: o for o in OPTIONS}
SECTIONS = tuple(dict.fromkeys(o.section for o in OPTIONS))


class Config:
    """Validated options: ``cfg.daemon.socket``; raw passthrough tables in
    ``cfg.extra['policy']`` etc.; ``cfg.source`` says where it came from."""

    def __init__(self, values: dict[str, Any], extra: dict[str, dict], source: str = "<defaults>"):
        self.values = values
        self.extra = extra
        self.source = source
        for sec in SECTIONS:
            setattr(
                self,
                sec,
                SimpleNamespace(**{o.name: values[o.key] for o in OPTIONS if o.section == sec}),
            )

    def get(self, key: str) -> Any:
        return self.values[key]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for o in OPTIONS:
            out.setdefault(o.section, {})[o.name] = self.values[o.key]
        for sec, tbl in self.extra.items():
            out[sec] = dict(tbl)
        return out


def _check(opt: Option, value: Any) -> Any:
    key = opt.key
    t = opt.type
    # TOML distinguishes int from float; accept an int where a float is wanted,
    # never a bool where a number is wanted (bool is an int subclass).
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {t.__name__}, got {type(value).__name__} {value!r}")
    if opt.lo is not None and value < opt.lo:
        raise ConfigError(f"{key}: must be >= {opt.lo:g}, got {value!r}")
    if opt.hi is not None and value > opt.hi:
        raise ConfigError(f"{key}: must be <= {opt.hi:g}, got {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise ConfigError(f"{key}: must be one of {', '.join(opt.choices)}, got {value!r}")
    return value


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a parsed TOML document; unknown keys and sections are errors
    (a typo must not silently fall back to a default)."""
    values = {o.key: o.default for o in OPTIONS}
    extra: dict[str, dict] = {sec: {} for sec in PASSTHROUGH}
    for sec, tbl in data.items():
        if sec in PASSTHROUGH:
            if not isinstance(tbl, dict):
                raise ConfigError(f"{sec}: expected a table, got {type(tbl).__name__}")
            extra[sec] = tbl
            continue
        if sec not in SECTIONS:
            raise ConfigError(
                f"{sec}: unknown section (known: {', '.join(SECTIONS + PASSTHROUGH)})"
            )
        if not isinstance(tbl, dict):
            raise ConfigError(f"{sec}: expected a table, got {type(tbl).__name__}")
        for name, value in tbl.items():
            key = f"{sec}.{name}"
            opt = _BY_KEY.get(key)
            if opt is None:
                known = ", ".join(o.name for o in OPTIONS if o.section == sec)
                raise ConfigError(f"{key}: unknown option (known in [{sec}]: {known})")
            values[key] = _check(opt, value)
    return Config(values, extra, source)


def load(path: str | None = DEFAULT_PATH, *, missing_ok: bool = False,
         overrides: dict[str, Any] | None = None) -> Config:
    """Read and validate ``path``; ``overrides`` ({"daemon.socket": ...}) win."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            source = path
        except FileNotFoundError:
            if not missing_ok:
                raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for key, value in (overrides or {}).items():
        sec, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"{key}: override must be section.name")
        data.setdefault(sec, {})[name] = value
    return from_dict(data, source)


def _toml_value(v: Any, opt: Option | None = None) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if opt is not None and opt.name == "socket_mode":
        return f"0o{v:o}"
    return repr(v)


def sample_toml() -> str:
    """The commented sample config, generated from OPTIONS (systemd/kvtierd.toml
    is this text; a test keeps them equal)."""
    lines = [
        "# kvtierd configuration (TOML). Every option is shown commented out with",
        "# its default; uncomment to change. Unknown keys are errors.",
        "# Generated from kvtier.config.OPTIONS: `kvtierd --print-sample-config`.",
    ]
    for sec in SECTIONS:
        lines += ["", f"[{sec}]"]
        for o in OPTIONS:
            if o.section != sec:
                continue
            bounds = []
            if o.lo is not None:
                bounds.append(f">= {o.lo:g}")
            if o.hi is not None:
                bounds.append(f"<= {o.hi:g}")
            if o.choices:
                bounds.append("one of " + ", ".join(o.choices))
            extra = f" ({o.type.__name__}{'; ' + '; '.join(bounds) if bounds else ''})"
            lines.append(f"# {o.doc}{extra}")
            lines.append(f"#{o.name} = {_toml_value(o.default, o)}")
    lines += [
        "",
        "# Sections read by other components (see their documentation):",
        "# [policy]    placement policy knobs (kvtier.policy.PolicyConfig)",
        "# [topology]  tier overrides, e.g. which NUMA nodes are CXL",
        "# [hotness]   hotness sources (DAMON, access bits, perf)",
        "# [metrics]   Prometheus exporter",
        "",
    ]
    return "\n".join(lines)

