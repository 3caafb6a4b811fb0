#!/usr/bin/env python3
"""Boot one QEMU guest with kvtier's memory topology and run a command in it.

    scripts/vm/run.py [options] -- COMMAND [ARG...]

The guest (see scripts/vm/init and guest_setup.sh):
  node 0   1 GiB RAM + both CPUs (DRAM tier)
  node 1   1 GiB CPU-less RAM, slower per HMAT (a lower memory tier)
  node 2   256 MiB CXL type-3 volatile memory, onlined through a CXL region
           and dax kmem as a CPU-less node in its own tier
  swap     a 1 GiB NVMe namespace (sparse file on the host)
It sees the host's root filesystem read-only with a tmpfs overlay (so the
repository, its .venv and the host's Python are at the same paths) and a
read-write share at /mnt/kvtier ($KVTIER_SHARE) to bring files back.
COMMAND runs as root in the guest, in the current directory, with
KVTIER_IN_VM=1; its exit status becomes run.py's.

--shape two-socket boots instead a guest shaped like a two-socket server
with far memory beside each socket (for per-process far-node affinity):
  node 0   512 MiB + CPU 0        node 1   512 MiB + CPU 1
  node 2   256 MiB CPU-less, near node 0 (SLIT 17, HMAT initiator 0)
  node 3   256 MiB CPU-less, near node 1 (SLIT 17, HMAT initiator 1)
  swap     as above; no CXL device (the guest sees KVTIER_VM_SHAPE).
Nodes 2 and 3 look alike from their own socket, so kvtier makes them one
far tier of two nodes.

--kernel idle boots the kernel scripts/vm/build-kernel.sh builds instead of
Debian's: the same 6.12 source, all built in, plus idle page tracking
(/sys/kernel/mm/page_idle, which no Debian kernel has); the guest sees
KVTIER_VM_KERNEL. Also $KVTIER_VM_KERNEL=idle.

--systemd boots the host's own systemd as PID 1 after the same set-up, and
COMMAND runs as a unit once basic.target is up (scripts/vm/systemd/sdguest.py).

--timeout is a quiet host's figure: the guest measures how slow it runs
(scripts/vm/speed.py, at boot and again whenever a test asks) and prints
KVTIER_SLOWNESS=<factor> on its console; the deadline is --timeout times the
largest factor seen, never past --max-timeout. --stall (also scaled) kills a
guest whose console stays silent that long.

run.py's own failures get statuses a command rarely uses:
  124  the guest did not finish within the (scaled) --timeout, or stalled
  125  the guest crashed or QEMU failed before reporting an exit status
  126  guest set-up failed (topology, swap); the command never ran
and always writes <share>/result.json:
  {"status": "ok"|"timeout"|"crash"|"setup_failed"|"unavailable",
   "exit_code", "boot_seconds", "run_seconds", "console_log", "reason",
   "slowness"}.
The guest console goes to <share>/console.log (or --log); on any failure its
tail is printed to stderr.

KVM cannot run a stock kernel on these (nested) machines, so the guest always
runs under TCG, which is why every wait here is bounded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import speed  # noqa: E402

# Guest sizes. The host has 24 GiB and runs other work; the guest takes
# 2.25 GiB of RAM plus QEMU's own overhead.
NODE0_MIB = 1024
NODE1_MIB = 1024
CXL_MIB = 256  # a CXL region is a multiple of 256 MiB per interleave way
SWAP_MIB = 1024
CPUS = 2

# HMAT figures (ns, bytes/s) that make node 1 a slower tier than node 0.
# The kernel only orders tiers by them; their absolute values do not matter.
HMAT = {0: (80, "20G"), 1: (200, "5G")}

SHARE_TAG = "kvtshare"
GUEST_SHARE = "/mnt/kvtier"
EXIT_RE = re.compile(r"KVTIER_EXIT=(\d+)")
SLOWNESS_RE = re.compile(re.escape(speed.MARK) + r"(\d+(?:\.\d+)?)")
SETUP_DONE = "KVTIER_SETUP_DONE"
SETUP_FAILED = "KVTIER_SETUP_FAILED"
INIT_FAILED = "KVTIER_INIT_FAILED"

DEFAULT_TIMEOUT = 600


class Unavailable(Exception):
    """The host cannot run the guest (no QEMU, no prepared kernel)."""


def cache_dir(name: str = "kvtier-vm", env: str = "KVTIER_VM_CACHE") -> Path:
    """A guest-kernel cache: $env, else /var/cache/NAME where its script
    (prepare.sh, build-kernel.sh) made it, else ~/.cache/NAME."""
    given = os.environ.get(env)
    if given:
        return Path(given)
    system = Path("/var/cache") / name
    if (system / "current").exists():
        return system
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / name


# Guest kernels run.py can boot (--kernel, or $KVTIER_VM_KERNEL):
#   stock  bookworm-backports' 6.12 (linux-image-*-amd64), unpacked by
#          prepare.sh with its modules; what every test uses by default.
#   idle   the same 6.12 source built by build-kernel.sh with everything the
#          test-bed needs built in, plus CONFIG_IDLE_PAGE_TRACKING (no Debian
#          kernel has it); for the access-bit source's page_idle mechanism.
KERNELS = ("stock", "idle")


class KernelNotBuilt(Unavailable):
    """The idle kernel is not built here (scripts/vm/build-kernel.sh)."""


@dataclass
class GuestImage:
    kver: str
    kernel: Path
    initrd: Path
    modules: Path

    @classmethod
    def find(cls, kernel: str = "stock") -> "GuestImage":
        """The kernel and initramfs prepare.sh (stock) or build-kernel.sh
        (idle) left in its cache."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown guest kernel {kernel!r} (have: {', '.join(KERNELS)})")
        if kernel == "idle":
            cache = cache_dir("kvtier-vm-idle", "KVTIER_VM_IDLE_CACHE")  # beside the stock one
            current = cache / "current"
            if not current.exists():
                raise KernelNotBuilt(f"no idle guest kernel in {cache} (scripts/vm/build-kernel.sh builds it)")
            kver, build = current.read_text().split()[:2]
            kdir = cache / build
            missing = KernelNotBuilt
            fix = "scripts/vm/build-kernel.sh"
        else:
            cache = cache_dir()
            current = cache / "current"
            if not current.exists():
                raise Unavailable(f"no guest kernel in {cache} (run scripts/vm/prepare.sh)")
            kver = current.read_text().split()[0]
            kdir = cache / kver
            missing = Unavailable
            fix = "scripts/vm/prepare.sh"
        img = cls(
            kver=kver,
            kernel=kdir / "boot" / f"vmlinuz-{kver}",
            # Named by the hash of what built it, so an edited init is never
            # booted from a stale image.
            initrd=kdir / f"initramfs-{initramfs_hash()}.cpio.gz",
            modules=kdir / "lib" / "modules" / kver,
        )
        for p in (img.kernel, img.initrd, img.modules / "modules.dep"):
            if not p.exists():
                raise missing(f"guest image missing or out of date: no {p} (run {fix})")
        return img


