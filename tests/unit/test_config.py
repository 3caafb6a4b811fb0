"""The config table: defaults, types, bounds, unknown keys, nested overrides,
the sample file, and one source of truth for the components' defaults."""

import dataclasses
import os
import subprocess
import sys
import tomllib

import pytest

from kvtier import config
from kvtier.errors import ConfigError
from kvtier.kernel import sources
from kvtier.kernel.sources.damon import DamonParams
from kvtier.metrics import MetricsConfig
from kvtier.policy import PolicyConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a message must never contain: Python talking instead of the config.
INTERNALS = ("not supported between", "unexpected keyword", "__init__", "Traceback", "object has no",
             "NoneType", "TypeError", "ValueError", "invalid literal")


def _section_ns(cfg, section):
    ns = cfg
    for part in section.split("."):
        ns = getattr(ns, part)
    return ns


def test_defaults_come_from_the_table():
    cfg = config.from_dict({})
    for o in config.OPTIONS:
        assert cfg.get(o.key) == o.default
        assert getattr(_section_ns(cfg, o.section), o.name) == o.default


def test_every_default_passes_its_own_validation_and_has_its_type():
    for o in config.OPTIONS:
        assert config.check_value(o, o.default) == o.default, o.key
        types = o.type if isinstance(o.type, tuple) else (o.type,)
        assert isinstance(o.default, types), o.key
        assert o.doc and o.section in config.SECTION_DOCS, o.key


@pytest.mark.parametrize("cls, section, skip", [
    (PolicyConfig, "policy", ()),
    (MetricsConfig, "metrics", ()),
    (DamonParams, "hotness.damon", ("enabled",)),
])
def test_component_defaults_are_derived_not_copied(cls, section, skip):
    """Every field of the component's dataclass has its row, and the row's
    default is the dataclass's: the policy can change a default in one place."""
    rows = {o.name: o for o in config.OPTIONS if o.section == section and o.name not in skip}
    assert set(rows) == {f.name for f in dataclasses.fields(cls)}, \
        f"add a row to kvtier.config.OPTIONS for each new field of {cls.__name__}"
    built = cls()
    for name, o in rows.items():
        assert o.default == getattr(built, name), o.key


def test_every_hotness_source_has_its_table():
    for name, (keys, on) in sources.SECTIONS.items():
        rows = {o.name: o for o in config.OPTIONS if o.section == f"hotness.{name}"}
        assert set(rows) == {"enabled", *keys}, name
        assert rows["enabled"].default is on


