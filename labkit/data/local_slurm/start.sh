#!/usr/bin/env bash
# Start a real Slurm on this host: munged, slurmctld and one slurmd per emulated node (n1..nN), with fake typed GPUs.
# Installs the Debian packages first when they are missing (root only). Idempotent: daemons already running with the
# same configuration are left alone; a changed configuration restarts them. Prints the line that points clients at it:
#   export SLURM_CONF=<runtime dir>/etc/slurm.conf
# Settings: see common.sh. Stop with stop.sh (same environment).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"

install_packages() {
    local missing=() packages=(slurmctld slurmd slurm-client munge)
    local tool
    for tool in munged slurmctld slurmd sbatch; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    if [ "$ACCOUNTING" = 1 ]; then
        packages+=(slurmdbd mariadb-server)
        for tool in slurmdbd mariadbd mariadb-install-db; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "Slurm is not installed (${missing[*]} missing) and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed (${missing[*]} missing) and there is no apt-get to install it"
    say "installing ${packages[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
}

write_config() {
    local dir=$1 k name gres gpu_type gpu_count
    {
        echo "# Written by labkit slurm up (labkit/data/local_slurm/start.sh); rewritten on every start."
        echo "ClusterName=local"
        echo "SlurmctldHost=$HOST(127.0.0.1)"
        echo "SlurmctldPort=$CTLD_PORT"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$MUNGE/munge.socket.2"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$SLURM_DIR/state/ctld"
        echo "SlurmdSpoolDir=$SLURM_DIR/state/d/%n"
        echo "SlurmctldPidFile=$RUN/slurmctld.pid"
        echo "SlurmdPidFile=$RUN/slurmd-%n.pid"
        echo "SlurmctldLogFile=$LOG/slurmctld.log"
        echo "SlurmdLogFile=$LOG/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        # Heterogeneous jobs are started only by the backfill scheduler: look every 2 s rather than every 30 s.
        echo "SchedulerParameters=bf_interval=2"
        # Emulated nodes declare more CPUs than the host has.
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        # Impossible requests are rejected at submit time instead of pending forever.
        echo "EnforcePartLimits=ALL"
        # A job whose afterok dependency failed is cancelled rather than left pending.
        echo "DependencyParameters=kill_invalid_depend"
        # Cancelled or timed-out jobs get SIGTERM, then SIGKILL this many seconds later.
        echo "KillWait=5"
        echo "MailProg=/bin/true"
        echo "MinJobAge=300"
        if [ "$ACCOUNTING" = 1 ]; then
            echo "AccountingStorageType=accounting_storage/slurmdbd"
            echo "AccountingStorageHost=localhost"
            echo "AccountingStoragePort=$DBD_PORT"
            # for slurmdbd connections the munge socket is named here, not by AuthInfo
            echo "AccountingStoragePass=$MUNGE/munge.socket.2"
        else
            echo "AccountingStorageType=accounting_storage/none"
        fi
        echo "JobCompType=jobcomp/filetxt"
        echo "JobCompLoc=$LOG/jobcomp.txt"
        echo "GresTypes=gpu"
        for k in "${!NODE_NAMES[@]}"; do
            name=${NODE_NAMES[$k]}
            gres=${NODE_GRES[$k]}
            echo "NodeName=$name NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 10001 + k))" \
                "CPUs=$CPUS_PER_NODE RealMemory=$MEMORY_MB${gres:+ Gres=$gres} State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$dir/slurm.conf"
    {
        # Typed GPUs need one character device per GPU (regular files or CountOnly leave the node INVAL).
        echo "AutoDetect=off"
        for k in "${!NODE_NAMES[@]}"; do
            name=${NODE_NAMES[$k]}
            gres=${NODE_GRES[$k]}
            [ -n "$gres" ] || continue
            IFS=: read -r _ gpu_type gpu_count <<<"$gres"
            echo "NodeName=$name Name=gpu Type=$gpu_type File=$SLURM_DIR/dev/$name-gpu[0-$((gpu_count - 1))]"
        done
    } >"$dir/gres.conf"
    # slurmdbd reads slurmdbd.conf beside slurm.conf and refuses one that others can read (it holds the password of
    # the database it alone uses).
    if [ "$ACCOUNTING" = 1 ]; then
        {
            echo "AuthType=auth/munge"
            echo "AuthInfo=socket=$MUNGE/munge.socket.2"
            echo "DbdHost=localhost"
            echo "DbdPort=$DBD_PORT"
            echo "SlurmUser=root"
            echo "PidFile=$RUN/slurmdbd.pid"
            echo "LogFile=$LOG/slurmdbd.log"
            echo "StorageType=accounting_storage/mysql"
            echo "StorageHost=127.0.0.1"
            echo "StoragePort=$DB_PORT"
            echo "StorageUser=slurm"
            echo "StoragePass=labkit-local"
            echo "StorageLoc=slurm_acct_db"
        } >"$dir/slurmdbd.conf"
        chmod 0600 "$dir/slurmdbd.conf"
    fi
}

wait_for() {
    local what=$1 deadline=$((SECONDS + 30))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what did not come up within 30 s; see $LOG"
        sleep 0.25
    done
}

# MariaDB for slurmdbd, private to this runtime dir: its own data dir, socket and port, root by socket only.
start_database() {
    live_pid "$RUN/mariadbd.pid" >/dev/null && return 0
    if [ ! -d "$DB/data/mysql" ]; then
        mkdir -p "$DB/data"
        mariadb-install-db --user=root --datadir="$DB/data" --auth-root-authentication-method=socket --skip-test-db \
            >"$LOG/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $LOG/mariadb-install.log"
    fi
    port_busy "$DB_PORT" && die "port $DB_PORT (MariaDB for slurmdbd) is taken; set LABKIT_SLURM_PORT"
    rm -f "$DB/mysqld.sock"
    mariadbd --user=root --datadir="$DB/data" --socket="$DB/mysqld.sock" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --skip-name-resolve --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" 9>&- 2>>"$LOG/mariadbd.log" &
    wait_for "MariaDB" mariadb --socket="$DB/mysqld.sock" -u root -e "SELECT 1"
    mariadb --socket="$DB/mysqld.sock" -u root -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'labkit-local';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    live_pid "$RUN/slurmdbd.pid" >/dev/null && return 0
    port_busy "$DBD_PORT" && die "port $DBD_PORT (slurmdbd) is taken by another program; set LABKIT_SLURM_PORT"
    SLURM_CONF=$CONF slurmdbd 9>&-
    wait_for "slurmdbd" sacctmgr -n list cluster
}

make_fake_gpus() {
    local k name gres gpu_count i
    mkdir -p "$SLURM_DIR/dev"
    for k in "${!NODE_NAMES[@]}"; do
        name=${NODE_NAMES[$k]}
        gres=${NODE_GRES[$k]}
        [ -n "$gres" ] || continue
        gpu_count=${gres##*:}
        for ((i = 0; i < gpu_count; i++)); do
            [ -c "$SLURM_DIR/dev/$name-gpu$i" ] || mknod "$SLURM_DIR/dev/$name-gpu$i" c 1 3
        done
    done
}

start_munged() {
    live_pid "$MUNGE/munged.pid" >/dev/null && return 0
    if [ ! -s "$MUNGE/munge.key" ]; then
        mungekey --create --keyfile="$MUNGE/munge.key"
    fi
    chown -R munge:munge "$MUNGE" "$LOG/munge"
    chmod 0755 "$MUNGE"
    chmod 0600 "$MUNGE/munge.key"
    rm -f "$MUNGE/munge.socket.2" "$MUNGE/munge.socket.2.lock"
    runuser -u munge -- munged --socket="$MUNGE/munge.socket.2" --key-file="$MUNGE/munge.key" \
        --pid-file="$MUNGE/munged.pid" --log-file="$LOG/munge/munged.log" --seed-file="$MUNGE/munged.seed" 9>&-
}

port_busy() { ss -Hltn "sport = :$1" | grep -q .; }

# Wait until every node is usable; nodes whose slurmd was just started must have registered since `since` (after a
# restart the controller may still show the previous registration as IDLE).
wait_for_nodes() {
    local since=$1 deadline=$((SECONDS + 60)) line name state started ready
    while ((SECONDS < deadline)); do
        ready=0
        while read -r line; do
            name=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$line")
            state=$(sed -n 's/.* State=\([^ ]*\).*/\1/p' <<<"$line")
            started=$(sed -n 's/.* SlurmdStartTime=\([^ ]*\).*/\1/p' <<<"$line")
            [[ " ${NODE_NAMES[*]} " == *" $name "* ]] || continue
            [[ $state =~ ^(IDLE|MIXED|ALLOCATED)$ ]] || continue
            if [[ " ${STARTED_NODES[*]} " == *" $name "* ]]; then
                [[ $started =~ ^[0-9] ]] && (($(date -d "$started" +%s) >= since)) || continue
            fi
            ready=$((ready + 1))
        done < <(scontrol -o show node 2>/dev/null || true)
        ((ready == ${#NODE_NAMES[@]})) && return 0
        sleep 0.5
    done
    scontrol -o show node >&2 || true
    die "nodes did not come up within 60 s; see $LOG/slurmctld.log and $LOG/slurmd-*.log"
}

main() {
    install_packages
    # The lock's descriptor (9) is closed for the daemons so that it is released when this script ends.
    lock_runtime_dir
    mkdir -p "$SLURM_DIR/etc" "$RUN" "$LOG/munge" "$MUNGE" "$SLURM_DIR/state/ctld" "$SLURM_DIR/state/d"
    fresh=$(mktemp -d)
    trap 'rm -rf "$fresh"' EXIT
    write_config "$fresh"
    if ! cmp -s "$fresh/slurm.conf" "$CONF" || ! cmp -s "$fresh/gres.conf" "$SLURM_DIR/etc/gres.conf" \
        || { [ -e "$fresh/slurmdbd.conf" ] && ! cmp -s "$fresh/slurmdbd.conf" "$SLURM_DIR/etc/slurmdbd.conf"; }; then
        if live_pid "$RUN/slurmctld.pid" >/dev/null || live_pid "$RUN/slurmdbd.pid" >/dev/null; then
            say "configuration changed: restarting"
            stop_all
        fi
        rm -f "$SLURM_DIR/etc/slurmdbd.conf"
        cp -p "$fresh"/*.conf "$SLURM_DIR/etc/"
    fi
    make_fake_gpus
    export SLURM_CONF=$CONF

    local since
    since=$(date +%s)
    start_munged
    if [ "$ACCOUNTING" = 1 ]; then
        start_database
        start_slurmdbd
    fi
    if ! live_pid "$RUN/slurmctld.pid" >/dev/null; then
        port_busy "$CTLD_PORT" && die "port $CTLD_PORT is taken by another program; set LABKIT_SLURM_PORT"
        slurmctld -f "$CONF" 9>&-
    fi
    local k name
    STARTED_NODES=()
    for k in "${!NODE_NAMES[@]}"; do
        name=${NODE_NAMES[$k]}
        live_pid "$RUN/slurmd-$name.pid" >/dev/null && continue
        port_busy $((CTLD_PORT + 10001 + k)) && die "port $((CTLD_PORT + 10001 + k)) (slurmd $name) is taken; set LABKIT_SLURM_PORT"
        slurmd -f "$CONF" -N "$name" 9>&-
        STARTED_NODES+=("$name")
    done
    wait_for_nodes "$since"

    # Node names resolve like on a real cluster, so job scripts can use `scontrol show hostnames | head -1` as the
    # torchrun master address.
    if [ "$(id -u)" -eq 0 ] && [ -w /etc/hosts ]; then
        local entry="127.0.0.1 ${NODE_NAMES[*]} $HOSTS_MARK"
        if ! grep -qxF "$entry" /etc/hosts; then
            # Rewritten in place: /etc/hosts may be a bind mount that cannot be replaced.
            { grep -vF "$HOSTS_MARK" /etc/hosts || true; echo "$entry"; } >"$fresh/hosts"
            cat "$fresh/hosts" >/etc/hosts
        fi
    fi

    # Plain `sinfo`/`sbatch` in a shell or notebook find this cluster when the host has no Slurm config of its own.
    if [ "$(id -u)" -eq 0 ] && [ ! -e /etc/slurm/slurm.conf ] && [ ! -L /etc/slurm/slurm.conf ]; then
        mkdir -p /etc/slurm && ln -s "$CONF" /etc/slurm/slurm.conf
    fi
    echo "export SLURM_CONF=$CONF" >"$SLURM_DIR/env"
    say "up: ${#NODE_NAMES[@]} nodes ($(sinfo -h -o '%N %G' | tr '\n' ' ')); runtime dir $SLURM_DIR"
    echo "export SLURM_CONF=$CONF"
}

main "$@"
