#!/usr/bin/env bash
# Builds the "idle" guest kernel: Debian's own 6.12 source (linux-source-6.12,
# the same upstream release and Debian patches as the stock guest kernel that
# prepare.sh unpacks) configured small, everything the test-bed needs built
# in, plus CONFIG_IDLE_PAGE_TRACKING, which no Debian kernel enables (the
# access-bit source's page_idle mechanism needs it). scripts/vm/run.py boots
# it with --kernel idle (or KVTIER_VM_KERNEL=idle); vmidle-marked tests get
# their own boot in it (tests/conftest.py).
#
# The config is x86_64_defconfig + kvm_guest.config + kernel-idle.config
# (beside this script). Everything is =y: the guest then needs no module
# tree; /lib/modules/<kver> holds only modules.builtin and an empty
# modules.dep, so guest_setup.sh's modprobe of nvme, cxl_*, kmem succeeds
# (kmod knows them as built in) and mkinitramfs.py packs no module.
#
# Cached beside the shared stock-kernel cache, never inside it (prepare.sh
# deletes every directory of $KVTIER_VM_CACHE but the current kernel):
#   $KVTIER_VM_IDLE_CACHE (default /var/cache/kvtier-vm-idle)
#     <hash>/boot/vmlinuz-<kver>, <hash>/lib/modules/<kver>/,
#     <hash>/initramfs-<inithash>.cpio.gz, <hash>/build.log, <hash>/config
#     current  (kver, then the <hash> directory; read by run.py)
#   <hash> covers the source package version, the config fragment and this
#   script. Idempotent: with the kernel in place it only checks and prints.
#
#   scripts/vm/build-kernel.sh            build if missing (needs root for apt)
#   scripts/vm/build-kernel.sh --check    exit 0 if built, 1 if not; builds nothing
#   JOBS=N (default: nproc), NICE=N (default 19)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
fragment="$here/kernel-idle.config"
series=6.12
localversion=-kvtier-idle

cache=${KVTIER_VM_IDLE_CACHE:-}
if [ -z "$cache" ]; then
  if mkdir -p /var/cache/kvtier-vm-idle 2>/dev/null && [ -w /var/cache/kvtier-vm-idle ]; then
    cache=/var/cache/kvtier-vm-idle
  else
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-vm-idle
  fi
fi
mkdir -p "$cache"

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

py=python3
[ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

# The source version: bookworm-backports' linux-source-6.12 (the release the
# stock guest kernel is built from), else whatever apt offers.
src_version() {
  local v
  v=$(apt-cache madison "linux-source-$series" 2>/dev/null |
      awk -F'|' '$3 ~ /-backports/ {gsub(/ /, "", $2); print $2; exit}')
  [ -n "$v" ] || v=$(apt-cache policy "linux-source-$series" 2>/dev/null | awk '/Candidate:/ {print $2}')
  [ -n "$v" ] && [ "$v" != "(none)" ] && echo "$v"
}

# User + system CPU seconds of this shell's finished children so far, into
# $cpu_s (times must run in this shell: a $(...) subshell has its own).
cpu_seconds() {
  times > "$work/times"
  cpu_s=$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] } printf "%.1f", s }' "$work/times")
}

# The .config, in the source tree (cwd). Steps chained by hand: set -e does
# not apply inside a function whose status is tested.
configure() {
  make -s x86_64_defconfig || return 1
  # Every =m becomes =y (no module tree in the guest); of kvm_guest.config
  # what the guest has no device for goes: virtio GPU (all of DRM), SCSI,
  # input, and the DHCP client (its only network is the loopback).
  sed -e 's/=m$/=y/' -e '/^CONFIG_\(DRM_VIRTIO_GPU\|SCSI_LOWLEVEL\|SCSI_VIRTIO\|VIRTIO_INPUT\|IP_PNP\|IP_PNP_DHCP\)=/d' \
    kernel/configs/kvm_guest.config > "$work/kvm_guest.config" &&
    sed 's/=m$/=y/' "$fragment" > "$work/idle.config" &&
    scripts/kconfig/merge_config.sh -m .config "$work/kvm_guest.config" "$work/idle.config" &&
    make -s olddefconfig || return 1
  # merge_config.sh -m does not check what kconfig dropped: every option of
  # the fragment must have survived (a missing dependency drops it quietly).
  local bad=0 line opt
  while IFS= read -r line; do
    case "$line" in
      CONFIG_*=*) grep -qxF "$line" .config ||
                    { echo "build-kernel.sh: $line did not survive olddefconfig"; bad=1; } ;;
      "# CONFIG_"*" is not set") opt=${line#\# }; opt=${opt%% *}
                    ! grep -q "^$opt=" .config ||
                    { echo "build-kernel.sh: $opt is still set after olddefconfig"; bad=1; } ;;
    esac
  done < "$work/idle.config"
  return "$bad"
}

