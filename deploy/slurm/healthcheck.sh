#!/bin/sh
# Slurm HealthCheckProgram (slurm.conf: HealthCheckProgram=/etc/slurm/ntp/healthcheck.sh,
# HealthCheckInterval=60). Slurm ignores the exit status: a check must drain the node itself.
# This one runs `ntp-agent health` and drains the node when it fails, with a reason that starts
# with "ntp-agent health:"; when the node is healthy again it resumes the node, but only a node
# drained with that reason. A node drained for any other reason (an operator, ntp-manager) is
# left alone either way. Settings: ntp-slurm.env beside this script (ntp-slurm.env.example).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
here=$(dirname "$0")
[ -r "$here/ntp-slurm.env" ] && . "$here/ntp-slurm.env"
[ -n "${SLURM_CONF:-}" ] && export SLURM_CONF
[ -n "${NTP_AGENT_STATE_FILE:-}" ] && export NTP_AGENT_STATE_FILE
PREFIX="ntp-agent health:"
node=${SLURMD_NODENAME:-$(hostname -s)}

out=$("${NTP_AGENT:-ntp-agent}" health --node "$node" ${NTP_HEALTH_ARGS:---agent-only} 2>&1)
rc=$?
line=$(printf '%s\n' "$out" | head -n 1 | sed 's/^unhealthy: //' | tr -d '|' | cut -c 1-200)
current=$(sinfo -h -N -n "$node" -t drain -o "%E" 2>/dev/null | head -n 1)
log() { [ -n "${NTP_SLURM_LOG:-}" ] && printf '%s healthcheck %s: %s\n' "$(date +%FT%T)" "$node" "$*" >> "$NTP_SLURM_LOG"; }

if [ "$rc" -ne 0 ]; then
    case "$current" in
        "" | "$PREFIX"*)
            scontrol update NodeName="$node" State=DRAIN Reason="$PREFIX $line" && log "drained: $line" ;;
        *) log "unhealthy ($line); already drained by someone else: $current" ;;
    esac
else
    case "$current" in
        "$PREFIX"*) scontrol update NodeName="$node" State=RESUME && log "resumed: $line" ;;
        *) log "$line" ;;
    esac
fi
exit 0
