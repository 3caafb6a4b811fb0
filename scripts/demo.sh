#!/usr/bin/env bash
# The kvtier demo, one command from a fresh Debian 12 clone:
#
#   scripts/demo.sh            # in the QEMU guest (DRAM node, far node, CXL node, NVMe swap)
#   scripts/demo.sh --host     # on this machine, if it has memory nodes without CPUs
#
# 1. scripts/setup.sh installs what is missing (apt packages, QEMU 10 and a
#    guest kernel from backports, the .venv); a no-op the second time.
# 2. Boots the guest with scripts/vm/run.py and runs scripts/demo/driver.py
#    in it: kvtierd with the default config plus tier capacity targets, and
#    a synthetic inference workload (scripts/demo/workload.py) whose 256 MiB
#    KV pool starts on the far node. One status line per second shows the
#    share of block reads served from DRAM climbing as kvtier moves the hot
#    set up and the cold blocks down to the far node and swap.
# 3. Writes out/demo/report.md and out/demo/placement.png (hot-set residency
#    and tier occupancy over time, bytes moved per tier pair).
#
# Takes about 5 minutes on 2 cores once set up (the guest runs under TCG).
# Knobs: KVTIER_DEMO_SECONDS (workload length, default 180), KVTIER_DEMO_OUT
# (default out/demo); extra arguments go to the driver, e.g. --with-cxl.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

mode=vm
if [ "${1:-}" = "--host" ]; then
  mode=host
  shift
fi
seconds=${KVTIER_DEMO_SECONDS:-180}
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
  # Boot ~20 s, interpreter start-up and pool set-up under TCG ~40 s,
  # the workload, then the daemon's shutdown.
  timeout=$(( seconds + 240 ))
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
