#!/usr/bin/env python3
"""Whole-region ops on a 1 Mi-block region: how long another client waits.

Starts a real kvtierd (temporary socket and state file, metrics off,
daemon.tick_interval=1.0), maps --blocks 4 KiB blocks of untouched
MAP_NORESERVE memory, writes one page of every --stride-th block, registers
the region, and meanwhile a second connection asks `stats` back to back.
Then sends each op below on the whole region, one after the other, and
reports per op its round trip, how many `stats` answers arrived while it
ran, the longest time without one while it ran (*wait*) and in the
--after seconds that follow it (*after*: the work the op left behind:
moves, measuring).

    migrate to swap --wait, migrate to dram --wait, migrate to swap (no
    wait), measure, explain (block 0), query (first page), blocks (first
    page), unregister

``--regions N`` splits the blocks into N regions of equal size instead,
and ``--ops`` picks the ops (a comma-separated list of the names above and
the operator ops, which read every registered block rather than one
region's): ages, tiers, status, regions (the first page), regions all
(every page, one request after the other), and "state save" (register and
unregister of a one-block region: the unregister is answered once the
state file, listing every region, is written).

A swap area must be active for the swap moves (the script says so and
skips them otherwise). ``--daemon-path DIR`` runs the daemon from another
checkout's ``daemon/`` (a before/after comparison):

    sudo flock /tmp/kvtier-host.lock nice -n 10 .venv/bin/python scripts/bench/whole_region_ops.py [--json out.json]
    sudo ... scripts/bench/whole_region_ops.py --daemon-path /path/to/old/checkout/daemon
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_bench import machine, wait_ready  # noqa: E402

from kvtier import protocol  # noqa: E402
from kvtier.client import buffer_address  # noqa: E402

MAP_NORESERVE = 0x4000


def call(sock: socket.socket, reader: protocol.FrameReader, req: dict) -> protocol.Response:
    sock.sendall(protocol.frame(msgspec.msgpack.encode(req)))
    out: list[bytes] = []
    while not out:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionResetError("kvtierd closed the connection")
        out += reader.feed(data)
    return protocol.decode_response(out[0])


def longest_gap(times: list[float], t0: float, t1: float) -> float:
    edges = [t0, *[t for t in times if t0 < t < t1], t1]
    return max(b - a for a, b in zip(edges, edges[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--stride", type=int, default=64, help="one page written every STRIDE blocks")
    ap.add_argument("--after", type=float, default=3.0, help="seconds watched after each op")
    ap.add_argument("--daemon-path", help="PYTHONPATH for the daemon (another checkout's daemon/)")
    ap.add_argument("--regions", type=int, default=1, help="split the blocks into this many regions")
    ap.add_argument("--ops", help="comma-separated ops to run, in order (default: the whole-region ops)")
    ap.add_argument("--json")
    args = ap.parse_args()
    nb = args.blocks
    if args.regions < 1 or nb % args.regions:
        ap.error(f"--regions must divide --blocks ({nb})")
    d = tempfile.mkdtemp(prefix="kvtier-bench-")
    sock_path, cfg = f"{d}/kvtierd.sock", f"{d}/kvtierd.toml"
    with open(cfg, "w") as f:
        f.write(textwrap.dedent(f"""\
            [daemon]
            socket = "{sock_path}"
            state_file = "{d}/state.json"
            tick_interval = 1.0
            [metrics]
            enabled = false
            """))
    env = dict(os.environ)
    if args.daemon_path:
        env["PYTHONPATH"] = args.daemon_path
    log = f"{d}/kvtierd.log"
    with open(log, "ab") as logf:
        p = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "-c", cfg], stdout=logf, stderr=logf, env=env)
    stop = threading.Event()
    try:
        wait_ready(p, sock_path, log)
        buf = mmap.mmap(-1, nb * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        for off in range(0, nb * 4096, args.stride * 4096):
            buf[off] = 1
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        reader = protocol.FrameReader(1 << 30)
        per = nb // args.regions * 4096
        base = buffer_address(buf)[0]
        for k in range(args.regions):
            r = call(s, reader, {"op": "register", "id": 1, "start": base + k * per, "length": per,
                                 "block_size": 4096})
            assert r.ok, r
            if k == 0:
                region = r.result["region"]
        spare = mmap.mmap(-1, 4096)  # the "state save" op's one-block region
        spare[0] = 1
        tiers = {t["name"]: t["index"] for t in call(s, reader, {"op": "tiers", "id": 2}).result["tiers"]}
        answers: list[float] = []

        def watch() -> None:
            w = socket.socket(socket.AF_UNIX)
            w.connect(sock_path)
            rd = protocol.FrameReader(1 << 30)
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    call(w, rd, {"op": "stats", "id": i})
                except OSError:
                    return  # the daemon is stopping
                answers.append(time.monotonic())

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        time.sleep(2.0)  # the first look at the region is done
        ops = []
        if "swap" in tiers:
            ops += [("migrate swap --wait", {"op": "migrate", "tier": tiers["swap"], "wait": True}),
                    ("migrate dram --wait", {"op": "migrate", "tier": tiers["dram"], "wait": True}),
                    ("migrate swap", {"op": "migrate", "tier": tiers["swap"]})]
        else:
            print("no swap tier (no active swap area): the swap moves are skipped", file=sys.stderr)
            ops += [("migrate dram --wait", {"op": "migrate", "tier": tiers["dram"], "wait": True})]
        ops += [("measure", {"op": "measure"}), ("explain", {"op": "explain", "block": 0}),
                ("query", {"op": "query"}), ("blocks", {"op": "blocks"}), ("unregister", {"op": "unregister"})]
        # Operator ops: no region, they read every registered block.
        anyops = [("ages", {"op": "ages"}), ("tiers", {"op": "tiers"}), ("status", {"op": "status"}),
                  ("regions", {"op": "regions"}), ("regions all", None), ("state save", None)]
        operator = {n for n, _ in anyops}
        if args.ops:
            known = dict(ops + anyops)
            names = [n.strip() for n in args.ops.split(",") if n.strip()]
            bad = [n for n in names if n not in known]
            if bad:
                ap.error(f"unknown ops {bad}; known: {', '.join(known)}")
            ops = [(n, known[n]) for n in names]

        def send(name: str, req: dict | None, rid: int) -> protocol.Response:
            if name == "regions all":  # every page, as kvtierctl regions does
                after, r = 0, None
                while after is not None:
                    r = call(s, reader, {"op": "regions", "id": rid, "after": after})
                    after = r.result.get("next") if r.ok else None
                return r
            if name == "state save":
                r = call(s, reader, {"op": "register", "id": rid, "start": buffer_address(spare)[0],
                                     "length": 4096, "block_size": 4096})
                assert r.ok, r
                return call(s, reader, {"op": "unregister", "id": rid, "region": r.result["region"]})
            if name in operator:
                return call(s, reader, {**req, "id": rid})
            return call(s, reader, {**req, "id": rid, "region": region})

        rows = []
        for i, (name, req) in enumerate(ops):
            t0 = time.monotonic()
            r = send(name, req, 10 + i)
            t1 = time.monotonic()
            time.sleep(args.after)
            t2 = time.monotonic()
            row = {"op": name, "ok": r.ok, "op_s": t1 - t0,
                   "answers_during": len([t for t in answers if t0 < t < t1]),
                   "wait_s": longest_gap(answers, t0, t1), "after_s": longest_gap(answers, t1, t2)}
            if not r.ok:
                row["error"] = str(r.error)
            rows.append(row)
            print(f"{name:22s} op {row['op_s'] * 1e3:8.1f} ms  answers {row['answers_during']:6d}  "
                  f"wait {row['wait_s'] * 1e3:7.1f} ms  after {row['after_s'] * 1e3:7.1f} ms"
                  + ("" if r.ok else f"  {r.error}"), flush=True)
        out = {"machine": machine(), "blocks": nb, "regions": args.regions, "stride": args.stride,
               "load": os.getloadavg(), "ops": rows}
        print(f"{machine()}; load {os.getloadavg()[0]:.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        stop.set()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        subprocess.run(["rm", "-rf", d], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
