#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py says what it runs): labkit's driver on one H100 or H200, in under 8 minutes,
# with no network. The machine brings Python and CUDA PyTorch; megatron-core and labkit's other runtime packages come
# from a wheelhouse made beforehand on a machine with PyPI (`make gpu-wheels` writes .wheelhouse/), installed only
# where the machine lacks them. Rows with kernels.attention_backend sdpa follow gpt2-large and llama-8l, and where
# Nsight Systems' `nsys` is on the PATH one step runs under it as a profile.nsys rank does and reads its capture back.
# Without a GPU it is a dry run of the same steps on the tiny model.
#   bash benchmarks/gpu_check.sh [--cpu] [--keep DIR] [--only STEP ...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=${LABKIT_WHEELHOUSE:-$ROOT/.wheelhouse}

if [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python          # a `make` environment: everything is installed
else
    PY=${PYTHON:-python3}
fi
# Each import name beside the package that provides it.
NEEDED="megatron.core:megatron-core yaml:pyyaml pandas:pandas numpy:numpy jinja2:jinja2 markupsafe:markupsafe
termcolor:termcolor tqdm:tqdm psutil:psutil tokenizers:tokenizers sentencepiece:sentencepiece dateutil:python-dateutil
tzdata:tzdata six:six packaging:packaging"
missing=()
for pair in $NEEDED; do
    "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ -d "$WHEELS" ] || { echo "gpu_check: missing ${missing[*]} and no wheelhouse at $WHEELS (make gpu-wheels)"; exit 2; }
    SITE=$(mktemp -d /tmp/labkit-gpu-site.XXXXXX)
    echo "installing ${missing[*]} from $WHEELS into $SITE ..."
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "${missing[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
