#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the `slurm`-marked tests and for trying the
# `slurm` and `sbatch` profiles without a real cluster. Run as root (it starts the daemons as
# root, as background processes: no systemd needed).
#
#   workflow/slurm/local-cluster.sh install   # apt-get the Debian packages (slurmctld slurmd
#                                             # slurm-client munge slurmdbd mariadb-server)
#   workflow/slurm/local-cluster.sh start     # munged, MariaDB, slurmdbd, slurmctld, slurmd
#   workflow/slurm/local-cluster.sh status    # sinfo and the daemons' pids
#   workflow/slurm/local-cluster.sh env       # the line to eval in a client shell
#   workflow/slurm/local-cluster.sh stop
#
# Everything (configs, state, spool, logs, the accounting database) lives under
# $PACO_SLURM_DIR (default /tmp/paco-slurm). The one file outside it is /etc/slurm/slurm.conf, a
# link to the cluster's config: jobs of the slurm executor plugin drop every SLURM_* variable
# (SLURM_CONF included) before their `srun`, which then only finds the standard location. A
# slurm.conf that is not this script's link is never replaced (start fails instead). Accounting (slurmdbd on a private MariaDB) is on, so `sacct` answers as on a real
# cluster; PACO_SLURM_ACCOUNTING=0 starts without it (the slurm profile then needs
# `slurm-status-command: squeue`).
#
# The node is the machine as `slurmd -C` reports it, with select/cons_tres CR_Core_Memory and
# DefMemPerCPU, so jobs share the node by cores and memory (without DefMemPerCPU one job takes
# all the memory and jobs run one at a time). ProctrackType=proctrack/linuxproc and
# TaskPlugin=task/none: no cgroups, which containers rarely delegate.
set -euo pipefail

DIR="${PACO_SLURM_DIR:-/tmp/paco-slurm}"
ACCOUNTING="${PACO_SLURM_ACCOUNTING:-1}"
CTLD_PORT="${PACO_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${PACO_SLURM_SLURMD_PORT:-6818}"
DBD_PORT="${PACO_SLURM_DBD_PORT:-6819}"
DB_PORT="${PACO_SLURM_DB_PORT:-3307}"
ACCOUNT="${PACO_SLURM_ACCOUNT:-paco}"
DEF_MEM_PER_CPU="${PACO_SLURM_DEF_MEM_PER_CPU:-1000}"
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

log() { echo "local-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (the daemons run as root without systemd)"; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds
  local limit="$1" what="$2"; shift 2
  local t=0
  until "$@" >/dev/null 2>&1; do
    t=$((t + 1))
    if [ "$t" -ge $((limit * 2)) ]; then
      die "$what did not come up within ${limit}s (logs in $DIR/log)"
    fi
    sleep 0.5
  done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cmd_install() {
  need_root
  # Debian's policy-rc.d (containers) keeps the packages from starting their services
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; }
}

write_configs() {
  local node host
  host="$(hostname -s)"  # the daemons talk over 127.0.0.1: the host name need not resolve
  # "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105" (the UpTime line dropped); leave 10% of
  # the memory to the system so slurmd's own check never drains the node
  node="$(slurmd -C | head -n 1)"
  local mem
  mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")"
  node="$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem * 9 / 10))/" <<<"$node")"
  mkdir -p "$DIR"/{state,spool,log,run}
  cat >"$DIR/slurm.conf" <<EOF
# written by workflow/slurm/local-cluster.sh
ClusterName=paco
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$DEF_MEM_PER_CPU
SchedulerType=sched/backfill
# schedule pending jobs within seconds (defaults: 60 s main loop, 30 s backfill), as a test
# cluster of short jobs needs
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
MinJobAge=300
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=2
JobAcctGatherParams=OverMemoryKill
EOF
  if [ "$ACCOUNTING" = 1 ]; then
    cat >>"$DIR/slurm.conf" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoreFlags=job_comment
EOF
    # slurmdbd reads slurmdbd.conf beside SLURM_CONF; it must be private to SlurmUser
    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/slurmdbd.conf"
  else
    echo "AccountingStorageType=accounting_storage/none" >>"$DIR/slurm.conf"
  fi
  cat >>"$DIR/slurm.conf" <<EOF
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  if pgrep -x munged >/dev/null; then
    return
  fi
  [ -s /etc/munge/munge.key ] || die "no /etc/munge/munge.key (install the munge package: $0 install)"
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
  else
    /usr/sbin/munged --force
  fi
  wait_for 10 munged munge -n
}