def initramfs_hash() -> str:
    """The hash prepare.sh names the initramfs by (init, builder, busybox)."""
    h = hashlib.sha256()
    for p in (HERE / "init", HERE / "mkinitramfs.py", Path("/bin/busybox")):
        try:
            h.update(p.read_bytes())
        except OSError as e:
            raise Unavailable(f"cannot read {p}: {e.strerror} (busybox-static comes with scripts/setup.sh)") from None
    return h.hexdigest()[:16]


def find_qemu() -> str:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise Unavailable("qemu-system-x86_64 not installed (run scripts/setup.sh)")
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.", out)
    # cxl-type3's volatile-memdev arrived after Debian 12's QEMU 7.2.
    if not m or int(m.group(1)) < 8:
        raise Unavailable(f"{qemu} is too old for cxl-type3 volatile memory: {out.strip()}")
    return qemu


# --shape two-socket: (MiB, CPUs or None, initiator) per node; SLIT between
# them; HMAT read latency (ns) and bandwidth from each CPU node.
TWO_SOCKET_NODES = {0: (512, "0", None), 1: (512, "1", None), 2: (256, None, 0), 3: (256, None, 1)}
TWO_SOCKET_SLIT = {(0, 1): 21, (0, 2): 17, (0, 3): 28, (1, 2): 28, (1, 3): 17, (2, 3): 32}
TWO_SOCKET_HMAT = {"local": (80, "20G"), "remote": (130, "10G"), "near": (200, "5G"), "far": (280, "3G")}
SHAPES = ("default", "two-socket")


