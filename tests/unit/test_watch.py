"""Zero-integration mode: rule selection, mapping choice, and the watcher
following a real child process's mappings through the real registry.

The child is a plain Python program (no kvtier import) that maps, grows,
shrinks and unmaps anonymous memory with libc on command; the scanner is the
real psutil one on this machine's /proc, the registry the daemon's. No root
needed: a process may read its own children's /proc files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid

import pytest

from kvtier import config
from kvtier import watch
from kvtier.blocks import BlockTable
from kvtier.errors import ConfigError
from kvtier.hotness import Temperature
from kvtier.kernel.procfs import Mapping, read_cgroup
from kvtier.kernel.procmap import ProcProcesses
from kvtier.kernel.watch import PsutilScanner
from kvtier.registry import Limits, Registry
from kvtier.stats import DaemonStats

MIB = 1 << 20


def rules(*entries):
    return watch.parse_rules(config.from_dict({"watch": list(entries)}).watch)


def proc(**kw):
    base = dict(pid=10, start_time=1, name="python3", exe="/usr/bin/python3.11",
                cmdline=["python3", "serve.py", "--model", "llama"], uid=1000, rss=4 << 30,
                cgroup="/system.slice/vllm-a.service")
    base.update(kw)
    return watch.ProcInfo(**base)


@pytest.mark.parametrize("rule, info, want", [
    ({"exe": "python3.11"}, {}, True),
    ({"exe": "python3"}, {}, True),  # psutil's name
    ({"exe": "/usr/bin/python3.11"}, {}, True),
    ({"exe": "/opt/python3.11"}, {}, False),
    ({"exe": "vllm"}, {}, False),
    ({"exe": "python3.11"}, {"exe": None}, False),  # unreadable exe never matches
    ({"cmdline": r"serve\.py.*llama"}, {}, True),
    ({"cmdline": r"^serve"}, {}, False),
    ({"cmdline": "serve"}, {"cmdline": None}, False),
    ({"uid": 1000}, {}, True),
    ({"uid": 0}, {}, False),
    ({"cgroup": "/system.slice"}, {}, True),
    ({"cgroup": "/system.slice/vllm-a.service"}, {}, True),
    ({"cgroup": "/system.slice/vllm"}, {}, False),  # a path prefix, not a string prefix
    ({"cgroup": "/"}, {}, True),
    ({"cgroup": "/system.slice"}, {"cgroup": None}, False),
    ({"exe": "python3", "min_rss": 8 << 30}, {}, False),
    ({"exe": "python3", "min_rss": 4 << 30}, {}, True),
    ({"exe": "python3", "uid": 1000, "cmdline": "llama"}, {}, True),
    ({"exe": "python3", "uid": 1000, "cmdline": "mistral"}, {}, False),
])
def test_every_given_selector_must_match(rule, info, want):
    assert rules(rule)[0].matches(proc(**info)) is want


@pytest.mark.parametrize("entry, msg", [
    ({"min_rss": 1}, "watch[0]: needs at least one of exe, cmdline, cgroup, uid"),
    ({"cmdline": "(unclosed"}, "watch[0].cmdline: bad regular expression"),
    ({"cgroup": "system.slice"}, "watch[0].cgroup: must be an absolute"),
    ({"exe": "x", "tenant": "t" * 65}, "watch[0].tenant: must be <= 64"),
])
def test_bad_rules_are_refused_naming_the_entry(entry, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        rules(entry)


def test_rule_names_default_and_must_be_unique():
    assert [r.name for r in rules({"exe": "a"}, {"exe": "b", "name": "sglang"})] == ["watch0", "sglang"]
    with pytest.raises(ConfigError, match=r"watch\[1\].name"):
        rules({"exe": "a", "name": "x"}, {"exe": "b", "name": "x"})


def test_tenant_from_rule_else_cgroup_leaf():
    assert watch.tenant_of(rules({"exe": "a", "tenant": "team-a"})[0], proc()) == "team-a"
    assert watch.tenant_of(rules({"exe": "a"})[0], proc()) == "vllm-a.service"
    assert watch.tenant_of(rules({"exe": "a"})[0], proc(cgroup="/")) == ""


def _m(start, end, perms="rw-p", inode=0, path=""):
    return Mapping(start, end, perms, 0, inode, path)


def test_adoptable_ranges_merge_split_vmas_and_keep_large_kv_memory():
    maps = [
        _m(0x1000_0000, 0x1400_0000),  # 64 MiB anon
        _m(0x1400_0000, 0x1800_0000, "rw-p"),  # split by a madvise: same allocation
        _m(0x2000_0000, 0x2010_0000),  # 1 MiB: too small
        _m(0x3000_0000, 0x3800_0000, "r--p", 1234, "/usr/lib/libfoo.so"),  # file-backed
        _m(0x4000_0000, 0x4800_0000, "rw-s", 99, "/dev/zero (deleted)"),  # MAP_SHARED anon
        _m(0x5000_0000, 0x5800_0000, "rw-p", 0, "[stack]"),
    ]
    assert watch.adoptable_ranges(maps, 64 * MIB) == [(0x1000_0000, 0x1800_0000), (0x4000_0000, 0x4800_0000)]
    assert watch.adoptable_ranges(maps, 129 * MIB) == []


def test_read_cgroup_prefers_the_unified_hierarchy(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("4:memory:/v1/mem\n0::/system.slice/x.service\n")
    assert read_cgroup(7, str(tmp_path)) == "/system.slice/x.service"
    (tmp_path / "7" / "cgroup").write_text("5:cpu,cpuacct:/a\n4:memory:/v1/mem\n")
    assert read_cgroup(7, str(tmp_path)) == "/v1/mem"


# -- a real child, the real scanner, the real registry -----------------------

CHILD = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    MIB = 1 << 20
    PROT_RW, MAP_PRIVATE_ANON, MAP_FIXED_NOREPLACE = 3, 0x22, 0x100000
    base = libc.mmap(None, 256 * MIB, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    ctypes.memset(base, 1, 4 * MIB)
    print(base, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "shrink":
            ok = libc.munmap(base + 128 * MIB, 128 * MIB) == 0
        elif cmd == "grow":
            ok = libc.mmap(base + 128 * MIB, 128 * MIB, PROT_RW, MAP_PRIVATE_ANON | MAP_FIXED_NOREPLACE, -1, 0) == base + 128 * MIB
        elif cmd == "below":
            ok = libc.mmap(base - 128 * MIB, 128 * MIB, PROT_RW, MAP_PRIVATE_ANON | MAP_FIXED_NOREPLACE, -1, 0) == base - 128 * MIB
        elif cmd == "free":
            ok = libc.munmap(base, 256 * MIB) == 0
        print("ok" if ok else "failed", flush=True)
""")


