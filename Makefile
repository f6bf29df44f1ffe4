PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup sshd demo lint test test-fast bench clean

setup: $(VENV)/.installed

# torch first, the version the tests ran with, from a local wheel when there is one (TORCH_WHEELS):
# pyproject accepts a range so that a cluster keeps its own CUDA build, and a range alone would let pip
# download a multi-GB CUDA build here.
TORCH_VERSION := 2.13.0
TORCH_WHEELS ?= /opt/wheels

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(or $(firstword $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)*.whl)),torch==$(TORCH_VERSION))
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The embedded default: a tiny GPT on a generated corpus, 4 gloo ranks, policy cona deciding online (a
# line per decision and switch), then the report with its timeline. A hand-written chain to replay:
# cona train configs/tiny.yaml --chain configs/tiny-chain.yaml.
demo: setup
	rm -rf runs/demo
	$(BIN)/cona train configs/tiny.yaml --run-dir runs/demo
	$(BIN)/cona report runs/demo

# The ssh launcher's tests talk to a real sshd on loopback: as root, install Debian's openssh-server
# if it is missing (elsewhere those tests skip, saying why).
sshd:
	@command -v sshd >/dev/null || test -x /usr/sbin/sshd || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    openssh-server >/dev/null; }

# ruff: lint and format check (line length 120, rules in pyproject.toml).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest workers, one test module each at a time (a module's fixtures run once), the longest modules
# first (tests/conftest.py): most end-to-end tests wait on process start-up and polling, so two share 2 cores.
test: setup sshd lint
	$(BIN)/pytest -q -n 2 --dist loadscope --no-loadscope-reorder

# Unit tests only (no torchrun jobs).
test-fast: setup
	$(BIN)/pytest -q -m "not e2e"

bench: setup
	$(BIN)/python scripts/bench_layouts.py

clean:
	rm -rf runs .pytest_cache