def two_socket_args() -> list[str]:
    """q35, two CPU nodes each with a CPU-less memory node beside it, HMAT."""
    total = sum(m for m, _, _ in TWO_SOCKET_NODES.values())
    args = ["-M", "q35,hmat=on", "-cpu", "max,hypervisor=off", "-smp", str(CPUS), "-m", f"{total}M"]
    for n, (mib, cpus, initiator) in TWO_SOCKET_NODES.items():
        args += ["-object", f"memory-backend-ram,id=m{n},size={mib}M"]
        spec = f"node,nodeid={n},memdev=m{n}"
        spec += f",cpus={cpus}" if cpus is not None else f",initiator={initiator}"
        args += ["-numa", spec]
    for (a, b), d in TWO_SOCKET_SLIT.items():
        args += ["-numa", f"dist,src={a},dst={b},val={d}"]
    for ini in (n for n, (_, cpus, _) in TWO_SOCKET_NODES.items() if cpus is not None):
        for target, (_, cpus, near) in TWO_SOCKET_NODES.items():
            kind = (("local" if target == ini else "remote") if cpus is not None
                    else ("near" if near == ini else "far"))
            lat, bw = TWO_SOCKET_HMAT[kind]
            args += [
                "-numa", f"hmat-lb,initiator={ini},target={target},hierarchy=memory,data-type=access-latency,"
                         f"latency={lat}",
                "-numa", f"hmat-lb,initiator={ini},target={target},hierarchy=memory,data-type=access-bandwidth,"
                         f"bandwidth={bw}",
            ]
    return args


def topology_args() -> list[str]:
    """q35 with two NUMA nodes, HMAT, one CXL type-3 device and an NVMe drive."""
    args = [
        "-M", "q35,cxl=on,hmat=on",
        # hypervisor=off: with the hypervisor CPUID bit set the CXL region
        # commit fails with ENXIO in this kernel/QEMU pair.
        "-cpu", "max,hypervisor=off",
        "-smp", str(CPUS),
        "-m", f"{NODE0_MIB + NODE1_MIB}M",
        "-object", f"memory-backend-ram,id=m0,size={NODE0_MIB}M",
        "-object", f"memory-backend-ram,id=m1,size={NODE1_MIB}M",
        "-numa", f"node,nodeid=0,cpus=0-{CPUS - 1},memdev=m0",
        "-numa", "node,nodeid=1,memdev=m1,initiator=0",
        "-numa", "dist,src=0,dst=1,val=20",
    ]
    for target, (lat, bw) in HMAT.items():
        args += [
            "-numa", f"hmat-lb,initiator=0,target={target},hierarchy=memory,data-type=access-latency,latency={lat}",
            "-numa", f"hmat-lb,initiator=0,target={target},hierarchy=memory,data-type=access-bandwidth,bandwidth={bw}",
        ]
    args += [
        "-object", f"memory-backend-ram,id=cxlmem0,size={CXL_MIB}M",
        "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
        "-device", "cxl-rp,port=0,bus=cxl.1,id=cxlrp0,chassis=0,slot=2",
        "-device", "cxl-type3,bus=cxlrp0,volatile-memdev=cxlmem0,id=cxl-vmem0",
        "-M", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G",
    ]
    return args