def test_values_are_read(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text(
        '[daemon]\nsocket = "/tmp/x.sock"\ntick_interval = 2\nsocket_mode = 0o600\n'
        "[limits]\nmax_message_bytes = 65536\n[policy]\nhigh_wm = 0.9\ncapacity = {1 = 0.5}\n"
        "[hotness]\ntau_s = 5\n[hotness.damon]\naggr_us = 200000\n"
        '[topology]\nswap = false\ntiers = [{name = "dram", nodes = [0]}]\n[metrics]\nport = 0\n'
    )
    cfg = config.load(str(p))
    assert cfg.daemon.socket == "/tmp/x.sock"
    assert cfg.daemon.tick_interval == 2.0 and isinstance(cfg.daemon.tick_interval, float)
    assert cfg.daemon.socket_mode == 0o600
    assert cfg.limits.max_message_bytes == 65536
    assert cfg.policy.high_wm == 0.9 and cfg.table("policy")["high_wm"] == 0.9
    assert cfg.policy.capacity == {1: 0.5}  # tier indices as ints
    assert cfg.hotness.tau_s == 5.0 and cfg.hotness.damon.aggr_us == 200000
    assert cfg.hotness.damon.enabled is True
    assert cfg.changed("topology") == {"swap": False, "tiers": [{"name": "dram", "nodes": [0]}]}
    assert cfg.metrics.port == 0
    assert cfg.source == str(p)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"daemon": {"tick_interval": "fast"}}, "daemon.tick_interval: expected float, got str 'fast'"),
        ({"daemon": {"tick_interval": 0}}, "daemon.tick_interval: must be >= 0.01"),
        ({"daemon": {"tick_interval": float("nan")}}, "daemon.tick_interval: must be a finite number"),
        ({"daemon": {"dry_run": 1}}, "daemon.dry_run: expected bool"),
        ({"daemon": {"socket": ""}}, "daemon.socket: must not be empty"),
        ({"daemon": {"socket_group": "no-such-group-kvtier"}}, "daemon.socket_group: no such group"),
        ({"security": {"admin_group": "no-such-group-kvtier"}}, "security.admin_group: no such group"),
        ({"limits": {"request_burst": True}}, "limits.request_burst: expected int"),
        ({"limits": {"max_message_bytes": 10}}, "limits.max_message_bytes: must be >= 4096"),
        ({"daemon": {"log_level": "loud"}}, "daemon.log_level: must be one of"),
        ({"daemon": {"sokcet": "/x"}}, "daemon.sokcet: unknown option (known in [daemon]: socket,"),
        ({"deamon": {}}, "deamon: unknown section (known: daemon,"),
        ({"daemon": 3}, "daemon: expected a table"),
        ({"policy": 3}, "policy: expected a table"),
        ({"policy": {"hihg_wm": 0.9}}, "policy.hihg_wm: unknown option"),
        ({"policy": {"capacity": {"1": "half"}}}, "policy.capacity.1: expected float, got str 'half'"),
        ({"policy": {"capacity": {"dram": 0.5}}}, "policy.capacity.dram: keys must be integers"),
        ({"policy": {"capacity": {"1": 0}}}, "policy.capacity.1: must be > 0"),
        ({"policy": {"capacity": 0.5}}, "policy.capacity: expected table of float, got float"),
        ({"policy": {"tenant_dram_quota": {"a": -1}}}, "policy.tenant_dram_quota.a: must be >= 0"),
        ({"policy": {"low_wm": 0.99}}, "policy: need 0 < low_wm <= high_wm"),
        ({"policy": {"high_wm": 0}}, "policy.high_wm: must be > 0"),
        ({"policy": {"promote_temp": 0.1}}, "policy: demote_temp must not exceed promote_temp"),
        ({"hotness": {"tau_s": 0}}, "hotness.tau_s: must be > 0"),
        ({"hotness": {"damon": 1}}, "hotness.damon: expected a table"),
        ({"hotness": {"damon": {"aggr_ms": 5}}}, "hotness.damon.aggr_ms: unknown option"),
        ({"hotness": {"damon": {"aggr_us": 10}}}, "hotness.damon: need 0 < sample_us <= aggr_us"),
        ({"hotness": {"damon": {"min_nr_regions": 2}}}, "hotness.damon.min_nr_regions: must be >= 3"),
        ({"hotness": {"damn": {}}}, "hotness.damn: unknown option (known in [hotness]: tau_s, end_of_run, access_bits,"),
        ({"hotness": {"perf": {"enabled": "yes"}}}, "hotness.perf.enabled: expected bool"),
        ({"hotness": {"perf": {"ring_pages": 3}}}, "hotness.perf.ring_pages: must be a power of two"),
        ({"hotness": {"access_bits": {"mode": "x"}}}, "hotness.access_bits.mode: must be one of auto,"),
        ({"topology": {"tiers": [3]}}, "topology.tiers[0]: expected table, got int"),
        ({"topology": {"tiers": {"name": "x"}}}, "topology.tiers: expected array of table"),
        ({"topology": {"tiers": [{"name": "d"}]}}, "topology.tiers[0].nodes: required"),
        ({"topology": {"tiers": [{"name": "d", "nodes": [0], "kind": "cxl"}]}}, "topology.tiers[0].kind:"),
        ({"topology": {"swap": "no"}}, "topology.swap: expected bool or table, got str"),
        ({"topology": {"swap": {"enabld": False}}}, "topology.swap.enabld: unknown key"),
        ({"topology": {"nodes": []}}, "topology.nodes: unknown option"),
        ({"metrics": {"port": 70000}}, "metrics.port: must be <= 65535"),
        ({"metrics": {"port": "9464"}}, "metrics.port: expected int"),
        ({"metrics": {"adress": "::"}}, "metrics.adress: unknown option"),
        ({"metrics": {"address": ""}}, "metrics.address: must not be empty"),
    ],
)
def test_errors_name_the_key(doc, message):
    with pytest.raises(ConfigError) as ei:
        config.from_dict(doc)
    assert message in str(ei.value)
    assert not any(s in str(ei.value) for s in INTERNALS), str(ei.value)


