# The few commands people run. Everything goes through `make setup`, which builds .venv here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser demo test test-fast bench lint proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m tunefarm.selfcheck
	touch $(STAMP)

# Headless Chromium and its driver for the dashboard's browser tests (Debian's packages;
# does nothing when both are there). CI runs it before `make test`.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then echo "chromium and chromedriver are installed"; \
	else $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; fi

# The main job on the embedded default: generate a small example CNN (ONNX), tune it end to
# end on this CPU (about five minutes), then run the tuned model. `tune` prints its speed-up
# over TVM's untuned build and over onnxruntime; rerunning resumes from the records.
demo: setup
	mkdir -p demo-out
	$(BIN)/python -m tunefarm.models.examples small_cnn --out demo-out/small_cnn.onnx
	$(BIN)/tunefarm tune demo-out/small_cnn.onnx --trials 300 --out demo-out/tuned --compare-default
	$(BIN)/tunefarm run demo-out/tuned

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

bench: setup
	$(BIN)/tunefarm bench ops --trials 256

lint: setup
	$(BIN)/ruff check tunefarm services tests

# Regenerate the gRPC code of proto/ into services/measurer/generated/ (checked in).
proto: setup
	$(BIN)/python -m services.measurer.proto_build

clean:
	rm -rf $(VENV) demo-out .pytest_cache
