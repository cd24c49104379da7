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

test: install-test redis-server haproxy chromium  ## install, then run lint and the whole test suite (slow tests included)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-fast: install-test redis-server  ## the suite without slow (torch / real-model) tests
	$(PY) -m pytest -q -m "not slow"

lint: install-test  ## ruff
	$(VENV)/bin/ruff check .

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache
