#!/usr/bin/env bash
# Stop the cluster start.sh DIR started: cancel its jobs, then end its daemons by the pids in DIR
# (never by process name, other clusters may run on this host).
set -euo pipefail

[[ $# -eq 1 && $1 != -h && $1 != --help ]] || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$1
if [[ -f $dir/slurmctld.pid && -f $dir/slurm.conf ]]; then
    export SLURM_CONF=$dir/slurm.conf
    # job steps outlive slurmd, so cancel them while slurmd can still signal them
    scancel --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
fi
for name in slurmd slurmctld munged; do
    pidfile=$dir/$name.pid
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
done
