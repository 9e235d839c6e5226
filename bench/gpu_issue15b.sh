#!/usr/bin/env bash
# Third device call: evaluation throughput after the lock change, and one replay RL step.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
timeout 330 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers 1,4 \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -40
timeout 200 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 2 \
    --out "$OUT/rl_step_replay.json" 2>&1 | tail -25
