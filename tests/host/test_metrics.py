"""The real kvtierd's /metrics while it actually migrates (root, this kernel).

kvtierd runs as a subprocess with a swap file enabled, so on this one-node
host it has two tiers: dram and swap. A KV pool owned by another process
(tests/kvchild.py) is registered through the client library; the DRAM
budget is capped at 8 MiB so the policy itself must page the cold blocks
out and, once the hints change, page the newly hot ones back in. Every
check scrapes the real HTTP endpoint with urllib and parses it with
prometheus_client's parser. Waits poll with a generous deadline; nothing
asserts on elapsed time.
"""

from __future__ import annotations

import functools
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from argparse import Namespace

import numpy as np
import pytest
import waiting
from prometheus_client.parser import text_string_to_metric_families

from kvchild import KVChild, page_out
from kvtierd import acting
from kvtier import top
from kvtier.client import Client, KvtierClientError

pytestmark = pytest.mark.root

MIB = 1 << 20
BLOCK = 2 * MIB
POOL = 32 * MIB  # 16 blocks
DRAM_BUDGET = 8 * MIB  # low watermark 0.85 -> 3 blocks stay in DRAM
DEADLINE = 60.0


wait_for = functools.partial(waiting.wait_for, timeout=DEADLINE, interval=0.1)


