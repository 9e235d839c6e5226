"""What an evaluation is asked and what it answers: `EvalConfig`, `EvalResult`, the verdicts and
the hack codes. Every module of the environment (evaluator, judge, cache, rewards, rollout) speaks
these types; they cross process boundaries as `dataclasses.asdict` and are rebuilt on arrival.
"""

from __future__ import annotations

import dataclasses
import json
import math

from drkernel.config import NON_NEGATIVE, POSITIVE, SEED, Limit, OneOf

# `reference_error`: the reference itself failed (import, build, inputs, forward); never the
# candidate's fault, never a reward signal.
VERDICTS = ("correct", "incorrect", "compile_error", "runtime_error", "timeout", "crashed", "hacked",
            "reference_error")
BASELINES = ("eager", "compile")  # what speedups are measured against (EvalConfig.baseline)
HACK_CODES = ("no_triton_kernel", "decoy_kernel", "output_cached", "output_aliases_input", "side_stream",
              "patched_function", "global_state_changed", "reference_access", "input_mutated",
              "bad_output_type", "degenerate_output", "precision_downgrade", "implausible_speedup",
              "thread_spawned", "reference_slowed", "forged_reply", "launch_pattern_changed")


@dataclasses.dataclass
class EvalConfig:
    # what each setting accepts, for every script that mirrors it (drkernel.config: LIMITS, SHARED)
    LIMITS = {"device": OneOf(pattern=r"auto|cpu|cuda(:\d+)?", text="auto, cpu, cuda or cuda:N"),
              "baseline": OneOf(BASELINES), "trials": Limit(1, 1000, why="each trial is a full call of both models"),
              "perf_trials": Limit(1, 100_000), "cpu_perf_trials": Limit(1, 100_000), "warmup": Limit(0, 10_000), "timeout": Limit(0, 7 * 86400, low_open=True, why="seconds, at most a week"), "atol_fp32": POSITIVE, "rtol_fp32": POSITIVE,
              "atol_half": POSITIVE, "rtol_half": POSITIVE, "rel_l2_fp32": POSITIVE, "rel_l2_half": POSITIVE,
              "loose_tol": POSITIVE, "seed": SEED,
              "max_rss_mb": Limit(2048, zero="the sandbox's default", why="a runner needs about 900 MB on a CPU, more "
                                  "with a CUDA context, before any candidate code runs; below this the candidate "
                                  "would be blamed for the runner's own memory"),
              "idle_probe_ms": POSITIVE, "idle_wait_s": NON_NEGATIVE, "max_speedup_recheck": POSITIVE}

    device: str = "auto"  # cpu | cuda | cuda:N | auto
    trials: int = 5
    perf_trials: int = 100
    warmup: int = 3
    timeout: float = 180.0
    atol_fp32: float = 1e-4
    rtol_fp32: float = 1e-4
    atol_half: float = 1e-2  # fp16 / bf16 outputs
    rtol_half: float = 1e-2
    rel_l2_fp32: float = 1e-3  # ||out - ref|| / ||ref||
    rel_l2_half: float = 2e-2
    loose_tol: float = 1e-2  # precision_downgrade: passes this but not the fp32 tolerance
    seed: int = 42
    second_distribution: bool = True
    l2_flush: bool = True
    profile: bool = True
    max_speedup_recheck: float = 20.0
    cpu_perf_trials: int = 3
    # implausible if candidate_ms < factor * bytes / bandwidth, bandwidth = the larger of a 1 GiB
    # device copy and what the reference itself achieved (a 256 MB copy measured slower than
    # torch's own ReLU on the H200, which flagged the reference timed against itself)
    roofline_factor: float = 0.9
    side_stream_slack_ms: float = 0.1  # reference_slowed: absolute slack
    # The runner's time per call counts only while the judge's own clock agrees: judge time minus
    # the calibrated per-call overhead may exceed it by at most max(slack_ms, slack_frac x time)
    # (honest H200 calls measured up to 0.21 ms over); beyond, side_stream and the judge's clock.
    clock_slack_ms: float = 0.3
    clock_slack_frac: float = 0.1
    cpu_clock_slack_ms: float = 25.0  # a loaded 2-core CPU delays a process by milliseconds
    # Refuse to evaluate (runtime_error) when the kernel cannot confine the runner completely
    # (Landlock, network namespace, no capabilities). False only on a machine that lacks a layer
    # and only for code you trust: an unconfined runner can reach other jobs and the network.
    require_confinement: bool = True
    # On-disk results keyed by both codes, these settings and the environment (drkernel.evalcache);
    # empty: no cache.
    cache_dir: str = ""
    ref_isolated_trials: int = 10  # reference alone before the candidate exists (roofline bandwidth)
    timing_block_calls: int = 10  # reference and candidate timings alternate in blocks of this many calls
    min_perf_trials: int = 20  # timing stops early once this many calls give a precise enough speedup
    speedup_precision: float = 0.01  # width of the speedup's 95 % bootstrap interval, relative
    ref_slowdown_limit: float = 1.5  # reference_slowed: reference after a candidate call > limit x after its own (+ slack)
    # Before a measurement the GPU must be idle: a tiny probe kernel, launched and synchronised,
    # must come back within this many ms (an idle H200: ~0.02 ms; next to another context's long
    # kernel: a time slice, >= 1 ms); the judge waits at most `idle_wait_s` for that.
    idle_probe_ms: float = 0.5
    idle_wait_s: float = 60.0
    max_rss_mb: int = 0  # 0: no limit beyond the sandbox default
    # False only to measure torch-only candidates (baselines, the reference timed against itself):
    # then no Triton launch is required and the decoy checks are off. Never for rewards.
    require_triton: bool = True
    # What speedups are measured against: the reference as written ("eager") or its forward under
    # torch.compile ("compile", compiled once per job, outside the timing; correctness is always
    # judged against the eager reference).
    baseline: str = "eager"


@dataclasses.dataclass
class EvalResult:
    verdict: str = "crashed"
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None  # the median of the timed pairs' own ratios (reference / candidate)
    ref_ms: float | None = None
    candidate_ms: float | None = None
    hacks: list = dataclasses.field(default_factory=list)
    error: str | None = None
    device: str | None = None
    timing: str | None = None
    trials_passed: int = 0
    trials: int = 0
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    speedup_interval: list | None = None  # 95 % bootstrap interval [low, high] of the speedup
    # whether that interval is narrower than `speedup_precision` asked (False: the most calls
    # allowed did not get there; the speedup is then a rough number)
    speedup_precise: bool | None = None
    baseline: str | None = None  # what the speedup was measured against: eager | compile
    # share of device time in the candidate's own Triton kernels whose writes reach the output
    triton_time_share: float | None = None
    kernels: list | None = None
    reward: float | None = None
    reward_terms: dict | None = None
    wall_s: float | None = None
    stdout: str = ""
    stderr: str = ""
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default)

    @classmethod
    def from_dict(cls, data: dict) -> "EvalResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def config_from_dict(data: dict) -> EvalConfig:
    """The `EvalConfig` a process boundary carried as a dict (unknown keys are ignored)."""
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    return EvalConfig(**{k: v for k, v in data.items() if k in names})


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return repr(o)
