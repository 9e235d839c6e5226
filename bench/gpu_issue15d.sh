#!/usr/bin/env bash
# Device call 2 (issue 15, session 5): the reference against itself with N runners side by side,
# then one replay RL step (real candidates through the evaluator) with its phase split.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
N=${N:-6}
timeout 200 python bench/evaluator.py --kernelbench .bench_data/kernelbench --only ref_self --repeats 2 \
    --workers "$N" --out "$OUT/ref_self_side_by_side.json" 2>&1 | tail -16
timeout 370 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 2 \
    --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | tail -25