class Child:
    def __init__(self, tag: str):
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, tag], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.base = int(self.p.stdout.readline())

    def do(self, cmd: str) -> None:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "ok", cmd

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


@pytest.fixture
def child():
    c = Child(f"kvtier-watch-test-{uuid.uuid4().hex}")
    yield c
    c.close()


def make_watcher(tag: str, **rule):
    reg = Registry(BlockTable(), Limits(), DaemonStats(), Temperature(30.0), ProcProcesses("/proc"))
    w = watch.Watcher(rules({"cmdline": re.escape(tag), "min_mapping": 100 * MIB, "tenant": "t", **rule}),
                  reg, PsutilScanner("/proc"))
    return reg, w


def step(w):
    w.apply(w.scan())


def adopted(reg):
    return sorted((r.pid, r.start, r.length, r.adopted_by) for r in reg.regions.values())


def aligned(addr):
    return -(-addr // (2 * MIB)) * 2 * MIB


def test_watcher_adopts_follows_and_releases_a_real_process(child):
    tag = child.p.args[-1]
    reg, w = make_watcher(tag)
    step(w)
    pid, base = child.p.pid, child.base
    start = aligned(base)  # regions sit on a grid of whole blocks
    assert adopted(reg) == [(pid, start, base + 256 * MIB - start, "watch0")]
    r = next(iter(reg.regions.values()))
    assert r.tenant == "t" and r.nblocks == 128 and r.owner_uid == os.getuid()
    # A second scan with nothing changed changes nothing.
    gen = reg.generation
    step(w)
    assert reg.generation == gen

    # Temperature survives a resize for the blocks that stay.
    s = reg.table.slices[r.id]
    reg.table.temp[s.start:s.stop] = range(128)
    child.do("shrink")
    step(w)
    assert adopted(reg) == [(pid, start, base + 128 * MIB - start, "watch0")]
    assert reg.table.region_view(r.id, "temp").tolist() == list(range(64))
    child.do("grow")
    step(w)
    assert adopted(reg) == [(pid, start, base + 256 * MIB - start, "watch0")]
    assert reg.table.region_view(r.id, "temp")[:64].tolist() == list(range(64))
    assert not reg.table.region_view(r.id, "temp")[64:].any()
    # Growing downwards (the kernel merged a new mapping just below): the
    # region starts lower, and every block keeps its state at its address.
    child.do("below")
    step(w)
    assert adopted(reg) == [(pid, start - 128 * MIB, base + 256 * MIB - start + 128 * MIB, "watch0")]
    temp = reg.table.region_view(r.id, "temp")
    assert temp[64:128].tolist() == list(range(64)) and not temp[:64].any() and not temp[128:].any()
    child.do("free")
    step(w)
    assert [x[1] for x in adopted(reg)] == [start - 128 * MIB]  # only the mapping below is left
    assert w.counters() == {"adopted": 1, "resized": 4, "released": 0, "errors": 0}


def test_watcher_skips_a_client_registration_and_non_matching_processes(child):
    tag = child.p.args[-1]
    reg, w = make_watcher(tag)
    # The process registered the mapping itself: the watcher leaves it alone.
    reg.add(child.p.pid, child.base, 256 * MIB, 2 * MIB, name="own")
    step(w)
    assert [(r.name, r.adopted_by) for r in reg.regions.values()] == [("own", "")]
    assert w.errors_total == 1
    step(w)
    assert w.errors_total == 1  # said once, not every scan
    reg2, w2 = make_watcher(tag, min_rss=1 << 50)
    step(w2)
    assert adopted(reg2) == []


def test_watcher_releases_a_process_that_stops_matching_and_state_skips_adopted(child):
    tag = child.p.args[-1]
    reg, w = make_watcher(tag)
    step(w)
    assert len(reg.regions) == 1
    assert reg.to_state() == []  # re-adopted by the next scan after a restart, not from the state file
    w.rules = rules({"cmdline": "no-such-process-" + uuid.uuid4().hex})
    step(w)
    assert reg.regions == {}


def test_watcher_drops_an_exited_process(child):
    tag = child.p.args[-1]
    reg, w = make_watcher(tag)
    step(w)
    assert len(reg.regions) == 1
    child.close()
    reg.check_alive()  # the daemon's pidfd does this at once; check_alive is its backstop
    assert reg.regions == {}
    step(w)
    assert reg.regions == {}
