# tokenline: `make run` serves the embedded default model, `make test` runs the suite.
# Both set everything up themselves (.venv, generated stubs, the default model).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= models/tokenline-tiny
PROTOS := $(wildcard proto/tokenline/v1/*.proto)
STUBS := proto/tokenline/v1/frontend_pb2.py
PYTEST_ARGS ?=
DESCRIPTOR := deploy/envoy/tokenline.pb
BUF := $(VENV)/bin/buf
# `make proto-check` compares the working tree's protos with this branch.
PROTO_AGAINST ?= main

.PHONY: all setup proto model kernels run test lint fmt bench clean descriptor proto-check soak containers-test

all: setup

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade --quiet pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) $(STUBS)

$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m services.common.gen_protos

proto: $(STAMP)
	$(PY) -m services.common.gen_protos

# The FileDescriptorSet (with imports and source info) Envoy's transcoder loads.
descriptor: $(STAMP)
	$(PY) -m services.common.gen_protos --descriptor-set $(DESCRIPTOR)

# buf lint, then buf breaking against $(PROTO_AGAINST) (skipped when that branch is absent).
proto-check: $(STAMP)
	$(BUF) lint
	@if git rev-parse --verify --quiet '$(PROTO_AGAINST)^{commit}' >/dev/null; then \
		echo "$(BUF) breaking proto --against '.git#branch=$(PROTO_AGAINST),subdir=proto'"; \
		$(BUF) breaking proto --against '.git#branch=$(PROTO_AGAINST),subdir=proto'; \
	else \
		echo "proto-check: no '$(PROTO_AGAINST)' branch in this checkout; buf breaking skipped"; \
	fi

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m services.common.default_model --out $(MODEL_DIR)

# The engine's compiled kernels for this machine, the sampler's and decode attention's
# (sample_kernel.py): built once, kept while torch, the CPU and the sources are unchanged;
# where they cannot be built (no C++ compiler) the engine keeps its eager paths, so a
# failure here stops nothing. A checkpoint no native path serves is refused first, in one
# line, before any compile.
kernels: $(MODEL_DIR)/config.json
	$(PY) -m services.scheduler.model.registry $(MODEL_DIR)
	-$(PY) -m services.scheduler.sample_kernel --model $(MODEL_DIR)

model: setup $(MODEL_DIR)/config.json kernels

run: model
	$(PY) -m services.launch --model $(MODEL_DIR)

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

# Opt-in, not part of `make test`: 256 streams for 60 s on a fresh local stack, then no
# failures, no leaked state and < 5 % RSS growth per service (bench/soak.py). ~2 minutes.
SOAK_ARGS ?=
soak: model
	$(PY) -m bench.soak --model-dir $(MODEL_DIR) $(SOAK_ARGS)

# Build the image and run the compose cluster on a real container engine, then check it
# end to end (deploy/containers-test.sh; needs root, opt-in: not part of `make test`).
containers-test: setup
	deploy/containers-test.sh

lint: setup
	$(VENV)/bin/ruff check services gateway tests bench
	$(VENV)/bin/mypy

fmt: setup
	$(VENV)/bin/ruff format services gateway tests bench

clean:
	rm -rf $(VENV) models proto/tokenline/v1/*_pb2*.py proto/tokenline/v1/*_pb2*.pyi
