#!/bin/bash
# Runs chrooted in the guest's root after guest_setup.sh (systemd mode; see
# init): makes the shared host root bootable by the host's own systemd and
# stores the command for the test unit. Arguments: the command; its
# environment and working directory are this script's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

# The development host is a container, and its /.dockerenv shows through the
# shared root: systemd would think it runs in a container and walk the host's
# /sys over 9p for minutes. The overlay hides it from the guest only.
rm -f /.dockerenv /run/.containerenv

# The guest is a machine of its own: a fresh identity, and none of the host's
# mounts (the root is already set up; swap is already on).
tr -d - < /proc/sys/kernel/random/uuid > /etc/machine-id
: > /etc/fstab

# Debian's tmp.conf ("D /tmp") makes systemd-tmpfiles --boot empty /tmp, which
# here is the host's /tmp through the overlay: minutes of 9p traffic, and the
# checkout under test may live there (CI clones do).
ln -sf /dev/null /etc/tmpfiles.d/tmp.conf

install -m 0644 "$here"/units/* /etc/systemd/system/

# The job the test unit runs: this environment (minus the shell's own
# variables), this directory, the command.
install -d -m 0755 /etc/kvtier-test
{
    echo "# written by $0"
    export -p | grep -Ev '^declare -x (OLDPWD|PWD|SHLVL|_)(=|$)'
    printf 'cd %q || exit 126\n' "$PWD"
    printf '%q ' "$@"
    echo
} > /etc/kvtier-test/job.sh
install -m 0755 "$here/job-wrapper.sh" /etc/kvtier-test/run
