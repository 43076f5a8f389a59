#!/bin/bash
# Asynchronous drafting on a lent GPU, in one call of the device tool (report: benchmarks/results/async-draft.md):
# the CUDA-stream path's test, then sync vs async drafting on SmolLM2-135M's shape with random weights (no weights
# to carry: the device tool carries 64 MiB a call), a layer-skipped draft. Needs the gguf wheel in .gpu/ (carried).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gguf-*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"
python3 -c "
import torch, tests.test_async_draft as t
t.test_async_drafting_on_a_gpu_stream(); print('GPU stream test passed')" 2>&1 | tail -3
for skip in 6-29 10-29; do
  timeout 150 python3 benchmarks/async_draft.py --device cuda --random-shape --method layer-skip --skip $skip \
    --prompts 4 --rounds 2 --out $OUT/gpu-skip-$skip 2>&1 | tail -40
done
