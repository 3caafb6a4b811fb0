#!/usr/bin/env python3
"""Build the guest initramfs: static busybox, /init, and the few modules the
guest needs before it can see the host's root filesystem (9p over virtio and
overlayfs).

Everything else (nvme, cxl, dax, kmem) is loaded later with the host's own
modprobe from inside the shared root, where the unpacked guest module tree is
bind-mounted at /lib/modules/<kver>; that keeps this image tiny and lets the
guest load any module without rebuilding it.

busybox's insmod cannot read compressed modules, and Debian ships them as
.ko.xz (older/newer builds: .ko.zst), so they are decompressed here. Load
order comes from modules.dep (dependencies first).

    mkinitramfs.py MODROOT KVER INIT_SCRIPT OUT.cpio.gz
"""

from __future__ import annotations

import gzip
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Modules /init must insmod before the host root can be mounted.
EARLY_MODULES = ("9pnet_virtio", "9p", "overlay")
BUSYBOX = Path("/bin/busybox")


def parse_modules_dep(moddir: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (relative path, relative paths of its dependencies)."""
    table: dict[str, tuple[str, list[str]]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, deps = line.partition(":")
        name = os.path.basename(path).split(".ko")[0].replace("-", "_")
        table[name] = (path, deps.split())
    return table


def parse_builtin(moddir: Path) -> set[str]:
    """Names of the modules built into the kernel (modules.builtin)."""
    try:
        text = (moddir / "modules.builtin").read_text()
    except FileNotFoundError:
        return set()
    return {os.path.basename(line).split(".ko")[0].replace("-", "_") for line in text.split()}


def load_order(table: dict[str, tuple[str, list[str]]], wanted: tuple[str, ...],
               builtin: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Module paths in an order where every dependency precedes its user;
    modules built into the kernel (build-kernel.sh's) need no loading."""
    by_path = {path: deps for path, deps in table.values()}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in by_path[path]:
            visit(dep)
        order.append(path)

    for name in wanted:
        key = name.replace("-", "_")
        if key in builtin and key not in table:
            continue
        if key not in table:
            raise SystemExit(f"mkinitramfs: module {name} not in modules.dep (built in, or wrong kernel?)")
        visit(table[key][0])
    return order


def decompress(src: Path, dst: Path) -> None:
    if src.suffix == ".xz":
        dst.write_bytes(lzma.decompress(src.read_bytes()))
    elif src.suffix == ".zst":
        # Python 3.11 has no zstd module; the zstd CLI comes with scripts/setup.sh.
        with open(dst, "wb") as out:
            subprocess.run(["zstd", "-dcq", str(src)], stdout=out, check=True)
    elif src.suffix == ".gz":
        dst.write_bytes(gzip.decompress(src.read_bytes()))
    else:
        shutil.copyfile(src, dst)


def main() -> int:
    modroot, kver, init_script, out = sys.argv[1:5]
    moddir = Path(modroot) / "lib" / "modules" / kver
    table = parse_modules_dep(moddir)
    order = load_order(table, EARLY_MODULES, parse_builtin(moddir))
    with tempfile.TemporaryDirectory(prefix="kvtier-initramfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "lower", "rw", "newroot", "modules"):
            (root / d).mkdir()
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        os.symlink("busybox", root / "bin" / "sh")
        shutil.copyfile(init_script, root / "init")
        os.chmod(root / "init", 0o755)
        names = []
        for i, rel in enumerate(order):
            src = moddir / rel
            name = f"{i:02d}-{os.path.basename(rel).split('.ko')[0]}.ko"
            decompress(src, root / "modules" / name)
            names.append(name)
        # One name a line; empty for a kernel with everything built in
        # (init's loop would otherwise insmod a blank name).
        (root / "modules" / "order").write_text("".join(n + "\n" for n in names))
        files = subprocess.run(
            ["find", ".", "-mindepth", "1"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
        archive = subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
            cwd=root, input=files.encode(), check=True, capture_output=True,
        ).stdout
    tmp_out = out + ".tmp"
    with gzip.open(tmp_out, "wb", compresslevel=6) as f:
        f.write(archive)
    os.replace(tmp_out, out)
    print(f"mkinitramfs: {out} ({len(names)} modules: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
