#!/usr/bin/env bash
# Installs everything kvtier needs on a fresh Debian 12 machine: apt packages
# (libnuma headers for the cffi build, QEMU 10 and a 6.12 guest kernel from
# bookworm-backports for the VM test-bed), a virtualenv in .venv and the
# package itself in editable mode (which compiles the cffi extension).
# Idempotent: re-running installs only what is missing.
#
#   scripts/setup.sh            host + VM test-bed
#   scripts/setup.sh --no-vm    host only (no QEMU, no guest kernel)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
want_vm=1
[ "${1:-}" = "--no-vm" ] && want_vm=0

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

host_pkgs=(libnuma-dev numactl build-essential python3-venv python3-dev pkg-config systemd util-linux)
vm_pkgs=(busybox-static cpio kmod zstd)

missing=()
for p in "${host_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "$want_vm" = 1 ]; then
  for p in "${vm_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
fi

need_backports=0
if [ "$want_vm" = 1 ]; then
  # Debian 12's own QEMU 7.2 lacks cxl-type3 volatile-memdev; backports has 10.x.
  if ! command -v qemu-system-x86_64 >/dev/null || \
     ! qemu-system-x86_64 --version | grep -qE 'version (9|1[0-9])\.'; then
    need_backports=1
  fi
fi

if [ ${#missing[@]} -gt 0 ] || [ "$need_backports" = 1 ]; then
  if [ "$need_backports" = 1 ] && ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    $SUDO tee /etc/apt/sources.list.d/kvtier-backports.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  $SUDO apt-get update -q
  [ ${#missing[@]} -gt 0 ] && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  if [ "$need_backports" = 1 ]; then
    $SUDO apt-get install -y -q --no-install-recommends -t bookworm-backports qemu-system-x86 qemu-utils
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.kvtier-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ ffi/build_ffi.py -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # The transformers integration's tests need torch and transformers, pinned.
  # torch==2.13.0 resolves to the CPU wheel this machine image keeps in pip's
  # find-links (its local version 2.13.0+cpu sorts above PyPI's CUDA build);
  # the check below refuses a CUDA build instead of carrying gigabytes of
  # nvidia libraries into the venv unnoticed.
  .venv/bin/pip install -q -e ".[test,plot,transformers]" "torch==2.13.0" "transformers==5.18.0"
  .venv/bin/python -c 'import sys, torch; sys.exit(f"torch {torch.__version__} is a CUDA build; install the CPU wheel" if torch.version.cuda else 0)'
  touch "$stamp"
fi

if [ "$want_vm" = 1 ]; then
  scripts/vm/prepare.sh
  # The idle kernel is never built here (it takes too long: scripts/vm/README.md);
  # where it was built, this gives it the initramfs of this checkout's init.
  scripts/vm/build-kernel.sh --check || true
fi