WRONG_VALUES = ["text", 7, 2.5, True, [1], {"a": 1}, -1, 1 << 70, float("inf")]


@pytest.mark.parametrize("opt", config.OPTIONS, ids=lambda o: o.key)
def test_no_wrong_value_leaks_python_internals(opt):
    """Every key, fed values of every TOML type: either accepted or a
    ConfigError that starts with the key (never a TypeError from a
    comparison deep in a component)."""
    for bad in WRONG_VALUES:
        doc: dict = {}
        config._merge(doc, opt.key, bad)
        try:
            config.from_dict(doc)
        except ConfigError as e:
            msg = str(e)
            assert msg.startswith(opt.key) or msg.startswith(opt.section + ":"), (bad, msg)
            assert not any(s in msg for s in INTERNALS), (bad, msg)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(str(tmp_path / "none.toml"))
    assert config.load(str(tmp_path / "none.toml"), missing_ok=True).source == "<defaults>"


def test_syntax_error_names_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[daemon\n")
    with pytest.raises(ConfigError, match=str(p)):
        config.load(str(p))


def test_overrides_win_and_are_validated(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text("[daemon]\ntick_interval = 2.0\n[hotness.damon]\nenabled = false\n")
    assert config.load(str(p), overrides={"daemon.tick_interval": 0.5}).daemon.tick_interval == 0.5
    with pytest.raises(ConfigError, match="daemon.tick_interval"):
        config.load(str(p), overrides={"daemon.tick_interval": -1.0})
    # nested keys, merged with the file's table instead of replacing it
    cfg = config.load(str(p), overrides={"hotness.damon.aggr_us": 200_000, "policy.capacity.1": 0.5})
    assert cfg.hotness.damon.aggr_us == 200_000 and cfg.hotness.damon.enabled is False
    assert cfg.policy.capacity == {1: 0.5}
    with pytest.raises(ConfigError, match="hotness.damon.aggr_ms: unknown option"):
        config.load(str(p), overrides={"hotness.damon.aggr_ms": 1})
    with pytest.raises(ConfigError, match="override must be section.name"):
        config.load(str(p), overrides={"tick_interval": 1.0})
    with pytest.raises(ConfigError, match="daemon.tick_interval: is not a table"):
        config.load(str(p), overrides={"daemon.tick_interval.x": 1.0})


@pytest.mark.parametrize("item, want", [
    ("daemon.tick_interval=0.5", ("daemon.tick_interval", 0.5)),
    ("hotness.damon.enabled=false", ("hotness.damon.enabled", False)),
    ("daemon.socket=/tmp/k.sock", ("daemon.socket", "/tmp/k.sock")),  # bare string
    ("policy.capacity={1 = 0.5}", ("policy.capacity", {"1": 0.5})),
    ("topology.tiers=[]", ("topology.tiers", [])),
])
def test_parse_override(item, want):
    assert config.parse_override(item) == want


def test_parse_override_needs_a_key():
    for item in ("daemon.tick_interval", "=3"):
        with pytest.raises(ConfigError, match="expected KEY=VALUE"):
            config.parse_override(item)


def _uncomment(text: str) -> str:
    return "\n".join(
        line[1:] if line.startswith("#") and "=" in line and not line.startswith("# ") else line
        for line in text.splitlines()
    )


def _keys(doc: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in doc.items():
        key = f"{prefix}.{k}" if prefix else k
        if (key in config._TABLES) and isinstance(v, dict):
            out |= _keys(v, key)
        else:
            out.add(key)
    return out


def test_sample_config_holds_every_key_with_its_default():
    doc = tomllib.loads(_uncomment(config.sample_toml()))
    assert _keys(doc) == {o.key for o in config.OPTIONS}
    cfg = config.from_dict(doc)
    for o in config.OPTIONS:
        assert cfg.get(o.key) == o.default, o.key


def test_shipped_sample_is_the_generated_one():
    with open(os.path.join(ROOT, "systemd", "kvtierd.toml")) as f:
        assert f.read() == config.sample_toml(), \
            "regenerate: kvtierd --print-sample-config > systemd/kvtierd.toml"


def _kvtierd(*args):
    return subprocess.run([sys.executable, "-m", "kvtier.daemon", *args], capture_output=True, text=True,
                          timeout=60)


def test_kvtierd_prints_the_sample_and_checks_nested_overrides(tmp_path):
    r = _kvtierd("--print-sample-config")
    assert r.returncode == 0 and r.stdout == config.sample_toml()
    empty = tmp_path / "k.toml"
    empty.write_text("")
    r = _kvtierd("-c", str(empty), "--check-config", "-s", "hotness.damon.aggr_us=200000",
                 "-s", "policy.capacity.1=0.5", "-s", "daemon.socket=/tmp/x.sock")
    assert r.returncode == 0, r.stderr
    r = _kvtierd("-c", str(empty), "--check-config", "-s", "policy.capacity.1=half")
    assert r.returncode == 78
    assert r.stderr == "kvtierd: config error: policy.capacity.1: expected float, got str 'half'\n"


# -- arrays of tables ([[watch]]) ---------------------------------------------


def test_repeated_sections_are_lists_of_entries_with_defaults():
    cfg = config.from_dict({"watch": [{"exe": "vllm", "min_rss": 1 << 30}, {"cmdline": "sglang", "uid": 1000}]})
    assert [r.exe for r in cfg.watch] == ["vllm", ""]
    assert cfg.watch[0].min_rss == 1 << 30 and cfg.watch[1].min_rss == 0
    assert cfg.watch[1].block_size == 2 * config.MIB
    assert config.from_dict({}).watch == []
    assert cfg.to_dict()["watch"][1]["uid"] == 1000


@pytest.mark.parametrize("doc, key", [
    ({"watch": {"exe": "x"}}, "watch: expected an array of tables"),
    ({"watch": [{"exe": "x", "bogus": 1}]}, "watch[0].bogus: unknown option"),
    ({"watch": [{"exe": "x"}, {"uid": "root"}]}, "watch[1].uid: expected int"),
    ({"watch": [{"exe": "x", "block_size": 16}]}, "watch[0].block_size: must be >= 4096"),
    ({"watch": [{"min_rss": 5}]}, "watch[0]: needs at least one of exe, cmdline, cgroup, uid"),
    ({"watch": [{"cmdline": "(x"}]}, "watch[0].cmdline: bad regular expression"),
])
def test_repeated_errors_name_the_entry(doc, key):
    with pytest.raises(ConfigError) as ei:
        config.from_dict(doc)
    assert str(ei.value).startswith(key), str(ei.value)


def test_sample_watch_rule_uncommented_is_the_defaults():
    text = config.sample_toml()
    block = text[text.index("# [[watch]]"):]
    doc = tomllib.loads("\n".join(line[2:] for line in block.splitlines() if line.startswith("# [[")
                                  or (" = " in line and not line.startswith("# ("))))
    rows = config.REPEATED["watch"]
    assert set(doc["watch"][0]) == {o.name for o in rows}
    entry = dict(doc["watch"][0], exe="x")  # a rule needs one selector
    assert vars(config.from_dict({"watch": [entry]}).watch[0]) == {o.name: o.default for o in rows} | {"exe": "x"}
