"""Shared test fixtures: a tiny offline tokenizer and model, the bundled tasks.

Triton runs through its interpreter on CPU; TRITON_INTERPRET must be set before any
`@triton.jit` is applied, so it is set here, before test modules import anything.

Inductor's CPU tests compile C++ without SIMD intrinsics (the same graphs and fusions, ~3x
faster to compile). That is fixed for the whole run here, before torch._inductor is imported:
inductor reads the setting into per-process caches (the chosen vector ISA), so switching it per
test made a test's outcome depend on which tests had compiled before it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"  # read once, when torch._inductor.config is imported

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_KERNELBENCH = ROOT.parent / "shared" / "kernelbench"

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(directory: Path):
    """A byte-level BPE tokenizer trained in a second on code-like text, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [p.read_text() for p in (ROOT / "drkernel" / "data" / "tasks").glob("*.py")]
    corpus += ["import triton\nimport triton.language as tl\n@triton.jit\ndef kernel(x_ptr, n):\n"
               "    pid = tl.program_id(0)\n```python\nclass ModelNew(nn.Module):\n```\n"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHATML
    fast.padding_side = "left"
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_tok")
    build_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir) -> Path:
    """A saved tiny random Qwen2 with the tiny tokenizer: loadable by `from_pretrained(path)`."""
    from tests.tiny_lm import tiny_random_model

    d = tmp_path_factory.mktemp("tiny_model")
    model = tiny_random_model(vocab_size=len(tiny_tokenizer))
    model.config.eos_token_id = tiny_tokenizer.eos_token_id
    model.config.pad_token_id = tiny_tokenizer.pad_token_id
    model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def kernelbench_path() -> Path:
    if not SHARED_KERNELBENCH.is_dir():
        pytest.skip("../shared/kernelbench is not present")
    return SHARED_KERNELBENCH


@pytest.fixture
def fresh_accelerate_state():
    """Each Trainer/SFT run builds its own Accelerator; start (and leave) a test with a clean
    shared Accelerate state."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def recursion_limit_as_found():
    """Inductor raises the interpreter's recursion limit when it compiles a graph its cache lacks;
    restored after every test, so that how deep a parse may nest does not depend on the tests
    that ran before (or on a warm inductor cache)."""
    import sys

    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)