@dataclass
class GuestResult:
    status: str
    exit_code: int
    boot_seconds: float | None = None
    run_seconds: float | None = None
    console_log: str = ""
    reason: str = ""
    slowness: float = 1.0  # the largest factor the guest reported
    tail: list[str] = field(default_factory=list)

    def process_status(self) -> int:
        return {"ok": self.exit_code, "timeout": 124, "setup_failed": 126}.get(self.status, 125)


def write_run_sh(share: Path, img: GuestImage, cmd: list[str], cwd: str, env: dict[str, str]) -> None:
    """The job /init runs chrooted in the guest: set-up, then the command."""
    venv = REPO / ".venv"
    base = {
        "PATH": f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": str(venv),
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "KVTIER_IN_VM": "1",
        "KVTIER_SHARE": GUEST_SHARE,
        "KVTIER_VM_KVER": img.kver,
        "KVTIER_VM_MODULES": str(img.modules),
        "KVTIER_REPO": str(REPO),
        # The root is a read-only share under a tmpfs: .pyc writes only waste guest RAM.
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    base.update(env)
    lines = ["#!/bin/sh", "# written by scripts/vm/run.py"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in base.items()]
    lines.append(f"cd {shlex.quote(cwd)} || exit 126")
    lines.append(f"exec /bin/bash {shlex.quote(str(HERE / 'guest_setup.sh'))} {shlex.join(cmd)}")
    (share / "run.sh").write_text("\n".join(lines) + "\n")


def boot(
    cmd: list[str],
    share: Path,
    timeout: float = DEFAULT_TIMEOUT,
    log: Path | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    echo: bool = False,
    systemd: bool = False,
    out=None,
    icount: int | None = None,
    max_timeout: float | None = None,
    stall: float | None = None,
    shape: str = "default",
    kernel: str | None = None,
) -> GuestResult:
    """Boot the guest, run ``cmd``, return how it went. Never raises for guest failures.

    ``out``: a text stream that receives the command's console output
    (``echo`` sends the whole console to stderr instead).
    """
    log = log or share / "console.log"
    try:
        qemu = find_qemu()
        kernel = kernel or os.environ.get("KVTIER_VM_KERNEL") or "stock"
        img = GuestImage.find(kernel)
    except Unavailable as e:
        return GuestResult("unavailable", 125, console_log=str(log), reason=str(e))

    share.mkdir(parents=True, exist_ok=True)
    for stale in ("exit_status", "result.json"):
        (share / stale).unlink(missing_ok=True)
    if systemd:
        # systemd as PID 1 (vmsystemd tests): scripts/vm/systemd/sdguest.py.
        sys.path.insert(0, str(HERE / "systemd"))
        import sdguest
        cmd = sdguest.wrap(cmd)
    if shape not in SHAPES:
        raise ValueError(f"unknown guest shape {shape!r} (have: {', '.join(SHAPES)})")
    write_run_sh(share, img, cmd, cwd or os.getcwd(), {"KVTIER_VM_SHAPE": shape, "KVTIER_VM_KERNEL": kernel, **(env or {})})

    with tempfile.TemporaryDirectory(prefix="kvtier-vm-") as tmp:
        disk = Path(tmp) / "swap.img"
        with open(disk, "wb") as f:
            f.truncate(SWAP_MIB << 20)  # sparse: costs nothing until the guest swaps
        initrd = sdguest.initrd(img.initrd, Path(tmp)) if systemd else img.initrd
        if icount is None:
            accel = ["-accel", "tcg,thread=multi"]
        else:
            # Deterministic virtual time: the guest clock advances 2**icount ns
            # per instruction, so timings inside the guest measure work done,
            # not how busy the host is. Needs single-threaded TCG.
            accel = ["-accel", "tcg,thread=single", "-icount", f"shift={icount},sleep=off"]
        argv = [
            qemu, *accel,
            *(two_socket_args() if shape == "two-socket" else topology_args()),
            "-drive", f"file={disk},if=none,id=nvm0,format=raw,cache=unsafe",
            "-device", "nvme,serial=kvtier-swap0,drive=nvm0,bus=pcie.0",
            # -virtfs would let QEMU pick a bus, and it picks the CXL host
            # bridge, which only takes bridges: place the 9p devices by hand.
            "-fsdev", "local,id=fshost,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=fshost,mount_tag=hostroot,bus=pcie.0",
            "-fsdev", f"local,id=fsshare,path={share},security_model=none,multidevs=remap",
            "-device", f"virtio-9p-pci,fsdev=fsshare,mount_tag={SHARE_TAG},bus=pcie.0",
            "-kernel", str(img.kernel),
            "-initrd", str(initrd),
            "-append", " ".join([
                "console=ttyS0", "panic=-1", "oops=panic",
                # CXL memory onlined by dax kmem must be movable so it can be
                # emptied again and so it never hosts kernel allocations.
                "memhp_default_state=online_movable",
                "loglevel=4", "no_timer_check", "tsc=reliable",
                # A TSC calibrated by TCG on a loaded host can run the guest
                # clock 10x fast (seen: uptime 493 s after 30 s) and trip
                # in-guest timeouts; the emulated HPET keeps real time.
                "clocksource=hpet",
                *(sdguest.kernel_args() if systemd else []),
            ]),
            "-nodefaults", "-display", "none", "-serial", "stdio", "-monitor", "none",
            "-no-reboot",
        ]
        return _supervise(argv, log, Limits(timeout, max_timeout, stall), echo, out)


@dataclass
class Limits:
    """How long a guest may take, in quiet-host seconds (see the module doc)."""

    timeout: float
    max_timeout: float | None = None  # default: timeout * speed.MAX_FACTOR
    stall: float | None = None  # console silence that counts as a hang; None: never

    def cap(self) -> float:
        return self.max_timeout if self.max_timeout is not None else self.timeout * speed.MAX_FACTOR

    def deadline(self, slowness: float) -> float:
        return min(self.cap(), self.timeout * slowness)

    def overrun(self, elapsed: float, silent: float, slowness: float) -> str | None:
        """Why the guest must be killed now, or None."""
        if elapsed > self.deadline(slowness):
            return (f"guest did not finish within {elapsed:.0f}s "
                    f"({self.timeout:.0f}s nominal x slowness {slowness:.2f}, at most {self.cap():.0f}s)")
        if self.stall is not None and silent > self.stall * slowness:
            return f"guest console silent for {silent:.0f}s ({self.stall:.0f}s nominal x slowness {slowness:.2f}): hung"
        return None


def _supervise(argv: list[str], log: Path, limits: Limits, echo: bool, out) -> GuestResult:
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    exit_code: list[int] = []
    slowness = [1.0]  # largest KVTIER_SLOWNESS= seen
    last_line = [t0]
    # The QEMU command line goes beside the log, so the log's tail stays the guest's.
    log.with_name(log.name + ".cmdline").write_text(shlex.join(argv) + "\n")
    with open(log, "w", errors="replace") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").replace("\r", "")
                logf.write(line)
                logf.flush()
                last_line[0] = time.monotonic()
                s = SLOWNESS_RE.search(line)
                if s:
                    slowness[0] = max(slowness[0], min(speed.MAX_FACTOR, float(s.group(1))))
                m = EXIT_RE.search(line)
                if m and not exit_code:
                    exit_code.append(int(m.group(1)))
                    marks["exit"] = time.monotonic()
                if echo:
                    sys.stderr.write(line)
                elif SETUP_DONE in marks and not exit_code and out is not None:
                    # The command's own output (plus any kernel warning).
                    out.write(line)
                    out.flush()
                if SETUP_DONE in line and SETUP_DONE not in marks:
                    marks[SETUP_DONE] = time.monotonic()
                for key in (SETUP_FAILED, INIT_FAILED):
                    if key in line and key not in marks:
                        marks[key] = time.monotonic()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        overrun = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                overrun = limits.overrun(now - t0, now - last_line[0], slowness[0])
                if overrun:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    break
                time.sleep(0.5)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM from a CI runner): QEMU runs in its
            # own session, so nothing else would stop a guest that hangs.
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
        reader.join(timeout=5)
        logf.write(f"\n# qemu exit {proc.returncode}, {time.monotonic() - t0:.1f}s{f' ({overrun})' if overrun else ''}\n")

    tail = log.read_text(errors="replace").splitlines()[-60:]
    boot_s = marks[SETUP_DONE] - t0 if SETUP_DONE in marks else None
    run_s = marks["exit"] - marks[SETUP_DONE] if SETUP_DONE in marks and "exit" in marks else None
    res = GuestResult("ok", exit_code[0] if exit_code else 125, boot_s, run_s, str(log),
                      slowness=slowness[0], tail=tail)
    if overrun:
        res.status, res.reason = "timeout", overrun
    elif not exit_code:
        res.status, res.reason = "crash", f"guest ended without reporting an exit status (qemu exit {proc.returncode})"
    elif SETUP_FAILED in marks or INIT_FAILED in marks:
        res.status = "setup_failed"
        res.reason = next((l for l in tail if SETUP_FAILED in l or INIT_FAILED in l), "guest set-up failed")
    return res


