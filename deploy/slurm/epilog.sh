#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/ntp/epilog.sh): after a job, every GPU of the node
# goes back to the fleet base cap (`ntp-agent power-reset`), so a boost given to a reduced TP group
# never outlives the job, even when the manager cannot be reached. NTP_EPILOG_DRY_RUN=1 only says
# what it would set. A limit that cannot be set exits non-zero: Slurm drains the node.
# Settings: ntp-slurm.env beside this script (ntp-slurm.env.example).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
here=$(dirname "$0")
[ -r "$here/ntp-slurm.env" ] && . "$here/ntp-slurm.env"
node=${SLURMD_NODENAME:-$(hostname -s)}
set -- --backend "${NTP_POWER_BACKEND:-nvml}"
[ -n "${NTP_POWER_SCENARIO:-}" ] && set -- "$@" --scenario "$NTP_POWER_SCENARIO"
[ -n "${NTP_BASE_CAP:-}" ] && set -- "$@" --base-cap "$NTP_BASE_CAP"
[ "${NTP_EPILOG_DRY_RUN:-0}" = 1 ] && set -- "$@" --dry-run
out=$("${NTP_AGENT:-ntp-agent}" power-reset "$@" 2>&1)
rc=$?
if [ -n "${NTP_SLURM_LOG:-}" ]; then
    printf '%s\n' "$out" | sed "s/^/$(date +%FT%T) epilog $node job ${SLURM_JOB_ID:-}: /" >> "$NTP_SLURM_LOG"
fi
[ "$rc" -eq 0 ] || printf 'ntp epilog: %s\n' "$out" >&2
exit "$rc"
