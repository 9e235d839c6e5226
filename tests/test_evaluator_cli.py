"""`python -m drkernel.evaluator`: flags, defaults in --help, value and device checks, exit status
and the JSON line. `main` runs in-process; `evaluate` is a recording fake except in the one
end-to-end run."""

import json
import math
import os
from pathlib import Path

import pytest

import drkernel.evaluator as evaluator
from drkernel.evaluator import VERDICTS, EvalConfig, EvalResult

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "drkernel" / "data" / "tasks" / "1_ReLU.py"
CANDIDATE = ROOT / "drkernel" / "data" / "solutions" / "1_ReLU.py"
FILES = ["--reference", str(REFERENCE), "--candidate", str(CANDIDATE)]


class FakeEvaluate:
    """Stands in for `drkernel.evaluator.evaluate`: records each configuration, answers `correct`."""

    def __init__(self):
        self.configs: list[EvalConfig] = []

    def __call__(self, reference, candidate, cfg=None, reward_config=None):
        self.configs.append(cfg)
        return EvalResult(verdict="correct", compiled=True, correct=True, device=cfg.device)


@pytest.fixture
def fake(monkeypatch):
    recorder = FakeEvaluate()
    monkeypatch.setattr(evaluator, "evaluate", recorder)
    return recorder


@pytest.fixture
def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_underscore_and_dashed_spellings_reach_the_config(fake, capsys, tmp_path):
    cache = str(tmp_path / "cache")
    code = evaluator.main([*FILES, "--device", "cpu", "--perf_trials", "7", "--cpu-perf-trials", "2",
                           "--warmup", "0", "--max_rss_mb", "4096", "--atol", "0.5", "--rtol_fp32", "0.25",
                           "--profile", "false", "--no-second-distribution", "--require_triton", "false",
                           "--require-confinement", "false", "--cache_dir", cache, "--seed", "3"])
    assert code == 0
    (cfg,) = fake.configs
    assert (cfg.perf_trials, cfg.cpu_perf_trials, cfg.warmup, cfg.max_rss_mb, cfg.seed) == (7, 2, 0, 4096, 3)
    assert (cfg.atol_fp32, cfg.rtol_fp32, cfg.cache_dir) == (0.5, 0.25, cache)
    assert not (cfg.profile or cfg.second_distribution or cfg.require_triton or cfg.require_confinement)
    assert cfg.trials == EvalConfig().trials  # an unset flag keeps the dataclass default
    assert "verdict: correct" in capsys.readouterr().out


def test_help_shows_every_default_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as exit_:
        evaluator.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1].split("\n  --")  # one entry per flag
    defaults = EvalConfig()
    for name in ("device", "trials", "perf_trials", "cpu_perf_trials", "warmup", "timeout", "seed", "atol_fp32",
                 "rtol_fp32", "profile", "second_distribution", "require_triton", "require_confinement",
                 "cache_dir", "max_rss_mb"):
        entry = next((" ".join(o.split()) for o in options if o.startswith(f"{name} ")), None)
        assert entry is not None, f"--{name} missing from --help"
        assert f"(default: {getattr(defaults, name)!r})" in entry, entry
    assert "exit status" in text and "usage error" in text


def test_bad_flag_with_json_exits_2_with_a_json_line(fake, capsys):
    assert evaluator.main([*FILES, "--bogus", "1", "--json"]) == 2
    captured = capsys.readouterr()
    assert last_json(captured.out) == {"error": "unrecognized arguments: --bogus 1", "usage_error": True}
    assert "--bogus" in captured.err
    assert fake.configs == []


@pytest.mark.parametrize("flag, value", [
    ("--timeout", "0"), ("--timeout", "-5"), ("--timeout", "nan"), ("--timeout", "inf"), ("--trials", "0"),
    ("--perf_trials", "0"), ("--cpu_perf_trials", "0"), ("--warmup", "-1"), ("--atol", "0"),
    ("--rtol_fp32", "nan"), ("--max_rss_mb", "-1"), ("--max_rss_mb", "10"), ("--seed", "-1"), ("--trials", "1.5"), ("--profile", "maybe"),
])
def test_bad_values_are_usage_errors_not_verdicts(fake, capsys, flag, value):
    assert evaluator.main([*FILES, "--device", "cpu", flag, value, "--json"]) == 2
    out = last_json(capsys.readouterr().out)
    assert out["usage_error"] is True and flag in out["error"]
    assert fake.configs == []


def test_a_memory_limit_the_runner_alone_exceeds_is_refused_and_0_means_the_default(fake, capsys):
    # below about 900 MB the runner fails before any candidate code runs, and the candidate was blamed
    assert evaluator.main([*FILES, "--device", "cpu", "--max_rss_mb", "600", "--json"]) == 2
    assert "the candidate would be blamed" in last_json(capsys.readouterr().out)["error"]
    assert evaluator.main([*FILES, "--device", "cpu", "--max_rss_mb", "0", "--json"]) == 0
    assert fake.configs[-1].max_rss_mb == 0