def main(argv: list[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C, so the guest is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share", type=Path, help="read-write share (default: a new temp dir, kept)")
    ap.add_argument("--log", type=Path, help="guest console log (default: SHARE/console.log)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help="seconds for boot + command on a quiet host (scaled by the guest's slowness)")
    ap.add_argument("--max-timeout", type=float, help="never wait longer than this (default: timeout x 10)")
    ap.add_argument("--stall", type=float, help="kill a guest whose console is silent this long (scaled)")
    ap.add_argument("--cwd", help="directory the command runs in (default: the current one)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra guest environment")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the guest console to stderr")
    ap.add_argument("--systemd", action="store_true", help="boot systemd as PID 1 (scripts/vm/systemd)")
    ap.add_argument("--icount", type=int, metavar="SHIFT",
                    help="deterministic guest clock, 2**SHIFT ns per instruction (benchmarks on a busy host)")
    ap.add_argument("--shape", choices=SHAPES, default="default",
                    help="the guest's NUMA layout (two-socket: see above)")
    ap.add_argument("--kernel", choices=KERNELS, default=os.environ.get("KVTIER_VM_KERNEL") or "stock",
                    help="guest kernel: stock (Debian's 6.12) or idle (built by build-kernel.sh, with page_idle)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given")
    share = a.share or Path(tempfile.mkdtemp(prefix="kvtier-share-"))
    env = dict(kv.split("=", 1) for kv in a.env)
    res = boot(cmd, share.resolve(), a.timeout, a.log, a.cwd, env, a.verbose, a.systemd, sys.stdout, a.icount,
               a.max_timeout, a.stall, a.shape, a.kernel)
    (share / "result.json").write_text(json.dumps({k: v for k, v in asdict(res).items() if k != "tail"}, indent=1))
    timing = ""
    if res.boot_seconds is not None:
        timing = f"boot {res.boot_seconds:.1f}s"
        if res.run_seconds is not None:
            timing += f", command {res.run_seconds:.1f}s"
        timing += f", slowness {res.slowness:.2f}"
    print(f"run.py: {res.status}, exit {res.exit_code}; {timing}; share {share}", file=sys.stderr)
    if res.status != "ok" or res.exit_code != 0:
        if res.reason:
            print(f"run.py: {res.reason}", file=sys.stderr)
        if res.tail and not a.verbose:
            print(f"--- last lines of {res.console_log} ---", file=sys.stderr)
            print("\n".join(res.tail), file=sys.stderr)
    return res.process_status()


if __name__ == "__main__":
    sys.exit(main())
