# Settings and helpers shared by start.sh and stop.sh (sourced, not run).
#
# Environment (all optional):
#   LABKIT_SLURM_DIR    runtime dir: config, state, logs, pid files, munge key and socket   [/tmp/labkit-slurm]
#   LABKIT_SLURM_GPUS   typed fake GPUs per node group, in node order, as NODESxTYPE:COUNT    [1xa100:4,3xa10:4]
#                       (data/clusters.yaml `local-slurm`: n1 with gpu:a100:4, n2..n4 with gpu:a10:4)
#   LABKIT_SLURM_NODES  number of emulated nodes n1..nN; nodes past the GPU groups have none [sum of the groups]
#   LABKIT_SLURM_CPUS   CPUs each emulated node declares (may exceed the host's cores)       [4]
#   LABKIT_SLURM_MEMORY MB of memory each emulated node declares                             [4000]
#   LABKIT_SLURM_PORT   slurmctld port; slurmd of node K listens on PORT+10000+K             [6817]
#   LABKIT_SLURM_ACCOUNTING  1: also run slurmdbd (port PORT+2) on a private MariaDB (PORT+3), so that `sacct`
#                       answers as on a production cluster; installs slurmdbd and mariadb-server   [0]

SLURM_DIR=${LABKIT_SLURM_DIR:-/tmp/labkit-slurm}
GPU_GROUPS=${LABKIT_SLURM_GPUS-1xa100:4,3xa10:4}
CPUS_PER_NODE=${LABKIT_SLURM_CPUS:-4}
MEMORY_MB=${LABKIT_SLURM_MEMORY:-4000}
CTLD_PORT=${LABKIT_SLURM_PORT:-6817}
ACCOUNTING=${LABKIT_SLURM_ACCOUNTING:-0}
DBD_PORT=$((CTLD_PORT + 2))
DB_PORT=$((CTLD_PORT + 3))

CONF=$SLURM_DIR/etc/slurm.conf
RUN=$SLURM_DIR/run
LOG=$SLURM_DIR/log
MUNGE=$SLURM_DIR/munge
DB=$SLURM_DIR/db
HOST=$(hostname -s)
HOSTS_MARK="# labkit local slurm $SLURM_DIR"

die() { echo "labkit slurm: $*" >&2; exit 1; }
say() { echo "labkit slurm: $*"; }

# NODE_NAMES[i] and NODE_GRES[i] ("" for a node without GPUs), n1..nN in order.
NODE_NAMES=()
NODE_GRES=()
IFS=, read -r -a _groups <<<"$GPU_GROUPS"
for _group in "${_groups[@]}"; do
    [ -n "$_group" ] || continue
    [[ $_group =~ ^([0-9]+)x([a-z0-9_]+):([0-9]+)$ ]] \
        || die "LABKIT_SLURM_GPUS: '$_group' is not NODESxTYPE:COUNT (for example 3xa10:4)"
    for ((_i = 0; _i < BASH_REMATCH[1]; _i++)); do
        NODE_NAMES+=("n$((${#NODE_NAMES[@]} + 1))")
        NODE_GRES+=("gpu:${BASH_REMATCH[2]}:${BASH_REMATCH[3]}")
    done
done
[[ $ACCOUNTING =~ ^[01]$ ]] || die "LABKIT_SLURM_ACCOUNTING: '$ACCOUNTING' is not 0 or 1"
NODE_COUNT=${LABKIT_SLURM_NODES:-${#NODE_NAMES[@]}}
[[ $NODE_COUNT =~ ^[1-9][0-9]*$ ]] || die "LABKIT_SLURM_NODES: '$NODE_COUNT' is not a positive number of nodes"
while ((${#NODE_NAMES[@]} < NODE_COUNT)); do
    NODE_NAMES+=("n$((${#NODE_NAMES[@]} + 1))")
    NODE_GRES+=("")
done
NODE_NAMES=("${NODE_NAMES[@]:0:NODE_COUNT}")
NODE_GRES=("${NODE_GRES[@]:0:NODE_COUNT}")
unset _groups _group _i

# The pid recorded in FILE, if that process is alive and is still the daemon we started (its command line, or for
# slurmdbd, which takes no config path, its SLURM_CONF, names our runtime dir), so a recycled pid is never mistaken
# for ours.
live_pid() {
    local file=$1 pid
    [ -s "$file" ] || return 1
    pid=$(tr -dc 0-9 <"$file")
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    { tr '\0' ' ' <"/proc/$pid/cmdline"; tr '\0' ' ' <"/proc/$pid/environ" 2>/dev/null || true; } \
        | grep -qF -- "$SLURM_DIR/" || return 1
    echo "$pid"
}

# Serialise start.sh and stop.sh runs on one runtime dir (test sessions may start the cluster concurrently).
lock_runtime_dir() {
    mkdir -p "$SLURM_DIR"
    exec 9>"$SLURM_DIR/.lock"
    flock 9
}

running() { [ -r "/proc/$1/stat" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat"; }

# Stop the daemons named by these pid files together: SIGTERM, up to 10 s to exit, then SIGKILL.
stop_daemons() {
    local file pid pids=() i
    for file in "$@"; do
        pid=$(live_pid "$file") && pids+=("$pid") && kill -TERM "$pid" 2>/dev/null || true
    done
    for ((i = 0; i < 100; i++)); do
        local alive=()
        for pid in "${pids[@]}"; do running "$pid" && alive+=("$pid"); done
        [ ${#alive[@]} -eq 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if running "$pid"; then
            say "pid $pid ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    STOPPED=$((STOPPED + ${#pids[@]}))
    rm -f "$@"
}

# Cancel the cluster's jobs, then stop its daemons: slurmd first, then slurmctld, slurmdbd and its database, munged
# last.
stop_all() {
    local i jobs
    if live_pid "$RUN/slurmctld.pid" >/dev/null; then
        # Jobs would otherwise outlive their controller as orphaned slurmstepd processes.
        jobs=$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            say "cancelling $(wc -w <<<"$jobs") job(s)"
            # shellcheck disable=SC2086
            SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                [ -z "$(SLURM_CONF=$CONF squeue -h -o %A -t PD,R,CG 2>/dev/null || true)" ] && break
                sleep 0.2
            done
        fi
    fi

    STOPPED=0
    shopt -s nullglob
    stop_daemons "$RUN"/slurmd-*.pid
    stop_daemons "$RUN/slurmctld.pid"
    stop_daemons "$RUN/slurmdbd.pid"
    stop_daemons "$RUN/mariadbd.pid"
    stop_daemons "$MUNGE/munged.pid"

    if grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null && [ -w /etc/hosts ]; then
        local kept
        kept=$(grep -vF "$HOSTS_MARK" /etc/hosts || true)
        printf '%s\n' "$kept" >/etc/hosts
    fi
    if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
        rm -f /etc/slurm/slurm.conf
    fi
    say "stopped $STOPPED daemon(s) of $SLURM_DIR"
}