def test_cuda_without_a_gpu_is_a_usage_error(fake, no_gpu, capsys):
    for device in ("cuda", "cuda:0"):
        assert evaluator.main([*FILES, "--device", device, "--json"]) == 2
        out = last_json(capsys.readouterr().out)
        assert out["usage_error"] is True and "no GPU" in out["error"]
    assert fake.configs == []


def test_cuda_index_out_of_range_is_a_usage_error(fake, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert evaluator.main([*FILES, "--device", "cuda:1", "--json"]) == 2
    assert "only 1 GPU" in last_json(capsys.readouterr().out)["error"]
    assert evaluator.main([*FILES, "--device", "cuda:0", "--json"]) == 0
    assert [c.device for c in fake.configs] == ["cuda:0"]


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "gpu"])
def test_unknown_device_is_a_usage_error(fake, capsys, device):
    assert evaluator.main([*FILES, "--device", device, "--json"]) == 2
    error = last_json(capsys.readouterr().out)["error"]
    assert "--device" in error and device in error, error
    assert fake.configs == []


def test_missing_file_is_a_usage_error(fake, tmp_path, capsys):
    missing = str(tmp_path / "missing.py")
    assert evaluator.main(["--reference", str(REFERENCE), "--candidate", missing, "--device", "cpu", "--json"]) == 2
    assert "no such file" in last_json(capsys.readouterr().out)["error"]
    os.mkfifo(tmp_path / "fifo.py")
    for odd in (tmp_path, tmp_path / "fifo.py"):  # there, but not a file to read
        assert evaluator.main(["--reference", str(REFERENCE), "--candidate", str(odd), "--device", "cpu", "--json"]) == 2
        assert "not a regular file" in last_json(capsys.readouterr().out)["error"]
    assert fake.configs == []


def test_an_unreadable_file_is_a_usage_error(fake, capsys, monkeypatch):
    """A file this user may not read is the caller's mistake, not the candidate's `runtime_error`
    (root reads every file, so the permission is what `os.access` says here)."""
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(REFERENCE))
    assert evaluator.main([*FILES, "--device", "cpu", "--json"]) == 2
    assert "cannot read" in last_json(capsys.readouterr().out)["error"] and fake.configs == []


def test_usage_error_without_json_prints_nothing_on_stdout(fake, capsys):
    assert evaluator.main([*FILES, "--trials", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--trials" in captured.err


def test_real_cpu_evaluation_through_the_cli(capsys):
    """The bundled ReLU task and solution, evaluated for real: exit 0 and the result as JSON."""
    code = evaluator.main([*FILES, "--device", "cpu", "--trials", "1", "--cpu_perf_trials", "1",
                           "--second_distribution", "false", "--timeout", "120", "--json"])
    assert code == 0
    result = last_json(capsys.readouterr().out)
    assert result["verdict"] in VERDICTS and result["device"] == "cpu"
    assert result["wall_s"] is not None and math.isfinite(result["wall_s"])


def test_cli_parent_leaves_torch_to_the_fork_server():
    """Importing the CLI and parsing a default command line (device auto) import no torch: in the
    parent that import would come before the fork server starts, seconds of the CLI's wall time."""
    import subprocess
    import sys

    code = ("import sys; from drkernel import evaluator as e; "
            f"cmd = e._parse({FILES!r}); print(cmd.cfg.device, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["auto", "False"]


def test_auto_on_a_gpu_host_whose_torch_lacks_cuda_says_so(tmp_path):
    """nvidia-smi lists a GPU, torch has no CUDA: with device auto the fork servers start without
    Triton's interpreter, so the judge names the mismatch instead of failing the candidate's kernels."""
    import os
    import stat
    import subprocess
    import sys

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.00'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}"}
    env.pop("TRITON_INTERPRET", None)
    args = [*FILES, "--trials", "1", "--second_distribution", "false", "--cache_dir", str(tmp_path / "c"), "--json"]
    out = subprocess.run([sys.executable, "-m", "drkernel.evaluator", *args], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    result = last_json(out.stdout)
    assert result["verdict"] == "runtime_error", out.stderr
    assert "nvidia-smi lists a GPU" in result["error"]


def test_module_run_keeps_exit_status_and_json_line_through_a_pipe():
    """`python -m drkernel.evaluator` ends without interpreter teardown: its exit status and its
    last stdout line (a pipe, so block-buffered) must still come out."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-m", "drkernel.evaluator", *FILES, "--trials", "zero", "--json"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert last_json(out.stdout)["usage_error"] is True


def test_a_cache_dir_that_is_a_file_is_a_usage_error(fake, tmp_path, capsys):
    """The cache skips entries it cannot write: a file there would silently cache nothing."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert evaluator.main([*FILES, "--device", "cpu", "--cache_dir", str(a_file), "--json"]) == 2
    out = last_json(capsys.readouterr().out)
    assert out["usage_error"] is True and out["error"] == f"--cache_dir {a_file}: is a file, not a directory"
    assert fake.configs == []
