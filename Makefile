# make demo: set up everything and run the ticket-triage example end to end.
# make test: set up everything and run lint, type checks and the whole test suite.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := dev,postgres,fleet,sizing,metrics,llamacpp,transformers,embedding,openai,lake
# llama.cpp must be built portably: a native build dies with "Illegal instruction"
# on machines whose CPU differs from the builder's.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
DEMO_STORE ?= sqlite:///demo/batchline.db

.PHONY: setup demo test lint typecheck services browser bench drill clean

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

# The report's browser test needs Debian's chromium; without it that test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "installing chromium for the report's browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	  || echo "chromium could not be installed: the browser test will skip"; }

# make drill: a fault drill (kill -9, SIGSTOP past the lease, SIGTERM, poison records) on SQLite and,
# where PostgreSQL is up on 127.0.0.1:5432, on a new database there; fails if any invariant does.
# Figures print as it ends; each run's worker logs and HTML report are kept in drill/.
DRILL_MINUTES ?= 3
DRILL_WORKERS ?= 4
DRILL_PG ?= postgresql://postgres@127.0.0.1:5432

drill: setup services
	mkdir -p drill
	@stamp=$$(date +%Y%m%d_%H%M%S); \
	echo "== drill on SQLite"; \
	$(BIN)/batchline drill --store sqlite:///drill/sqlite-$$stamp.db --workers $(DRILL_WORKERS) \
	  --minutes $(DRILL_MINUTES) --work-dir drill/sqlite-$$stamp --report drill/sqlite-$$stamp.html || exit 1; \
	if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then \
	  echo "== drill on PostgreSQL (database batchline_drill_$$stamp)"; \
	  psql -q -h 127.0.0.1 -U postgres -d postgres -c "CREATE DATABASE batchline_drill_$$stamp" || exit 1; \
	  $(BIN)/batchline drill --store $(DRILL_PG)/batchline_drill_$$stamp --workers $(DRILL_WORKERS) \
	    --minutes $(DRILL_MINUTES) --work-dir drill/postgres-$$stamp --report drill/postgres-$$stamp.html || exit 1; \
	  psql -q -h 127.0.0.1 -U postgres -d postgres -c "DROP DATABASE batchline_drill_$$stamp"; \
	else echo "PostgreSQL is not up on 127.0.0.1:5432: drilled SQLite only"; fi

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy batchline

test: setup services browser lint typecheck
	BATCHLINE_REQUIRE_POSTGRES=1 $(BIN)/pytest -q

bench: setup
	$(BIN)/python bench/store_throughput.py

clean:
	rm -rf demo drill .pytest_cache .mypy_cache .ruff_cache
