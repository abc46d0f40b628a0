#!/usr/bin/env bash
# A real SLURM cluster on one Debian host for megarl's launch tier (tests/launch): a private munged,
# slurmctld and NUM_NODES slurmd daemons, "fake nodes" n1..nN with their own slurmd port and their
# own loopback address (NodeAddr 127.0.0.2, 127.0.0.3, ...: a job that mixes up the nodes'
# addresses fails here as it would on a real cluster), one partition, no accounting.
#
#   tools/slurm_ci/cluster.sh start    install packages if missing, write slurm.conf, start, wait idle
#   tools/slurm_ci/cluster.sh status   sinfo and the daemons' pids
#   tools/slurm_ci/cluster.sh stop     stop exactly the daemons this script started (pid files)
#   . $BASE/env.sh                     afterwards: SLURM_CONF for sbatch/srun/squeue/scontrol
#
# Knobs: BASE (required, a short path: munge's socket lives there)  NUM_NODES=2  CTLD_PORT=6817
#        SLURMD_PORT=6818 (first node; the next nodes take the next ports)  CPUS_PER_NODE=<real>
#        MEM_MB=4000  KILL_WAIT=30  SKIP_APT=0
# Recipe (learned on these machines, Debian 12, slurm-wlm 22.05):
#  - munged runs as user munge with its own key and socket; slurm.conf points at it (AuthInfo).
#  - several slurmd on one host need %n in spool/pid/log paths and TmpFS=<dir>/%n (srun --mpi=pmix
#    puts per-step directories there; a shared /tmp makes the nodes collide).
#  - proctrack/linuxproc + task/none: no cgroups inside a container.
#  - hetjobs start only from the backfill scheduler: bf_interval=1 keeps them fast.
#  - scontrol requeue sets BeginTime=now+~2min: `scontrol update jobid=J StartTime=now` pulls it in
#    (in the second of the requeue it fails the job: "Job credential revoked"; a future StartTime
#    is not acted on until the scheduler's next periodic pass).
#  - KillWait is the grace between a job's SIGTERM and SIGKILL: a preempted trainer saves within it.
set -euo pipefail

