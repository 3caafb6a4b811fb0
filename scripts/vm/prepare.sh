#!/usr/bin/env bash
# Prepares the VM test-bed: fetches the guest kernel (the 6.12 kernel that
# bookworm-backports' linux-image-amd64 depends on), unpacks it without
# installing it on the host, indexes its modules and builds the busybox
# initramfs. Installs nothing else (scripts/setup.sh installs QEMU, busybox,
# cpio, kmod, zstd).
#
# The result is cached outside the checkout, keyed by kernel version, so fresh
# clones (CI) reuse it:  $KVTIER_VM_CACHE (default /var/cache/kvtier-vm, or
# ~/.cache/kvtier-vm when /var/cache is not writable)
#   <kver>/boot/vmlinuz-<kver>, <kver>/lib/modules/<kver>/...
#   <kver>/initramfs-<hash>.cpio.gz  (hash of init + builder + busybox; run.py
#                                     boots the one matching its checkout)
#   current                          (kver and initramfs path, read by run.py)
# Idempotent: a second run with everything in place only checks and prints.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

cache=${KVTIER_VM_CACHE:-}
if [ -z "$cache" ]; then
  if mkdir -p /var/cache/kvtier-vm 2>/dev/null && [ -w /var/cache/kvtier-vm ]; then
    cache=/var/cache/kvtier-vm
  else
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-vm
  fi
fi
mkdir -p "$cache"

py=python3
[ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# Which kernel does bookworm-backports' metapackage point at today?
backports_kernel() {
  local ver
  ver=$(apt-cache madison linux-image-amd64 2>/dev/null | awk -F'|' '$3 ~ /-backports/ {gsub(/ /, "", $2); print $2; exit}')
  [ -n "$ver" ] || return 1
  apt-cache show "linux-image-amd64=$ver" 2>/dev/null |
    sed -n 's/^Depends: \(linux-image-[^ ,]*\) (= \([^)]*\)).*/\1 \2/p' | head -n1
}

pkg_line=$(backports_kernel || true)
if [ -z "$pkg_line" ] && grep -rqs -- -backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
  $SUDO apt-get update -q >/dev/null
  pkg_line=$(backports_kernel || true)
fi
if [ -z "$pkg_line" ]; then
  if [ -f "$cache/current" ]; then
    echo "prepare.sh: bookworm-backports not reachable; keeping cached guest kernel $(head -n1 "$cache/current")" >&2
    pkg=""
  else
    echo "prepare.sh: cannot find linux-image-amd64 in bookworm-backports (run scripts/setup.sh, which adds it)" >&2
    exit 1
  fi
else
  read -r pkg pkgver <<<"$pkg_line"
fi

if [ -n "$pkg" ]; then
  kver=${pkg#linux-image-}
  kdir="$cache/$kver"
  if [ ! -f "$kdir/boot/vmlinuz-$kver" ] || [ ! -f "$kdir/lib/modules/$kver/modules.dep" ]; then
    echo "prepare.sh: fetching guest kernel $pkg $pkgver"
    dl=$(mktemp -d "$cache/.dl.XXXXXX")
    trap 'rm -rf "$dl"' EXIT
    # apt's _apt user must be able to write the download directory.
    chmod 0777 "$dl"
    # (As root apt warns that it downloads unsandboxed; that is expected here.)
    (cd "$dl" && apt-get download -q "$pkg=$pkgver" 2>&1 | grep -v 'unsandboxed') || true
    deb=$(ls "$dl"/*.deb 2>/dev/null | head -n1)
    if [ -z "$deb" ]; then
      echo "prepare.sh: apt-get download $pkg=$pkgver failed" >&2
      exit 1
    fi
    dpkg -x "$deb" "$dl/root"
    # The metapackage's kernel may use /usr/lib/modules (merged /usr): normalise.
    if [ ! -d "$dl/root/lib/modules/$kver" ] && [ -d "$dl/root/usr/lib/modules/$kver" ]; then
      mkdir -p "$dl/root/lib/modules"
      mv "$dl/root/usr/lib/modules/$kver" "$dl/root/lib/modules/"
    fi
    depmod -b "$dl/root" "$kver"
    rm -rf "$kdir"
    mv "$dl/root" "$kdir"
    rm -rf "$dl"
    trap - EXIT
  fi
else
  kver=$(head -n1 "$cache/current")
  kdir="$cache/$kver"
fi

hash=$(cat "$here/init" "$here/mkinitramfs.py" /bin/busybox | sha256sum | cut -c1-16)
initrd="$kdir/initramfs-$hash.cpio.gz"
if [ ! -f "$initrd" ]; then
  "$py" "$here/mkinitramfs.py" "$kdir" "$kver" "$here/init" "$initrd"
fi
# Images of other init versions stay (another checkout, e.g. CI's clone, may
# boot one; run.py picks by hash) until unused for a month.
find "$kdir" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "$(basename "$initrd")" -atime +30 -delete

printf '%s\n%s\n' "$kver" "$initrd" > "$cache/current.tmp"
mv "$cache/current.tmp" "$cache/current"

# Old kernels are dead weight once backports moved on.
for d in "$cache"/*/; do
  d=${d%/}
  [ "$(basename "$d")" = "$kver" ] || rm -rf "$d"
done
echo "prepare.sh: guest kernel $kver ready in $kdir"
