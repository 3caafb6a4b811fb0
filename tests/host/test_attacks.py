"""kvtierd attacked the way a hostile local user would: real daemon, real
processes, real kernel (pid reuse forced through ns_last_pid, floods and
stalls over a real unix socket). Each test is the regression test of one
defect of issue 12; on the code before the fix it fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest

from kvtier import protocol

from test_daemon import DROP, NOBODY, DaemonProc, PY, daemon, wait_for, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root


def raw_call(sock: socket.socket, reader: protocol.FrameReader, req: dict) -> protocol.Response:
    sock.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    pending: list[bytes] = []
    while not pending:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionResetError("daemon closed the connection")
        pending += reader.feed(data)
    return protocol.decode_response(pending[0])


# The attacker: connects as nobody, forks, and the connecting process exits
# so that its pid can be handed to a root process. The child keeps the
# connection and, on "go", tries every op on the victim's region through it.
ATTACKER = DROP + r"""
import json, socket, msgspec
from kvtier import protocol
sock_path = sys.argv[1]
drop(65534, 65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
stale = os.getpid()
if os.fork():
    os._exit(0)  # the process the daemon saw connect is gone
print(json.dumps({"stale_pid": stale}), flush=True)
cmd = json.loads(sys.stdin.readline())
reader = protocol.FrameReader(1 << 30)
def call(**req):
    s.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    out = []
    while not out:
        out += reader.feed(s.recv(1 << 20))
    r = protocol.decode_response(out[0])
    return "ok" if r.ok else r.error.code
rid = cmd["region"]
blk = protocol.pack_blocks([0])
res = {}
for op, kw in [("query", {}), ("blocks", {}), ("explain", {"block": 0}), ("hint", {"blocks": blk}),
               ("phase", {"phase": "free"}), ("migrate", {"tier": 0}), ("pin", {}), ("unpin", {}),
               ("unregister", {})]:
    res[op] = call(op=op, id=1, region=rid, **kw)
res["register"] = call(op="register", id=2, start=cmd["addr"] + (1 << 20), length=1 << 20,
                       block_size=1 << 20)
print(json.dumps(res), flush=True)
"""

# Forks until a child gets ``target`` as its pid (ns_last_pid = target - 1
# before each fork; other processes on the host may take it first). That
# child, root, registers 4 MiB of its memory and waits for stdin to close.
VICTIM = r"""
import json, mmap, os, sys
from kvtier.client import Client
sock_path, target = sys.argv[1], int(sys.argv[2])
for attempt in range(500):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(target - 1))
    pid = os.fork()
    if pid == 0:
        if os.getpid() != target:
            os._exit(3)
        buf = mmap.mmap(-1, 4 << 20); buf.write(b"\1" * len(buf))
        c = Client(sock_path)
        r = c.register(buf, block_size=1 << 20, name="root-kv")
        print(json.dumps({"pid": os.getpid(), "region": r.id, "addr": r.start, "attempts": attempt + 1}), flush=True)
        sys.stdin.read()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 3:
        sys.exit(0)
print(json.dumps({"error": "pid %d never came back" % target}), flush=True)
"""


def test_stale_peer_pid_cannot_take_over_a_reused_pid(daemon):
    """Defect 1: a connection whose process exited keeps no rights over the
    process that later gets its pid (here root's, forced with ns_last_pid)."""
    attacker = subprocess.Popen([PY, "-c", ATTACKER, daemon.sock], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    victim = None
    try:
        stale = json.loads(attacker.stdout.readline())["stale_pid"]
        attacker.wait(timeout=20)  # reaped: the pid is free for reuse
        victim = subprocess.Popen([PY, "-c", VICTIM, daemon.sock, str(stale)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        v = json.loads(victim.stdout.readline())
        assert "error" not in v, v
        assert v["pid"] == stale
        # The attacker's child still holds the old connection and the pipes.
        attacker.stdin.write(json.dumps(v) + "\n")
        attacker.stdin.flush()
        res = json.loads(attacker.stdout.readline())
        assert {op: r for op, r in res.items() if op != "register"} == {
            op: "permission_denied" for op in ("query", "blocks", "explain", "hint", "phase", "migrate",
                                               "pin", "unpin", "unregister")}, res
        # Registering "my own" memory through the stale pid would name root's.
        assert res["register"] == "process_gone", res
        regions = daemon.regions()
        assert [(r["pid"], r["name"], r["owner_uid"]) for r in regions] == [(stale, "root-kv", 0)], regions
    finally:
        for p in (attacker, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
