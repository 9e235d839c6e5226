#!/usr/bin/env bash
# Second device call: re-checks after the clock-rule change, then evaluation throughput (issue 15)
# and a replay RL step. Carry .bench_data. Results flat in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
timeout 100 python bench/hacks.py --kernelbench .bench_data/kernelbench \
    --only legit,write_outside,torch_gemm,side_stream,forged_timer,rewrite,lazy --out "$OUT/hacks_recheck.json" 2>&1 | tail -16
timeout 130 python bench/evaluator.py --kernelbench .bench_data/kernelbench --repeats 2 \
    --only level1_47,level1_49,level1_19,ref_self_L1_1,ref_self_L2_9,ref_self_L1_47 --out "$OUT/evaluator_recheck.json" 2>&1 | tail -12
timeout "${TPUT_S:-330}" python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --workers 1,4 \
    --json "$OUT/eval_throughput.json" 2>&1 | tail -45
