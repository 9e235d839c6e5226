#!/usr/bin/env bash
# One device call: a smoke evaluation, then the evaluator and hack benchmarks (issue 14).
# Carry .bench_data (KernelBench copy). Results flat in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python -m drkernel.evaluator --reference drkernel/data/tasks/1_ReLU.py \
    --candidate drkernel/data/solutions/1_ReLU.py --device cuda --json 2>&1 | tail -1 | tee "$OUT/smoke.json"
timeout "${EVAL_S:-280}" python bench/evaluator.py --kernelbench .bench_data/kernelbench --repeats 2 \
    --out "$OUT/evaluator.json" 2>&1 | tail -40
timeout "${HACKS_S:-260}" python bench/hacks.py --kernelbench .bench_data/kernelbench --out "$OUT/hacks.json" 2>&1 | tail -75
