# tokenline: `make run` serves the embedded default model, `make test` runs the suite.
# Both set everything up themselves (.venv, generated stubs, the default model).

PYTHON ?= python3
# Python caches compiled bytecode in __pycache__ (gitignored) even where the environment
# says not to: the suite starts dozens of four-process stacks, and without the cache each
# process compiles our sources again (a stack start 6.0 -> 5.2 CPU-s, a worker's collection
# 19.5 -> 13.7 s).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= models/tokenline-tiny
# `make model-small`: the same random model at Qwen2.5-0.5B's dimensions (~474 M parameters,
# ~0.95 GB) for benchmarks at a realistic size; `bench.serve ... --model-dir $(SMALL_MODEL_DIR)`.
SMALL_MODEL_DIR ?= models/tokenline-small
# `make model-qwen3` / `make model-moe`: random Qwen3-0.6B-shaped and small Qwen3-MoE-shaped
# checkpoints (bench/checkpoints.py) for the serving benchmarks of the native model paths.
QWEN3_MODEL_DIR ?= models/bench-qwen3-0.6b
MOE_MODEL_DIR ?= models/bench-qwen3-moe
# Which model code serves MODEL_DIR: auto (native where it exists), native or transformers.
MODEL_IMPL ?= $(or $(TOKENLINE_MODEL_IMPL),auto)
PROTOS := $(wildcard proto/tokenline/v1/*.proto)
STUBS := proto/tokenline/v1/frontend_pb2.py
PYTEST_ARGS ?=
# pytest-xdist workers (`auto`: one per core); each takes one test file at a time, so a
# module's own stack starts once (docs/contributing.md). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= auto
DESCRIPTOR := deploy/envoy/tokenline.pb
BUF := $(VENV)/bin/buf
# `make proto-check` compares the working tree's protos with this branch.
PROTO_AGAINST ?= main

.PHONY: all setup proto model model-small model-qwen3 model-moe check-model kernels run test test-fast lint fmt bench clean descriptor proto-check soak containers-test docs

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

# A checkpoint no model path can run is refused here, in one line, before any build.
check-model: $(MODEL_DIR)/config.json
	@$(PY) -m services.scheduler.model_executor.models.model_impl --model $(MODEL_DIR) --model-impl $(MODEL_IMPL)

# The engine's compiled kernels for this machine's vector ISA level, the sampler's and decode
# attention's (services/scheduler/ops/cpu_kernels.py): built once, kept while torch, the
# compiler, the flags and the sources are unchanged;
# where they cannot be built (no C++ compiler) the engine keeps its eager paths, so a
# failure here stops nothing.
kernels: check-model
	-$(PY) -m services.scheduler.ops.cpu_kernels --model $(MODEL_DIR)

model: setup $(MODEL_DIR)/config.json kernels

$(SMALL_MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m services.common.default_model --shape small --out $(SMALL_MODEL_DIR)

model-small: setup $(SMALL_MODEL_DIR)/config.json
	-$(PY) -m services.scheduler.ops.cpu_kernels --model $(SMALL_MODEL_DIR)

model-qwen3: setup
	$(PY) -m bench.checkpoints --shape qwen3-0.6b --out $(QWEN3_MODEL_DIR)
	-$(PY) -m services.scheduler.ops.cpu_kernels --model $(QWEN3_MODEL_DIR)

model-moe: setup
	$(PY) -m bench.checkpoints --shape qwen3-moe --out $(MOE_MODEL_DIR)
	-$(PY) -m services.scheduler.ops.cpu_kernels --model $(MOE_MODEL_DIR)

# ARGS: any launcher or service flag, each handed to the services that take it
# (make run ARGS="--tool-call-parser deepseek_v31 --dtype float32"; docs/flags.md#serve).
ARGS ?=
run: model
	TOKENLINE_MODEL_IMPL=$(MODEL_IMPL) $(PY) -m services.launch --model $(MODEL_DIR) $(ARGS)

test: model
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: the in-process tier only (tests/conftest.py marks every test unit, live
# or tooling; docs/contributing.md has each tier's time). No stacks to start once per
# module here, so tests, not files, are shared out: the workers end together.
test-fast: model
	$(PY) -m pytest -m unit -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Opt-in, not part of `make test`: 256 streams for 60 s on a fresh local stack, then no
# failures, no leaked state and < 5 % RSS growth per service (bench/soak.py). ~2 minutes.
SOAK_ARGS ?=
soak: model
	$(PY) -m bench.soak --model-dir $(MODEL_DIR) $(SOAK_ARGS)

# Build the image and run the compose cluster on a real container engine, then check it
# end to end (deploy/containers-test.sh; needs root, opt-in: not part of `make test`).
containers-test: setup
	deploy/containers-test.sh

# docs/flags.md from every command's argparse parser (services/common/flags_doc.py); a unit
# test fails when it is stale.
docs: setup
	$(PY) -m services.common.flags_doc --write

lint: setup
	$(VENV)/bin/ruff check services gateway tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: setup
	$(VENV)/bin/ruff format services gateway tests bench

clean:
	rm -rf $(VENV) models proto/tokenline/v1/*_pb2*.py proto/tokenline/v1/*_pb2*.pyi
