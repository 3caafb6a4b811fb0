#!/usr/bin/env python3
"""Robustness benchmark: a well-behaved client's latency while others attack kvtierd.

Starts a real kvtierd (default limits; temporary socket and state file,
metrics off) and a well-behaved client process that sends one `query` of
its 256-block region every 2 ms and records each round trip. It runs
--seconds alone (baseline), then as long again while attacker processes,
forked and dropped to uid nobody, do what issue 12 found:

* flood: 10 connections, each 5,000 pipelined `stats` it never reads
* blocks: 4 connections, each 30 `blocks` requests on its own 64 Ki-block
  region, never read (each answer is a 917 KiB page)
* halfframes: 24 connections, each most (15 MiB) of a 16 MiB frame
* stall: 50 connections that send 2 bytes of a header and stop
* deep: 1,000 frames of msgpack nested 50,000 deep, answers read
* garbage: 5,000 random frames, answers read
* conns: as many idle connections as the daemon gives uid nobody

CPU groups (``--cpu-groups``, where the kernel has a cpu controller):
kvtierd, the good client and the attackers each run in a CPU cgroup of
their own, of equal weight, as a systemd host places them: kvtierd.service
in system.slice, the engine a service or container of its own, local users
in user.slice (each slice weight 100 by default). By default all share the
bench's cgroup, so seven attacker processes get seven shares of the CPUs
to the daemon's one (docs/benchmarks.md: on a quiet host the p99 ratio was
the same either way).

Reported: hostile frames sent, daemon crashes, the good client's p50/p99/max
and requests over 100 ms in both phases, daemon RSS (idle, peak sampled
every 20 ms, and VmHWM), fds and threads before and after.

    sudo .venv/bin/python scripts/bench/robustness.py [--seconds 10] [--json out.json]

Root is needed to drop the attackers to another uid.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_bench import machine, wait_ready  # noqa: E402
from robust_trace import SchedSampler, attribute  # noqa: E402

from kvtier import protocol  # noqa: E402
from kvtier.client import Client  # noqa: E402

NOBODY = 65534
BLOCKS_REGION = 65536


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def good_client(sock: str, seconds: float, tx) -> None:
    buf = mmap.mmap(-1, 256 * 65536)
    buf.write(b"\1" * len(buf))
    c = Client(sock)
    region = c.register(buf, block_size=65536, name="good")
    lat = []
    slow = []  # (perf_counter start, seconds) of requests over 2 ms, to line up with --loop-profile
    starts = []  # perf_counter (CLOCK_MONOTONIC, as the daemon's) at each request's send
    errors = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            region.query()
        except Exception:
            errors += 1
        dt = time.perf_counter() - t0
        lat.append(dt)
        starts.append(t0)
        if dt > 0.002:
            slow.append((t0, dt))
        time.sleep(0.002)
    region.unregister()
    tx.send({"lat": lat, "errors": errors, "slow": slow, "starts": starts, "pid": os.getpid()})


def _drop() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _conn(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def _frame(d: dict) -> bytes:
    return protocol.frame(msgspec.msgpack.encode(d))


def attacker(kind: str, path: str, seconds: float, tx) -> None:
    """One attack as uid nobody; sends the number of hostile frames sent."""
    _drop()
    sent = 0
    held: list[socket.socket] = []
    try:
        if kind == "flood":
            for _ in range(10):
                s = _conn(path)
                s.setblocking(False)
                blob = _frame({"op": "stats", "id": 1}) * 5000
                try:
                    s.send(blob)
                except BlockingIOError:
                    pass
                sent += 5000
                held.append(s)
        elif kind == "blocks":
            bufs = []
            for _ in range(4):
                # 64 Ki blocks of 4 KiB, never touched: each answer is a
                # 917 KiB page (a bigger region pages the same way; only its
                # registration and ticks cost more, which is not an attack).
                buf = mmap.mmap(-1, BLOCKS_REGION * 4096)
                bufs.append(buf)
                c = Client(path)
                rid = c.register(buf, block_size=4096).id
                s = _conn(path)
                s.sendall(_frame({"op": "blocks", "id": 2, "region": rid}) * 30)
                sent += 30
                held += [s, c.sock]
        elif kind == "halfframes":
            for _ in range(24):
                try:
                    s = _conn(path)
                    s.setblocking(False)
                    part = protocol.HEADER.pack(16 << 20 - 1) + b"\x81" * (15 << 20)
                    try:
                        s.send(part)
                    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                        pass
                    sent += 1
                    held.append(s)
                except OSError:
                    break
        elif kind == "stall":
            for _ in range(50):
                try:
                    s = _conn(path)
                    s.send(b"\0\0")
                    sent += 1
                    held.append(s)
                except OSError:
                    break
        elif kind == "deep":
            s = _conn(path)
            reader = protocol.FrameReader(1 << 30)
            deep = protocol.frame(b"\x83\xa2op\xa5stats\xa2id\x05\xa1x" + b"\x91" * 50_000 + b"\x01")
            for _ in range(1000):
                s.sendall(deep)
                sent += 1
                got: list[bytes] = []
                while not got:
                    got += reader.feed(s.recv(1 << 16))
        elif kind == "garbage":
            rng = random.Random(5)
            s = _conn(path)
            for _ in range(5000):
                try:
                    s.sendall(protocol.frame(rng.randbytes(rng.randint(1, 200))))
                    sent += 1
                    s.settimeout(5)
                    s.recv(1 << 16)
                except OSError:
                    s.close()
                    s = _conn(path)
        elif kind == "conns":
            while True:
                s = _conn(path)
                s.settimeout(0.2)
                try:
                    if not s.recv(1):
                        break
                    break  # refused: the daemon answered limit_exceeded
                except socket.timeout:
                    held.append(s)
                    sent += 1
        tx.send({"kind": kind, "sent": sent, "error": None})
        time.sleep(seconds)
    except Exception as e:
        tx.send({"kind": kind, "sent": sent, "error": repr(e)})
    finally:
        for s in held:
            s.close()


ATTACKS = ("flood", "blocks", "halfframes", "stall", "deep", "garbage", "conns")


class CpuGroups:
    """CPU cgroups of equal weight, one per name, under a fresh parent
    (cgroup v1's cpu hierarchy, or v2 with the cpu controller enabled at
    the root); OSError where neither is there or writable."""

    def __init__(self, names: list[str]):
        v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
        if os.path.exists(os.path.join(v1, "cpu.shares")):
            self.root, self.weight_file, weight = v1, "cpu.shares", "1024"
        elif "cpu" in Path(v2, "cgroup.subtree_control").read_text().split():
            self.root, self.weight_file, weight = v2, "cpu.weight", "100"
        else:
            raise OSError("no cpu controller (cgroup v1 cpu, or v2 with +cpu at the root)")
        self.parent = os.path.join(self.root, f"kvtier-robust-{os.getpid()}")
        os.mkdir(self.parent)
        if self.weight_file == "cpu.weight":
            with open(os.path.join(self.parent, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
        self.paths = {}
        for n in names:
            path = os.path.join(self.parent, n)
            os.mkdir(path)
            with open(os.path.join(path, self.weight_file), "w") as f:
                f.write(weight)
            self.paths[n] = path

    def put(self, name: str, pid: int) -> None:
        with open(os.path.join(self.paths[name], "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def close(self) -> None:
        for path in self.paths.values():
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = f.read().split()
                for pid in pids:  # anything left goes back to the root
                    with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
                        f.write(pid)
                os.rmdir(path)
            except OSError:
                pass
        try:
            os.rmdir(self.parent)
        except OSError:
            pass


GROUPS: CpuGroups | None = None


def run_phase(ctx, sock: str, seconds: float, sched: "SchedSampler | None" = None) -> dict:
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=good_client, args=(sock, seconds, tx))
    p.start()
    if GROUPS is not None:
        GROUPS.put("engine", p.pid)
    if sched is not None:
        sched.watch("good", p.pid)
    out = rx.recv()
    p.join()
    lat = np.array(out["lat"])
    return {"requests": int(lat.size), "errors": out["errors"], "slow": out["slow"],
            "trace": list(zip(out["starts"], out["lat"])),
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "max_ms": float(lat.max() * 1e3), "over_100ms": int((lat > 0.1).sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help="comma-separated subset of: %(default)s")
    ap.add_argument("--loop-profile", metavar="OUT.json",
                    help="time every event-loop callback of the daemon (scripts/bench/loop_profile.py)")
    ap.add_argument("--trace", metavar="OUT.json",
                    help="where each good request waited: the daemon's loop timeline and every thread's "
                         "and process's CPU and run-queue wait (scripts/bench/robust_trace.py)")
    ap.add_argument("--cpu-groups", action=argparse.BooleanOptionalAction, default=False,
                    help="kvtierd, the good client and the attackers in CPU cgroups of equal weight, as "
                         "systemd's slices place them (default: all in the bench's own)")
    a = ap.parse_args()
    kinds = [k for k in a.attacks.split(",") if k]
    if set(kinds) - set(ATTACKS):
        ap.error(f"unknown attacks {sorted(set(kinds) - set(ATTACKS))}")
    if os.geteuid() != 0:
        raise SystemExit("run as root (attackers drop to uid nobody)")
    work = tempfile.mkdtemp(prefix="kvtier-robust-")
    os.chmod(work, 0o755)
    sock = os.path.join(work, "kvtierd.sock")
    cfg = os.path.join(work, "kvtierd.toml")
    with open(cfg, "w") as f:
        f.write(f'[daemon]\nsocket = "{sock}"\nstate_file = "{work}/state.json"\nsocket_mode = 0o666\n'
                "[metrics]\nenabled = false\n")
    log = os.path.join(work, "log")
    cmd = [sys.executable, "-m", "kvtier.daemon", "-c", cfg]
    env = dict(os.environ)
    profile = a.loop_profile
    if a.trace:
        profile = profile or os.path.join(work, "loop.json")
        env["KVTIER_TRACE_UID"] = str(os.geteuid())  # the good client's; the attackers run as nobody
    if profile:
        here = os.path.dirname(os.path.abspath(__file__))
        cmd = [sys.executable, os.path.join(here, "loop_profile.py"), os.path.abspath(profile),
               "--", "-c", cfg]
    global GROUPS
    if a.cpu_groups:
        try:
            GROUPS = CpuGroups(["daemon", "engine", "users"])
        except OSError as e:
            print(f"robustness: no CPU groups ({e}); all processes share one", file=sys.stderr)
    d = subprocess.Popen(cmd, stderr=open(log, "w"), env=env)
    if GROUPS is not None:
        GROUPS.put("daemon", d.pid)
    wait_ready(d, sock, log)
    sched = None
    if a.trace:
        sched = SchedSampler()
        sched.watch_daemon(d.pid)
        sched.start()
    ctx = multiprocessing.get_context("fork")
    time.sleep(1.0)
    load_before = os.getloadavg()
    before = proc_status(d.pid)
    baseline = run_phase(ctx, sock, a.seconds, sched)

    peak = [before["VmRSS"]]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], proc_status(d.pid)["VmRSS"])
            except OSError:
                return
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rx, tx = ctx.Pipe(duplex=False)
    attackers = [ctx.Process(target=attacker, args=(k, sock, a.seconds + 2, tx)) for k in kinds]
    for p in attackers:
        p.start()
        if GROUPS is not None:
            GROUPS.put("users", p.pid)
        if sched is not None:
            sched.watch(f"attacker:{kinds[attackers.index(p)]}", p.pid)
    attack = run_phase(ctx, sock, a.seconds, sched)
    reports = [rx.recv() for _ in attackers if rx.poll(a.seconds + 30)]
    for p in attackers:
        p.join(a.seconds + 30)
        if p.is_alive():
            p.kill()
    stop.set()
    sampler.join()
    crashed = d.poll() is not None
    time.sleep(2.0)  # the daemon notices the closed connections
    after = proc_status(d.pid) if not crashed else {}
    d.send_signal(signal.SIGTERM)
    rc = d.wait(30)
    text = open(log).read()
    result = {
        "machine": machine(), "seconds": a.seconds, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "attack_kinds": kinds,
        "hostile_frames": sum(r["sent"] for r in reports),
        "attacks": {r["kind"]: {"sent": r["sent"], "error": r["error"]} for r in reports},
        "cpu_groups": GROUPS is not None,
        "daemon_crashed": crashed, "daemon_exit": rc, "tracebacks": text.count("Traceback"),
        "baseline": baseline, "attack": attack,
        "p99_ratio": attack["p99_ms"] / baseline["p99_ms"],
        "rss_idle_kib": before["VmRSS"], "rss_peak_kib": peak[0], "vmhwm_kib": after.get("VmHWM"),
        "fds_before": before["fds"], "fds_after": after.get("fds"),
        "threads_before": before["Threads"], "threads_after": after.get("Threads"),
    }
    slow = {"baseline": baseline.pop("slow"), "attack": attack.pop("slow")}
    traces = {"baseline": baseline.pop("trace"), "attack": attack.pop("trace")}
    if sched is not None:
        sched.stop()
        with open(profile) as f:
            prof = json.load(f)
        names = {f"daemon:{tid}": f"daemon {name}" for tid, name in prof["threads"].items()}
        names[f"daemon:{prof['loop_tid']}"] = "daemon loop"
        full = {phase: attribute(traces[phase], prof, sched, names) for phase in traces}
        with open(a.trace, "w") as f:
            json.dump(full, f, indent=1)
        # printed: the totals and the three slowest requests of each phase (all in the --trace file)
        result["trace"] = {phase: {**t, "worst": t.get("worst", [])[:3]} for phase, t in full.items()}
    print(json.dumps(result, indent=2))
    result["slow_requests"] = slow  # in the --json file only
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    subprocess.run(["rm", "-rf", work], check=False)
    if GROUPS is not None:
        GROUPS.close()
    return 1 if crashed or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
