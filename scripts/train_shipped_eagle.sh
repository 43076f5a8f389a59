#!/usr/bin/env bash
# How the shipped EAGLE head for SmolLM2-135M-Instruct was trained: on a rented GPU (an H100), from the
# repo root, with the GGUF reassembled from two carried halves and the training prompts unpacked in
# /tmp/gpu. On a machine with the package installed, the same command runs without the set-up lines.
set -euo pipefail
G=/tmp/gpu
mkdir -p "$G"
[ -f "$G/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat "$G/gguf.part1" .gpu/b/gguf.part2 > "$G/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -d "$G/train" ] || tar xJf .gpu/b/train.tar.xz -C "$G"
export SPECDECODE_CACHE="$G/cache" PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
python3 -m specdecode.cli.commands train eagle --target "$G/SmolLM2-135M-Instruct.Q4_1.gguf" --data "$G/train" \
    --out "$G/eagle" --samples "${SAMPLES:-6000}" --heldout 128 --max-new-tokens 256 --gen-batch 512 \
    --steps "${STEPS:-1800}" --batch-size 32 --max-len 1024 --lr 6e-4 --warmup 100 --ttt-steps 5 \
    --draft-vocab 8192 --eval-every 300 --bf16 --device cuda "$@"
