# make demo: set up everything and run the ticket-triage example end to end.
# make test: set up everything and run lint, type checks and the whole test suite.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := dev,postgres,fleet,sizing,llamacpp,transformers,embedding,openai
# llama.cpp must be built portably: a native build dies with "Illegal instruction"
# on machines whose CPU differs from the builder's.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
DEMO_STORE ?= sqlite:///demo/batchline.db

.PHONY: setup demo test lint typecheck services bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch, from the file on disk: an unpinned torch would pull a CUDA build of several GB.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

setup: $(VENV)/.installed

services:
	@pg_isready -q -h 127.0.0.1 -p 5432 || { \
	  echo "starting PostgreSQL"; \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql | head -n 1) main start; \
	  for i in $$(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done; }

demo: setup
	mkdir -p demo
	$(BIN)/batchline run examples/tickets/job.yaml --store $(DEMO_STORE) --workers 1 --publish

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy batchline

test: setup services lint typecheck
	BATCHLINE_REQUIRE_POSTGRES=1 $(BIN)/pytest -q

bench: setup
	$(BIN)/python bench/store_throughput.py

clean:
	rm -rf demo .pytest_cache .mypy_cache .ruff_cache