class Scrape:
    """One parsed scrape: value(name, **labels), sum over unlisted labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def value(self, metric: str, /, **labels: str) -> float | None:
        hits = [s.value for s in self.samples
                if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(hits) if hits else None


CONFIG = f"""\
    tick_interval = 0.1
    residency_interval = 0.5
    [policy]
    capacity = {{ "0" = {DRAM_BUDGET} }}
    min_residence_s = 0.0
    [hotness]
    tau_s = 2.0
    """


@pytest.fixture
def kvtierd(tmp_path, swapfile):
    with acting(tmp_path, CONFIG, DEADLINE) as daemon:
        yield daemon


@pytest.fixture
def kvtierd_dry(tmp_path, swapfile):
    with acting(tmp_path, CONFIG, DEADLINE, "--dry-run") as daemon:
        yield daemon


class SteadyReader:
    """Hints ``blocks`` every 50 ms from its own connection, as a decoding
    engine does each step, until closed. The tests' polling loops hinted
    between scrapes, so on a loaded host their reads came in bursts seconds
    apart, and a run that goes that long silent at its own rate has ended
    (hotness.end_of_run): every temperature 0, the access ratio 0.0
    (tests/host/test_metrics.py failed so in a fresh-clone CI at load 9)."""

    def __init__(self, socket: str, region: int, blocks: np.ndarray, count: int = 5):
        self.blocks, self.count = np.asarray(blocks), count
        self.sent = 0  # block ids the daemon has answered for
        self._stop = threading.Event()
        self._kv = Client(socket, name="steady-reader")
        self._region = region
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            ids = np.repeat(self.blocks, self.count).astype("<u4")
            try:
                self._kv.request("hint", region=self._region, blocks=ids.tobytes())
                self.sent += ids.size
            except KvtierClientError:  # the region went (the test ended or failed): stop reading
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._kv.close()

    def __enter__(self) -> "SteadyReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return Scrape(r.read().decode())


def test_metrics_follow_registration_hints_and_migrations(kvtierd):
    m = scrape(kvtierd.url)
    assert m.value("kvtier_tier_info", tier="swap", index="1", kind="swap") == 1
    assert m.value("kvtier_regions") == 0
    assert m.value("process_resident_memory_bytes") > 0

    with KVChild(POOL) as child, Client(kvtierd.socket, name="test_metrics") as kv:
        before = child.checksum()
        region = kv.register(addr=child.addr, length=POOL, block_size=BLOCK, name="pool", tenant="team-a",
                             pid=child.pid)
        hot = np.array([0, 1, 2])
        reader = SteadyReader(kvtierd.socket, region.id, hot)

        # Phase 1: blocks 0-2 hot, the rest cold -> the policy pages the cold ones out.
        def settled_out():
            s = scrape(kvtierd.url)
            # The access ratio is summed at each tick's end (kvtier.summary): it
            # may lag the placement by a tick, during which the reader's first
            # hints may not have been counted yet.
            return s if (s.value("kvtier_tier_bytes", tier="dram") == 3 * BLOCK
                         and s.value("kvtier_tier_access_ratio", tier="dram") > 0.9) else None

        m = wait_for(settled_out, "the cold blocks to be paged out and the hot ones to hold the accesses")
        assert m.value("kvtier_regions") == 1 and m.value("kvtier_clients") == 1  # the reader has no region
        assert m.value("kvtier_registered_bytes") == POOL
        assert m.value("kvtier_tier_bytes", tier="swap") == 13 * BLOCK
        assert m.value("kvtier_tier_blocks", tier="swap") == 13
        assert m.value("kvtier_tenant_tier_bytes", tenant="team-a", tier="dram") == 3 * BLOCK
        assert m.value("kvtier_region_tier_bytes", name="pool", tier="swap") == 13 * BLOCK
        out_blocks = m.value("kvtier_migrated_blocks_total", src="dram", dst="swap")
        assert out_blocks >= 13
        assert m.value("kvtier_migrated_bytes_total", src="dram", dst="swap") == out_blocks * BLOCK
        assert m.value("kvtier_migration_duration_seconds_count") >= 1
        assert m.value("kvtier_migration_duration_seconds_bucket", le="+Inf") == \
            m.value("kvtier_migration_duration_seconds_count")
        assert m.value("kvtier_requests_total", op="register") == 1
        assert m.value("kvtier_requests_total", op="hint") >= 1
        assert 0 < m.value("kvtier_hinted_blocks_total") <= reader.sent
        assert m.value("kvtier_ticks_total") >= 1
        assert m.value("kvtier_tick_duration_seconds_count") == m.value("kvtier_ticks_total")
        # The hot blocks hold nearly all the recent accesses and sit in DRAM.
        assert m.value("kvtier_block_temperature_gcount") == 16
        assert list(region.query()[:3]) == [0, 0, 0]

        # Phase 2: the hot set moves to blocks 10-12 (in swap): they come back in.
        new_hot = np.array([10, 11, 12])

        reader.blocks, reader.count = new_hot, 20

        # The table first, then the scrape: the move that brings them in
        # may finish between the two, and a scrape taken before the query
        # then lacks the migration the query already shows (2 of 8 runs
        # beside two kvtier-sim processes: 0 swap -> dram counted).
        def settled_in():
            return scrape(kvtierd.url) if list(region.query()[10:13]) == [0, 0, 0] else None

        m = wait_for(settled_in, "the new hot blocks to be paged in")
        reader.close()
        why = "\n".join(line for line in m.text.splitlines()
                        if line.startswith(("kvtier_migrated_blocks_total", "kvtier_pageout_returns",
                                            "kvtier_topology_events", "kvtier_tier_bytes")))
        assert m.value("kvtier_migrated_blocks_total", src="swap", dst="dram") >= 3, \
            why + "\n" + kvtierd.log.read_text()[-6000:]
        assert m.value("kvtier_migrated_bytes_total", src="swap", dst="dram") >= 3 * BLOCK
        assert m.value("kvtier_tier_bytes", tier="dram") <= DRAM_BUDGET
        # Phase 1's hints all found their blocks in DRAM once settled;
        # phase 2's first hints found theirs in swap.
        assert m.value("kvtier_hint_block_accesses_total", tier="swap") > 0
        assert m.value("kvtier_hint_block_accesses_total", tier="dram") > 0
        assert 0 < m.value("kvtier_tier_hit_ratio", tier="dram") < 1

        # A refused request is counted by op and code.
        with pytest.raises(KvtierClientError):
            kv.request("migrate", region=region.id, tier=7)
        m = scrape(kvtierd.url)
        assert m.value("kvtier_request_errors_total", op="migrate", code="invalid_argument") == 1

        # kvtierctl top against the same daemon: one frame, no redraw codes.
        out = io.StringIO()
        assert top.run(Namespace(socket=kvtierd.socket, once=True, count=0, interval=1.0), out=out) == 0
        frame = out.getvalue()
        assert "\x1b[" not in frame
        assert re.search(r"^dram +dram +0 ", frame, re.M) and re.search(r"^swap +swap ", frame, re.M)
        assert re.search(r"dram → swap .*total", frame)
        assert re.search(r"^ +\d+ pool +team-a ", frame, re.M)

        assert child.checksum() == before  # paged out and back, the data is intact
        region.unregister()

    m = wait_for(lambda: (s := scrape(kvtierd.url)).value("kvtier_regions") == 0 and s, "the region to go")
    assert m.value("kvtier_region_events_total", event="unregistered") == 1
    assert m.value("kvtier_tier_bytes", tier="dram") == 0


def test_partly_failed_pageout_does_not_evict_a_hot_block(kvtierd):
    """A cold block whose pageout leaves a few pages behind is where most of
    its pages went (swap), not in DRAM: counting it in DRAM made the next
    plan evict a hot block for room that was already free (the
    once-in-twenty access ratio of 0.667 above, when the last pages the child
    wrote were still in a CPU's LRU batch). Here a forked sharer keeps four
    pages of block 15 in DRAM the same way, every run, and the pageout
    comes from a reload that lowers the DRAM budget once every block has
    been measured in DRAM (so no first measurement can hide it)."""
    with KVChild(POOL) as child, Client(kvtierd.socket, name="test_metrics") as kv:
        assert child.ask(f"share {15 * BLOCK} {4 * 4096}") == "ok"
        conf = kvtierd.conf.read_text()
        kvtierd.conf.write_text(conf.replace(f'"0" = {DRAM_BUDGET}', f'"0" = {4 * POOL}'))
        reload(kvtierd, 1)
        region = kv.register(addr=child.addr, length=POOL, block_size=BLOCK, name="pool", pid=child.pid)
        with SteadyReader(kvtierd.socket, region.id, np.array([0, 1, 2])):
            wait_for(lambda: list(region.query()) == [0] * 16, "every block measured in DRAM")
            kvtierd.conf.write_text(conf)
            reload(kvtierd, 2)

            def settled_out():
                s = scrape(kvtierd.url)
                return s if (s.value("kvtier_tier_bytes", tier="dram") == 3 * BLOCK
                             and s.value("kvtier_tier_access_ratio", tier="dram") > 0.9) else None

            m = wait_for(settled_out, "the cold blocks to be paged out and the hot ones to hold the accesses")
        assert m.value("kvtier_migration_failed_pages_total", src="dram", dst="swap", reason="NOT_PAGED_OUT") == 4
        assert list(region.query()) == [0, 0, 0] + [1] * 13


def test_perf_fault_samples_and_source_events_are_scraped(kvtierd):
    """The major-fault source in the real daemon: a pool the test put in
    swap (twice paged out, so no page is left in the swap cache, see
    kvchild.page_out) is registered, its owner reads four blocks back,
    and the scrape counts their major faults as perf_fault samples; the
    blocks after them (up to hotness.perf_fault.prefetch_blocks, default 4),
    never read, are paged in ahead of the reader."""
    from test_perf_host import majflt

    kvtierd.conf.write_text(kvtierd.conf.read_text().replace(f'"0" = {DRAM_BUDGET}', f'"0" = {4 * POOL}'))
    reload(kvtierd, 1)  # room in DRAM: nothing is paged out again
    with KVChild(POOL) as child, Client(kvtierd.socket, name="test_perf_events") as kv:
        page_out(child)
        region = kv.register(addr=child.addr, length=POOL, block_size=BLOCK, name="pool", pid=child.pid)
        kv.request("measure", region=region.id, blocks=None)
        wait_for(lambda: list(region.query()) == [1] * 16, "the pool measured in swap")
        # Two collects after the registration: the source follows its threads.
        n = kv.status()["engine"]["sources"]["perf_fault"]["collects"]
        wait_for(lambda: kv.status()["engine"]["sources"]["perf_fault"]["collects"] >= n + 2, "two collects")
        m = scrape(kvtierd.url)
        assert m.value("kvtier_hotness_source_active", source="perf_fault") == 1
        assert m.value("kvtier_source_events_total", source="perf_fault", event="samples") == 0
        before = majflt(child.pid)
        for b in (4, 5, 6, 7):
            assert child.ask(f"touch {b * BLOCK} {BLOCK}").startswith("ok")
        faults = majflt(child.pid) - before
        assert faults > 0
        m = wait_for(lambda: (s := scrape(kvtierd.url)).value(
            "kvtier_source_events_total", source="perf_fault", event="samples") >= faults and s,
            "the faults sampled")
        assert m.value("kvtier_source_events_total", source="perf_fault", event="lost") == 0
        assert m.value("kvtier_source_events_total", source="perf_fault", event="unmatched") == 0
        assert m.value("kvtier_source_events_total", source="damon", event="sysfs_busy_retries") == 0
        # Which collect sees which fault depends on timing: if one collect sees
        # only block 4's faults, 5-8 come in ahead and the reader's later blocks
        # take no major fault, so nothing asks for 9-11. Block 8, after the last
        # block read, is paged in either way, and nothing past 11 (4 after 7).
        wait_for(lambda: region.query()[8] == 0, "block 8 paged in ahead of the reader")
        assert scrape(kvtierd.url).value("kvtier_fault_prefetch_blocks_total") >= 1
        assert list(region.query()[12:]) == [1] * 4


def swapped_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmSwap:")).split()[1])


def test_dry_run_moves_nothing_and_says_what_it_would_move(kvtierd_dry):
    """--dry-run over the same pool and budget as above: the plan wants the
    13 cold blocks in swap, and nothing moves. Every block stays in DRAM in
    the daemon's view as in the kernel's, the migration counters stay at 0,
    and the planned moves are counted apart (main recorded them as done:
    the blocks "in swap", 0 pages there)."""
    with KVChild(POOL) as child, Client(kvtierd_dry.socket, name="test_dry_run") as kv:
        before = child.checksum()
        region = kv.register(addr=child.addr, length=POOL, block_size=BLOCK, name="pool", pid=child.pid)

        def planned():
            region.hint(np.repeat([0, 1, 2], 50))
            kv.flush()
            s = scrape(kvtierd_dry.url)
            return s if (s.value("kvtier_dry_run_planned_blocks_total", src="dram", dst="swap") or 0) >= 13 else None

        m = wait_for(planned, "the dry run to plan the cold blocks' pageout")
        time.sleep(1.0)  # ten more ticks: a pretended move would show by now
        m = scrape(kvtierd_dry.url)
        assert m.value("kvtier_dry_run") == 1
        assert m.value("kvtier_migrated_blocks_total") == 0
        assert m.value("kvtier_migrated_bytes_total") == 0
        assert m.value("kvtier_tier_bytes", tier="dram") == POOL
        assert m.value("kvtier_tier_bytes", tier="swap") == 0
        assert m.value("kvtier_dry_run_planned_bytes_total", src="dram", dst="swap") == \
            m.value("kvtier_dry_run_planned_blocks_total", src="dram", dst="swap") * BLOCK
        assert list(region.query()) == [0] * 16
        assert swapped_kib(child.pid) == 0
        engine = kv.status()["engine"]
        assert engine["dry_run"] is True
        last = {(p["src"], p["dst"]): p for p in engine["dry_run_planned"]["last_plan"]}
        assert 0 < last[("dram", "swap")]["blocks"] <= 13, engine["dry_run_planned"]
        out = subprocess.run([sys.executable, "-m", "kvtier.ctl", "status", "--socket", kvtierd_dry.socket],
                             capture_output=True, text=True, check=True).stdout
        assert re.search(r"dry run, no page moved: the last plan would move dram -> swap \d+ blocks", out), out
        assert child.checksum() == before
    assert "(dry run)" in kvtierd_dry.log.read_text()


def test_reload_applies_hotness_and_metrics_or_refuses_naming_the_key(kvtierd):
    """SIGHUP with a changed [hotness.perf_fault] and [metrics]: the source
    stops (gone from status and scrape), the exporter is rebuilt without
    per-region series. Then a change to a key read only at start is refused
    as a whole, naming the key: nothing of that file is applied. (Main
    validated both tables, logged "reloaded" and applied neither.)"""
    with KVChild(POOL) as child, Client(kvtierd.socket, name="test_reload") as kv:
        kv.register(addr=child.addr, length=POOL, block_size=BLOCK, name="pool", pid=child.pid)
        m = wait_for(lambda: (s := scrape(kvtierd.url)).value("kvtier_region_tier_bytes", name="pool") and s,
                     "per-region series")
        assert m.value("kvtier_hotness_source_active", source="perf_fault") == 1
        assert kv.status()["engine"]["sources"]["perf_fault"]["active"] is True
        conf = kvtierd.conf.read_text()
        kvtierd.conf.write_text(conf.replace("port = 0\n", "port = 0\nper_region = false\n")
                                + "[hotness.perf_fault]\nenabled = false\n")
        old_url = kvtierd.url
        kvtierd.proc.send_signal(signal.SIGHUP)
        urls = lambda: re.findall(r"metrics on (http://\S+/metrics)", kvtierd.log.read_text())  # noqa: E731
        wait_for(lambda: len(urls()) == 2, "the exporter to be rebuilt")
        new_url = urls()[-1]
        m = wait_for(lambda: (s := scrape(new_url)).value("kvtier_config_reloads_total", result="ok") == 1 and s,
                     "the reload counted")
        assert m.value("kvtier_region_tier_bytes") is None  # per_region = false
        assert m.value("kvtier_tenant_tier_bytes") == POOL
        assert m.value("kvtier_hotness_source_active", source="perf_fault") is None
        assert "perf_fault" not in kv.status()["engine"]["sources"]
        log = kvtierd.log.read_text()
        assert re.search(r"event=config_reloaded .*changed=metrics.per_region,hotness.perf_fault.enabled|"
                         r"event=config_reloaded .*changed=hotness.perf_fault.enabled,metrics.per_region", log), log
        assert "event=source_disabled source=perf_fault" in log
        if new_url != old_url:
            with pytest.raises(OSError):
                urllib.request.urlopen(old_url, timeout=5)

        # A key read only at start, beside one that could be applied: all refused.
        kvtierd.conf.write_text(conf.replace("[daemon]\n", "[daemon]\nsocket_mode = 0o600\n"))
        kvtierd.proc.send_signal(signal.SIGHUP)
        m = wait_for(lambda: (s := scrape(new_url)).value("kvtier_config_reloads_total", result="error") == 1 and s,
                     "the reload to be refused")
        assert m.value("kvtier_config_reloads_total", result="ok") == 1
        assert m.value("kvtier_region_tier_bytes") is None and "perf_fault" not in kv.status()["engine"]["sources"]
        assert "reload refused, keeping the running config: daemon.socket_mode changed (432 -> 384): read only " \
               "at start, restart kvtierd to change it" in kvtierd.log.read_text()


def reload(kvtierd, n: int) -> None:
    kvtierd.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: scrape(kvtierd.url).value("kvtier_config_reloads_total", result="ok") == n, f"reload {n}")


def test_exporter_is_loopback_only_by_default(kvtierd):
    assert kvtierd.url.startswith("http://127.0.0.1:")


def test_top_redraws_in_place_and_exits_cleanly_on_ctrl_c(kvtierd):
    """kvtierctl top on a terminal: alternate screen, in-place redraws, and
    Ctrl-C restores the screen and exits 0."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # child: the real command on the pty
        # A terminal user's Ctrl-C: SIGINT at its default. A suite started as a
        # background job of a non-interactive shell inherits SIGINT ignored,
        # and exec keeps that, so top would never see the Ctrl-C sent below.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "kvtier.ctl", "top", "--socket", kvtierd.socket,
                                  "--interval", "0.2"])
    out = b""

    def read_some():
        nonlocal out
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                out += os.read(fd, 65536)
            except OSError:  # EIO: the child closed the pty
                return True
        return False

    try:
        wait_for(lambda: read_some() or out.count(b"\x1b[H") >= 3, "three redraws")
        assert out.startswith(b"\x1b[?1049h")  # alternate screen first
        assert b"TIER" in out and b"dram" in out
        os.kill(pid, signal.SIGINT)
        wait_for(lambda: read_some(), "the pty to close")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert out.rstrip().endswith(b"\x1b[?25h\x1b[?1049l")  # cursor back, main screen restored
    assert b"Traceback" not in out
