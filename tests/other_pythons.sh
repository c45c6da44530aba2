#!/usr/bin/env bash
# The fast suite (no training, no Slurm, no browser) on every supported Python other than the main environment's.
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

status=0
for version in 3.11 3.12 3.13; do
  [ "$version" = "$main_version" ] && continue
  if ! python=$(find_python "$version"); then
    echo "other Pythons: python$version not found on this machine; its fast suite is skipped"
    continue
  fi
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
  echo "other Pythons: fast suite on $("$venv/bin/python" --version)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not slurm and not browser" || status=1
done
exit $status
