#!/usr/bin/env bash
# One device call (issue 15, session 6): evaluation throughput for 1 and N runners per GPU (jobs
# requeued while their GPU memory does not fit, two alone holds per job), the reference against
# itself with N runners side by side, then one replay RL step with its phase split. Each stage
# has its own timeout so that one overrun leaves the others' results.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
WORKERS=${WORKERS:-1,6}
N=${N:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 300 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers "$WORKERS" \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -45
timeout 90 python bench/evaluator.py --kernelbench .bench_data/kernelbench --only ref_self --repeats 2 \
    --workers "$N" --out "$OUT/ref_self_side_by_side.json" 2>&1 | tail -14
timeout 190 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 1 \
    --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | tail -14
