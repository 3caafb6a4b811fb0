#!/bin/bash
# Runs as root inside the test guest (chrooted into the host's root over 9p +
# tmpfs overlay, started by run.sh from scripts/vm/run.py): finishes the
# guest's set-up, then execs the command given as arguments.
#
# Set-up: kernel filesystems, the guest kernel's modules, the CXL region
# onlined as NUMA node 2, NVMe swap, numa_balancing=0. A step that fails
# prints KVTIER_SETUP_FAILED and exits 126 so run.py can tell a broken guest
# from a failing command.
set -uo pipefail

fail() {
    echo "KVTIER_SETUP_FAILED: $*"
    exit 126
}

# wait_for CONDITION... : poll up to 20 s times the guest's slowness (TCG is
# slow, more so on a busy host, and probing is async).
wait_for() {
    local i n
    n=$(awk -v f="${KVTIER_VM_SLOWNESS:-1}" 'BEGIN { printf "%d", 200 * f }')
    for ((i = 0; i < n; i++)); do
        "$@" && return 0
        sleep 0.1
    done
    return 1
}

mount_kernel_fs() {
    mkdir -p /dev/pts /dev/shm
    # No udev here: the links it would make that shells and Python rely on.
    ln -sf /proc/self/fd /dev/fd
    ln -sf /proc/self/fd/0 /dev/stdin
    ln -sf /proc/self/fd/1 /dev/stdout
    ln -sf /proc/self/fd/2 /dev/stderr
    mount -t devpts -o gid=5,mode=620 devpts /dev/pts
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    # No fresh tmpfs on /tmp: the overlay already makes it writable, and the
    # checkout under test may itself live in the host's /tmp (CI clones do).
    mount -t tmpfs -o mode=0755 tmpfs /run
    # Loopback starts down without an init system; the metrics exporter and
    # anything else on 127.0.0.1 need it.
    ip link set lo up 2>/dev/null || busybox ip link set lo up
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
    mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
    # The guest kernel's modules, unpacked on the host by prepare.sh, where
    # the host's modprobe (xz/zstd aware) finds them.
    mkdir -p "/lib/modules/$KVTIER_VM_KVER"
    mount --bind "$KVTIER_VM_MODULES" "/lib/modules/$KVTIER_VM_KVER" || fail "bind guest modules"
    hostname kvtier-guest
}

CXL=/sys/bus/cxl/devices
CXL_SIZE=${KVTIER_VM_CXL_BYTES:-268435456}

# Turn the CXL type-3 device's volatile capacity into a RAM region by hand,
# the way cxl-cli would (ndctl 76.1's `cxl create-region -t ram` fails on
# this kernel): allocate a region under the root decoder (the CFMWS window),
# size it, give the endpoint decoder DPA in ram mode, attach, commit, bind.
# dax_cxl then makes dax0.0 with the window's proximity node (2) and, since a
# CXL ram region's dax region is marked for kmem, kmem onlines it as
# movable memory: a CPU-less node in its own memory tier.
setup_cxl() {
    wait_for test -e "$CXL/decoder0.0/create_ram_region" || fail "no CXL root decoder (cxl_acpi)"
    local ep
    wait_for compgen -G "$CXL/endpoint*/decoder*.0" >/dev/null || fail "no CXL endpoint (cxl_mem)"
    ep=$(basename "$(compgen -G "$CXL/endpoint*/decoder*.0" | head -n1)")
    local r
    r=$(cat "$CXL/decoder0.0/create_ram_region") || fail "read create_ram_region"
    echo "$r" > "$CXL/decoder0.0/create_ram_region" || fail "create $r"
    echo 256 > "$CXL/$r/interleave_granularity" &&
        echo 1 > "$CXL/$r/interleave_ways" &&
        echo "$CXL_SIZE" > "$CXL/$r/size" || fail "size $r"
    echo ram > "$CXL/$ep/mode" &&
        echo "$CXL_SIZE" > "$CXL/$ep/dpa_size" || fail "give $ep DPA"
    echo "$ep" > "$CXL/$r/target0" || fail "attach $ep to $r"
    echo 1 > "$CXL/$r/commit" || fail "commit $r"
    echo "$r" > /sys/bus/cxl/drivers/cxl_region/bind || fail "bind $r"
    wait_for node2_has_memory || fail "CXL region $r did not come online as node 2"
}

node2_has_memory() {
    local kb
    kb=$(awk '/MemTotal/ {print $4}' /sys/devices/system/node/node2/meminfo 2>/dev/null)
    [ "${kb:-0}" -gt 0 ]
}

# The NVMe namespace is the swap tier: the policy pages blocks out to it.
setup_swap() {
    wait_for test -b /dev/nvme0n1 || fail "no NVMe namespace"
    mkswap -q /dev/nvme0n1 >/dev/null || fail "mkswap /dev/nvme0n1"
    swapon /dev/nvme0n1 || fail "swapon /dev/nvme0n1"
}

mount_kernel_fs
# How slow this guest runs on this host now (scripts/vm/speed.py): every
# wall-clock limit below and in the command scales by it, and run.py
# stretches the whole run's timeout by it (the KVTIER_SLOWNESS= line).
KVTIER_VM_SLOWNESS=$(python3 -S "$(dirname "${BASH_SOURCE[0]}")/speed.py" --report) || KVTIER_VM_SLOWNESS=1
export KVTIER_VM_SLOWNESS
# The Debian kernel boots with NUMA balancing on; tests need pages to stay
# where kvtier put them.
if [ "${KVTIER_VM_SHAPE:-default}" = two-socket ]; then
    # Two CPU nodes with far memory beside each (run.py --shape); no CXL.
    modprobe -a nvme || fail "modprobe"
    echo 0 > /proc/sys/kernel/numa_balancing
else
    modprobe -a nvme cxl_acpi cxl_pci cxl_mem dax_cxl device_dax kmem || fail "modprobe"
    echo 0 > /proc/sys/kernel/numa_balancing
    setup_cxl
fi
setup_swap
echo "KVTIER_SETUP_DONE"
exec "$@"
