"""bench/rl_step.py: the Qwen2.5 tokenizer built from the BPE ranks file, a tiny end-to-end run
through the real trainer on KernelBench level 1 without the `datasets` package (as on the GPU box),
and the replay policy (candidates of bench/candidates.py instead of the model's text)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELBENCH = ROOT.parent / "shared" / "kernelbench"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_rl_step", ROOT / "bench" / "rl_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rl_step = _load_bench()


@pytest.fixture(scope="module")
def tokenizer():
    return rl_step.qwen25_tokenizer(rl_step.find_vocab_file(None))


def test_qwen25_tokenizer_ids_and_template(tokenizer):
    # ids of Qwen2/2.5's vocabulary: "user" 872, "\n" 198, "import" 474, " torch" 7834
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "import torch"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nimport torch<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert ids[:5] == [151644, 872, 198, 474, 7834] and ids[5] == 151645
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (151645, 151643, 151665)
    text = "class ModelNew(nn.Module):\n    def forward(self, x):  # 12 héllo\n        return x * 2"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.convert_tokens_to_ids("<|file_sep|>") == 151664


@pytest.mark.slow
@pytest.mark.skipif(not KERNELBENCH.is_dir(), reason="needs ../shared/kernelbench")
def test_tiny_rl_step_without_datasets(tmp_path, monkeypatch, fresh_accelerate_state):
    monkeypatch.setitem(sys.modules, "datasets", None)  # the GPU box has no `datasets`
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # main() sets it; undone after the test
    out = tmp_path / "rl_step.json"
    assert rl_step.main(["--device", "cpu", "--tiny", "--layers", "1", "--tasks", str(KERNELBENCH),
                         "--num-tasks", "1", "--num-generations", "2", "--max-new-tokens", "3", "--steps", "1",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["tasks_per_step"] == 1 and result["config"]["skip_zero_advantage"] is False
    (step,) = result["steps"]
    # 1 task x 2 trajectories x 2 turns, each turn exactly max_new_tokens (a random model never says EOS)
    assert step["turns"] == 4 and step["gen_tokens"] == 4 * 3 and step["truncated"] == 4
    assert sum(step["verdicts"].values()) == 4 and set(step["verdicts"]) <= {
        "turn1:format_error", "turn2:format_error"}
    assert step["n_evaluated"] == 0 and step["evaluate_s"] == 0.0
    # every sample is forwarded although every advantage is 0
    assert step["update_samples"] == 4 and step["update_tokens"] > 4 * 100
    assert step["generate_s"] > 0 and step["update_s"] > 0
    assert sum(step["phases_s"].values()) == pytest.approx(step["step_s"], rel=1e-6)


# ---- the replay policy ------------------------------------------------------------------------

def _replay_candidates():
    from bench.candidates import bundled_solutions, corrupt, fixtures

    sols = bundled_solutions()
    return sols + [c for s in sols for c in corrupt(s)] + [c for c in fixtures() if not c.cuda_only]


def test_replay_generator_answers_each_prompt_with_a_candidate_of_its_task(tiny_tokenizer):
    from drkernel.generation import GenerationConfig
    from drkernel.prompts import extract_code, first_turn_messages, render_prompt

    cands = _replay_candidates()
    calls = []
    gen = rl_step.ReplayGenerator(cands, lambda *a: calls.append(a))
    tasks = {t.name: t for t in gen.tasks}
    order = [tasks["4_Softmax.py"], tasks["1_ReLU.py"], tasks["4_Softmax.py"], tasks["8_LayerNorm.py"]]
    prompts = [tiny_tokenizer(render_prompt(first_turn_messages(t), tiny_tokenizer),
                              add_special_tokens=False)["input_ids"] for t in order]
    outs = gen(None, tiny_tokenizer, prompts, GenerationConfig(seed=7))
    assert len(calls) == 1  # the real generator still ran (its time is the generate phase)
    by_code = {extract_code(rl_step.response_text(c.code)): c for c in cands}
    for task, out in zip(order, outs):
        assert isinstance(out, rl_step.GenOutput) and out.finished
        assert out.response_ids[-1] == tiny_tokenizer.eos_token_id
        assert len(out.logprobs) == len(out.response_ids)
        code = extract_code(tiny_tokenizer.decode(out.response_ids, skip_special_tokens=True))
        assert by_code[code].task.key == task.key  # a candidate written for this prompt's task
    again = gen(None, tiny_tokenizer, prompts, GenerationConfig(seed=7))
    assert [o.response_ids for o in again] == [o.response_ids for o in outs]  # seeded
    other = gen(None, tiny_tokenizer, prompts, GenerationConfig(seed=8))
    assert [o.response_ids for o in other] != [o.response_ids for o in outs]
    rows = [{"code": extract_code(tiny_tokenizer.decode(o.response_ids, skip_special_tokens=True))} for o in outs]
    assert sum(rl_step.replayed_kinds(rows + [{"code": None}], cands).values()) == 5
    assert rl_step.replayed_kinds([{"code": None}], cands) == {"not a candidate": 1}
    with pytest.raises(LookupError):
        gen.task_of("a prompt about something else")


@pytest.mark.slow
@pytest.mark.skipif(not KERNELBENCH.is_dir(), reason="needs ../shared/kernelbench")
def test_tiny_replay_step_evaluates_real_candidates(tmp_path, monkeypatch, fresh_accelerate_state):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    out = tmp_path / "rl_step.json"
    assert rl_step.main(["--device", "cpu", "--tiny", "--layers", "1", "--tasks", str(KERNELBENCH), "--shrink",
                         "--policy", "replay", "--num-tasks", "1", "--num-generations", "2", "--num-turns", "1",
                         "--max-new-tokens", "3", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["policy"] == "replay" and result["config"]["mismatch_correction"] is False
    from bench.kernelbench_eval import solution_files

    problems = {s.key for s in solution_files()}  # + the 8 bundled tasks
    assert result["config"]["replay_tasks"] == len(problems) + 8
    (step,) = result["steps"]
    # both responses are candidates, judged by the trainer's own evaluator
    assert step["n_evaluated"] == 2 and step["evaluate_s"] > 0
    assert sum(step["replayed"].values()) == 2 and "not a candidate" not in step["replayed"]
    assert sum(step["verdicts"].values()) == 2 and "turn1:format_error" not in step["verdicts"]
    # on a CPU no turn has a profile: PRS drops the correct ones from the update
    assert step["truncated"] == 0 and step["update_samples"] == 2 - step["verdicts"].get("turn1:correct", 0)
    assert sum(step["phases_s"].values()) == pytest.approx(step["step_s"], rel=1e-6)


# ---- bad input: one line, exit status 2, before any model is built -------------------------------

def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available()


def test_rl_step_with_a_gpu_asked_for_and_missing_is_one_line(tmp_path):
    import subprocess

    if _gpu_visible():
        pytest.skip("a GPU is visible")
    out = tmp_path / "rl_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rl_step.py"), "--device", "cuda", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "rl_step.py: error: --device cuda: no GPU is visible (torch.cuda.is_available() is False); "
        "use --device cpu or auto"]
    assert not out.exists()


def _bad_vocab(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--device", "gpu"], "bad --device 'gpu': use auto, cpu, cuda or cuda:N"),
    (["--layers", "-1"], "--layers must be >= 0, got -1"),
    (["--num-tasks", "0"], "tasks_per_step must be in [1, 1e+06], got 0"),
    (["--steps", "0"], "max_steps must be in [1, 1e+06], got 0"),
    (["--levels", "x"], "levels must be a comma list of integers, not 'x'"),
    (["--", "--no_such_key", "1"], "unknown option(s) --no_such_key"),
    (["--vocab-file", "{tmp}/missing.tiktoken"], "missing.tiktoken: not a file"),
    (["--vocab-file", "{tmp}"], ": not a file"),
    (["--vocab-file", "{garbage}"], "garbage.tiktoken:2: not a qwen.tiktoken BPE ranks file"),
    (["--vocab-file", "{small}"], "small.tiktoken is not the Qwen2 vocabulary (<|endoftext|> got id 2)"),
])
def test_rl_step_on_bad_input_says_one_line_and_exits_2(args, message, tmp_path, monkeypatch, capsys):
    from bench.entry import exit_status

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # main() sets it; undone after the test
    subst = {"{tmp}": str(tmp_path), "{garbage}": _bad_vocab(tmp_path, "garbage.tiktoken", "IQ== 0\nnot base64\n"),
             "{small}": _bad_vocab(tmp_path, "small.tiktoken", "IQ== 0\nIg== 1\n")}
    args = [subst.get(a, a.replace("{tmp}", str(tmp_path))) for a in args]
    out = tmp_path / "rl_step.json"
    # a bad --tasks too: an input the check misses fails on it, after a tiny model, not after a step
    argv = ["--device", "cpu", "--tiny", "--layers", "1", "--num-tasks", "1", "--num-generations", "2",
            "--max-new-tokens", "2", "--steps", "1", "--tasks", str(tmp_path / "no_kernelbench"), "--out", str(out)]
    argv += args
    status = exit_status(lambda: rl_step.main(argv))
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last and message in last, err
    assert not out.exists()


def test_rl_step_with_a_missing_gpu_for_the_evaluator_says_so_before_building_a_model(tmp_path, monkeypatch,
                                                                                      capsys):
    from bench.entry import exit_status

    if _gpu_visible():
        pytest.skip("a GPU is visible")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setattr(rl_step, "save_random_model", lambda *a, **k: pytest.fail("built a model"))
    status = exit_status(lambda: rl_step.main(["--device", "cpu", "--out", str(tmp_path / "r.json"), "--",
                                               "--eval_device", "cuda"]))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last.endswith("error: eval_device: --device cuda: no GPU is visible "
                                         "(torch.cuda.is_available() is False); use --device cpu or auto")


def test_rl_step_dtype_is_bf16_or_fp32():
    with pytest.raises(SystemExit) as exc:  # argparse: usage and one error line, status 2
        rl_step.main(["--dtype", "fp16"])
    assert exc.value.code == 2
