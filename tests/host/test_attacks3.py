"""kvtierd's newer ops and paths attacked by an unprivileged local user
(staged registration, scheduler hints, engine-mode moves): real daemon run
as root, a real ``nobody`` client over the real unix socket. Each test is
the regression test of one defect found; on the code before its fix it
fails (the commit that added it says how).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess

import msgspec
import pytest

from kvtier import protocol

from test_attacks import _connect, protocol_addr, raw_call
from test_daemon import DEADLINE, DROP, NOBODY, ChildClient, DaemonProc, PY, wait_for, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

# As nobody: maps ``n`` large untouched ranges and sends a register of each
# on a connection of its own. With "close" it closes those connections at
# once (the answers are never read); else it keeps them, and on "count"
# says how many answers have arrived so far, on "read" reads them all.
STAGER = DROP + r"""
import json, mmap, select, socket, msgspec
from kvtier import protocol
from kvtier.client import buffer_address
sock_path, n, nblocks, close = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "close"
drop(65534, 65534)
bufs = [mmap.mmap(-1, nblocks * 4096) for _ in range(n)]
socks = []
for i, b in enumerate(bufs):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(protocol.frame(msgspec.msgpack.encode(
        {"op": "register", "id": i + 1, "start": buffer_address(b)[0], "length": nblocks * 4096,
         "block_size": 4096})))
    socks.append(s)
if close:
    for s in socks:
        s.close()
print(json.dumps({"sent": n}), flush=True)
for line in sys.stdin:
    if line.strip() == "count":
        ready = [s for s in socks if select.select([s], [], [], 0)[0]]
        print(json.dumps({"answered": len(ready)}), flush=True)
    elif line.strip() == "read":
        res = []
        for s in socks:
            r, out = protocol.FrameReader(1 << 20), []
            while not out:
                out += r.feed(s.recv(1 << 16))
            res.append(protocol.decode_response(out[0]).ok)
        print(json.dumps({"ok": res}), flush=True)
