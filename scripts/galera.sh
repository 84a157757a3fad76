#!/usr/bin/env bash
# A three-node MariaDB Galera cluster on loopback, for tests and CI (issue 17).
#
#   scripts/galera.sh start    # install what is missing, bootstrap node 1, join nodes 2 and 3
#   scripts/galera.sh status   # each node's wsrep_cluster_size, wsrep_ready, state
#   scripts/galera.sh stop     # shut the three nodes down and remove their data
#   scripts/galera.sh kill-node N    # kill -9 node N's mariadbd (tests: a node lost mid-run)
#   scripts/galera.sh restart-node N # start node N again from its data: it recovers its
#                                    # position and rejoins (IST, or SST when it must)
#
# Node N (1-3) serves clients on 127.0.0.1:$((GALERA_BASE_PORT + N)) (default 23307-23309) as
# root without a password, database `test`; group communication on 127.0.0.1:2457N0, IST on
# 2457N1, SST (rsync) on 2457N2. Data, configs and logs live under $GALERA_DIR (default
# /tmp/nexuscrm-galera). It never touches the MariaDB on 3306: every node runs from its own
# --defaults-file.
set -euo pipefail

DIR=${GALERA_DIR:-/tmp/nexuscrm-galera}
BASE=${GALERA_BASE_PORT:-23306}
NODES=(1 2 3)

