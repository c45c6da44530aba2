#!/usr/bin/env bash
# On the ends of the supported range (3.11 and 3.13) other than the main environment's Python, or on 3.12 where
# neither is found, the fast tests (no training, no Slurm, no browser) of what rests on the interpreter and on the
# dependencies pip resolves for it: the command line (argparse's output changed in 3.13), the spec and its errors
# (dataclasses, typing), Megatron's flags and rules against megatron-core's own objects, the job scripts (jinja2), the
# estimate and the planner's command (pandas), the log parser, the driver's arguments and its CPU compatibility
# layer (torch, megatron-core), the package's data and imports. The rest of the suite checks labkit's own arithmetic
# and the operating system's file locks and renames (the run records), the same on every Python, and runs in full on
# the main environment.
# An interpreter that is not found is reported and skipped, not failed: each machine has the Pythons it has.
# Usage: tests/other_pythons.sh MAIN_PYTHON
set -euo pipefail
main=${1:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
main_version=$("$main" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

find_python() {  # the first interpreter for version $1 that runs: on PATH, else a pyenv installation
  local candidate
  for candidate in "python$1" "$HOME"/.pyenv/versions/"$1".*/bin/"python$1"; do
    if "$candidate" -c 'import sys' >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

PORTABLE=(tests/test_cli_output.py tests/test_cli_pipe.py tests/test_spec.py tests/test_spec_input.py
          tests/test_megatron_flags.py tests/test_megatron_args.py tests/test_jobs_render.py tests/test_estimate.py
          tests/test_plan_cli.py tests/test_logs_parse.py tests/test_train_args.py tests/test_train_cpu_compat.py
          tests/test_packaging.py tests/test_architecture.py)

# The ends of the range stand for what lies between: a Python between two that pass has shown no break of its own.
versions=()
for version in 3.11 3.13; do
  [ "$version" = "$main_version" ] && continue
  if find_python "$version" >/dev/null; then
    versions+=("$version")
  else
    echo "other Pythons: python$version not found on this machine; its tests are skipped"
  fi
done
if [ ${#versions[@]} -eq 0 ] && [ "$main_version" != 3.12 ] && find_python 3.12 >/dev/null; then
  versions=(3.12)
fi

status=0
for version in ${versions[@]+"${versions[@]}"}; do
  python=$(find_python "$version")
  venv=".venv-$version"
  stamp="$venv/.installed-$(cksum < pyproject.toml | cut -d' ' -f1)"
  if [ ! -f "$stamp" ]; then
    echo "other Pythons: installing labkit into $venv with $("$python" --version)"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -c "$repo/constraints.txt" torch
    "$venv/bin/pip" install --quiet --disable-pip-version-check -c "$repo/constraints.txt" -e '.[all,deepspeed,test]'
    touch "$stamp"
  fi
  echo "other Pythons: the interpreter-dependent fast tests on $("$venv/bin/python" --version)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not slurm and not browser" "${PORTABLE[@]}" \
    || status=1
done
exit $status
