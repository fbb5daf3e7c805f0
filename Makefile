# The few commands people run. Everything goes through `make setup`, which builds .venv here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m tunefarm.selfcheck
	touch $(STAMP)

# The main job on the embedded default: tune a GEMM on this CPU, write records and a report,
# then rebuild the best kernel into a shared library without search.
demo: setup
	mkdir -p demo-out
	$(BIN)/tunefarm tune-op matmul --shape M=512,N=512,K=512 --trials 64 \
		--records demo-out/gemm.jsonl --json demo-out/report.json
	$(BIN)/tunefarm apply-best demo-out/gemm.jsonl --out demo-out/gemm.so

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

bench: setup
	$(BIN)/tunefarm bench ops --trials 256

lint: setup
	$(BIN)/ruff check tunefarm services tests

clean:
	rm -rf $(VENV) demo-out .pytest_cache
