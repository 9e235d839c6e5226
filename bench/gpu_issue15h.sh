#!/usr/bin/env bash
# One device call (issue 15, session 6): the replay RL step with its phase split, then evaluation
# throughput for N runners per GPU against run 6's 1-worker pass (--baseline). Each stage has its
# own timeout so that one overrun leaves the others' results.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
N=${N:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 210 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 1 \
    --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | grep -v "it/s" | tail -16
timeout 280 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers "${WORKERS:-6,8}" \
    --baseline bench/results/eval_throughput_h200_run6.json --json "$OUT/eval_throughput.json" 2>&1 | tail -45
