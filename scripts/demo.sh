#!/usr/bin/env bash
# The kvtier demo, one command from a fresh Debian 12 clone:
#
#   scripts/demo.sh            # in the QEMU guest (DRAM node, far node, CXL node, NVMe swap)
#   scripts/demo.sh --host     # on this machine, if it has memory nodes without CPUs
#
# 1. scripts/setup.sh installs what is missing (apt packages, QEMU 10 and a
#    guest kernel from backports, the .venv); a no-op the second time.
# 2. Boots the guest with scripts/vm/run.py and runs scripts/demo/driver.py
#    in it: a synthetic inference workload (scripts/demo/workload.py) whose
#    256 MiB KV pool starts on the far node, run three times in the same
#    guest boot with the same seed and the same free DRAM: with kvtierd
#    (default config plus tier capacity targets), with the kernel's own
#    tiering (numa_balancing=2) and with neither. One status line per second
#    shows the share of block reads served from DRAM.
# 3. Writes out/demo/report.md, out/demo/comparison.png (the three modes side
#    by side: DRAM share of reads, pool bytes in DRAM, bytes moved) and
#    out/demo/placement.png (kvtier's run: residency and tier occupancy).
#
# Takes about 10 minutes on 2 cores once set up (the guest runs under TCG).
# Knobs: KVTIER_DEMO_SECONDS (workload length per mode, default 120),
# KVTIER_DEMO_OUT (default out/demo); extra arguments go to the driver, e.g.
# --with-cxl or --modes kvtier.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

mode=vm
if [ "${1:-}" = "--host" ]; then
  mode=host
  shift
fi
seconds=${KVTIER_DEMO_SECONDS:-120}
out=${KVTIER_DEMO_OUT:-$repo/out/demo}
run_dir=$out/run
mkdir -p "$out"
rm -rf "$run_dir"
mkdir -p "$run_dir"

say() { printf '\033[1m== %s\033[0m\n' "$*"; }

say "setup (scripts/setup.sh)"
if [ "$mode" = host ]; then
  scripts/setup.sh --no-vm
else
  scripts/setup.sh
fi
py=$repo/.venv/bin/python

if [ "$mode" = host ]; then
  say "running on this host: kvtierd + workload for ${seconds}s"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  set +e
  $SUDO env PATH="$repo/.venv/bin:$PATH" "$py" scripts/demo/driver.py --out "$run_dir" \
    --run-dir /run/kvtier-demo --duration "$seconds" "$@"
  rc=$?
  set -e
else
  # Boot ~20 s; per mode, interpreter start-up and pool set-up under TCG
  # ~40 s, the workload, the daemon's shutdown.
  timeout=$(( 3 * (seconds + 90) + 120 ))
  say "booting the QEMU guest; kvtierd + workload for ${seconds}s inside (console: $run_dir/console.log)"
  set +e
  "$py" scripts/vm/run.py --share "$run_dir" --timeout "$timeout" -- \
    python scripts/demo/driver.py --out /mnt/kvtier --duration "$seconds" "$@" >/dev/null &
  vm=$!
  # The driver appends its status lines to the share; follow them live.
  tail -n +1 -F --pid="$vm" "$run_dir/status.log" 2>/dev/null
  wait "$vm"
  rc=$?
  set -e
fi

if [ "$rc" -ne 0 ]; then
  say "the demo run failed (exit $rc); logs in $run_dir"
  [ -f "$run_dir/result.json" ] && cat "$run_dir/result.json"
  [ -f "$run_dir/kvtierd.log" ] && tail -n 20 "$run_dir/kvtierd.log"
  exit "$rc"
fi

say "report"
"$py" scripts/demo/report.py --run "$run_dir" --out "$out"
say "wrote $out/report.md and $out/placement.png"
