#!/usr/bin/env bash
# One device call (issue 15, session 5): evaluation throughput for 1 and N runners per GPU (with
# the pre-flight import, memory admission and re-runs alone), the reference against itself with
# N runners side by side, then one replay RL step with its phase split. Each stage has its own
# timeout so that one overrun leaves the others' results.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
N=${N:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 290 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers "1,$N" \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -45
timeout 75 python bench/evaluator.py --kernelbench .bench_data/kernelbench --only ref_self --repeats 2 \
    --workers "$N" --out "$OUT/ref_self_side_by_side.json" 2>&1 | tail -14
timeout 150 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 1 \
    --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | tail -12
