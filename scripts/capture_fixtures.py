#!/usr/bin/env python3
"""Copy the sysfs/procfs files kvtier's topology discovery reads into a
fixture tree, so unit tests can run discovery against a real machine's view.

    python scripts/capture_fixtures.py tests/fixtures/host-1node
    python scripts/capture_fixtures.py tests/fixtures/qemu-cxl     # in the guest
    python scripts/capture_fixtures.py --synthetic-cxl tests/fixtures/synthetic-cxl

The tree is DEST/sys, DEST/proc and DEST/fixture.json. Only small text files
are copied; symlinks (sysfs is full of them: /sys/block/X, dax and region
devices) are recreated with their relative targets and the files of the
target are copied to where the link points, so path-based rules (a dax device
below a CXL region) see the same tree. Directories missing on the source
kernel are skipped silently: old kernels lack memory tiers, most machines
lack CXL and HMAT.

Runs under any Python 3.9+ with only the standard library (the guest may not
have the venv); the list of kernel file names comes from kvtier.kernel.sysfs, which
imports nothing outside the standard library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))

from kvtier.kernel import sysfs  # noqa: E402

_SKIP_DISKS = re.compile(r"^(loop|ram)\d+$")


class Capture:
    def __init__(self, src_sys: str, src_proc: str, dest: str):
        self.src_sys, self.src_proc, self.dest = src_sys, src_proc, dest
        self.copied = 0

    # -- primitives ---------------------------------------------------------

    def _dst(self, tree: str, rel: str) -> str:
        return os.path.join(self.dest, tree, rel)

    def copy_file(self, rel: str, tree: str = "sys") -> bool:
        """Copy one small text file (rel to the sys or proc root) if present."""
        src = os.path.join(self.src_sys if tree == "sys" else self.src_proc, rel)
        try:
            with open(src, "rb") as f:
                data = f.read(1 << 16)
        except OSError:
            return False  # absent, or a sysfs attribute that refuses reads
        dst = self._dst(tree, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
        self.copied += 1
        return True

    def copy_link(self, rel: str) -> str | None:
        """Recreate sysfs symlink ``rel``; return the target's path relative
        to the sys root (where its files should go), or None."""
        src = os.path.join(self.src_sys, rel)
        try:
            target = os.readlink(src)
        except OSError:
            return None
        dst = self._dst("sys", rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.lexists(dst):
            os.unlink(dst)
        os.symlink(target, dst)
        resolved = os.path.normpath(os.path.join(os.path.dirname(rel), target))
        return None if resolved.startswith("..") else resolved

    def copy_entry(self, rel: str, files: tuple[str, ...]) -> str:
        """Copy ``files`` of a sysfs directory that may be reached through a
        symlink; return the directory's real relative path."""
        real = self.copy_link(rel) or rel
        for f in files:
            self.copy_file(os.path.join(real, f))
        return real

    def listdir(self, rel: str, tree: str = "sys") -> list[str]:
        return sysfs.listdir(os.path.join(self.src_sys if tree == "sys" else self.src_proc, rel))

    # -- what discovery reads -------------------------------------------------

    def nodes(self) -> None:
        for f in sysfs.NODE_LIST_FILES:
            self.copy_file(os.path.join(sysfs.NODE_DIR, f))
        has_cpu = sysfs.read_list(os.path.join(self.src_sys, sysfs.NODE_DIR, sysfs.NODE_HAS_CPU))
        for name in self.listdir(sysfs.NODE_DIR):
            m = re.match(rf"^{sysfs.NODE_PREFIX}(\d+)$", name)
            if not m:
                continue
            ndir = os.path.join(sysfs.NODE_DIR, name)
            for f in sysfs.NODE_FILES:
                self.copy_file(os.path.join(ndir, f))
            for access in sysfs.HMAT_ACCESS_CLASSES:
                for f in sysfs.HMAT_FILES:
                    self.copy_file(os.path.join(ndir, access, sysfs.HMAT_INITIATORS, f))
            # Memory block links matter only for CPU-less nodes (the CXL
            # range rule); DRAM nodes can have thousands of them.
            if has_cpu is not None and int(m.group(1)) in has_cpu:
                continue
            for entry in self.listdir(ndir):
                if re.match(rf"^{sysfs.MEMORY_BLOCK_PREFIX}\d+$", entry):
                    self.copy_link(os.path.join(ndir, entry))
        self.copy_file(sysfs.MEMORY_BLOCK_SIZE)

    def memory_tiers(self) -> None:
        for name in self.listdir(sysfs.MEMTIER_DIR):
            if name.startswith(sysfs.MEMTIER_PREFIX):
                self.copy_file(os.path.join(sysfs.MEMTIER_DIR, name, sysfs.MEMTIER_NODELIST))

    def cxl_and_dax(self) -> None:
        for name in self.listdir(sysfs.CXL_DEVICES):
            if name.startswith(sysfs.CXL_REGION_PREFIX):
                self.copy_entry(os.path.join(sysfs.CXL_DEVICES, name), sysfs.CXL_REGION_FILES)
        for name in self.listdir(sysfs.DAX_DEVICES):
            self.copy_entry(os.path.join(sysfs.DAX_DEVICES, name), sysfs.DAX_FILES)

    def block(self, disk: str) -> None:
        real = self.copy_entry(os.path.join(sysfs.BLOCK_DIR, disk), (sysfs.BLOCK_DEV, sysfs.BLOCK_SIZE, sysfs.BLOCK_ROTATIONAL))
        self.copy_link(os.path.join(real, sysfs.BLOCK_DEVICE_LINK))
        self.dev_link(real)
        for entry in self.listdir(real):
            sub = os.path.join(real, entry)
            if os.path.exists(os.path.join(self.src_sys, sub, sysfs.BLOCK_PARTITION)):
                for f in (sysfs.BLOCK_PARTITION, sysfs.BLOCK_DEV, sysfs.BLOCK_SIZE):
                    self.copy_file(os.path.join(sub, f))
                self.dev_link(sub)
        for slave in self.listdir(os.path.join(real, sysfs.BLOCK_SLAVES)):
            self.copy_link(os.path.join(real, sysfs.BLOCK_SLAVES, slave))

    def dev_link(self, block_dir: str) -> None:
        """The /sys/dev/block/MAJ:MIN link of a disk or partition: how a swap
        file's st_dev finds its device."""
        majmin = sysfs.read_text(os.path.join(self.src_sys, block_dir, sysfs.BLOCK_DEV))
        if majmin:
            self.copy_link(os.path.join(sysfs.DEV_BLOCK_DIR, majmin))

    def blocks_and_swaps(self) -> dict[str, str]:
        """Copy /proc/swaps and the block devices; return swap file -> MAJ:MIN."""
        self.copy_file(sysfs.PROC_SWAPS, tree="proc")
        swap_files: dict[str, str] = {}
        swaps = sysfs.parse_swaps(sysfs.read_text(os.path.join(self.src_proc, sysfs.PROC_SWAPS)) or "")
        for path, typ, _size, _used, _prio in swaps:
            if typ != "file":
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            swap_files[path] = majmin
            self.copy_link(os.path.join(sysfs.DEV_BLOCK_DIR, majmin))
        used = {os.path.basename(path) for path, *_ in swaps}
        for disk in self.listdir(sysfs.BLOCK_DIR):
            if _SKIP_DISKS.match(disk) and disk not in used:
                continue
            self.block(disk)
        return swap_files


