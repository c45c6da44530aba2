#!/bin/bash
# labkit run RUN: tiny-cpu
# The embedded backend: this host plays every node; one node_main per node, as srun would start them, with the
# same logs (LOGDIR/JOBID/NODE.out|err|gpu). The job id is this script's pid. Its end is recorded in LOGDIR/JOBID/state.
# Rendered from the run spec by labkit.jobs.render: change the spec, not this file.

export RUN_NAME=tiny-cpu
export LOGDIR=/runs/RUN/logs
export PARTITION=2  # transformer layers per pipeline stage
export NNODES=1
export WORLD_SIZE=2
export GLOBAL_BATCH_SIZE=8
export MICRO_BATCH_SIZE=2
export TENSOR_MP_SIZE=1
export PIPELINE_MP_SIZE=1
export DP_SIZE=2
export MODEL=tiny
export NUM_LAYERS=2
export HIDDEN_SIZE=64
export NUM_ATTENTION_HEADS=4
export SEQ_LENGTH=64
export PRECISION=fp32
TRAIN_ARGS=(
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --micro-batch-size 2
    --global-batch-size 8
    --optimizer adam
    --lr 0.00015
    --min-lr 1e-05
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --weight-decay 0.01
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --train-iters 20
    --log-interval 5
    --seed 1234
    --timing-log-level 2
    --eval-iters 0
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 1023
    --log-throughput
)
export JOB_ID=$$
# ---- shared by every node (rendered from the run spec; every user-given value is single-quoted) -------------------
export GPU_MONITOR_INTERVAL=10
export TORCHRUN=torchrun

# One task per node: echo the job info, sample the GPUs into NODE.gpu, run torchrun; logs go to LOGDIR/JOBID/NODE.*
# Usage: node_main FIRST_NODE_RANK NPROC_PER_NODE TRAIN_ARGS...   (node rank = FIRST_NODE_RANK + SLURM_PROCID)
node_main() {
    local node_rank=$(($1 + SLURM_PROCID)) nproc=$2 node=${SLURMD_NODENAME:-$(hostname -s)} sampler="" status var
    shift 2
    local logs="$LOGDIR/$JOB_ID"
    # A requeued job's later attempts (SLURM_RESTART_COUNT 1, 2, ...) log beside the first one's, never over them.
    [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && logs="$logs/attempt-$SLURM_RESTART_COUNT"
    # Every node of a job (all hetjob components, master and slave alike) shares JOB_ID, so they agree on the port,
    # while two jobs placed on the same node get different ones; a requeued attempt moves on, in case the last one's
    # processes still hold the port.
    export MASTER_PORT=${MASTER_PORT:-$((20000 + (JOB_ID + 997 * ${SLURM_RESTART_COUNT:-0}) % 20000))}
    # torchrun limits threads only when it starts several processes; share the task's CPUs among them ourselves,
    # so one-process jobs placed side by side do not each spin a thread per core.
    local cpus=${SLURM_CPUS_PER_TASK:-$(getconf _NPROCESSORS_ONLN)}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / nproc > 0 ? cpus / nproc : 1))}
    mkdir -p "$logs"
    exec >"$logs/$node.out" 2>"$logs/$node.err"
    echo "******************* job info $JOB_ID *******************"
    echo "NODE: $node"
    echo "NODE_RANK: $node_rank"
    echo "NPROC_PER_NODE: $nproc"
    for var in MASTER_ADDR MASTER_PORT NNODES WORLD_SIZE GLOBAL_BATCH_SIZE MICRO_BATCH_SIZE TENSOR_MP_SIZE PIPELINE_MP_SIZE DP_SIZE PARTITION MODEL NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH PRECISION; do
        echo "$var: ${!var}"
    done
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,index,name,temperature.gpu,utilization.gpu,memory.used,memory.total \
            --format=csv,noheader -l "$GPU_MONITOR_INTERVAL" >"$logs/$node.gpu" 2>&1 &
        sampler=$!
    else
        echo "no nvidia-smi on $node: no GPU samples" >"$logs/$node.gpu"
    fi
    "$TORCHRUN" --nnodes "$NNODES" --nproc_per_node "$nproc" \
        --node_rank "$node_rank" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        -m labkit.train "$@" &
    local launcher=$!
    # A SIGTERM from Slurm (cancel, time limit) reaches torchrun and its workers too: wait while they stop, so that
    # the node's processes end as one tree.
    trap 'kill -TERM "$launcher" 2>/dev/null' TERM
    wait "$launcher"
    status=$?
    while kill -0 "$launcher" 2>/dev/null; do
        wait "$launcher"
        status=$?
    done
    [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
    echo "node $node: torchrun exited with status $status"
    return $status
}
export -f node_main

export MASTER_ADDR=127.0.0.1
# This host plays every node: its cores are shared among all the job's processes, as each Slurm node shares its own
# among its processes; otherwise every node's processes would each spin a thread per core of the same host.
host_cpus=$(getconf _NPROCESSORS_ONLN)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((host_cpus / WORLD_SIZE > 0 ? host_cpus / WORLD_SIZE : 1))}
if [ -n "${LABKIT_LAUNCH_GATE:-}" ]; then
    # labkit writes "start" once it has recorded this job; end of input means it stopped first: start nothing.
    unset LABKIT_LAUNCH_GATE
    read -r _ || exit 1
    exec </dev/null
fi
mkdir -p "$LOGDIR/$JOB_ID"
state_file="$LOGDIR/$JOB_ID/state"
echo "RUNNING" >"$state_file"
finish() {  # finish STATE EXIT_CODE: stop the whole process group (nodes, torchrun, workers), record the end, exit
    trap '' TERM INT USR1
    kill -TERM 0 2>/dev/null
    wait
    # Written whole and renamed into place, so that a reader never sees a half-written state (on a full disk, no
    # state.tmp is left: the run then reads as stopped without recording an end).
    { echo "$1 $2" >"$state_file.tmp" && mv -f "$state_file.tmp" "$state_file"; } || rm -f "$state_file.tmp"
    exit "$2"
}
trap 'finish CANCELLED 143' TERM INT
trap 'finish TIMEOUT 124' USR1
nodes=()
SLURMD_NODENAME=node0 SLURM_PROCID=0 \
    node_main 0 2 "${TRAIN_ARGS[@]}" &
nodes+=($!)
# The first node to fail ends the job. Each node's status is read with `wait PID`, which bash keeps for a child that
# has exited; the loop looks every 0.2 s rather than sleeping in `wait -n`, which bash 5.2 answers 127 ("no such job")
# for a node that ended before the call (two nodes ending together) and which, given a node that has just ended and
# one that runs on, sleeps until the second one ends.
running=("${nodes[@]}")
while [ -n "${running[*]}" ]; do
    still=()
    for pid in "${running[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            still+=("$pid")
        else
            wait "$pid"
            node_status=$?
            [ "$node_status" -eq 0 ] || finish FAILED "$node_status"
        fi
    done
    running=("${still[@]}")
    [ -n "${running[*]}" ] && sleep 0.2
done
finish COMPLETED 0
