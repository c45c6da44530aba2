#!/usr/bin/env bash
# Where `make` installs PyTorch from: on a Linux machine without an NVIDIA GPU (no nvidia-smi, no /proc/driver/nvidia)
# whose PyTorch CPU index answers within a few seconds, print the pip options that take torch's CPU wheel from it
# (https://pytorch.org/get-started/locally/: pip install torch --index-url https://download.pytorch.org/whl/cpu), and
# say so in one line on stderr; PyPI's Linux wheel brings several GB of CUDA packages a CPU machine never uses.
# Otherwise print nothing, and pip installs torch as it would without this script.
# Usage: tests/torch_cpu_index.sh PYTHON   (LABKIT_TORCH_CPU_INDEX overrides the index's URL)
set -u
python=${1:-python3}
index=${LABKIT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
[ "$(uname -s)" = Linux ] || exit 0  # PyPI's macOS and Windows wheels are CPU wheels already
if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; then
    exit 0
fi
# A closed network must not hold make up: 3 s for the answer, 4 s in all (the name lookup included).
timeout 4 "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3).close()' \
    "$index/torch/" >/dev/null 2>&1 || exit 0
echo "no NVIDIA GPU here: installing PyTorch's CPU wheel from $index" >&2
echo "--index-url $index"
