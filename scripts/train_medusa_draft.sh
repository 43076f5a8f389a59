#!/usr/bin/env bash
# Medusa heads and a distilled 2x256 draft LM for SmolLM2-135M-Instruct, on a rented GPU (an H100), from the
# repo root, set up like scripts/train_shipped_eagle.sh (the GGUF and the training prompts in /tmp/gpu).
# Both reuse the target's answers of the EAGLE run when they are there (same seed and --heldout: the same
# held-out prompts), else the target writes them once for both. Weights are saved in bfloat16 (Medusa
# 22 MB, the draft 29 MB): split them (`split -b 15M`) to carry them back from the machine.
set -euo pipefail
G=/tmp/gpu
mkdir -p "$G"
[ -f "$G/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat "$G/gguf.part1" .gpu/b/gguf.part2 > "$G/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -d "$G/train" ] || tar xJf .gpu/b/train.tar.xz -C "$G"
export SPECDECODE_CACHE="$G/cache" PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
SAMPLES=()
[ -f "$G/eagle/work/samples.jsonl" ] && SAMPLES=(--samples-file "$G/eagle/work/samples.jsonl")
COMMON=(--target "$G/SmolLM2-135M-Instruct.Q4_1.gguf" --data "$G/train" --samples "${N:-6000}" --heldout 128
        --max-new-tokens 256 --gen-batch 512 --batch-size 32 --max-len 1024 --eval-every 500 --eval-prompts 16
        --bf16 --device cuda --seed 0 --save-dtype bfloat16)
python3 -m specdecode.cli.commands train medusa "${COMMON[@]}" "${SAMPLES[@]}" --out "$G/medusa" --heads 4 --draft-vocab 4096 \
    --steps "${MEDUSA_STEPS:-2000}" --lr 1e-3 --warmup 100
[ ${#SAMPLES[@]} -gt 0 ] || SAMPLES=(--samples-file "$G/medusa/work/samples.jsonl")
python3 -m specdecode.cli.commands train draft "${COMMON[@]}" "${SAMPLES[@]}" --out "$G/draft" --layers 2 --hidden 256 \
    --steps "${DRAFT_STEPS:-3000}" --lr 2e-3 --warmup 200