say() { printf 'galera: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

port() { echo $((BASE + $1)); }
gcomm() { echo $((24570 + $1 * 10)); }
sock() { echo "$DIR/node$1/mysqld.sock"; }
sql() { mariadb --no-defaults -uroot -S "$(sock "$1")" -N -B -e "$2"; }

install_missing() {
  local need=()
  command -v mariadbd >/dev/null || need+=(mariadb-server)
  dpkg -s galera-4 >/dev/null 2>&1 || need+=(galera-4)
  command -v rsync >/dev/null || need+=(rsync)
  command -v mariadb >/dev/null || need+=(mariadb-client)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    if [ "$(id -u)" = 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
    else
      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
    fi
  fi
}

provider() {
  local p
  p=$(dpkg -L galera-4 2>/dev/null | grep -m1 'libgalera_smm\.so$' || true)
  [ -n "$p" ] || die "libgalera_smm.so not found (is galera-4 installed?)"
  echo "$p"
}

write_config() {
  local n=$1 d="$DIR/node$1" addr=""
  for m in "${NODES[@]}"; do addr+="${addr:+,}127.0.0.1:$(gcomm "$m")"; done
  cat >"$d/my.cnf" <<CNF
[mysqld]
user=mysql
datadir=$d/data
socket=$(sock "$n")
port=$(port "$n")
bind-address=127.0.0.1
pid-file=$d/mysqld.pid
log-error=$d/error.log
skip-name-resolve
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=64M
innodb_log_file_size=48M
innodb_flush_log_at_trx_commit=2
max_connections=300
character-set-server=utf8mb4
collation-server=utf8mb4_general_ci
wsrep_on=ON
wsrep_provider=$(provider)
wsrep_cluster_name=nexuscrm-test
wsrep_cluster_address=gcomm://$addr
wsrep_node_name=node$n
wsrep_node_address=127.0.0.1
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$(gcomm "$n");ist.recv_addr=127.0.0.1:$(($(gcomm "$n") + 1))"
wsrep_sst_receive_address=127.0.0.1:$(($(gcomm "$n") + 2))
wsrep_sst_method=rsync
CNF
}

wait_for() { # node, what, test command..., within seconds
  local n=$1 what=$2 within=$3; shift 3
  for _ in $(seq 1 $((within * 2))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    if [ -f "$DIR/node$n/mysqld.pid" ] && ! kill -0 "$(cat "$DIR/node$n/mysqld.pid")" 2>/dev/null; then
      tail -n 30 "$DIR/node$n/error.log" >&2 || true
      die "node $n exited while waiting for $what"
    fi
    sleep 0.5
  done
  tail -n 30 "$DIR/node$n/error.log" >&2 || true
  die "node $n: no $what within ${within}s"
}

synced() { [ "$(sql "$1" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_local_state_comment'")" = Synced ]; }
ready() { [ "$(sql "$1" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_ready'")" = ON ]; }
size() { sql "$1" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_cluster_size'"; }

start_node() {
  local n=$1; shift
  setsid mariadbd --defaults-file="$DIR/node$n/my.cnf" "$@" </dev/null >>"$DIR/node$n/stdout.log" 2>&1 &
  wait_for "$n" "socket" 120 test -S "$(sock "$n")"
  wait_for "$n" "Synced state" 180 synced "$n"
  wait_for "$n" "wsrep_ready = ON" 60 ready "$n"
}

running() { [ -S "$(sock 1)" ] && sql 1 "SELECT 1" >/dev/null 2>&1; }

start() {
  if running && [ "$(size 1)" = 3 ]; then
    say "already running (cluster size 3)"
    return 0
  fi
  stop_nodes
  install_missing
  rm -rf "$DIR"
  for n in "${NODES[@]}"; do
    mkdir -p "$DIR/node$n/data"
    write_config "$n"
  done
  # The rsync SST daemon runs as the mysql user: it must be able to read and write every
  # node's directory.
  chown -R mysql:mysql "$DIR"
  mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/node1/data" \
    --auth-root-authentication-method=normal --skip-test-db >"$DIR/node1/install.log" 2>&1 ||
    { cat "$DIR/node1/install.log" >&2; die "mariadb-install-db failed"; }
  say "bootstrapping node 1 on 127.0.0.1:$(port 1)"
  start_node 1 --wsrep-new-cluster
  # TCP logins as root without a password, and the database tests use; replicated to the
  # joiners by their state transfer.
  sql 1 "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
         GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
         CREATE DATABASE IF NOT EXISTS test;"
  for n in 2 3; do
    say "joining node $n on 127.0.0.1:$(port "$n")"
    start_node "$n"
  done
  for n in "${NODES[@]}"; do
    local s; s=$(size "$n")
    [ "$s" = 3 ] || die "node $n sees a cluster of $s, not 3"
  done
  say "cluster ready: 3 nodes on 127.0.0.1:$(port 1),$(port 2),$(port 3)"
}

stop_nodes() {
  for n in 3 2 1; do
    local pidf="$DIR/node$n/mysqld.pid"
    [ -f "$pidf" ] || continue
    local pid; pid=$(cat "$pidf")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

status() {
  for n in "${NODES[@]}"; do
    if [ -S "$(sock "$n")" ] && sql "$n" "SELECT 1" >/dev/null 2>&1; then
      printf 'node %s 127.0.0.1:%s: cluster_size=%s ready=%s state=%s\n' "$n" "$(port "$n")" \
        "$(size "$n")" \
        "$(sql "$n" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_ready'")" \
        "$(sql "$n" "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'wsrep_local_state_comment'")"
    else
      printf 'node %s 127.0.0.1:%s: down\n' "$n" "$(port "$n")"
    fi
  done
}

kill_node() {
  local n=$1 pidf="$DIR/node$1/mysqld.pid"
  [ -f "$pidf" ] || die "node $n has no pid file (is it running?)"
  local pid; pid=$(cat "$pidf")
  kill -9 "$pid" 2>/dev/null || die "node $n (pid $pid) is not running"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  rm -f "$(sock "$n")" "$pidf"
  say "killed node $n (pid $pid)"
}

restart_node() {
  local n=$1 d="$DIR/node$1"
  [ -f "$d/my.cnf" ] || die "node $n has no configuration (start the cluster first)"
  # After kill -9 grastate.dat says seqno -1: recover the position InnoDB committed (what
  # galera_recovery does for systemd), so the node can rejoin by IST instead of a full SST.
  local log="$d/recover.log" pos
  mariadbd --defaults-file="$d/my.cnf" --wsrep-recover --log-error="$log" </dev/null >/dev/null 2>&1 || true
  pos=$(sed -n 's/.*WSREP: Recovered position: \(.*\)$/\1/p' "$log" 2>/dev/null | tail -n 1)
  say "restarting node $n${pos:+ from position $pos}"
  if [ -n "$pos" ]; then
    start_node "$n" --wsrep-start-position="$pos"
  else
    start_node "$n"
  fi
  say "node $n rejoined: cluster size $(size "$n")"
}

node_arg() {
  case "${1:-}" in 1|2|3) echo "$1" ;; *) die "a node number (1, 2 or 3) is required" ;; esac
}

case "${1:-}" in
  start) start ;;
  stop) stop_nodes; rm -rf "$DIR"; say "stopped" ;;
  status) status ;;
  kill-node) kill_node "$(node_arg "${2:-}")" ;;
  restart-node) restart_node "$(node_arg "${2:-}")" ;;
  *) echo "usage: $0 start|stop|status|kill-node N|restart-node N" >&2; exit 2 ;;
esac