def _fresh(dest: str) -> None:
    """Empty ``dest`` for a new capture, refusing to delete a directory that
    is not a fixture tree (a mistyped path must not cost anyone their files)."""
    if os.path.exists(dest):
        if os.listdir(dest) and not os.path.exists(os.path.join(dest, sysfs.FIXTURE_META)):
            raise SystemExit(f"{dest} exists and is not a fixture tree (no {sysfs.FIXTURE_META}); not touching it")
        shutil.rmtree(dest)
    os.makedirs(dest)


def capture(dest: str, src_sys: str = "/sys", src_proc: str = "/proc") -> dict:
    _fresh(dest)
    c = Capture(src_sys, src_proc, dest)
    c.nodes()
    c.memory_tiers()
    c.cxl_and_dax()
    swap_files = c.blocks_and_swaps()
    meta = {
        "synthetic": False,
        "description": f"captured by scripts/capture_fixtures.py from {src_sys} and {src_proc}",
        "kernel": platform.release() if os.path.realpath(src_sys) == "/sys" else None,
        "captured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        # discover() cannot stat a swap file inside a fixture; this is its st_dev.
        "swap_files": swap_files,
        "files": c.copied,
    }
    with open(os.path.join(dest, sysfs.FIXTURE_META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    return meta


# ---------------------------------------------------------------------------
# synthetic tree (until the real QEMU guest capture exists)


def _write(dest: str, rel: str, text: str) -> None:
    p = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def _link(dest: str, rel: str, target: str) -> None:
    p = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.symlink(target, p)


def _meminfo(node: int, total_kb: int, free_kb: int) -> str:
    return (
        f"Node {node} MemTotal:       {total_kb} kB\n"
        f"Node {node} MemFree:        {free_kb} kB\n"
        f"Node {node} MemUsed:        {total_kb - free_kb} kB\n"
    )


def _disk(dest: str, name: str, devpath: str, device_link: str, majmin: str, sectors: int,
          rotational: bool) -> str:
    """A /sys/block disk as the kernel lays it out: the /sys/block link,
    the device directory, the dev/block link. Returns the directory below dest."""
    ddir = os.path.join("sys", devpath)
    _link(dest, os.path.join("sys", sysfs.BLOCK_DIR, name), f"../{devpath}")
    _write(dest, os.path.join(ddir, sysfs.BLOCK_DEV), majmin)
    _write(dest, os.path.join(ddir, sysfs.BLOCK_SIZE), str(sectors))
    _write(dest, os.path.join(ddir, sysfs.BLOCK_ROTATIONAL), "1" if rotational else "0")
    _link(dest, os.path.join(ddir, sysfs.BLOCK_DEVICE_LINK), device_link)
    _link(dest, os.path.join("sys", sysfs.DEV_BLOCK_DIR, majmin), f"../../{devpath}")
    return ddir


def build_synthetic_cxl(dest: str) -> None:
    """Hand-built tree of the guest topology DESIGN.md describes: node0 with
    2 CPUs (DRAM), node1 CPU-less far RAM in a lower memory tier with HMAT
    latencies, node2 CPU-less CXL memory onlined through dax kmem in its own
    tier, swap on nvme0n1. File names and formats follow a 6.12 kernel; the
    numbers are invented but consistent (memory tiers follow the kernel's
    abstract-distance formula from the HMAT values)."""
    _fresh(dest)
    s = "sys"
    node = os.path.join(s, sysfs.NODE_DIR)
    _write(dest, os.path.join(node, sysfs.NODE_ONLINE), "0-2")
    _write(dest, os.path.join(node, sysfs.NODE_POSSIBLE), "0-2")
    _write(dest, os.path.join(node, sysfs.NODE_HAS_CPU), "0")
    _write(dest, os.path.join(node, sysfs.NODE_HAS_MEMORY), "0-2")
    _write(dest, os.path.join(node, sysfs.NODE_HAS_NORMAL_MEMORY), "0-1")
    _write(dest, os.path.join(node, sysfs.NODE_HAS_GENERIC_INITIATOR), "")
    gib = 1 << 20  # in kB
    layout = {
        # node: (cpulist, total kB, free kB, distance row, hmat (rl, wl, rbw, wbw))
        0: ("0-1", 2 * gib, 1536 * 1024, "10 20 30", (100, 100, 20000, 20000)),
        1: ("", 1 * gib, 1000 * 1024, "20 10 40", (200, 200, 10000, 10000)),
        2: ("", 1 * gib, 1020 * 1024, "30 40 10", (350, 400, 5000, 4000)),
    }
    for n, (cpus, total, free, dist, perf) in layout.items():
        nd = os.path.join(node, f"node{n}")
        _write(dest, os.path.join(nd, sysfs.NODE_CPULIST), cpus)
        _write(dest, os.path.join(nd, sysfs.NODE_MEMINFO), _meminfo(n, total, free))
        _write(dest, os.path.join(nd, sysfs.NODE_DISTANCE), dist)
        for access in sysfs.HMAT_ACCESS_CLASSES:
            for f, v in zip(sysfs.HMAT_FILES, perf):
                _write(dest, os.path.join(nd, access, sysfs.HMAT_INITIATORS, f), str(v))
    # 128 MiB memory blocks; node2's memory is the CXL window at 0x290000000
    # (blocks 82..89), node1's sits at 0xc0000000 (blocks 24..31).
    _write(dest, os.path.join(s, sysfs.MEMORY_BLOCK_SIZE), "8000000")
    for n, blocks in ((1, range(24, 32)), (2, range(82, 90))):
        for b in blocks:
            _link(dest, os.path.join(node, f"node{n}", f"memory{b}"), f"../../memory/memory{b}")
    # Memory tiers: DRAM at the kernel's default (4); node1 at 4x DRAM's
    # abstract distance (2x latency, 1/2 bandwidth) -> 2304 >> 7 = 18; the
    # dax kmem node at the kmem default 5 * 576 = 2880 >> 7 = 22.
    for tier, nodes in ((4, "0"), (18, "1"), (22, "2")):
        _write(dest, os.path.join(s, sysfs.MEMTIER_DIR, f"memory_tier{tier}", sysfs.MEMTIER_NODELIST), nodes)
    cxl_dev = "devices/platform/ACPI0017:00/root0/decoder0.0/region0"
    _link(dest, os.path.join(s, sysfs.CXL_DEVICES, "region0"), f"../../../{cxl_dev}")
    _write(dest, os.path.join(s, cxl_dev, sysfs.CXL_REGION_RESOURCE), "0x290000000")
    _write(dest, os.path.join(s, cxl_dev, sysfs.CXL_REGION_SIZE), "0x40000000")
    _write(dest, os.path.join(s, cxl_dev, sysfs.CXL_REGION_MODE), "ram")
    dax_dev = f"{cxl_dev}/dax_region0/dax0.0"
    _link(dest, os.path.join(s, sysfs.DAX_DEVICES, "dax0.0"), f"../../../{dax_dev}")
    _write(dest, os.path.join(s, dax_dev, sysfs.DAX_TARGET_NODE), "2")
    _write(dest, os.path.join(s, dax_dev, sysfs.DAX_SIZE), str(1 << 30))
    # Block devices: the virtio root disk and the NVMe namespace used as swap
    # (whole disk), with one partition to exercise partition lookup.
    _disk(dest, "vda", "devices/pci0000:00/0000:00:02.0/virtio1/block/vda", "../../../virtio1",
          "254:0", 20 << 21, rotational=True)
    nvme = _disk(dest, "nvme0n1", "devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1", "../../nvme0",
                 "259:0", 4 << 21, rotational=False)
    for f, v in ((sysfs.BLOCK_PARTITION, "1"), (sysfs.BLOCK_DEV, "259:1"), (sysfs.BLOCK_SIZE, str(1 << 21))):
        _write(dest, os.path.join(nvme, "nvme0n1p1", f), v)
    _link(dest, os.path.join("sys", sysfs.DEV_BLOCK_DIR, "259:1"), f"../../{nvme[4:]}/nvme0n1p1")
    _write(
        dest,
        os.path.join("proc", sysfs.PROC_SWAPS),
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
        "/dev/nvme0n1                            partition\t4194300\t\t1024\t\t-2\n",
    )
    meta = {
        "synthetic": True,
        "description": (
            "SYNTHETIC: hand-built by scripts/capture_fixtures.py --synthetic-cxl from the guest "
            "topology in DESIGN.md (node0 DRAM with 2 CPUs, node1 CPU-less far RAM, node2 CXL via "
            "dax kmem, nvme0n1 swap). Not captured from a machine; replace with tests/fixtures/qemu-cxl."
        ),
        "kernel": "6.12 (file layout)",
        "swap_files": {},
    }
    with open(os.path.join(dest, sysfs.FIXTURE_META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    _write(dest, "README.md", "# SYNTHETIC fixture\n\n" + meta["description"] + "\n\n"
           "Regenerate with `python scripts/capture_fixtures.py --synthetic-cxl tests/fixtures/synthetic-cxl`.\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", help="fixture directory to (re)create")
    ap.add_argument("--sys-root", default="/sys")
    ap.add_argument("--proc-root", default="/proc")
    ap.add_argument("--synthetic-cxl", action="store_true",
                    help="write the hand-built synthetic CXL tree instead of capturing")
    args = ap.parse_args(argv)
    if args.synthetic_cxl:
        build_synthetic_cxl(args.dest)
        print(f"wrote synthetic fixture {args.dest}")
        return 0
    meta = capture(args.dest, args.sys_root, args.proc_root)
    print(f"captured {meta['files']} files into {args.dest}; swap files: {meta['swap_files'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
