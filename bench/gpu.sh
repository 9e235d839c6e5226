#!/usr/bin/env bash
# Every GPU measurement of this project, as stages of one device call (each under its own timeout,
# so that one overrun leaves the others' results; JSON lands flat in $OUT). Before the call:
#   cp -r ../shared/kernelbench .bench_data/kernelbench      # carried: carry=[".bench_data"]
#   python bench/rl_step.py --save-vocab                     # rl_step: .bench_data/qwen.tiktoken
# STAGES picks, in order (default: all, about 25 minutes on one H200, plus up to 5 for rl_step):
#   hacks       every hack, legit, fault and attack fixture through the evaluator (bench/hacks.py; HACKS_S seconds,
#               HACKS_ARGS passed on, e.g. "--only renice,seed_schedule" (substrings of file names); on a
#               cold machine all 170 fixtures take more than 480 s)
#   neighbours  4 honest kernels alone, then beside a hostile one with 4 runners (bench/neighbours.py)
#   ref_self    the reference against itself: 20 repeats of the launch-bound MobileNetV1/V2 and
#               ResNet18, then every level-1-3 problem once (bench/ref_self.py; REF_SELF_S seconds,
#               REF_SELF_ARGS passed on, e.g. "--repeats 0 --levels 2,3" or "--levels none", REF_SELF_TAG
#               names the JSON)
#   solutions_eager, solutions_compile  bench/solutions against the eager or the torch.compile
#               baseline (bench/evaluator.py; its JSON is rewritten after each solution; COMPILE_S
#               seconds for the compile one, each of whose references is compiled first)
#   throughput_full  candidates a minute on the full-size mixed set, 1 and N runners (FULL_WORKERS
#               picks other counts) (bench/eval_throughput.py --set full)
#   throughput_rl    candidates a minute on the RL-shaped batch, 8 problems x 16 candidates, N runners
#               (its 1-runner pass, estimated at 9 minutes, fits no call beside another: RL_WORKERS=1 RL_TAG=_serial
#               in one call, then RL_BASELINE=<that JSON, copied into bench/results> in the next; RL_S
#               seconds)
#   rl_step     one RL step whose responses are replayed candidates, so the trainer's own evaluator
#               judges 64 real kernels with N runners; time per phase (bench/rl_step.py --policy replay)
#   cli         the evaluator CLI's wall time for one level-1 evaluation, three times; then where
#               the time goes (import and CUDA start-up times, the CLI's slowest imports)
#   costs       the judge's per-call costs on real sizes (bench/judge_costs.py)
#   profiler    (only when named) launch-bound models timed before and after one profiled call in one process
#               (bench/profiler_after.py): a profiler left behind slows what the process times next
# After the call each $OUT/<name>.json replaces bench/results/<name>_<card>.json (h200, h100), and its headline
# numbers go on top of that benchmark's history table in docs/benchmarks.md.
set -u
export PYTHONUNBUFFERED=1
# The device image's site-packages keeps no bytecode (each process compiled torch's 1,700 modules,
# about 3 s); a pip install keeps it, so the figures here do too
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/drkernel-pycache}
unset PYTHONDONTWRITEBYTECODE  # where the image sets it, the prefix above stays empty
OUT=${OUT:-bench/results}
KB=${KB:-.bench_data/kernelbench}
N=${N:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for stage in ${STAGES:-hacks neighbours ref_self solutions_eager solutions_compile throughput_full throughput_rl rl_step cli costs}; do
    echo "== $stage"
    case $stage in
    hacks) timeout "${HACKS_S:-480}" python bench/hacks.py --kernelbench "$KB" ${HACKS_ARGS:-} --out "$OUT/hacks.json" 2>&1 | tail -80 ;;
    neighbours) timeout 180 python bench/neighbours.py --kernelbench "$KB" --workers 4 \
        --out "$OUT/neighbours.json" 2>&1 | tail -12 ;;
    ref_self) timeout "${REF_SELF_S:-420}" python bench/ref_self.py --kernelbench "$KB" ${REF_SELF_ARGS:-} \
        --out "$OUT/ref_self${REF_SELF_TAG:-}.json" 2>&1 | tail -40 ;;
    solutions_eager) timeout 210 python bench/evaluator.py --kernelbench "$KB" --n-ref 0 --repeats 1 \
        --out "$OUT/solutions_eager.json" 2>&1 | tail -20 ;;
    solutions_compile) timeout "${COMPILE_S:-240}" python bench/evaluator.py --kernelbench "$KB" --n-ref 0 --repeats 1 \
        --baseline compile --out "$OUT/solutions_compile.json" 2>&1 | tail -20 ;;
    throughput_full) timeout 420 python bench/eval_throughput.py --kernelbench "$KB" --set full \
        --workers "${FULL_WORKERS:-1,$N}" --json "$OUT/eval_throughput_full.json" 2>&1 | tail -60 ;;
    throughput_rl) timeout "${RL_S:-300}" python bench/eval_throughput.py --kernelbench "$KB" --set rl \
        --workers "${RL_WORKERS:-$N}" ${RL_BASELINE:+--baseline "$RL_BASELINE"} \
        --json "$OUT/eval_throughput_rl${RL_TAG:-}.json" 2>&1 | tail -40 ;;
    rl_step) timeout 300 python bench/rl_step.py --tasks "$KB" --policy replay --steps 1 \
        --out "$OUT/rl_step_replay.json" -- --eval_workers "$N" 2>&1 | grep -v "it/s" | tail -16 ;;
    cli)
        python -c "from drkernel.tasks import load_kernelbench as l
open('/tmp/ref.py', 'w').write(next(t for t in l('$KB', 1) if t.problem_id == 19).code)"
        for i in 1 2 3; do
            /usr/bin/time -f "cli wall %e s" python -m drkernel.evaluator --reference /tmp/ref.py \
                --candidate bench/solutions/level1_19_ReLU.py --json 2>&1 | tail -2
        done
        env -u PYTHONPYCACHEPREFIX python -c "import torch, os; print('torch bytecode beside the source:', os.path.exists(torch.__cached__))"
        python -c "import sys; print('bytecode written:', not sys.flags.dont_write_bytecode, 'prefix:', sys.pycache_prefix)"
        python -c "import time; t = time.perf_counter(); import torch; a = time.perf_counter(); import triton
b = time.perf_counter(); torch.zeros(1, device='cuda'); c = time.perf_counter()
print(f'import torch {a - t:.2f} s, import triton {b - a:.2f} s, CUDA context {c - b:.2f} s')"
        # the CLI ends without the interpreter's teardown, so cProfile would never print: the
        # slowest imports of the CLI's own process instead (microseconds, cumulative)
        python -X importtime -m drkernel.evaluator --reference /tmp/ref.py \
            --candidate bench/solutions/level1_19_ReLU.py 2>&1 | grep "^import time" | sort -t'|' -k2 -n | tail -12 ;;
    profiler) timeout 240 python bench/profiler_after.py --kernelbench "$KB" --out "$OUT/profiler_after.json" 2>&1 | tail -12 ;;
    costs) timeout 60 python bench/judge_costs.py --kernelbench "$KB" --problems 1:19,1:36,2:12 \
        --json "$OUT/judge_costs.json" 2>&1 | tail -8 ;;
    esac
done
