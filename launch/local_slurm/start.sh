#!/usr/bin/env bash
# Start a throwaway single-node slurm cluster (munged, slurmctld, slurmd) whose config, state, logs,
# munge key and socket all live in DIR, so it never touches /etc/slurm or a system munged.
# Needs root and the Debian packages slurm-wlm and munge. Stop it with stop.sh DIR.
set -euo pipefail

usage="usage: $0 DIR   (then: export SLURM_CONF=DIR/slurm.conf; stop with $(dirname "$0")/stop.sh DIR)"
[[ $# -eq 1 && $1 != -h && $1 != --help ]] || { echo "$usage" >&2; exit 2; }
for bin in munged slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || { echo "$0: $bin not found; install with: apt-get install -y slurm-wlm munge" >&2; exit 3; }
done
[[ $(id -u) -eq 0 ]] || { echo "$0: must run as root (SlurmUser=root, slurmd launches jobs)" >&2; exit 3; }

mkdir -p "$1"
dir=$(cd "$1" && pwd)
chmod 700 "$dir"  # munged refuses keys and sockets in group/world-writable directories
mkdir -p "$dir/state" "$dir/spool" "$dir/log"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
host=$(hostname -s)
# the node's real CPU layout as slurmd detects it (nproc would follow OMP_NUM_THREADS); without
# RealMemory, which is not enforced here and would drain the node should slurmd see a little less
hardware=$(slurmd -C | head -n 1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ RealMemory=[0-9]*//')
ctld_port=${SLURMCTLD_PORT:-$(free_port)}
slurmd_port=${SLURMD_PORT:-$(free_port)}

[[ -f $dir/munge.key ]] || { dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none; chmod 600 "$dir/munge.key"; }

cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
# completed jobs are forgotten after 4 s, so sbatch --wait keeps polling every 2 s (it backs off to
# 32 s while MinJobAge, default 300 s, allows), returning about when the job ends
MinJobAge=4
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host $hardware State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf

fail() {
    echo "$0: $1; logs in $dir/log:" >&2
    tail -n 20 "$dir"/log/*.log >&2 || true
    "$(dirname "$0")/stop.sh" "$dir"
    exit 1
}
# --force: munged refuses to run as root without it
munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" || fail "munged did not start"
slurmctld -c || fail "slurmctld did not start"  # -c: drop jobs left by an earlier run in DIR
slurmd || fail "slurmd did not start"

for _ in $(seq 60); do
    if [[ $(sinfo -h -N -n "$host" -o %T 2>/dev/null) == idle ]]; then
        echo "slurm up: export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
fail "node $host not idle after 30 s"
