#!/bin/bash
# One GPU loan (15 minutes of device time) spent on EAGLE-3-architecture heads for SmolLM2-135M-Instruct (issue 57;
# report: benchmarks/results/eagle3-h200-smollm2.md). Two trainings share the GPU at once on the same answers: the
# shipped head fine-tuned (--init; converted to EAGLE-3's architecture where it is specdecode's first) and a head
# trained from scratch.
# The device tool carries at most 64 MiB a call, the working tree included, so the calls run with
# benchmarks/results and specdecode/drafts taken out of the index (`git rm -r -q --cached benchmarks/results
# specdecode/drafts`, both listed in .git/info/exclude; put back right after with `git reset -q -- benchmarks/results
# specdecode/drafts`), and:
#   stage1 (carry .gpu/part.a .gpu/head .gpu/gguf-*.whl): keeps the GGUF's first 48 MB and the shipped head in /tmp/w;
#   stage2 (carry .gpu/part.b .gpu/train.tar.xz .gpu/gguf-*.whl, the next call on the same warm machine: it goes
#     back after 30 s idle): joins and checks the GGUF, answers prompts for DISTILL_SECONDS (0: none) beside the
#     committed answers (a resumed self-distillation: the GPU answers only the prompts they leave), trains both heads
#     for TRAIN_SECONDS, and packs the heads as they ship (int8), the answers and the logs into $OUT/run.tar.* (pieces
#     of 15 MB: the tool brings back 64 MiB a call). The defaults end within the tool's 600 s a call: distillation
#     takes at most DISTILL_LIMIT (170 s), training TRAIN_SECONDS + 170 s (two loads and feature passes at once took
#     ~120 s); with DISTILL_SECONDS > 0, TRAIN_SECONDS <= 220.
# .gpu/part.a, part.b: `head -c 48000000 GGUF`, `tail -c +48000001 GGUF`; .gpu/head: the shipped head's folder;
# .gpu/train.tar.xz: ../shared/data/train; the gguf wheel: `pip download --no-deps --python-version 3.12 gguf==0.19.0`.
# DEVICE=cpu with small ANSWERS / seconds rehearses stage2 on a CPU (OUT, WORK: folders of your choice).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
WORK=${WORK:-/tmp/w}
GGUF=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
DEVICE=${DEVICE:-cuda}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gguf-*.whl || exit 1
if [ "${1:-}" = stage1 ]; then
  mkdir -p "$WORK" && cp .gpu/part.a "$WORK/part.a" && cp -r .gpu/head "$WORK/head" && ls -la "$WORK" "$WORK/head"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
  python3 -c "import torch, transformers, gguf, specdecode.training.cli; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
  exit $?
fi
date +%T
cat "$WORK/part.a" .gpu/part.b > "$GGUF" || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c || exit 1
mkdir -p "$WORK/data" "$WORK/answers/work" "$WORK/logs" && tar xJf .gpu/train.tar.xz -C "$WORK/data" || exit 1
xz -dc data/answers/smollm2-135m-instruct-*.jsonl.xz | head -n "${ANSWERS:-100000}" > "$WORK/answers/work/samples.partial.jsonl"
wc -l "$WORK/answers/work/samples.partial.jsonl"
BF16=$([ "$DEVICE" = cuda ] && echo --bf16)
[ "${DISTILL_SECONDS:-0}" = 0 ] && mv "$WORK/answers/work/samples.partial.jsonl" "$WORK/answers/work/samples.jsonl"
[ "${DISTILL_SECONDS:-0}" = 0 ] || timeout "${DISTILL_LIMIT:-170}" python3 -m specdecode.cli.commands train eagle --target "$GGUF" --data "$WORK/data/train" \
  --out "$WORK/answers" --samples 60000 --heldout 256 --max-new-tokens 256 --gen-batch "${GEN_BATCH:-1024}" \
  --distill-seconds "${DISTILL_SECONDS:-0}" --distill-only --device "$DEVICE" --seed 1 > "$WORK/logs/distill.txt" 2>&1
echo "distill exit $?"; date +%T; tail -n 3 "$WORK/logs/distill.txt"
SAMPLES=$WORK/answers/work/samples.jsonl
[ -f "$SAMPLES" ] || python3 -c "  # cut short: train on the answers written whole
import json, sys
for line in open(sys.argv[1]):
    try: json.loads(line); print(line, end='')
    except ValueError: pass" "$WORK/answers/work/samples.partial.jsonl" > "$SAMPLES"
wc -l "$SAMPLES"
COMMON="--target $GGUF --samples-file $SAMPLES --heldout ${HELDOUT:-256} --max-len 1024 --ttt-steps 5 --seed 1 \
  --feature-cache memory --device $DEVICE $BF16 --steps 20000 --batch-size 32 --eval-every ${EVAL_EVERY:-600} \
  --train-seconds ${TRAIN_SECONDS:-360}"
TRAIN_LIMIT=${TRAIN_LIMIT:-$((${TRAIN_SECONDS:-360} + 170))}  # two loads and feature passes at once took ~120 s
timeout "$TRAIN_LIMIT" python3 -m specdecode.cli.commands train eagle $COMMON --out "$WORK/warm" --arch eagle3 \
  --init "$WORK/head" --lr 4e-4 --warmup 50 > "$WORK/logs/warm.txt" 2>&1 &
timeout "$TRAIN_LIMIT" python3 -m specdecode.cli.commands train eagle $COMMON --out "$WORK/scratch" --arch eagle3 \
  --draft-vocab 8192 --lr 6e-4 --warmup 100 > "$WORK/logs/scratch.txt" 2>&1 &
wait
date +%T
for run in warm scratch; do  # each head as it ships (int8 blocks: 10 MB, where float32 is 39), from its checkpoint
  echo "== $run"; tail -n 12 "$WORK/logs/$run.txt"  # where the time limit stopped the run before it saved
  python3 - "$WORK/$run" <<'PY'
import shutil, sys
from pathlib import Path
import torch
from specdecode.models.eagle import ARCH_EAGLE3, CONFIG, WEIGHTS, EagleConfig, EagleHead
from specdecode.models.eagle3 import Eagle3Head
run = Path(sys.argv[1])
config = EagleConfig.from_json((run / CONFIG).read_text())
head = (Eagle3Head if config.arch == ARCH_EAGLE3 else EagleHead)(config)
if (run / WEIGHTS).exists():
    head = type(head).load(run)
else:
    head.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=False, map_location="cpu")["module"])
out = run.with_name(run.name + "-int8")
head.float().save(out, int8=True)
for name in ("train_log.jsonl", "report.md"):
    if (run / name).exists():
        shutil.copy(run / name, out / name)
print(f"{out}: {sorted(p.name for p in out.iterdir())}")
PY
done
xz -T0 -6 -c "$SAMPLES" > "$WORK/samples.jsonl.xz"
(cd "$WORK" && tar cf - logs warm-int8 scratch-int8 samples.jsonl.xz) | split -b 15000000 -d - "$OUT/run.tar."
ls -la "$OUT"; date +%T