start_database() {
  local db="$DIR/db"
  if [ ! -d "$db/mysql" ]; then
    mariadb-install-db --user=root --datadir="$db" --auth-root-authentication-method=socket \
      >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: $DIR/log/mariadb-install.log"
  fi
  if ! pid_alive "$DIR/run/mariadb.pid"; then
    nohup mariadbd --no-defaults --user=root --datadir="$db" --socket="$DIR/run/mariadb.sock" \
      --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/run/mariadb.pid" \
      --log-error="$DIR/log/mariadb.log" --skip-log-bin --innodb-buffer-pool-size=64M \
      >/dev/null 2>&1 &
  fi
  wait_for 30 MariaDB mariadb --no-defaults --socket="$DIR/run/mariadb.sock" -e "SELECT 1"
  mariadb --no-defaults --socket="$DIR/run/mariadb.sock" <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

SYSTEM_CONF=/etc/slurm/slurm.conf

link_config() {  # /etc/slurm/slurm.conf -> $DIR/slurm.conf, never over a foreign config
  if [ -e "$SYSTEM_CONF" ] || [ -L "$SYSTEM_CONF" ]; then
    if [ "$(readlink "$SYSTEM_CONF" || true)" != "$DIR/slurm.conf" ]; then
      if [ -L "$SYSTEM_CONF" ] && grep -q "written by workflow/slurm/local-cluster.sh" "$SYSTEM_CONF" 2>/dev/null; then
        :  # another state dir of this script: relink below
      elif [ -L "$SYSTEM_CONF" ] && [ ! -e "$SYSTEM_CONF" ]; then
        :  # a dangling link (a removed state dir of this script)
      else
        die "$SYSTEM_CONF exists and is not this script's link: a real SLURM installation? (not replaced)"
      fi
    fi
  fi
  mkdir -p "$(dirname "$SYSTEM_CONF")"
  ln -sfn "$DIR/slurm.conf" "$SYSTEM_CONF"
}

cmd_start() {
  need_root
  command -v slurmctld >/dev/null || die "slurmctld not found: run '$0 install' first"
  if pid_alive "$DIR/run/slurmctld.pid"; then
    log "already running ($DIR)"
    cmd_status
    return
  fi
  local t0=$SECONDS
  write_configs
  export SLURM_CONF="$DIR/slurm.conf"
  start_munge
  if [ "$ACCOUNTING" = 1 ]; then
    start_database
    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster paco >/dev/null 2>&1 || true
    sacctmgr -i add account "$ACCOUNT" Description=paco Organization=paco >/dev/null 2>&1 || true
    sacctmgr -i add user "$(id -un)" Account="$ACCOUNT" DefaultAccount="$ACCOUNT" >/dev/null 2>&1 || true
  fi
  link_config
  slurmctld
  wait_for 30 slurmctld scontrol ping
  slurmd
  # the node answers and is idle (not down/drained)
  wait_for 30 "slurmd (node idle)" bash -c "sinfo -h -N -o %t | grep -qx idle"
  log "up in $((SECONDS - t0)) s; clients: export SLURM_CONF=$SLURM_CONF"
  cmd_status
}

cmd_stop() {
  need_root
  local name
  for name in slurmd slurmctld slurmdbd mariadb; do
    if pid_alive "$DIR/run/$name.pid"; then
      kill "$(cat "$DIR/run/$name.pid")" 2>/dev/null || true
    fi
  done
  # wait for the daemons to exit (slurmctld saves its state first)
  for name in slurmd slurmctld slurmdbd mariadb; do
    local t=0
    while pid_alive "$DIR/run/$name.pid" && [ "$t" -lt 40 ]; do sleep 0.5; t=$((t + 1)); done
  done
  if [ "$(readlink "$SYSTEM_CONF" 2>/dev/null || true)" = "$DIR/slurm.conf" ]; then
    rm -f "$SYSTEM_CONF"
  fi
  log "stopped (state kept in $DIR; remove it for a fresh cluster)"
}

cmd_status() {
  export SLURM_CONF="$DIR/slurm.conf"
  [ -f "$SLURM_CONF" ] || { log "not configured ($DIR)"; return 1; }
  local name ok=0
  for name in slurmctld slurmd slurmdbd mariadb; do
    if pid_alive "$DIR/run/$name.pid"; then
      echo "$name: running (pid $(cat "$DIR/run/$name.pid"))"
    else
      echo "$name: not running"
      case "$name" in slurmdbd|mariadb) [ "$ACCOUNTING" = 1 ] && ok=1 ;; *) ok=1 ;; esac
    fi
  done
  sinfo -N -l || ok=1
  return "$ok"
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