: "${BASE:?set BASE to the work directory of the cluster}"
NUM_NODES=${NUM_NODES:-2}
CTLD_PORT=${CTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
CPUS_PER_NODE=${CPUS_PER_NODE:-}
MEM_MB=${MEM_MB:-4000}
KILL_WAIT=${KILL_WAIT:-30}
SKIP_APT=${SKIP_APT:-0}
CONF=$BASE/etc/slurm.conf
RUN=$BASE/run
LOG=$BASE/log
MUNGE_DIR=$BASE/munge
MUNGE_SOCK=$MUNGE_DIR/munge.socket.2
say() { echo "[slurm_ci] $*"; }

# is_ours PIDFILE PATTERN: the pid in the file is alive and its command line matches PATTERN
is_ours() {
  local f=$1 pat=$2 pid
  [ -s "$f" ] || return 1
  pid=$(cat "$f")
  [ -d "/proc/$pid" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$pat"
}
stop_pidfile() {  # stop_pidfile FILE PATTERN
  local f=$1 pat=$2 pid
  if is_ours "$f" "$pat"; then
    pid=$(cat "$f")
    say "stopping $(basename "$f" .pid) (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 150); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    if [ -d "/proc/$pid" ]; then say "  SIGKILL $pid"; kill -KILL "$pid"; fi
  fi
  rm -f "$f"
}
stop_all() {
  if is_ours "$RUN/slurmctld.pid" "slurmctld -f $CONF"; then
    SLURM_CONF=$CONF scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    sleep 1
  fi
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" "slurmd -f $CONF"; done
  stop_pidfile "$RUN/slurmctld.pid" "slurmctld -f $CONF"
  stop_pidfile "$RUN/munged.pid" "munged.*$MUNGE_SOCK"
}

case "${1:-start}" in
  stop) stop_all; exit 0 ;;
  status)
    for f in "$RUN"/*.pid; do [ -e "$f" ] && echo "$(basename "$f" .pid) $(cat "$f")"; done
    SLURM_CONF=$CONF sinfo -N -l || true
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|status|stop]" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || { echo "$0: must run as root (munged runs as user munge)" >&2; exit 1; }
mkdir -p "$BASE"/{etc,run,log,state/ctld}
chmod o+x "$BASE"  # munged runs as user munge and must reach its directory (mktemp -d gives 0700)

# ------------------------------------------------------------------ packages
PKGS=(slurmctld slurmd slurm-client munge libpmix-dev)  # libpmix.so: srun --mpi=pmix
if [ "$SKIP_APT" != 1 ]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$BASE/apt-install.log" 2>&1 \
      || { tail -30 "$BASE/apt-install.log"; exit 1; }
  fi
fi

# ------------------------------------------------------------------ munge (a private instance)
install -d -o munge -g munge -m 0711 "$MUNGE_DIR"
if [ ! -s "$MUNGE_DIR/munge.key" ]; then
  dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1 count=1024 status=none
  chown munge:munge "$MUNGE_DIR/munge.key"
  chmod 0400 "$MUNGE_DIR/munge.key"
fi
if ! is_ours "$RUN/munged.pid" "munged.*$MUNGE_SOCK"; then
  say "starting munged"
  rm -f "$MUNGE_DIR/munged.pid"
  runuser -u munge -- /usr/sbin/munged --force \
    --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed"
  for _ in $(seq 50); do [ -s "$MUNGE_DIR/munged.pid" ] && break; sleep 0.1; done
  cp "$MUNGE_DIR/munged.pid" "$RUN/munged.pid"
fi
munge -S "$MUNGE_SOCK" -n | unmunge -S "$MUNGE_SOCK" >/dev/null || { echo "munge self-test failed" >&2; exit 1; }

# ------------------------------------------------------------------ slurm.conf
HOST=$(hostname -s)
HW=$(slurmd -C | head -1 | grep -o 'CPUs=[0-9]* Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*')
EXTRA=""
if [ -n "$CPUS_PER_NODE" ]; then HW="CPUs=$CPUS_PER_NODE"; EXTRA="SlurmdParameters=config_overrides"; fi
cat >"$CONF.new" <<EOF
# generated by tools/slurm_ci/cluster.sh
ClusterName=megarlci
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${MUNGE_SOCK}
SlurmctldPort=${CTLD_PORT}
StateSaveLocation=${BASE}/state/ctld
SlurmdSpoolDir=${BASE}/state/slurmd-%n
SlurmctldPidFile=${RUN}/slurmctld.pid
SlurmdPidFile=${RUN}/slurmd-%n.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS=${BASE}/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=${KILL_WAIT}
MailProg=/bin/true
${EXTRA}
EOF
for i in $(seq 1 "$NUM_NODES"); do
  echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.$((i + 1)) Port=$((SLURMD_PORT + i - 1)) $HW RealMemory=$MEM_MB State=UNKNOWN" >>"$CONF.new"
  mkdir -p "$BASE/state/slurmd-n$i" "$BASE/tmp/n$i"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF.new"
if ! cmp -s "$CONF.new" "$CONF"; then
  mv "$CONF.new" "$CONF"
  say "wrote $CONF; restarting daemons that run an older one"
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" "slurmd -f $CONF"; done
  stop_pidfile "$RUN/slurmctld.pid" "slurmctld -f $CONF"
else
  rm -f "$CONF.new"
fi
export SLURM_CONF=$CONF

# ------------------------------------------------------------------ daemons
if ! is_ours "$RUN/slurmctld.pid" "slurmctld -f $CONF"; then say "starting slurmctld"; slurmctld -f "$CONF"; fi
for i in $(seq 1 "$NUM_NODES"); do
  if ! is_ours "$RUN/slurmd-n$i.pid" "slurmd -f $CONF -N n$i"; then say "starting slurmd n$i"; slurmd -f "$CONF" -N "n$i"; fi
done
states=""
for _ in $(seq 300); do
  states=$(sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
  [ "$states" = "idle " ] && break
  sleep 0.1
done
if [ "$states" != "idle " ]; then
  echo "nodes not idle: $states" >&2
  sinfo -N -l >&2 || true
  tail -20 "$LOG/slurmctld.log" >&2
  exit 1
fi
echo "export SLURM_CONF=$CONF" >"$BASE/env.sh"
say "cluster up: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')"
