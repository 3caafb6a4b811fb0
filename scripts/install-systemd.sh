#!/bin/sh
# Install kvtierd's systemd units, sysusers/tmpfiles snippets and the sample
# config (only if /etc/kvtierd/kvtierd.toml does not exist yet), then reload
# systemd. Run as root from a checkout where kvtier is installed.
#
#   scripts/install-systemd.sh [--root DIR] [--kvtierd PATH] [--enable]
#
# --root DIR     install below DIR instead of / (packaging, tests); does not
#                run systemctl/systemd-sysusers/systemd-tmpfiles
# --kvtierd PATH the kvtierd executable (default: `command -v kvtierd`, else
#                this checkout's .venv/bin/kvtierd)
# --enable       also `systemctl enable --now kvtierd.socket kvtierd.service`
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
root=""
kvtierd=""
enable=0
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root=$2; shift 2 ;;
        --kvtierd) kvtierd=$2; shift 2 ;;
        --enable) enable=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "install-systemd.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [ -z "$kvtierd" ]; then
    kvtierd=$(command -v kvtierd 2>/dev/null || echo "$here/.venv/bin/kvtierd")
fi
if [ ! -x "$kvtierd" ]; then
    echo "install-systemd.sh: $kvtierd is not executable (pip install kvtier first, or pass --kvtierd)" >&2
    exit 1
fi
case "$kvtierd" in /*) ;; *) kvtierd=$(cd "$(dirname "$kvtierd")" && pwd)/$(basename "$kvtierd") ;; esac

unitdir=$root/etc/systemd/system
install -d -m 0755 "$unitdir" "$root/etc/sysusers.d" "$root/etc/tmpfiles.d" "$root/etc/kvtierd"
sed "s#^ExecStart=/usr/local/bin/kvtierd #ExecStart=$kvtierd #" "$here/systemd/kvtierd.service" \
    > "$unitdir/kvtierd.service"
chmod 0644 "$unitdir/kvtierd.service"
install -m 0644 "$here/systemd/kvtierd.socket" "$unitdir/kvtierd.socket"
install -m 0644 "$here/systemd/sysusers.d/kvtier.conf" "$root/etc/sysusers.d/kvtier.conf"
install -m 0644 "$here/systemd/tmpfiles.d/kvtierd.conf" "$root/etc/tmpfiles.d/kvtierd.conf"

# ProtectHome=yes hides /root and /home; a kvtierd (or the Python it runs on,
# e.g. pyenv or a venv) living there needs them visible, read-only.
real=$(readlink -f "$kvtierd")
interp=$(head -n1 "$kvtierd" | sed -n 's/^#! *\([^ ]*\).*/\1/p')
[ -n "$interp" ] && interp=$(readlink -f "$interp")
dropin=$unitdir/kvtierd.service.d/10-home.conf
case "$kvtierd $real $interp" in
    */root/*|*/home/*)
        install -d -m 0755 "$unitdir/kvtierd.service.d"
        printf '# written by install-systemd.sh: kvtierd or its Python lives under /root or /home\n[Service]\nProtectHome=read-only\n' > "$dropin"
        chmod 0644 "$dropin" ;;
    *) rm -f "$dropin" ;;
esac
# PrivateTmp=yes gives the service an empty /tmp and /var/tmp; a kvtierd
# installed from a checkout there (CI clones into mktemp -d) would vanish
# (status=203/EXEC, seen in the systemd guest). Keep the host's /tmp then.
tmpdropin=$unitdir/kvtierd.service.d/10-tmp.conf
case "$kvtierd $real $interp" in
    */tmp/*)
        install -d -m 0755 "$unitdir/kvtierd.service.d"
        printf '# written by install-systemd.sh: kvtierd or its Python lives under /tmp or /var/tmp\n[Service]\nPrivateTmp=no\n' > "$tmpdropin"
        chmod 0644 "$tmpdropin" ;;
    *) rm -f "$tmpdropin" ;;
esac

if [ -e "$root/etc/kvtierd/kvtierd.toml" ]; then
    echo "keeping existing $root/etc/kvtierd/kvtierd.toml"
else
    install -m 0644 "$here/systemd/kvtierd.toml" "$root/etc/kvtierd/kvtierd.toml"
fi
"$kvtierd" --check-config --config "$root/etc/kvtierd/kvtierd.toml"

if [ -z "$root" ]; then
    systemd-sysusers /etc/sysusers.d/kvtier.conf
    systemd-tmpfiles --create /etc/tmpfiles.d/kvtierd.conf
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        if [ "$enable" = 1 ]; then
            systemctl enable --now kvtierd.socket kvtierd.service
        fi
    else
        echo "systemd is not running: units installed, not loaded"
    fi
fi
echo "installed kvtierd units for $kvtierd below ${root:-/}"
[ "$enable" = 1 ] || echo "start with: systemctl enable --now kvtierd.socket kvtierd.service"
