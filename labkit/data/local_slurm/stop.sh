#!/usr/bin/env bash
# Stop the local Slurm that start.sh started (same LABKIT_SLURM_DIR): cancel its jobs, then stop each daemon named by
# a pid file in the runtime dir, slurmd first and munged last. Nothing is killed by name. Idempotent.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"

[ -d "$SLURM_DIR" ] || { say "nothing to stop in $SLURM_DIR"; exit 0; }
lock_runtime_dir
stop_all
