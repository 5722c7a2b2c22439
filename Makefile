# Every target creates or refreshes .venv itself: `make demo` and `make test` are all a fresh machine needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: venv demo test test-fast bench lint format docs clean

$(STAMP): pyproject.toml setup.py constraints.txt aiokv/_native/_copy.c aiokv/_native/_lru.c aiokv/_native/_sha.c aiokv/_native/_step.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -c constraints.txt "setuptools>=68" wheel
	$(PIP) install -c constraints.txt --no-build-isolation -e ".[test,fast,redis,cli,plot,serve,events,dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/chat_demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check aiokv tests examples benchmarks
	$(BIN)/ruff format --check aiokv
	$(BIN)/mypy aiokv

format: $(STAMP)
	$(BIN)/ruff format aiokv tests examples benchmarks
	$(BIN)/ruff check --fix aiokv tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info aiokv/_native/*.so
