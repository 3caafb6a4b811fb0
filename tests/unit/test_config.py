"""The config table: defaults, types, bounds, unknown keys, sample file."""

import os

import pytest

from kvtier import config as C
from kvtier.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_come_from_the_table():
    cfg = C.from_dict({})
    for o in C.OPTIONS:
        assert cfg.get(o.key) == o.default
        assert getattr(getattr(cfg, o.section), o.name) == o.default


def test_every_default_passes_its_own_validation():
    for o in C.OPTIONS:
        assert C._check(o, o.default) == o.default


def test_values_are_read(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text(
        '[daemon]\nsocket = "/tmp/x.sock"\ntick_interval = 2\nsocket_mode = 0o600\n'
        "[limits]\nmax_message_bytes = 65536\n[policy]\nhigh_wm = 0.9\n"
    )
    cfg = C.load(str(p))
    assert cfg.daemon.socket == "/tmp/x.sock"
    assert cfg.daemon.tick_interval == 2.0 and isinstance(cfg.daemon.tick_interval, float)
    assert cfg.daemon.socket_mode == 0o600
    assert cfg.limits.max_message_bytes == 65536
    assert cfg.extra["policy"] == {"high_wm": 0.9}
    assert cfg.source == str(p)


@pytest.mark.parametrize(
    "doc, key",
    [
        ({"daemon": {"tick_interval": "fast"}}, "daemon.tick_interval: expected float"),
        ({"daemon": {"tick_interval": 0}}, "daemon.tick_interval: must be >= 0.01"),
        ({"daemon": {"dry_run": 1}}, "daemon.dry_run: expected bool"),
        ({"limits": {"request_burst": True}}, "limits.request_burst: expected int"),
        ({"limits": {"max_message_bytes": 10}}, "limits.max_message_bytes: must be >= 4096"),
        ({"daemon": {"log_level": "loud"}}, "daemon.log_level: must be one of"),
        ({"daemon": {"sokcet": "/x"}}, "daemon.sokcet: unknown option"),
        ({"deamon": {}}, "deamon: unknown section"),
        ({"daemon": 3}, "daemon: expected a table"),
        ({"policy": 3}, "policy: expected a table"),
    ],
)
def test_errors_name_the_key(doc, key):
    with pytest.raises(ConfigError) as ei:
        C.from_dict(doc)
    assert key in str(ei.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        C.load(str(tmp_path / "none.toml"))
    assert C.load(str(tmp_path / "none.toml"), missing_ok=True).source == "<defaults>"


def test_syntax_error_names_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[daemon\n")
    with pytest.raises(ConfigError, match=str(p)):
        C.load(str(p))


def test_overrides_win_and_are_validated(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text("[daemon]\ntick_interval = 2.0\n")
    assert C.load(str(p), overrides={"daemon.tick_interval": 0.5}).daemon.tick_interval == 0.5
    with pytest.raises(ConfigError, match="daemon.tick_interval"):
        C.load(str(p), overrides={"daemon.tick_interval": -1.0})


def test_sample_config_parses_to_the_defaults_when_uncommented():
    text = C.sample_toml()
    uncommented = "\n".join(
        line[1:] if line.startswith("#") and "=" in line and not line.startswith("# ") else line
        for line in text.splitlines()
    )
    cfg = C.from_dict(__import__("tomllib").loads(uncommented))
    for o in C.OPTIONS:
        assert cfg.get(o.key) == o.default, o.key


def test_shipped_sample_is_the_generated_one():
    with open(os.path.join(ROOT, "systemd", "kvtierd.toml")) as f:
        assert f.read() == C.sample_toml(), "regenerate: kvtierd --print-sample-config > systemd/kvtierd.toml"
