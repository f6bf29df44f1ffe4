PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The embedded default: a tiny GPT on a generated corpus, 4 gloo ranks, a 3-stage chain.
demo: setup
	rm -rf runs/demo
	$(BIN)/cona train configs/tiny.yaml --chain configs/tiny-chain.yaml --run-dir runs/demo
	$(BIN)/cona report runs/demo

test: setup
	$(BIN)/pytest -q

# Unit tests only (no torchrun jobs).
test-fast: setup
	$(BIN)/pytest -q -m "not e2e"

bench: setup
	$(BIN)/python scripts/bench_layouts.py

clean:
	rm -rf runs .pytest_cache
