#!/usr/bin/env bash
set -euo pipefail
cd /work/main
python -m specdecode.cli bench --model smollm2-135m-instruct \
  --methods none@0,prompt-lookup@auto,prompt-lookup@4,eagle@auto,medusa:/work/trained/medusa@auto,draft:/work/trained/draft@auto,hybrid@auto,lookahead@auto,layer-skip@auto \
  --categories all --prompts-per-category 2 --repeats 2 --max-new-tokens 128 \
  --out benchmarks/results/spec-bench-smollm2-cpu-shape
