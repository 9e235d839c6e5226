#!/usr/bin/env bash
# Device call 1 (issue 15, session 5): evaluation throughput for 1, 6 and 8 runners per GPU (run 3), with
# the pre-flight import, re-runs alone and the time split per judge phase.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 560 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers ${WORKERS:-1,6,8} \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -70