"""


def _status(sock: str) -> dict:
    s = _connect(sock)
    try:
        return raw_call(s, protocol.FrameReader(1 << 30), {"op": "status", "id": 1}).result
    finally:
        s.close()


def test_staged_registers_of_closed_connections_are_dropped_and_uids_take_turns(workdir):
    """A large register is written a step per loop turn, one at a time, in
    arrival order. Before the fix a user could (a) send large registers and
    close the connections at once: every one was still written and added
    (8 regions nobody asked for any more, counted against the limits and
    taking the loop's steps), and (b) keep 8 such registers queued so that
    root's large register, sent after them, was answered after all 8. Now
    the registrations of a closed connection are dropped and uids take
    turns: root's waits for at most the one being written."""
    nblocks = 1 << 18  # 32 steps each
    d = DaemonProc(workdir).start()
    import mmap

    closed = kept = None
    mine = mmap.mmap(-1, nblocks * 4096)
    try:
        closed = subprocess.Popen([PY, "-c", STAGER, d.sock, "8", str(nblocks), "close"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(closed.stdout.readline())["sent"] == 8
        kept = subprocess.Popen([PY, "-c", STAGER, d.sock, "8", str(nblocks), "keep"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(kept.stdout.readline())["sent"] == 8
        s = _connect(d.sock)
        r = raw_call(s, protocol.FrameReader(1 << 30),
                     {"op": "register", "id": 9, "start": protocol_addr(mine), "length": nblocks * 4096,
                      "block_size": 4096})
        assert r.ok and r.result["blocks"] == nblocks, r
        kept.stdin.write("count\n")
        kept.stdin.flush()
        ahead = json.loads(kept.stdout.readline())["answered"]
        assert ahead <= 2, f"root's register was answered after {ahead} of another uid's 8 queued before it"
        kept.stdin.write("read\n")
        kept.stdin.flush()
        assert json.loads(kept.stdout.readline())["ok"] == [True] * 8
        st = _status(d.sock)
        # root's + the 8 kept; none of the 8 whose client closed the connection
        assert st["regions"] == 9, st
        assert st["blocks"] == 9 * nblocks, st
        s.close()
    finally:
        for p in (closed, kept):
            if p is not None:
                p.kill()
                p.wait()
        mine.close()
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()


def test_a_region_larger_than_the_recording_file_keeps_the_recorder_bounded(workdir):
    """With [record] on, each new file repeats every live block. Before the
    fix, once those lines alone exceeded record.max_bytes the repeat itself
    rotated the file, which repeated them again: a nobody's register of
    4,096 blocks (16 MiB of untouched memory) hit RecursionError inside the
    registry (internal_error, a Traceback in the log, the region half added).
    Now a file rotates only when it also holds as much new as repeated:
    every request answers, and the files stay few and bounded."""
    rec = os.path.join(workdir, "rec")
    d = DaemonProc(workdir, f'[record]\nenabled = true\ndir = "{rec}"\nmax_bytes = 4096\nfiles = 3\n').start()
    try:
        with ChildClient(d.sock, size=16 << 20, block_size=4096, user=NOBODY) as child:
            r = child("register")
            assert "error" not in r, r
            for i in range(20):
                assert child("hint", blocks=list(range(i * 200, i * 200 + 200)))["errors"] == []
            assert len(child("query")["tiers"]) == 4096
            assert child("unregister") == {"ok": True}
        st = _status(d.sock)
        assert st["regions"] == 0 and st["blocks"] == 0, st
        names = sorted(os.listdir(rec))
        assert names == ["kvtier.csv", "kvtier.csv.1", "kvtier.csv.2"][:len(names)], names
        sizes = [os.path.getsize(os.path.join(rec, n)) for n in names]
        # 4,096 live blocks are ~0.3 MB of lines: a file holds at most about
        # twice that (the repeat and as much new), not one rotation per write.
        assert max(sizes) < 2 << 20, sizes
    finally:
        assert d.stop() == 0
        log = d.read_log()
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]


# As nobody: maps anonymous memory at [argv[3], argv[4]) (where the setuid
# program's non-PIE image will be loaded), registers it, says so, then on
# "go" execs ``argv[2:]`` (cpp, setuid root, reading its stdin): same pid,
# same start time, euid 0, and the registered range now holds root's image.
SETUID_EXEC = DROP + r"""
import ctypes, json, mmap, sys
from kvtier.client import Client
sock_path, lo, hi, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
drop(65534, 65534)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FIXED_NOREPLACE = 0x100000
addr = libc.mmap(lo, hi - lo, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
assert addr == lo, (addr, ctypes.get_errno())
ctypes.memset(lo, 1, hi - lo)
c = Client(sock_path)
r = c.register(addr=lo, length=hi - lo, block_size=4096, name="then-setuid")
print(json.dumps({"region": r.id, "pid": os.getpid()}), flush=True)
sys.stdin.readline()
os.execv(argv[0], argv)
"""

OWNER_PIN = DROP + r"""
import json, sys
from kvtier import protocol
from kvtier.client import Client
drop(65534, 65534)
c = Client(sys.argv[1])
try:
    c.call(protocol.Pin(region=int(sys.argv[2])))
    print(json.dumps({"pin": "ok"}))
except Exception as e:
    print(json.dumps({"pin": getattr(e, "code", type(e).__name__), "message": str(e)}))
"""


def _image_range(argv: list[str]) -> tuple[int, int]:
    """Where the non-PIE ``argv[0]`` maps its file (the same every run)."""
    prog = argv[0]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        def maps():
            with open(f"/proc/{p.pid}/maps") as f:
                spans = [[int(x, 16) for x in ln.split()[0].split("-")] for ln in f if ln.rstrip().endswith(prog)]
            return spans or None
        spans = wait_for(maps, f"{prog} to be loaded")
    finally:
        p.kill()
        p.stdin.close()  # cc1, its child, reads the same pipe: EOF ends it
        p.wait()
    return min(a for a, _ in spans), max(b for _, b in spans)


def test_a_region_of_a_process_that_execs_a_setuid_program_is_dropped(workdir):
    """exec keeps the pid and the start time, so a nobody's region stayed
    registered over its process after it exec'd a setuid-root program
    (ruid 65534, euid 0). Where the new image's pages fall inside the old
    range (here cpp's non-PIE image, mapped where nobody had registered
    memory) the region was never dropped as unmapped, and nobody went on
    pinning (and could move and hint) root's pages for as long as it ran.
    Now a region whose process runs as another uid than its unprivileged
    owner is dropped within a tick, and not_found says why."""
    import shutil

    d = DaemonProc(workdir).start()
    bindir = os.path.join("/var/tmp", f"kvtier-setuid-{os.getpid()}")  # /var/tmp: not nosuid
    os.makedirs(bindir, mode=0o755, exist_ok=True)
    import glob

    cc1 = sorted(glob.glob("/usr/lib/gcc/*/*/cc1"))
    assert cc1, "needs gcc's cpp and cc1 (a non-PIE program that keeps euid 0 and waits on stdin)"
    prog = os.path.join(bindir, "cpp")
    # Debian's cpp is non-PIE: its image lands at a fixed address
    shutil.copy(os.path.realpath(shutil.which("cpp")), prog)
    argv = [prog, "-B" + os.path.dirname(cc1[-1]) + "/", "-"]
    os.chown(prog, 0, 0)
    os.chmod(prog, 0o4755)
    p = None
    try:
        lo, hi = _image_range(argv)
        p = subprocess.Popen([PY, "-c", SETUID_EXEC, d.sock, str(lo), str(hi), *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        r = json.loads(p.stdout.readline())
        p.stdin.write("go\n")
        p.stdin.flush()

        def setuid_running():
            with open(f"/proc/{r['pid']}/status") as f:
                uid = next(ln for ln in f if ln.startswith("Uid:")).split()
            return uid[1:3] == ["65534", "0"]

        wait_for(setuid_running, "the setuid exec")

        def owner_pin() -> dict | None:
            out = subprocess.run([PY, "-c", OWNER_PIN, d.sock, str(r["region"])], capture_output=True,
                                 text=True, timeout=DEADLINE)
            got = json.loads(out.stdout)
            return None if got["pin"] == "ok" else got

        got = wait_for(owner_pin, "nobody's pin on a region of a root process to be refused")
        assert got["pin"] == "not_found" and "setuid" in got["message"], got
        assert _status(d.sock)["regions"] == 0
    finally:
        if p is not None:
            p.kill()
            p.stdin.close()
            p.wait()
        shutil.rmtree(bindir, ignore_errors=True)
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()


# A process of nobody's uid and the given gid: maps and writes 1 MiB, says
# where, waits on stdin. Dumpable (setuid() made it undumpable: it says so
# again, as a process exec'd with those ids is), or with "undumpable" not,
# as ssh-agent and gpg-agent make themselves so that their own user cannot
# read their memory.
VICTIM = DROP + r"""
import ctypes, json, mmap
from kvtier.client import buffer_address
drop(65534, int(sys.argv[2]))
ctypes.CDLL(None).prctl(4, int(sys.argv[1] != "undumpable"), 0, 0, 0)  # PR_SET_DUMPABLE
buf = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf.write(b"S" * (1 << 20))
print(json.dumps({"addr": buffer_address(buf)[0]}), flush=True)
sys.stdin.read()
"""

# As nobody: registers another process's memory (pid, addr), answers what the daemon said.
REGISTER_OTHER = DROP + r"""
import json
import mmap
from kvtier import protocol
from kvtier.client import Client
drop(65534, 65534)
c = Client(sys.argv[1])
try:
    c.call(protocol.Register(pid=int(sys.argv[2]), start=int(sys.argv[3]), length=1 << 20, block_size=1 << 16))
    print(json.dumps({"ok": True}))
except Exception as e:
    print(json.dumps({"ok": False, "code": getattr(e, "code", type(e).__name__), "message": str(e)}))
"""


def test_a_user_registers_only_memory_of_processes_it_could_ptrace(workdir):
    """The daemon acts with CAP_SYS_PTRACE, so its register check is the
    only thing between a user and processes of its uid the kernel keeps it
    out of. It compared the real and effective uid only: nobody registered
    (and could then page out, move, measure) the memory of its own
    undumpable process (ssh-agent, gpg-agent: /proc/PID/mem refused to
    nobody itself) and of a process running with its uids but another
    group (a setgid program: unix_chkpwd, chage, holding what its group may
    read). Now it must be a process nobody could ptrace-read: every uid and
    gid nobody's, and dumpable. nobody's own plain process still may."""
    d = DaemonProc(workdir).start()
    victims = []
    try:
        def victim(kind: str, group: int) -> tuple[int, int]:
            p = subprocess.Popen([PY, "-c", VICTIM, kind, str(group)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            victims.append(p)
            return p.pid, json.loads(p.stdout.readline())["addr"]

        def register(pid: int, addr: int) -> dict:
            out = subprocess.run([PY, "-c", REGISTER_OTHER, d.sock, str(pid), str(addr)], capture_output=True,
                                 text=True, timeout=DEADLINE)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        undumpable = register(*victim("undumpable", NOBODY))
        assert undumpable["code"] == "permission_denied" and "not dumpable" in undumpable["message"], undumpable
        setgid = register(*victim("plain", 0))  # nobody's uids, root's gids
        assert setgid["code"] == "permission_denied" and "gids 0/0/0" in setgid["message"], setgid
        assert _status(d.sock)["regions"] == 0
        assert register(*victim("plain", NOBODY))["ok"]
        assert _status(d.sock)["regions"] == 1
    finally:
        for p in victims:
            p.kill()
            p.wait()
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()


def test_failed_requests_naming_new_tenants_do_not_use_up_the_tenant_ids(workdir):
    """Tenant ids are int16. ``allocate`` gave a request's tenant name an id
    before anything was checked, and ids were never taken back: 32,767
    pipelined allocates of an unmapped range, each naming a new tenant and
    each refused, left every later register naming a new tenant refused
    (limit_exceeded, too many distinct tenants) until a restart. Now a
    name gets an id only with a region, and the ids of names no region
    and no quota uses are taken back when they run out."""
    d = DaemonProc(workdir).start()
    try:
        s = _connect(d.sock)
        n = 32_800
        blob = b"".join(protocol.frame(msgspec.msgpack.encode(
            {"op": "allocate", "id": i + 1, "start": 4096, "length": 4096, "block_size": 4096,
             "tenant": f"x{i}"})) for i in range(n))
        s.sendall(blob)
        reader, codes = protocol.FrameReader(1 << 30), {}
        while sum(codes.values()) < n:
            data = s.recv(1 << 20)
            assert data, "daemon closed the connection"
            for f in reader.feed(data):
                r = protocol.decode_response(f)
                code = r.error.code if r.error is not None else "ok"
                codes[code] = codes.get(code, 0) + 1
        assert set(codes) == {"range_not_mapped"}, codes
        buf = mmap.mmap(-1, 2 * 4096)
        ok = raw_call(s, reader, {"op": "register", "id": n + 1, "start": protocol_addr(buf), "length": 2 * 4096,
                                  "block_size": 4096, "tenant": "a-new-tenant"})
        assert ok.error is None, ok.error
        s.close()
    finally:
        assert d.stop() == 0
        assert "Traceback" not in d.read_log(), d.read_log()
