#!/usr/bin/env bash
# Device calls of issue 15, session 7 (comparison passes as Triton kernels, memory estimate
# from the reference's meta-device peak, no output or input copies in the judge's trials).
# STAGES picks, in order: costs (the judge's per-call costs), throughput (evaluation for the
# worker counts in WORKERS, against BASELINE's 1-worker pass when set, with each task's memory
# estimate against its measured peaks), ref_self (the reference against itself with N runners
# side by side), rl_step (one replay RL step with its phase split). Each stage has its own
# timeout so that one overrun leaves the others' results.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
N=${N:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for stage in ${STAGES:-costs throughput}; do
    case $stage in
    costs) timeout 60 python bench/judge_costs.py --kernelbench .bench_data/kernelbench --problems 1:19,1:36,2:12 \
        --json "$OUT/judge_costs.json" 2>&1 | tail -8 ;;
    throughput) timeout 420 python bench/eval_throughput.py --kernelbench .bench_data/kernelbench \
        --workers "${WORKERS:-1,$N}" ${BASELINE:+--baseline "$BASELINE"} --json "$OUT/eval_throughput.json" 2>&1 | tail -75 ;;
    ref_self) timeout 90 python bench/evaluator.py --kernelbench .bench_data/kernelbench --only ref_self --repeats 2 \
        --workers "$N" --out "$OUT/ref_self_side_by_side.json" 2>&1 | tail -14 ;;
    rl_step) timeout 200 python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay --steps 1 \
        --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | tail -16 ;;
    esac
done
