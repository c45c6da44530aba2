# Two commands do all the set-up: `make lab` runs the lab series, `make test` runs the test suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: lab test env slurm-up slurm-down clean-venv

env: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }; $(PYTHON) -m venv $(VENV); }
	@echo "installing labkit and its pinned dependencies into $(VENV) ..."
	@$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@rm -f $(VENV)/.installed-* && touch $@

lab: $(STAMP)
	$(BIN)/labkit lab

test: $(STAMP)
	$(BIN)/python -m pytest

slurm-up:
	bash slurm/local/start.sh

slurm-down:
	bash slurm/local/stop.sh

clean-venv:
	rm -rf $(VENV)
