#!/bin/bash
# Stands in for torchrun where a test is about scheduling, not training: prints the driver's layout line and
# Megatron-format iteration lines, records its arguments (NUL-separated) in LOGDIR/JOBID/NODE.argv and its environment in NODE.env0, and exits FAKE_EXIT.
# FAKE_ITERATION_S sets the pause per logged iteration, FAKE_LINGER_S one after the last.
iters=10 interval=5 args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
    --train-iters) iters=${args[i + 1]} ;;
    --log-interval) interval=${args[i + 1]} ;;
    esac
done
printf "%s\0" "$@" >"$LOGDIR/$JOB_ID/${SLURMD_NODENAME:-node}.argv"
env -0 >"$LOGDIR/$JOB_ID/${SLURMD_NODENAME:-node}.env0"
echo "using world size: $WORLD_SIZE, data-parallel size: $DP_SIZE, context-parallel size: 1, tensor-model-parallel size: $TENSOR_MP_SIZE, pipeline-model-parallel size: $PIPELINE_MP_SIZE"
for ((i = interval; i <= iters; i += interval)); do
    sleep "${FAKE_ITERATION_S:-0}"
    printf ' iteration %8d/%8d | elapsed time per iteration (ms): 100.0 | lm loss: 7.000000E+00 |\n' "$i" "$iters"
done
sleep "${FAKE_LINGER_S:-0}"
exit "${FAKE_EXIT:-0}"
