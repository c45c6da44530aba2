#!/usr/bin/env bash
# The wheel as a user installs it: build it, install it (not editable) into a throwaway environment and, from an
# unrelated directory, first with the base install alone (no torch: what planning needs) validate, estimate, plan and
# dry-run, and see a command that trains name the extra it needs; then add labkit[train] and run a tiny local job, and
# copy the course files out.
# Usage: tests/wheel_check.sh PYTHON   (the interpreter that builds the wheel and makes the throwaway environment)
set -euo pipefail
python=${1:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "wheel check: building the wheel"
# From a copy of the checkout's files (tracked, and new ones git does not ignore): setuptools writes build/ and
# *.egg-info where it builds, which `make test` is meanwhile installing from (tests/other_pythons.sh), and would
# ship a stale build/lib's modules.
mkdir "$scratch/source"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$repo" ls-files -z --cached --others --exclude-standard |
    tar -C "$repo" --null -T - --ignore-failed-read -cf - | tar -xf - -C "$scratch/source"
else  # a tree without git (an unpacked source archive): all of it but the environments and earlier builds
  tar -C "$repo" --exclude='./.venv*' --exclude=./build -cf - . | tar -xf - -C "$scratch/source"
fi
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$scratch/dist" "$scratch/source"
wheel=$(echo "$scratch"/dist/labkit-*.whl)
# The base interpreter, not the project's venv: the throwaway environment sees nothing of the checkout.
base=$("$python" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$scratch/env"
echo "wheel check: installing $(basename "$wheel") (the base install) into a throwaway environment"
SECONDS=0
"$scratch/env/bin/pip" install --quiet --disable-pip-version-check "$wheel"
echo "wheel check: base install: $SECONDS s, $(du -sm "$scratch/env" | cut -f1) MB"

mkdir "$scratch/elsewhere"
cd "$scratch/elsewhere"
export PATH="$scratch/env/bin:$PATH" LABKIT_HOME="$scratch/home"
set -x
if python -c 'import torch' 2>/dev/null; then echo 'the base install brought torch'; exit 1; fi
labkit --version
labkit --help >/dev/null
labkit workspace course
test -f course/notebooks/05_performance_estimation.ipynb
test -f course/notebooks/solutions/05_performance_estimation.ipynb
test -f course/notebooks/ko/05_performance_estimation.ipynb && test -f course/notebooks/ko/solutions/05_performance_estimation.ipynb
labkit validate course/examples/tiny-cpu.yaml >/dev/null
labkit estimate course/examples/gpt2-xl-hetero.yaml >/dev/null
labkit plan course/examples/gpt2-xl-hetero.yaml >/dev/null
labkit run course/examples/tiny-cpu.yaml --backend local --dry-run >/dev/null
printf 'name: wheel-check\nmodel: {preset: tiny}\nbatch: {micro: 2, global: 4}\ntrain: {iters: 2, log_interval: 1}\n' \
  > tiny.yaml
set +e
labkit run tiny.yaml --backend local 2>needs.txt
status=$?
set -e
test "$status" = 1
grep -qF "pip install 'labkit[train]'" needs.txt  # the extra it needs, not a traceback
python -c 'import labkit, pathlib; assert (pathlib.Path(labkit.__file__).parent / "py.typed").is_file()'
python -c 'import importlib.metadata as m; assert m.metadata("labkit")["License-Expression"] == "Apache-2.0"'
set +x

echo "wheel check: adding labkit[train] (torch and megatron-core)"
SECONDS=0
"$scratch/env/bin/pip" install --quiet --disable-pip-version-check -c "$repo/constraints.txt" torch
"$scratch/env/bin/pip" install --quiet --disable-pip-version-check -c "$repo/constraints.txt" "$wheel[train]"
echo "wheel check: labkit[train] added: $SECONDS s, $(du -sm "$scratch/env" | cut -f1) MB"
set -x
labkit run tiny.yaml --backend local --wait
set +x
python -c 'import labkit, sys; sys.exit(0 if "site-packages" in labkit.__file__ else "labkit did not come from the wheel")'
echo "wheel check: ok"
