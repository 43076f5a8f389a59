#!/usr/bin/env bash
# The CPU route of issue 57 (no GPU at hand): an EAGLE-3-architecture head for SmolLM2-135M-Instruct fine-tuned on
# this machine, niced (the machine is shared), on the target's own answers kept in data/answers (never Spec-Bench).
# Runs add up: the head starts from HEAD_INIT (default: the shipped head, an EAGLE-3 head since 2026-11-28's GPU run;
# a head of specdecode's first architecture is converted as a warm start), and OUT keeps the checkpoint a rerun
# resumes from.
# Report of the run that made the committed curve: benchmarks/results/eagle3-cpu-route-smollm2.md.
set -euo pipefail
OUT=${OUT:-/tmp/x/eagle3-cpu}
SAMPLES=${SAMPLES:-16}  # answers taken from the archive (shuffled, seed 7); features are the target's forward
INIT=${HEAD_INIT:-specdecode/drafts/smollm2-135m-instruct-eagle}
mkdir -p "$OUT"
[ -f "$OUT/samples.jsonl" ] || xz -dc data/answers/smollm2-135m-instruct-h200-float-22k.jsonl.xz | python3 -c "
import random, sys
lines = sys.stdin.readlines(); random.seed(7); random.shuffle(lines); sys.stdout.writelines(lines[:$SAMPLES])" \
    > "$OUT/samples.jsonl"
nice -n 15 python3 -m specdecode.cli.commands train eagle --target smollm2-135m-instruct \
    --samples-file "$OUT/samples.jsonl" --out "$OUT/run" --heldout 4 --init "$INIT" --arch eagle3 --vocab-swaps 0 \
    --steps 100000 --train-seconds "${SECONDS_BUDGET:-1500}" --batch-size 2 --max-len 192 --lr 3e-4 --warmup 3 \
    --ttt-steps 5 --eval-every 4 --feature-cache disk --device cpu --seed 1 "$@"
