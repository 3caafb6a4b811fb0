"""Structured logging: logfmt lines, journal priority prefixes, JOURNAL_STREAM detection."""

from __future__ import annotations

import io
import logging
import os
import re

import pytest

from kvtier import logs


@pytest.fixture
def logger():
    log = logging.getLogger("kvtier.test_logs")
    yield log
    root = logging.getLogger(logs.ROOT_LOGGER)
    for h in list(root.handlers):
        root.removeHandler(h)
    root.propagate = True


def test_event_is_one_logfmt_line_with_timestamp(logger):
    out = io.StringIO()
    logs.setup("info", out)
    logs.event(logger, "region_registered", region=3, pid=1234, name="kv pool", tenant="")
    line = out.getvalue()
    assert line.count("\n") == 1
    assert re.fullmatch(
        r'ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=info logger=kvtier\.test_logs '
        r'event=region_registered region=3 pid=1234 name="kv pool" tenant=""\n', line)


def test_journal_format_has_priority_and_no_timestamp(logger):
    out = io.StringIO()
    logs.setup("debug", out, journal=True)
    logs.event(logger, "source_unavailable", logging.WARNING, source="damon",
               reason="vaddr ops missing")
    logger.error("batch %d failed", 7)
    logger.debug("detail")
    lines = out.getvalue().splitlines()
    assert lines == [
        '<4>level=warning logger=kvtier.test_logs event=source_unavailable source=damon reason="vaddr ops missing"',
        '<3>level=error logger=kvtier.test_logs msg="batch 7 failed"',
        "<7>level=debug logger=kvtier.test_logs msg=detail",
    ]


def test_level_filters_and_setup_replaces_its_handler(logger):
    out1, out2 = io.StringIO(), io.StringIO()
    logs.setup("warning", out1)
    logs.event(logger, "tier_discovered", tier="cxl0")
    assert out1.getvalue() == ""
    logs.setup("info", out2)
    logs.event(logger, "tier_discovered", tier="cxl0")
    assert out1.getvalue() == "" and "event=tier_discovered tier=cxl0" in out2.getvalue()
    assert len([h for h in logging.getLogger("kvtier").handlers if getattr(h, "_kvtier", False)]) == 1


def test_exception_stays_on_one_line(logger):
    out = io.StringIO()
    logs.setup("info", out, journal=True)
    try:
        raise OSError(16, "Device or resource busy")
    except OSError:
        logger.exception("migration batch failed")
    (line,) = out.getvalue().splitlines()
    assert line.startswith('<3>level=error logger=kvtier.test_logs msg="migration batch failed" exc="Traceback')
    assert "\\n" in line and "Device or resource busy" in line


@pytest.mark.parametrize("value, text", [
    ("plain", "plain"),
    ("two words", '"two words"'),
    ('say "hi"', r'"say \"hi\""'),
    ("a=b", '"a=b"'),
    ("", '""'),
    (None, '""'),
    (True, "true"),
    (0.000123456789, "0.000123457"),
    (12, "12"),
    ("tab\there", r'"tab\there"'),
])
def test_quote(value, text):
    assert logs.quote(value) == text


def test_journal_stream_matches_the_stream_device_and_inode(tmp_path):
    with open(tmp_path / "err", "w") as f, open(tmp_path / "other", "w") as g:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert logs.journal_stream(f, env)
        # A stream redirected elsewhere (child with 2>file) is not the journal.
        assert not logs.journal_stream(g, env)
        assert not logs.journal_stream(f, {})
        assert not logs.journal_stream(f, {"JOURNAL_STREAM": "garbage"})
    assert not logs.journal_stream(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def test_setup_detects_the_journal_from_the_environment(tmp_path, monkeypatch, logger):
    with open(tmp_path / "err", "w+") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.setup("info", f)
        logs.event(logger, "daemon_started", version="0.1.0")
        f.flush()
        f.seek(0)
        assert f.read() == "<6>level=info logger=kvtier.test_logs event=daemon_started version=0.1.0\n"


def test_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="unknown log level"):
        logs.setup("loud", io.StringIO())


def test_syslog_priority_rounds_custom_levels_down():
    assert logs.syslog_priority(logging.INFO + 5) == 6
    assert logs.syslog_priority(logging.CRITICAL) == 2
    assert logs.syslog_priority(1) == 7
