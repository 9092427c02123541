#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ntp/prolog.sh): before a job starts on a node, the
# node's agent must be running and heard by the manager (`ntp-agent health`), or the manager could
# not see its GPUs fail. A non-zero exit has Slurm drain the node and requeue the job.
# Settings: ntp-slurm.env beside this script (ntp-slurm.env.example).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
here=$(dirname "$0")
[ -r "$here/ntp-slurm.env" ] && . "$here/ntp-slurm.env"
[ -n "${NTP_AGENT_STATE_FILE:-}" ] && export NTP_AGENT_STATE_FILE
node=${SLURMD_NODENAME:-$(hostname -s)}
out=$("${NTP_AGENT:-ntp-agent}" health --node "$node" ${NTP_HEALTH_ARGS:---agent-only} 2>&1)
rc=$?
[ -n "${NTP_SLURM_LOG:-}" ] && printf '%s prolog %s job %s: %s\n' "$(date +%FT%T)" "$node" "${SLURM_JOB_ID:-}" \
    "$(printf '%s' "$out" | head -n 1)" >> "$NTP_SLURM_LOG"
[ "$rc" -eq 0 ] || { printf 'ntp prolog: %s\n' "$out" >&2; exit 1; }
exit 0
