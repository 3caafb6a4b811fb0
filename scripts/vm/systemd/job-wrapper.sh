#!/bin/bash
# ExecStart of kvtier-test.service: runs the job prepare-root.sh stored, then
# reports its exit status the way run.py reads it (the share's exit_status
# file and a KVTIER_EXIT= line on the console). The unit's SuccessAction /
# FailureAction power the guest off after this returns.
echo "KVTIER_SYSTEMD_READY uptime=$(cut -d' ' -f1 /proc/uptime)s"
bash /etc/kvtier-test/job.sh
rc=$?
echo "$rc" > /mnt/kvtier/exit_status
sync
echo "KVTIER_EXIT=$rc"
exit "$rc"
