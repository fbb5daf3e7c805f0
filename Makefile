# The few commands people run. Everything goes through `make setup`, which builds .venv here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The aarch64 root the emulated ARM agent runs in (outside the repository; see deploy/aarch64-root.sh).
TUNEFARM_AARCH64_ROOT ?= /var/cache/tunefarm/aarch64-root
export TUNEFARM_AARCH64_ROOT

.PHONY: setup bytecode browser demo test test-fast test-aarch64 aarch64-root bench lint proto clean gpu-bundle gpu-check pretrained pretraining-data

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m tunefarm.selfcheck
	touch $(STAMP)

# The project's own modules compiled to bytecode once (about a second). Where
# PYTHONDONTWRITEBYTECODE is set (it is on this project's 2-core machines), Python never writes them,
# so without this step every process compiles each tunefarm, services and test module it
# imports from source again: the suite and a tuning run start hundreds of processes
# (builders, runners, farm services), about 0.3 s of compiling each.
bytecode: setup
	$(BIN)/python -m compileall -q tunefarm services tunefarm_app tests > /dev/null

# Headless Chromium and its driver for the dashboard's browser tests (Debian's packages;
# does nothing when both are there). CI runs it before `make test`.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then echo "chromium and chromedriver are installed"; \
	else $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; fi

# The main job on the embedded default: generate a small example CNN (ONNX), tune it end to
# end on this CPU (about five minutes), then run the tuned model. `tune` prints its speed-up
# over TVM's untuned build and over onnxruntime; rerunning resumes from the records.
demo: bytecode
	mkdir -p demo-out
	$(BIN)/python -m tunefarm.models.examples small_cnn --out demo-out/small_cnn.onnx
	$(BIN)/tunefarm tune demo-out/small_cnn.onnx --trials 300 --out demo-out/tuned --compare-default
	$(BIN)/tunefarm run demo-out/tuned

test: bytecode
	$(BIN)/pytest -q -n 2 --dist loadfile

test-fast: bytecode
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not slow"

# An aarch64 Debian root with the agent's packages, run under qemu-user through binfmt_misc:
# cross compiler, qemu, the root and the wheels, each step skipped when done (needs root the
# first time; a few minutes from nothing, about two seconds after).
aarch64-root: setup
	PYTHON=$(BIN)/python deploy/aarch64-root.sh

# The ARM tests: cross-compiled kernels and models, and the farm tuning a model for an
# aarch64 class through the real agent under emulation (also part of `make test`).
test-aarch64: setup aarch64-root
	$(BIN)/pytest -q tests/test_aarch64.py tests/test_farm_aarch64.py

bench: bytecode
	$(BIN)/tunefarm bench ops --trials 256

# The pretrained cost model shipped for x86 (tunefarm/search/cost_model/pretrained/x86.npz),
# rebuilt from the measurements kept in pretraining/x86/ (records, gzipped): their features
# are computed again by this version, so a new feature version needs no new measurement.
PRETRAIN_WORK ?= build/pretrain
pretrained: setup
	rm -rf $(PRETRAIN_WORK) && mkdir -p $(PRETRAIN_WORK)
	for f in pretraining/x86/*.gz; do gunzip -c $$f > $(PRETRAIN_WORK)/$$(basename $$f .gz); done
	$(BIN)/tunefarm dataset $(PRETRAIN_WORK)/*.jsonl --out $(PRETRAIN_WORK)/x86.parquet
	$(BIN)/tunefarm pretrain $(PRETRAIN_WORK)/x86.parquet --out tunefarm/search/cost_model/pretrained/x86.npz

# New measurements for it on this machine: its own CPU's class and AVX2 (haswell), the operators
# and the example models' tasks (about 25 minutes each on a quiet 2-core machine), then SSE4.2
# (x86-64-v2), the operators only (about 15 minutes); gzip the records into pretraining/x86/
# and run `make pretrained`.
pretraining-data: setup
	$(BIN)/tunefarm build-dataset --out $(PRETRAIN_WORK)/measured --classes host,haswell --trials 48 --model-trials 10 \
		--models small_cnn,bert_layer,mobilenet_v3,dbnet
	$(BIN)/tunefarm build-dataset --out $(PRETRAIN_WORK)/measured --classes x86-64-v2 --trials 48 --models none

lint: setup
	$(BIN)/ruff check tunefarm services tests

# Regenerate the gRPC code of proto/ into services/protocol/generated/ (checked in).
proto: setup
	$(BIN)/python -m services.protocol.proto_build

clean:
	rm -rf $(VENV) demo-out .pytest_cache

# The GPU check's files (.gpu/, from .venv and PyPI) and the check itself, on a machine with an
# NVIDIA GPU, PyTorch and the CUDA toolkit but no TVM (see tools/gpu_check.sh).
gpu-bundle: setup
	tools/gpu_bundle.sh

gpu-check:
	tools/gpu_check.sh unpack
	tools/gpu_check.sh run