ver=$(src_version || true)
if [ -z "$ver" ]; then
  # Offline: keep what was built last.
  if [ -f "$cache/current" ] && [ -f "$cache/$(sed -n 2p "$cache/current")/done" ]; then
    echo "build-kernel.sh: apt has no linux-source-$series; keeping $(head -n1 "$cache/current")" >&2
    exit 0
  fi
  [ "$check_only" = 1 ] && exit 1
  echo "build-kernel.sh: apt has no linux-source-$series (bookworm-backports; scripts/setup.sh adds it)" >&2
  exit 1
fi
hash=$({ echo "$ver"; cat "$fragment" "$0"; } | sha256sum | cut -c1-12)
out="$cache/$hash"

if [ -f "$out/done" ]; then
  kver=$(cat "$out/kver")
else
  [ "$check_only" = 1 ] && exit 1
  deps=(flex bison libelf-dev bc libssl-dev build-essential xz-utils cpio kmod)
  missing=()
  for p in "${deps[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  work="$cache/$hash.build"
  mkdir -p "$work"
  if [ ! -f "$work/src/Makefile" ]; then
    dl="$work/dl"
    rm -rf "$dl" "$work/src"
    mkdir -p "$dl"
    chmod 0777 "$dl"  # apt's _apt user writes the download
    (cd "$dl" && apt-get download -q "linux-source-$series=$ver" 2>&1 | grep -v unsandboxed) || true
    deb=$(ls "$dl"/*.deb 2>/dev/null | head -n1)
    [ -n "$deb" ] || { echo "build-kernel.sh: apt-get download linux-source-$series=$ver failed" >&2; exit 1; }
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$dl" "./usr/src/linux-source-$series.tar.xz"
    mkdir -p "$work/src.tmp"
    tar -xJf "$dl/usr/src/linux-source-$series.tar.xz" -C "$work/src.tmp" --strip-components=1
    mv "$work/src.tmp" "$work/src"
    rm -rf "$dl"
  fi
  cd "$work/src"
  log="$work/build.log"
  start=$(date +%s)
  configure >"$log" 2>&1 || { tail -n 20 "$log" >&2; exit 1; }
  echo "build-kernel.sh: building linux-source-$series $ver ($hash) with -j${JOBS:-$(nproc)} at nice ${NICE:-19}; log $log"
  # The CPU seconds the build took (user + sys of make and its children,
  # from bash's times) say what it costs on a quiet machine, whatever the load.
  cpu_seconds
  cpu0=$cpu_s
  if ! nice -n "${NICE:-19}" make -j"${JOBS:-$(nproc)}" LOCALVERSION="$localversion" bzImage modules >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    exit 1
  fi
  cpu_seconds
  cpu=$(awk -v a="$cpu_s" -v b="$cpu0" 'BEGIN { printf "%d", a - b }')
  kver=$(make -s LOCALVERSION="$localversion" kernelrelease)
  stage="$work/stage"
  rm -rf "$stage"
  mkdir -p "$stage/boot"
  cp arch/x86/boot/bzImage "$stage/boot/vmlinuz-$kver"
  cp .config "$stage/config"
  # modules_install with nothing modular: modules.builtin(.modinfo) and
  # depmod's indexes, which is what modprobe needs to accept built-ins.
  make -s LOCALVERSION="$localversion" INSTALL_MOD_PATH="$stage" modules_install >>"$log" 2>&1
  if [ ! -d "$stage/lib/modules/$kver" ] && [ -d "$stage/usr/lib/modules/$kver" ]; then
    mkdir -p "$stage/lib/modules"
    mv "$stage/usr/lib/modules/$kver" "$stage/lib/modules/"
  fi
  rm -f "$stage/lib/modules/$kver/build" "$stage/lib/modules/$kver/source"
  depmod -b "$stage" "$kver"
  end=$(date +%s)
  echo "$kver" > "$stage/kver"
  printf 'linux-source-%s %s, built in %ss with -j%s at nice %s (make: %s CPU seconds), load %s\n' "$series" "$ver" \
    "$((end - start))" "${JOBS:-$(nproc)}" "${NICE:-19}" "$cpu" "$(cut -d' ' -f1-3 /proc/loadavg)" > "$stage/built"
  cp "$log" "$stage/build.log"
  touch "$stage/done"
  rm -rf "$out"
  mv "$stage" "$out"
  cd "$cache"
  rm -rf "$work"
  echo "build-kernel.sh: $(cat "$out/built")"
fi

# The initramfs: the same init and builder as the stock guest's (no modules
# to pack), named by the same hash run.py looks for.
inithash=$(cat "$here/init" "$here/mkinitramfs.py" /bin/busybox | sha256sum | cut -c1-16)
initrd="$out/initramfs-$inithash.cpio.gz"
[ -f "$initrd" ] || "$py" "$here/mkinitramfs.py" "$out" "$kver" "$here/init" "$initrd"
find "$out" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "$(basename "$initrd")" -atime +30 -delete

printf '%s\n%s\n' "$kver" "$hash" > "$cache/current.tmp"
mv "$cache/current.tmp" "$cache/current"
# Builds of older configs or sources are dead weight.
for d in "$cache"/*/; do
  d=${d%/}
  case "$(basename "$d")" in "$hash"|"$hash.build") ;; *) rm -rf "$d" ;; esac
done
echo "build-kernel.sh: guest kernel $kver ready in $out"
