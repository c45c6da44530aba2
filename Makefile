# Two commands do all the set-up: `make lab` runs the lab series (both editions), `make test` runs the test suite.
# PYTHON: the newest supported interpreter found (3.13, 3.12, then 3.11; one that is on PATH but does not run, such as
# an inactive pyenv shim, is skipped); override with `make test PYTHON=/path/to/python3.x`.
SUPPORTED := python3.13 python3.12 python3.11
PYTHON ?= $(firstword $(foreach py,$(SUPPORTED),$(shell $(py) -c 'import sys' >/dev/null 2>&1 && echo $(py))))
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: lab test test-suite wheel-check other-pythons env slurm-up slurm-down clean-venv gpu-wheels

env: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || { test -n "$(PYTHON)" || { echo "need Python 3.11, 3.12 or 3.13 on PATH (or PYTHON=...)"; exit 1; }; $(PYTHON) -m venv $(VENV); }
	@echo "installing labkit and its pinned dependencies into $(VENV) with $$($(BIN)/python --version) ..."
	@$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt torch \
		$$(bash tests/torch_cpu_index.sh $(BIN)/python)
	@$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[all,deepspeed,test]'
	@rm -f $(VENV)/.installed-* && touch $@

# Both editions of the series: English, then Korean (notebooks/ko/).
lab: $(STAMP)
	$(BIN)/labkit lab
	$(BIN)/labkit lab --lang ko

# The whole suite on this environment's Python, then side by side (each installs into an environment of its own, most
# of their time; each one's output is printed whole when it ends) the wheel as a user installs it and the fast tests
# of what rests on the interpreter on the other supported Pythons found here (tests/other_pythons.sh names them).
test: test-suite
	@$(MAKE) --no-print-directory -j2 --output-sync=target wheel-check other-pythons

test-suite: $(STAMP)
	$(BIN)/python -m pytest

wheel-check: $(STAMP)
	bash tests/wheel_check.sh $(BIN)/python

other-pythons: $(STAMP)
	bash tests/other_pythons.sh $(BIN)/python

slurm-up: $(STAMP)
	$(BIN)/labkit slurm up

slurm-down: $(STAMP)
	$(BIN)/labkit slurm down

clean-venv:
	rm -rf $(VENV)

# The wheels benchmarks/gpu_check.sh installs on a GPU machine without network (CPython 3.12, x86-64 Linux; its own CUDA
# PyTorch stays): megatron-core and labkit's runtime packages, downloaded here into .wheelhouse/.
GPU_WHEELS := megatron-core==0.16.1 pandas numpy pyyaml jinja2 markupsafe termcolor tqdm psutil tokenizers \
	sentencepiece python-dateutil tzdata six packaging
gpu-wheels:
	$(or $(PYTHON),python3) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .wheelhouse $(GPU_WHEELS)
