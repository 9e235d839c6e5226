#!/usr/bin/env bash
# One device call (issue 15, session 6): what the judge's per-call steps cost on real KernelBench
# sizes, then evaluation throughput for 1 and N runners per GPU with the lock and memory waits of
# every job (details.lock_wait_s, memory_wait_s, overhead_s). Each stage has its own timeout.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
WORKERS=${WORKERS:-1,6,8}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
timeout 80 python bench/judge_costs.py --kernelbench .bench_data/kernelbench --json "$OUT/judge_costs.json" 2>&1 | tail -8
timeout 480 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers "$WORKERS" \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -60
