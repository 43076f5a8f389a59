#!/bin/bash
# A 15-minute GPU loan, spent on the SmolLM2 EAGLE head within fixed time budgets (report:
# benchmarks/results/eagle-training-h200-budgets.md). The device tool carries at most 64 MiB a call, so
# `stage1` keeps the GGUF's first 60 MB (.gpu/part.a) in /tmp/w and `stage2` (the next call, same machine)
# joins the rest (.gpu/part.b), checks it, unpacks the training prompts (.gpu/train.tar.xz), trains, and packs
# the head and the target's answers into $OUT in pieces under 16 MB. SIZES overrides the run's sizes. The 64 MiB counts
# the working tree too (~42 MB tracked): run 3 moved benchmarks/results and specdecode/drafts out of the checkout for
# its two calls (and back after), leaving ~5 MB beside part.a.
# Answers made beforehand (data/answers/*.jsonl.xz: an earlier loan's; .gpu/answers*.jsonl.xz: e.g. a CPU's
# `specdecode train eagle --distill-only`) start the run as a resumed self-distillation's: the GPU answers only the
# prompts they leave, in its own --distill-seconds, and all of them train.
# TRAIN_LIMIT (seconds, the whole stage) must exceed --distill-seconds + --train-seconds by ~90 s (loading, the last
# batch of answers, features, saving), or the run ends before it saves (run 3 of the report).
# DRAFT_VOCAB: 16384 by default (benchmarks/results/draft-vocab-coverage-smollm2.md: 95% of Spec-Bench answers'
# tokens, against 90% at 8192).
# TF32 matrix products (cuBLAS override): the float32 self-distillation's products on the tensor cores.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
GGUF=/tmp/w/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gguf-*.whl || exit 1
if [ "$1" = stage1 ]; then
  mkdir -p /tmp/w && cp .gpu/part.a /tmp/w/part.a && ls -la /tmp/w
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; gcc --version | head -1
  python3 -c "import torch, transformers, gguf, specdecode.training.cli; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
  exit $?
fi
date +%T
cat /tmp/w/part.a .gpu/part.b > $GGUF || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c || exit 1
mkdir -p /tmp/data && tar xJf .gpu/train.tar.xz -C /tmp/data || exit 1
date +%T
SIZES=${SIZES:---samples 60000 --heldout 256 --max-new-tokens 256 --gen-batch 1024 --distill-seconds 170 \
  --steps 20000 --train-seconds 230 --batch-size 64 --eval-every 500 --bf16 --device cuda}
ARGS="--target $GGUF --data /tmp/data/train --out /tmp/eagle $SIZES --max-len 1024 --lr 6e-4 --warmup 100 \
  --ttt-steps 5 --draft-vocab ${DRAFT_VOCAB:-16384} --feature-cache memory --seed 1"
ANSWERS=$(ls data/answers/*.jsonl.xz .gpu/answers*.jsonl.xz 2>/dev/null)
if [ -n "$ANSWERS" ]; then  # answers made before, as a resumed run's: the GPU answers only the prompts they leave
  mkdir -p /tmp/eagle/work && xz -dc $ANSWERS > /tmp/eagle/work/samples.partial.jsonl
  wc -l /tmp/eagle/work/samples.partial.jsonl
fi
timeout ${TRAIN_LIMIT:-530} python3 -m specdecode.cli.commands train eagle $ARGS > $OUT/log.txt 2>&1
echo "train exit $?"; date +%T
tail -c 3000 $OUT/log.txt
cd /tmp/eagle && ls -la . work
[ -f work/samples.jsonl ] && xz -T16 -3 -c work/samples.jsonl | split -b 15000000 -d - $OUT/samples.jsonl.xz.
tar cf - --exclude=work --exclude=checkpoint.pt . | split -b 15000000 -d - $OUT/head.tar.
[ -f checkpoint.pt ] && [ ! -f eagle.safetensors ] && python3 -c "import torch; torch.save(torch.load('checkpoint.pt', weights_only=False)['module'], 'module.pt')" && split -b 15000000 -d module.pt $OUT/module.pt.
ls -la $OUT; date +%T
