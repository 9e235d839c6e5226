"""The judge: decides verdicts, hack codes and speedups, and never imports candidate code.

It runs as a sandbox job (`drkernel.sandbox`) whose zygote also forked, for it, a **reference
twin** (a runner that imports only the reference) and one **runner** per candidate of the group
(all candidates of one job share one reference). The judge builds the reference, makes every
input, writes it into the shared arena, asks the runners to call their model, and checks what
comes back in its own slots against the reference it computed itself. Reference and candidate are
timed the same way: each in a process of the same kind, confined the same way, answering the same
requests (`drkernel.channel`), timed by the same code, pinned to the same core.

Once per group (`Reference`), in order:

1. `setup`: device, true fp32, the reference imported and built once (a never-run template from
   which every later reference is copied), the output layout, GPU memory and lock;
2. `start_twin`: the twin attached to the arena and confined;
3. `calibrate`: trusted null calls through the twin give the judge's clock overhead per call;
4. `load_twin`: the twin builds the reference model (compiled when `baseline` is compile: the
   compile happens here, outside any timing);
5. `time_reference_alone`: the twin timed before any candidate code exists and the device copy
   bandwidth (both bound the roofline);
6. `probe_profiler`: one profiled call of the twin says whether the profiler works here.

Then per candidate (`Judge`), in order:

6. `attach_runner`: its runner attached to the arena and confined, its evidence machinery described;
7. `load_candidate`: the runner imports the candidate and builds `ModelNew`;
8. `check_correctness`: trials on fresh uniform and signed-normal inputs, each with the runner's
   data-flow log (which of its Triton launches the output needs), and among them, at a random
   place, the counterfactual calls (`check_needed`: each kernel's launches read perturbed data);
9. `time_interleaved`: twin and runner called in turn on the same inputs; the runner's CUDA-event
   times count only when they agree with this process's clock, and every call's output is
   checked before the next request;
10. `profile`: the runner's kernel trace, classified here by the kernels the candidate's source
   declares and weighed by the data flow (the Triton share of useful device time); one profiled
   call on signed inputs, and the candidate's kernels must do the same work on both kinds;
11. `final`: the runner's last integrity report; the runner is then killed.

Every input is drawn from a fresh seed (`fresh_seed`), the forward's RNG seeded from a keyed hash
of it (`forward_seed`); after each candidate call no process of the candidate's may be left and
the scheduling of the job's processes must be as it was.

On a GPU shared by several evaluations (`gpushare.DeviceLock`) the phases in a tuple of `GROUP`
and `CANDIDATE` run in one hold of the GPU alone, which starts only once the GPU is idle; every
other request holds it shared. A phase ends a candidate's evaluation by raising `Stop` (a plain
verdict) or `Hacked`; a failure of the group's own phases ends every candidate's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import time
import traceback
from typing import Any

from drkernel import compare, dataflow, ipc, launch_pattern, procfs, profiling, triton_source
from drkernel.channel import Channel, Hacked, Stop, cuda_fault, exception_text, runner_error, short
from drkernel.evaltypes import HACK_CODES, EvalConfig, EvalResult, config_from_dict

_perf = time.perf_counter
_CACHE_BYTES = 2**30  # reference outputs kept per group for later candidates' trials


@dataclasses.dataclass
class Call:
    """One call through a runner as the judge saw it: the reply, the judge's own milliseconds,
    the inputs and their seed, and the output as committed when the reply came (a copy, where kept)."""
    reply: dict
    wall_ms: float
    inputs: list
    seed: int
    signed: bool = False  # the inputs' kind: drawn from signed normals, or KernelBench's own
    output: Any = None
    ms: float | None = None  # the runner's own time for the call, where it sent a number
    before_s: float = 0.0  # the judge's seconds before the request (inputs, poison, flush)
    after_s: float = 0.0  # and after the reply (the output's copy)
    pattern: Any = None  # its launch pattern, as the runner described it (`drkernel.launch_pattern`)


@dataclasses.dataclass
class Flow:
    """What the data-flow logs of the checked calls said: per call, each launch of the candidate's
    kernels and whether the output needed it; the kernels whose counterfactual call left the
    output right (their work was not needed, whatever the log says), and those whose counterfactual
    call made it wrong."""
    calls: list[list[tuple[str, bool]]] = dataclasses.field(default_factory=list)
    unneeded: set[str] = dataclasses.field(default_factory=set)
    moved: set[str] = dataclasses.field(default_factory=set)

    def steady(self) -> list[list[tuple[str, bool]]]:
        """The calls after the first where there are any: the first call may autotune (every
        benchmarked config a launch, `reset_to_zero` cutting each from the next) or fill a cache,
        which the profiled calls, made later, do not repeat."""
        return self.calls[1:] or self.calls

    def needed(self) -> list[str]:
        """The kernels some launch of which the output needed, in any call."""
        return sorted({name for call in self.calls for name, n in call if n})

    def fractions(self) -> dict[str, float]:
        """Per kernel, the share of its launches in the steady calls that the output needed."""
        launches = [launch for call in self.steady() for launch in call]
        names = {name for name, _ in launches}
        return {k: 0.0 if k in self.unneeded else sum(n for m, n in launches if m == k) /
                sum(1 for m, _ in launches if m == k) for k in sorted(names)}

    def most(self, name: str) -> int:
        """The most launches of `name` in one steady call."""
        return max((sum(1 for m, _ in call if m == name) for call in self.steady()), default=0)


@dataclasses.dataclass
class Reference:
    """What every candidate of a group is judged against, built once."""
    cfg: EvalConfig
    reference_path: str
    twin: Channel
    details: dict = dataclasses.field(default_factory=dict)  # the group's own, copied into each result
    device: Any = None
    seed: int = 0
    forward_key: bytes = b""  # keys `forward_seed`; made in this process, after the runners were forked
    perf_n: int = 1
    ref_mod: Any = None
    template: Any = None
    layout: ipc.Layout | None = None
    arena: Any = None
    handle: dict = dataclasses.field(default_factory=dict)  # what lets a runner map the arena
    in_views: list = dataclasses.field(default_factory=list)
    out_views: list = dataclasses.field(default_factory=list)
    flush: Any = None
    io_bytes: int = 0
    ref_aliases: bool = False
    ref_mutates: bool = True  # the reference writes into its inputs (known after setup)
    ref_alone_ms: float = 0.0
    bandwidth: float | None = None
    overhead_ms: float = 0.0
    profiler_works: bool = False  # the twin's profiled call gave a trace (`probe_profiler`)
    outputs: dict = dataclasses.field(default_factory=dict)  # (seed, signed) -> the reference's output
    trial_seeds: list[int] = dataclasses.field(default_factory=list)  # the group's correctness trials
    cached_bytes: int = 0
    clock: float = 0.0
    gpu: Any = None  # gpushare.DeviceLock of this GPU
    memory: Any = None  # gpushare.MemoryLedger of this GPU, holding this job's estimate
    timing_cores: dict[int, int] = dataclasses.field(default_factory=dict)  # GPU -> its timing core (`gpushare.CorePlan`)
    core: int | None = None  # the CPU core both timed processes run on while measured
    exclusive: bool = False  # hold the GPU alone for the whole job (a retry after out-of-memory)
    defer: bool = False  # give the job back at once when its GPU memory does not fit (the caller requeues it)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def mark(self, phase: str, details: dict | None = None) -> None:
        """The seconds since the last mark, as `phase_s[phase]`; on a GPU the phase's peak memory."""
        details = self.details if details is None else details
        now = _perf()
        details.setdefault("phase_s", {})[phase] = round(now - self.clock, 4)
        self.clock = now
        if self.memory is not None:  # each phase's peak GPU memory here, to check `memory_estimate` against
            import torch
            peak = torch.cuda.max_memory_reserved(self.device)
            details.setdefault("memory_peak_gib_by_phase", {})[phase] = round(peak / 2**30, 2)
            used = torch.cuda.max_memory_allocated(self.device)  # below the reserved peak: blocks cached unused
            details.setdefault("memory_allocated_gib_by_phase", {})[phase] = round(used / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(self.device)


@dataclasses.dataclass
class Judge:
    """One candidate's evaluation against its group's `Reference`."""
    ref: Reference
    runner: Channel
    candidate_path: str
    out: EvalResult = dataclasses.field(default_factory=EvalResult)
    kernels: dict[str, triton_source.Kernel] = dataclasses.field(default_factory=dict)  # from the source
    launched: set = dataclasses.field(default_factory=set)  # the candidate's kernels seen launching
    flow: Flow = dataclasses.field(default_factory=Flow)
    patterns: launch_pattern.Patterns = dataclasses.field(default_factory=launch_pattern.Patterns)
    last_launches: dict[str, int] = dataclasses.field(default_factory=dict)  # the last call's, per kernel
    borrowed: set[str] = dataclasses.field(default_factory=set)  # its kernels' names other device code ran under
    honest_extra: float = 0.0  # the judge's clock over the reference's own time, per ms (`_honest_extra`)
    reference_excess_ms: float = 0.0  # the same in ms a call, unscaled (what counts on a CPU)
    sched: dict = dataclasses.field(default_factory=dict)  # pid -> `_sched_of`, before any candidate code

    @property
    def cfg(self) -> EvalConfig:
        return self.ref.cfg

    @property
    def details(self) -> dict:
        return self.out.details

    def hack(self, code: str, detail: str, stop: bool = True) -> None:
        if code not in self.out.hacks:
            self.out.hacks.append(code)
        self.details.setdefault("hack_details", []).append(f"{code}: {detail}")
        if stop:
            raise Hacked(code, detail)

    def raise_hacks(self) -> None:
        if self.out.hacks:
            raise Hacked(self.out.hacks[-1], self.details["hack_details"][-1])

    def spend(self, part: str, since: float) -> float:
        """Add the seconds since `since` to `details.split_s[part]` (where the job's time goes by
        kind of work, across phases); returns now."""
        now = _perf()
        self.add(part, now - since)
        return now

    def add(self, part: str, seconds: float) -> None:
        split = self.details.setdefault("split_s", {})
        split[part] = round(split.get(part, 0.0) + seconds, 4)

    def mark(self, phase: str) -> None:
        self.ref.mark(phase, self.details)


# ======================================================================================
# Inputs, references, calls
# ======================================================================================

def fresh_seed() -> int:
    """The seed of one call's inputs, drawn from the OS: a candidate cannot predict a call's
    inputs from another's."""
    return random.SystemRandom().randrange(1, 2**31)


def forward_seed(r: Reference, seed: int) -> int:
    """The RNG seed of the forward on the inputs drawn from `seed` (the reference's here, the
    runner's through its request): a keyed hash, so a candidate that reads its RNG's seed cannot
    draw its inputs again and, comparing, tell KernelBench's kind of inputs from the judge's."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little"), key=r.forward_key, digest_size=4).digest()
    return int.from_bytes(digest, "little") % 2**31


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gen_inputs(r: Reference, seed: int, signed: bool = False) -> list:
    """The reference's `get_inputs()` under `seed`, on the device. When `signed`, its uniform
    draws are standard normals (KernelBench draws uniform [0, 1) inputs, on which ReLU(x) = x and
    other shortcuts pass): what it builds from them stays (`_NormalDraws`)."""
    import torch
    torch.manual_seed(seed)
    with _reference_fails("the reference's get_inputs() failed"), _NormalDraws(torch, signed) as draws:
        if r.cuda:
            torch.cuda.manual_seed_all(seed)
            with torch.device(r.device):
                inputs = list(r.ref_mod.get_inputs())
        else:
            inputs = list(r.ref_mod.get_inputs())
    inputs = compare.map_tensors(inputs, lambda t: t.to(r.device))
    if signed and not draws.drawn:  # no uniform draw to turn signed: its float inputs are replaced
        _redraw_signed(inputs, torch.Generator(device=r.device).manual_seed(seed + 7919))
    return inputs


class _NormalDraws:
    """While entered (and `on`), `torch.rand` and `torch.rand_like` draw standard normals, so that
    a `get_inputs()` builds its signed inputs itself: a triangle, a symmetric matrix, softmax rows
    or labels it makes of its draws stay what they are, as a candidate may rely on. `drawn`
    says whether any draw was made so."""

    def __init__(self, torch, on: bool):
        self.torch, self.on, self.drawn = torch, on, False
        self.saved = (torch.rand, torch.rand_like)

    def __enter__(self) -> _NormalDraws:
        if self.on:
            self.torch.rand, self.torch.rand_like = self.randn, self.randn_like
        return self

    def __exit__(self, *exc) -> None:
        self.torch.rand, self.torch.rand_like = self.saved

    def randn(self, *args, **kwargs):
        self.drawn = True
        return self.torch.randn(*args, **kwargs)

    def randn_like(self, *args, **kwargs):
        self.drawn = True
        return self.torch.randn_like(*args, **kwargs)


def _redraw_signed(inputs: list, g) -> None:
    """Float tensors replaced, in order, by standard normals; each top-level one is let go before
    its replacement is drawn, so that multi-GB inputs are never held twice."""
    import torch
    for i in range(len(inputs)):
        item, inputs[i] = inputs[i], None
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            shape, dtype, device = item.shape, item.dtype, item.device
            item = None
            inputs[i] = torch.randn(shape, dtype=dtype, device=device, generator=g)
        else:  # integers, integer tensors, nested structures
            inputs[i] = compare.map_tensors(item, lambda t: torch.randn(
                t.shape, dtype=t.dtype, device=t.device, generator=g) if t.is_floating_point() else t)


def _clone(obj):
    return compare.map_tensors(obj, lambda t: t.detach().clone())


def _build_reference(r: Reference):
    from drkernel.runner import build_model, init_inputs
    return build_model(r.ref_mod.Model, init_inputs(r.ref_mod, r.seed), r.seed, r.device)


def run_reference(r: Reference, inputs: list, seed: int):
    """The reference's output on `inputs`, from a fresh copy of the never-run template. The RNG is
    seeded with the call's seed, as the runner seeds it before the candidate's forward: a
    reference in training mode (KernelBench's dropout problems) then draws the same mask."""
    import torch
    with _reference_fails("the reference failed"), torch.no_grad():
        model = copy.deepcopy(r.template)
        torch.manual_seed(forward_seed(r, seed))
        out = model(*inputs)
        _sync(r.device)
    return out


def reference_inputs(r: Reference, inputs: list) -> list:
    """What the reference may run on: `inputs` themselves, or a copy where the reference writes
    into its inputs (they are compared with the candidate's afterwards)."""
    return _clone(inputs) if r.ref_mutates else inputs


def reference_output(r: Reference, key: tuple[int, bool], inputs: list) -> tuple[Any, list]:
    """The reference's output for a trial, and its inputs after the run. Outputs of a reference
    that leaves its inputs alone are kept for the group's later candidates while they are small."""
    if key in r.outputs:
        return r.outputs[key], inputs
    ref_in = reference_inputs(r, inputs)
    out = run_reference(r, ref_in, key[0])
    size = compare.nbytes(compare.tensors(out))
    if not r.ref_mutates and r.cached_bytes + size <= _CACHE_BYTES:
        r.outputs[key], r.cached_bytes = out, r.cached_bytes + size
    return out, ref_in


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _poison_slots(r: Reference) -> None:
    """Slots hold NaN (or an integer sentinel) until a runner commits: an answer not written
    when the runner replies is never mistaken for a correct one."""
    import torch
    for v in r.out_views:
        if v.is_floating_point() or v.is_complex():
            v.fill_(float("nan"))
        elif v.dtype == torch.bool:
            v.fill_(True)
        else:
            v.fill_(torch.iinfo(v.dtype).max)


def _write_inputs(r: Reference, inputs: list) -> None:
    for view, t in zip(r.in_views, inputs):
        if view is not None:
            view.copy_(t)


def call(r: Reference, channel: Channel, seed: int, mode: str, signed: bool = False, keep: bool = False,
         perturb: tuple[str, ...] = (), changes: bool = False) -> Call:
    """Fresh inputs into the arena, slots poisoned, L2 flushed; then one call, timed by this clock.
    With `keep`, the committed output is copied the moment the reply arrives (the runner is
    stopped by then; a write that lands later never counts). A call names the kernels whose
    launches read perturbed data (none but in a counterfactual call). A checked call on signed
    inputs, or one asked with `changes`, also says where each launch changed its arguments."""
    start = _perf()
    inputs = gen_inputs(r, seed, signed)
    _write_inputs(r, inputs)
    _poison_slots(r)
    if r.flush is not None:
        r.flush.fill_(float(seed % 7))
    _sync(r.device)
    t0 = _perf()
    # where each launch changed its arguments (`dataflow`): on uniform [0, 1) inputs many honest
    # launches change nothing (an in-place ReLU), so only where a call's question needs it
    request = {"op": "call", "mode": mode, "seed": forward_seed(r, seed), "perturb": list(perturb)}
    if mode == "check":
        request.update(changes=signed or changes)
    reply = channel.ask(request)
    t1 = _perf()
    if "error" in reply:
        raise runner_error(reply, "forward raised")
    c = Call(reply=reply, wall_ms=(t1 - t0) * 1e3, inputs=inputs, seed=seed, signed=signed,
             ms=ipc.number(reply, "ms"), before_s=t0 - start)
    if keep:
        c.output = _clone(committed(r, c))
        _sync(r.device)
    c.after_s = _perf() - t1
    return c


def call_candidate(j: Judge, seed: int, mode: str, signed: bool = False, keep: bool = False,
                   perturb: tuple[str, ...] = (), changes: bool = False) -> Call:
    """One call of the candidate, then what it may have left behind: no process of its may outlive
    the call, and the scheduling of the job's processes is as it was."""
    t = _perf()
    before = _scheduling(j)
    try:
        c = call(j.ref, j.runner, seed, mode, signed, keep, perturb, changes)
    except Stop as stop:
        _findings(j, {"findings": stop.findings})  # what the runner found where the forward failed
        raise
    j.spend("candidate", t)
    _findings(j, c.reply)
    if c.reply.get("output_in_arena") and not j.ref.ref_aliases:
        j.hack("output_aliases_input", f"a {mode} call returned a view of the judge's arena (an input or the "
                                       "output slot), which the copy into the slot skips", stop=False)
    _split_call(j, c)
    t = _perf()
    c.pattern = _launch_pattern(j, mode, judged=not perturb)
    _check_processes(j, f"a {mode} call")
    _check_scheduling(j, before)
    j.spend("process_checks", t)
    return c


def _launch_pattern(j: Judge, mode: str, judged: bool = True) -> Any:
    """The call's launch pattern, asked for after its reply: a checked call's is learnt, any other
    call's must be one of them (`drkernel.launch_pattern`). A counterfactual call's is asked for
    as any other's and not judged (perturbed data may take an honest forward down another branch)."""
    sig = j.runner.ask({"op": "pattern"}).get("pattern")
    if not judged:
        return sig
    try:
        allowed = j.patterns.learn(sig) if mode == "check" else j.patterns.allows(sig)
        j.last_launches = launch_pattern.kernel_counts(sig)
    except ValueError as exc:
        j.hack("forged_reply", f"a {mode} call: {exc}")
    if not allowed:
        j.hack("launch_pattern_changed", f"a {mode} call launched the candidate's kernels otherwise than the "
                                         f"checked calls did: {short(str(sig), 300)}")
    return sig


def _split_call(j: Judge, c: Call) -> None:
    """A candidate call's seconds by part, beside `candidate` in `split_s`; the runner's own split
    is what it says (diagnostics only: nothing is judged on it)."""
    spent = c.reply.get("spent_ms") if isinstance(c.reply.get("spent_ms"), dict) else {}
    said = {f"runner_{k}": ipc.number(spent, k, 0.0) / 1e3 for k in ("forward", "after")}
    parts = {"call_inputs": c.before_s, "call_reply": c.wall_ms / 1e3, "call_output_copy": c.after_s, **said}
    for part, seconds in parts.items():
        j.add(part, seconds)


def _sched_of(pid: int) -> tuple | None:
    """(policy, nice, CPU set) of a process; None once it is gone."""
    try:
        return os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid), frozenset(os.sched_getaffinity(pid))
    except OSError:
        return None


def _scheduling(j: Judge) -> dict[int, tuple | None]:
    """The scheduling of every process of the job a runner can reach: its own, the reference
    twin's (timed beside it) and the other candidates' runners."""
    return {pid: _sched_of(pid) for pid in (j.runner.pid, j.ref.twin.pid, *j.runner.siblings)}


def _check_scheduling(j: Judge, before: dict[int, tuple | None]) -> None:
    """Policy and nice as before the candidate existed, CPU sets as before the request: a
    candidate that renices or moves the twin (or itself, or another candidate) changes what
    the timing compares. What it changed is put back for the group's later candidates."""
    for pid, now in _scheduling(j).items():
        base, prev = j.sched.get(pid), before.get(pid)
        if now is None or base is None or prev is None or (now[:2] == base[:2] and now[2] == prev[2]):
            continue
        _restore_sched(pid, base[:2] + prev[2:])
        code = "global_state_changed" if pid == j.runner.pid else "reference_slowed"
        j.hack(code, f"the candidate changed the scheduling of process {pid} "
                     f"({'its own' if pid == j.runner.pid else 'another of the job'}): {prev} -> {now}")


def _restore_sched(pid: int, state: tuple) -> None:
    policy, nice, cores = state
    with contextlib.suppress(OSError):
        os.sched_setscheduler(pid, policy, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    _set_affinity(pid, set(cores))


def committed(r: Reference, c: Call):
    """The output the runner committed, in the reference's structure: views of the slots, valid
    until the next call rewrites them."""
    if "mismatch" in c.reply:
        return None
    if not r.out_views:
        return c.reply.get("value")
    ts = list(r.out_views)
    if r.details["output_structure"] == "T":
        return ts[0]
    values = c.reply.get("leaves") if isinstance(c.reply.get("leaves"), list) else []
    return _rebuild(r.details["output_structure"], iter(ts), iter(values))


def _rebuild(struct, ts, values):
    """The output from its structure: tensors from the slots, other values from the reply (a
    value whose type is not the structure's comes back as None, and fails the comparison)."""
    if struct == "T":
        return next(ts)
    if isinstance(struct, list) and len(struct) == 2 and struct[0] == "seq":
        return tuple(_rebuild(s, ts, values) for s in struct[1])
    if isinstance(struct, list) and len(struct) == 2 and struct[0] == "dict":
        return {k: _rebuild(s, ts, values) for k, s in struct[1]}
    value = next(values, None)
    return value if type(value).__name__ == struct else None


def verify(j: Judge, c: Call, label: str, code: str = "output_cached", ref: Any = None) -> None:
    """The output a call committed (copied at its reply) against the reference on the same inputs:
    `ref`, where the twin's timed call gave it, else a run of the reference here."""
    t = _perf()
    if ref is None:
        ref = run_reference(j.ref, reference_inputs(j.ref, c.inputs), c.seed)
    cmp = compare.compare(c.output, ref, j.cfg, finite_only=_finite_only(c.signed, ref)) \
        if c.output is not None else compare.Match(False, str(c.reply.get("mismatch")))
    j.spend("verify", t)
    if not cmp.ok:
        j.hack(code, f"{label}: the output is stale or wrong for its fresh inputs ({cmp.why})")


# ======================================================================================
# Group phases
# ======================================================================================

def setup(r: Reference) -> None:
    import torch
    r.device = torch.device(_auto_device(r.cfg.device, torch.cuda.is_available()))
    if r.cuda:
        if not torch.cuda.is_available():
            raise Stop("runtime_error", "CUDA requested but not available")
        if r.device.index is None:
            r.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(r.device)
    r.seed = r.cfg.seed  # the weights' seed; every call's inputs get a `fresh_seed`
    r.forward_key = secrets.token_bytes(16)
    r.trial_seeds = [fresh_seed() for _ in range(r.cfg.trials + 2)]  # shared by the group (cached outputs)
    r.perf_n = r.cfg.perf_trials if r.cuda else r.cfg.cpu_perf_trials
    with _twin_fails():
        _init_runner(r, r.twin, os.path.join(r.twin.dir, "reference.py"))  # CUDA starts there meanwhile
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    from drkernel.runner import import_file
    with _reference_fails("the reference failed to import"):
        r.ref_mod = import_file(r.reference_path, "_drk_judge_reference")
    if r.cuda:  # memory first: waiting for it while holding the GPU lock could deadlock
        _warm_up_comparisons(r)
        _reserve_memory(r)
        _lock_gpu(r)
    with _shared(r):
        with _reference_fails("the reference failed to build"):
            r.template = _build_reference(r)
        warm = gen_inputs(r, r.seed)
        ref_out, r.ref_mutates = _first_reference_run(r, warm, r.seed)
    if ref_out is None:  # a forward that returns nothing: no candidate can be judged against it
        raise Stop("reference_error", "the reference's forward returned None")
    outs = compare.tensors(ref_out)
    if outs and all(t.numel() == 0 for t in outs):  # no kernel could write one element (a batch size of 0)
        shapes = ", ".join(str(tuple(t.shape)) for t in outs[:3])
        raise Stop("reference_error", f"the reference's output is empty ({shapes}): nothing a kernel computes can be checked")
    _plan_arena(r, warm, ref_out)
    r.mark("setup")


def _auto_device(device: str, cuda_available: bool) -> str:
    """`auto` as torch sees it here. The evaluator chose GPU or Triton's interpreter for this job
    before torch was imported (nvidia-smi); a GPU host whose torch lacks CUDA would otherwise fail
    every Triton candidate as its own runtime_error."""
    if device != "auto":
        return device
    if cuda_available:
        return "cuda"
    if not os.environ.get("TRITON_INTERPRET"):
        raise Stop("runtime_error", "device auto: nvidia-smi lists a GPU but this torch has no CUDA "
                   "(torch.cuda.is_available() is False); use --device cpu (Triton's interpreter) "
                   "or a CUDA build of torch")
    return "cpu"


def _init_runner(r: Reference, channel: Channel, candidate: str) -> None:
    """`init` sent; the runner starts CUDA and imports the reference while the judge works on."""
    channel.send({"op": "init", "device": str(r.device), "seed": r.seed,
                  "reference": os.path.join(channel.dir, "reference.py"), "candidate": candidate})


def _first_reference_run(r: Reference, inputs: list, seed: int) -> tuple[Any, bool]:
    """The reference's output, and whether it writes into its inputs: an in-place op bumps a
    tensor's version counter even where it leaves the values as they were (ReLU on uniform
    inputs), and the values catch what bypasses the counter."""
    ts = compare.tensors(inputs)
    before, copies = [t._version for t in ts], [t.detach().clone() for t in ts]
    out = run_reference(r, inputs, seed)
    return out, any(t._version != v or not compare.same_values(t, c) for t, v, c in zip(ts, before, copies))


def _plan_arena(r: Reference, warm: list, ref_out) -> None:
    import torch
    r.io_bytes = compare.nbytes(compare.tensors(warm)) + compare.nbytes(compare.tensors(ref_out))
    r.ref_aliases = compare.overlap(compare.ranges(compare.tensors(ref_out)), compare.ranges(compare.tensors(warm)))
    r.layout = ipc.plan(warm, compare.tensors(ref_out))
    r.details["output_structure"] = json.loads(json.dumps(compare.structure(ref_out), default=str))
    try:
        r.arena, r.handle = ipc.allocate(r.layout, r.device, os.path.dirname(r.twin.dir))
    except OSError as err:  # a file on the CPU: past the sandbox's file-size limit, or no disk left
        raise Stop("reference_error", f"the reference's inputs and outputs ({r.layout.nbytes / 2**30:.1f} GiB) do not "
                                      f"fit in the judge's arena file: {err.strerror or err}") from None
    if r.cuda and r.cfg.l2_flush:  # after the arena's emptied cache: carved out of a freed input-sized
        # block, these 256 MB (more than L2) would keep the whole block from ever being released
        r.flush = torch.empty(2**26, dtype=torch.float32, device=r.device)
    r.in_views = [ipc.view(r.arena, s) if s else None for s in r.layout.inputs]
    r.out_views = [ipc.view(r.arena, s) for s in r.layout.outputs]


def _attach(r: Reference, channel: Channel) -> dict:
    """The runner's answer to `init`, then the arena attached and the runner confined; its
    evidence machinery as described before any candidate code exists."""
    from drkernel.confine import hidden_dirs
    reply = channel.receive()
    if "error" in reply:
        raise Stop("runtime_error", f"the runner could not start: {str(reply['error'])[:600]}")
    reply = channel.ask({"op": "attach", "handle": r.handle, "layout": r.layout.to_dict(),
                         "structure": r.details["output_structure"],
                         "hidden": hidden_dirs(os.path.dirname(channel.dir))})
    if "error" in reply:
        raise Stop("runtime_error", f"the runner could not attach: {str(reply['error'])[:600]}")
    conf = reply.get("confinement") if isinstance(reply.get("confinement"), dict) else {}
    if r.cfg.require_confinement and not conf.get("complete"):
        raise Stop("runtime_error", "refused: the runner could not be confined "
                                    f"({'; '.join(map(str, conf.get('errors') or [])) or 'incomplete'}); "
                                    "require_confinement=false evaluates without it (trusted code only)")
    channel.evidence_state = str(reply.get("evidence_state") or "")
    channel.threads_before = len(procfs.tids(channel.pid))
    return conf


def start_twin(r: Reference) -> None:
    """The reference twin: attached, calibrated (before it holds any model) and loaded."""
    with _twin_fails():
        r.details["confinement"] = _attach(r, r.twin)
    r.mark("start_twin")


def calibrate(r: Reference) -> None:
    """Null calls through the twin (a runner of the same kind as the candidates', holding no model
    yet): what the judge's clock adds to a runner's own time per call (messages, the commit copy,
    the sync, stopping it)."""
    with _twin_fails():
        r.overhead_ms = median([_residual_ms(r, fresh_seed()) for _ in range(10 if r.cuda else 3)])
    r.details["clock_overhead_ms"] = r.overhead_ms
    r.mark("calibrate")


def _residual_ms(r: Reference, seed: int) -> float:
    """The judge's time for one null call minus the runner's."""
    c = call(r, r.twin, seed, "null")
    if c.ms is None:
        raise Stop("runtime_error", "the twin's calibration call returned no time")
    return c.wall_ms - c.ms


def load_twin(r: Reference) -> None:
    """The twin builds the reference model (compiled when `baseline` is compile) and runs it a few
    times: a compile happens here, outside any timing and any hold of the GPU alone."""
    with _shared(r), _twin_fails():
        reply = r.twin.ask({"op": "load", "cls": "Model", "compile": r.cfg.baseline == "compile"})
        if "error" in reply:
            raise Stop("reference_error", "the reference failed in its timing process: " + str(reply["error"])[:600])
        for i in range(max(1, r.cfg.warmup)):
            call(r, r.twin, fresh_seed(), "warm")
    r.mark("load_twin")


def time_reference_alone(r: Reference) -> None:
    with _twin_fails():
        r.ref_alone_ms = _reference_alone_ms(r)
    r.bandwidth = _copy_bandwidth(r.device) if r.cuda else None
    r.details["ref_ms_isolated"] = r.ref_alone_ms
    r.details["io_bytes"] = r.io_bytes
    if r.cuda:
        r.details["copy_bandwidth_gbs"] = r.bandwidth / 1e6 if r.bandwidth else None
        if r.bandwidth and r.ref_alone_ms > 0:  # torch's own kernels can beat a plain copy
            r.bandwidth = max(r.bandwidth, r.io_bytes / r.ref_alone_ms)
    r.mark("reference_alone")


def _twin_ms(r: Reference, seed: int, keep: bool = False) -> Call:
    """One timed reference call in the twin (trusted: it never runs candidate code), its output
    copied with `keep`; its `ms` is set."""
    c = call(r, r.twin, seed, "time", keep=keep)
    if c.ms is None:
        raise Stop("runtime_error", "the reference's timing process returned no time")
    return c


def probe_profiler(r: Reference) -> None:
    """Whether the profiler gives a trace on this machine, from one profiled call of the twin
    (trusted): where it does, a candidate's profiled call that fails or shows no trace is the
    candidate's doing, and skipping the checks only the profile makes cannot be its way out."""
    if r.cuda and r.cfg.profile:
        with contextlib.suppress(Stop):
            r.profiler_works = bool(_profile_rows(call(r, r.twin, fresh_seed(), "profile").reply))
        r.details["profiler_works"] = r.profiler_works
    r.mark("probe_profiler")


def _reference_alone_ms(r: Reference) -> float:
    """The reference's median time over `ref_isolated_trials` calls of the twin alone."""
    with _pinned(r, r.twin):
        n = max(1, min(r.perf_n, r.cfg.ref_isolated_trials))
        return median([_twin_ms(r, fresh_seed()).ms for _ in range(n)])


def _copy_bandwidth(device) -> float | None:
    """Bytes/ms of a 1 GiB device-to-device copy (read + write), best of 5."""
    import torch
    src = torch.ones(2**28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = None
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
        if ms > 0:
            best = max(best or 0.0, 2 * src.numel() * 4 / ms)
    del src, dst
    torch.cuda.empty_cache()  # 2 GiB cached would be split by later temporaries
    return best


# ======================================================================================
# Candidate phases
# ======================================================================================

def attach_runner(j: Judge) -> None:
    j.details["confinement"] = _attach(j.ref, j.runner)
    j.sched = _scheduling(j)
    j.mark("attach_runner")


def _findings(j: Judge, reply: dict) -> None:
    """Hack codes the runner reported (self-reports: they can only cost the candidate)."""
    for item in reply.get("findings") or []:
        if isinstance(item, list) and len(item) == 2 and item[0] in HACK_CODES:
            j.hack(str(item[0]), str(item[1])[:500])


def _check_processes(j: Judge, where: str) -> None:
    """No process of the candidate's may outlive a request; the runner's native threads counted."""
    strays = j.runner.strays()
    for pid in strays:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    threads = len(procfs.tids(j.runner.pid))
    count = j.details.setdefault("runner_threads", {"before_candidate": j.runner.threads_before, "max": threads})
    count["max"] = max(count["max"], threads)
    if strays:
        j.hack("thread_spawned", f"{where}: {len(strays)} process(es) of the candidate outlived its call")
    _escaped_kills(j, where)


def _escaped_kills(j: Judge, where: str) -> None:
    """Processes that left the candidate's runner and that the supervisor killed over a limit."""
    if note := j.runner.escaped_kills():
        j.hack("thread_spawned", f"{where}: the sandbox killed {note}", stop=False)


def load_candidate(j: Judge) -> None:
    with _shared(j.ref):  # importing and building may already run candidate GPU work
        reply = j.runner.ask({"op": "load"})
    if reply.get("stage") == "import":
        raise Stop("compile_error", "candidate failed to import: " + str(reply.get("error"))[:1400])
    j.out.compiled = True
    _findings(j, reply)
    if "error" in reply:
        raise Stop("runtime_error", "ModelNew(*get_init_inputs()) failed (constructor must match Model's): "
                   + str(reply["error"])[:1200])
    _check_processes(j, "after import")
    _check_scheduling(j, j.sched)
    j.mark("load_candidate")


def _own_kernels(j: Judge, names) -> set[str]:
    """The names the runner reported that are kernels of the candidate's source."""
    return {str(k) for k in names or [] if str(k) in j.kernels}


def _trial_hacks(j: Judge, ti: int, c: Call) -> None:
    """Hack codes from one checked call's self-reported facts."""
    r = c.reply
    _check_processes(j, f"trial {ti}")
    if r.get("bad_type"):
        j.hack("bad_output_type", str(r["bad_type"])[:300])
    if r.get("structure"):
        j.hack("bad_output_type", str(r.get("mismatch"))[:300])
    own = _own_kernels(j, r.get("kernels"))
    # a buffer kept and rewritten by this call's own launches is an honest reuse: what they wrote
    # is judged by the data flow and the values; returned again with no launch, it is a cache
    if r.get("reuses_previous_output") and not own:
        j.hack("output_cached", f"trial {ti}: output shares storage with an earlier call's output, and no kernel "
                                "of the candidate's ran")
    if j.cfg.require_triton and not own:
        j.hack("no_triton_kernel", f"trial {ti}: forward launched no Triton kernel of the candidate's source "
                                   "over a non-empty grid")
    if r.get("off_stream"):
        j.hack("side_stream", f"trial {ti}: kernel(s) {', '.join(map(str, r['off_stream']))[:200]} launched on "
                              "a stream other than the one forward was called on")
    j.launched |= own


def _judge_flow(j: Judge, ti: int, flow: Any, reported: set[str], launches: Any) -> None:
    """The call's data-flow log replayed here: some launch of the candidate's own kernels must
    have written what the output is made of (else `decoy_kernel`); per kernel, the share of its
    launches that did weighs its device time in the profile. A log cut short is no evidence, and
    its launches must be those the launch record `reported` (which kernels, how many)."""
    events, outputs, mine = _launch_needs(j, f"trial {ti}", flow)
    logged = [e.kernel for e in events if e.kernel is not None]
    if {k for k in logged if k in j.kernels} != reported or len(logged) != launches:
        j.hack("forged_reply", f"trial {ti}: the launch record ({sorted(reported)}, {launches} launches) and the "
                               f"data-flow log ({len(logged)}) disagree on the candidate's launches")
    j.flow.calls.append([(name, bool(n)) for name, n in mine])
    # where no input moves the reference's output (KernelBench has such problems), an honest kernel
    # storing that constant into a recycled buffer already holding it changes nothing: no evidence
    if mine and outputs and not any(n for _, n in mine) and _output_depends_on_inputs(j.ref):
        j.hack("decoy_kernel", f"trial {ti}: no launch of the candidate's Triton kernels wrote anything the output "
                               "is made of (torch computed it)")


def _launch_needs(j: Judge, label: str, flow: Any, tracked: bool = True) -> tuple[list, list[int], list[tuple[str, bool]]]:
    """A checked call's data-flow log: its events, its output keys, and per launch of the
    candidate's kernels whether the output is made of what it wrote (`tracked` False: what it
    stored through, changed or not). A malformed log is a forged reply; one cut short is no
    evidence (`decoy_kernel`)."""
    try:
        events = [dataflow.Event.from_list(e) for e in flow["events"]]
        events = events if tracked else [dataclasses.replace(e, changed=None) for e in events]
        outputs = [int(k) for k in flow["outputs"]]
        spans = {int(k): (int(lo), int(hi)) for k, lo, hi in flow["output_spans"]}
        truncated = bool(flow["truncated"])
    except (TypeError, KeyError, ValueError):
        j.hack("forged_reply", f"{label}: a malformed data-flow log")
    if truncated:
        j.hack("decoy_kernel", f"{label}: forward ran more than {dataflow.MAX_EVENTS} ops: what the output "
                               "needs cannot be told")
    stores = {name: k.stores for name, k in j.kernels.items()}
    needed = dataflow.needed_launches(events, outputs, stores, spans)
    launches = [e for e in events if e.kernel is not None]
    return events, outputs, [(e.kernel, n) for e, n in zip(launches, needed) if e.kernel in stores]


def _mutations(j: Judge, ti: int, c: Call, pristine: list, ref_in: list) -> None:
    """Inputs the candidate changed (seen here, in the arena), unless it left them as the
    reference leaves its own."""
    shared = [v for v in j.ref.in_views if v is not None]
    if any(not compare.same_values(a, b) for a, b in zip(shared, compare.tensors(pristine))):
        if not j.ref.ref_mutates:
            j.hack("input_mutated", f"trial {ti}: the candidate modified its inputs (the reference does not)",
                   stop=False)
        elif not compare.compare(shared, compare.tensors(ref_in), j.cfg).ok:
            j.hack("input_mutated", f"trial {ti}: the candidate modified its inputs otherwise than the reference",
                   stop=False)
    if c.reply.get("aliases_input") and not j.ref.ref_aliases:
        j.hack("output_aliases_input", f"trial {ti}: output shares storage with an input", stop=False)


def _judge_values(j: Judge, ti: int, signed: bool, out, ref, pristine: list, degenerate: bool,
                  finite_only: bool = False) -> None:
    import torch
    t = _perf()
    cmp = compare.compare(out, ref, j.cfg, finite_only=finite_only)
    t = j.spend("compare", t)
    j.out.trials += 1
    j.details.setdefault("trials", []).append({"trial": ti, "signed": signed, "ok": cmp.ok,
                                               "max_abs": cmp.max_abs, "rel_l2": cmp.rel_l2})
    if cmp.max_abs is not None:
        j.out.max_abs_err = max(j.out.max_abs_err or 0.0, cmp.max_abs)
        j.out.max_rel_err = max(j.out.max_rel_err or 0.0, cmp.max_rel)
    j.raise_hacks()
    deg = compare.degenerate(out, ref, pristine, j.cfg) if degenerate or not cmp.ok else None
    j.spend("degenerate", t)
    if deg:
        j.hack("degenerate_output", f"trial {ti}: {deg}")
    if cmp.ok:
        j.out.trials_passed += 1
        return
    floats = [x for x in compare.tensors(ref) if x.is_floating_point()]
    if floats and all(x.dtype == torch.float32 for x in floats) and compare.compare(
            out, ref, j.cfg, loose=True, finite_only=finite_only).ok:
        j.hack("precision_downgrade", f"trial {ti}: fails the fp32 tolerance ({cmp.why}) but passes "
                                      f"{j.cfg.loose_tol:g}: reduced precision inside an fp32 problem")
    kind = f"trial {ti} failed on signed-normal inputs" if signed else f"trial {ti} failed"
    raise Stop("incorrect", f"{kind}: {cmp.why}; max abs err {cmp.max_abs}, rel L2 err {cmp.rel_l2}")


def check_correctness(j: Judge) -> None:
    """The trials: a uniform one, then the other uniform and the signed-normal ones in a random
    order (having seen a signed input says nothing about which calls are left), with the
    counterfactual calls at a random place after the first trial (the kernels it launched are
    those asked about), on fresh inputs of the kind of the trial before them: a candidate that
    answers differently when it guesses them fails trials as often, and one that does less on one
    kind of inputs is asked on either."""
    n = j.cfg.trials
    n_signed = (2 if n >= 4 else 1) if j.cfg.second_distribution else 0
    seeds = j.ref.trial_seeds
    plan = [(seeds[i], False) for i in range(n)] + [(seeds[n + i], True) for i in range(n_signed)]
    pick = random.SystemRandom()
    # the first call may autotune and is no launch pattern's model (`Flow.steady`, `launch_pattern`):
    # a signed one there would leave no signed call to compare the uniform ones with
    later = plan[1:]
    pick.shuffle(later)
    plan = plan[:1] + later
    counterfactual_at = 1 + pick.randrange(len(plan))
    # The degenerate check (two passes over multi-GB outputs) runs on every signed trial, where
    # trivial answers differ most from the reference, on one uniform trial the candidate cannot
    # predict, and on a failing trial (the last one).
    uniform = [ti for ti, (_, signed) in enumerate(plan) if not signed]
    checked = {ti for ti, (_, signed) in enumerate(plan) if signed} | {pick.choice(uniform)}
    for ti, (seed, signed) in enumerate(plan):
        if ti == counterfactual_at:
            check_needed(j, signed=plan[ti - 1][1])
        with _shared(j.ref):
            _trial(j, ti, seed, signed, degenerate=ti in checked)
    if counterfactual_at == len(plan):
        check_needed(j, signed=plan[-1][1])
    j.details["launched_kernels"] = sorted(j.launched)
    j.details["needed_fraction"] = {k: round(v, 3) for k, v in j.flow.fractions().items()}
    j.mark("correctness")


def _trial(j: Judge, ti: int, seed: int, signed: bool, degenerate: bool) -> None:
    """One correctness trial: the candidate on fresh inputs, then the reference on the same ones."""
    c = call_candidate(j, seed, "check", signed, keep=True)
    _trial_hacks(j, ti, c)
    t = _perf()
    ref, ref_in = reference_output(j.ref, (seed, signed), c.inputs)
    t = j.spend("reference", t)
    _mutations(j, ti, c, c.inputs, ref_in)
    j.spend("mutations", t)
    j.raise_hacks()
    if j.cfg.require_triton:
        _judge_flow(j, ti, c.reply.get("flow"), _own_kernels(j, c.reply.get("kernels")), c.reply.get("launches"))
    if "mismatch" in c.reply:
        j.raise_hacks()
        raise Stop("incorrect", f"trial {ti}: {str(c.reply['mismatch'])[:400]}")
    _judge_values(j, ti, signed, c.output, ref, c.inputs, degenerate, _finite_only(signed, ref))


def _right(j: Judge, output: Any, ref: Any, signed: bool) -> bool:
    """Whether a counterfactual call's output (None: it committed none) passes as a trial's would."""
    return output is not None and compare.compare(output, ref, j.cfg, finite_only=_finite_only(signed, ref)).ok


def _finite_only(signed: bool, ref) -> bool:
    """Signed inputs may leave the reference's domain (a log, a square root): such an output is
    judged where the reference's is finite."""
    return signed and not all(compare.all_finite(x) for x in compare.tensors(ref) if x.is_floating_point())


# ======================================================================================
# The GPU shared with other jobs; the core the timed processes run on
# ======================================================================================

@contextlib.contextmanager
def _alone(r: Reference):
    """This GPU to this job alone (timing, calibration, profiling), once it is idle; no-op on the CPU."""
    if r.gpu is None:
        yield
        return
    with r.gpu.alone():
        _wait_idle(r)
        yield


def _probe_ms(r: Reference) -> float:
    """Milliseconds for a one-element kernel to run and return, best of three: an idle GPU answers
    in microseconds; one still busy with another context's work makes it wait for a time slice."""
    import torch
    x = torch.zeros(1, device=r.device)
    best = float("inf")
    for _ in range(3):
        t0 = _perf()
        x.add_(1.0)
        torch.cuda.synchronize(r.device)
        best = min(best, (_perf() - t0) * 1e3)
    return best


def _wait_idle(r: Reference) -> bool:
    """Wait until work other jobs left queued on the GPU (their runners are stopped, but kernels
    already queued run on) has finished; measuring next to it would move this job's numbers.
    False when the GPU is still busy after `idle_wait_s`."""
    t0 = _perf()
    idle = True
    while (ms := _probe_ms(r)) > r.cfg.idle_probe_ms:
        if _perf() - t0 > r.cfg.idle_wait_s:
            r.details["gpu_busy"] = f"still busy after {r.cfg.idle_wait_s:g} s (probe {ms:.2f} ms)"
            idle = False
            break
        time.sleep(0.005)
    r.details["idle_wait_s"] = round(r.details.get("idle_wait_s", 0.0) + _perf() - t0, 4)
    return idle


def _shared(r: Reference):
    """The GPU shared with other evaluations' unmeasured work, for one short burst (a trial), so
    that a neighbour waiting to measure gets in between."""
    if r.gpu is None or r.gpu.mode is not None:
        return contextlib.nullcontext()
    return _shared_burst(r.gpu)


@contextlib.contextmanager
def _shared_burst(gpu):
    gpu.acquire(alone=False)
    try:
        yield
    finally:
        gpu.release()


@contextlib.contextmanager
def _pinned(r: Reference, *channels: Channel):
    """The timed processes' main threads on one CPU core while they are measured: reference and
    candidate then launch their kernels from the same core, frequency and caches."""
    if r.core is None:
        yield
        return
    before = {c.pid: _affinity(c.pid) for c in channels}
    for c in channels:
        _set_affinity(c.pid, {r.core})
    try:
        yield
    finally:
        for pid, cores in before.items():
            _set_affinity(pid, cores)


def _affinity(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except OSError:
        return None


def _set_affinity(pid: int, cores: set[int] | None) -> None:
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cores)


def _physical_gpu(r: Reference) -> int:
    """The physical GPU, not the per-worker index (workers see one GPU each)."""
    idx = r.device.index or 0
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(vis[idx]) if idx < len(vis) and vis[idx].isdigit() else idx


def _lock_gpu(r: Reference) -> None:
    """This job's lock on its physical GPU (held alone for the whole job on a retry), and the core
    its timed processes use (one per GPU, kept free of the other sandbox processes by the
    evaluator's `CorePlan`: one job measures on a GPU at a time)."""
    from drkernel.gpushare import DeviceLock
    gpu = _physical_gpu(r)
    r.gpu = DeviceLock(gpu)
    r.core = r.details["timing_core"] = r.timing_cores.get(gpu)
    if r.exclusive:
        r.gpu.acquire(alone=True)
        _wait_idle(r)


def _warm_up_comparisons(r: Reference) -> None:
    """Triton's start for the comparison kernels, paid before this job holds the GPU (CPU work
    only). A failure here costs nothing but time: the first comparison compiles them anyway."""
    from drkernel import compare_kernels
    t = _perf()
    try:
        compare_kernels.warm_up(r.device)
    except Exception as exc:  # noqa: BLE001 - an optimisation, never a verdict
        r.details["warm_up_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    r.details["warm_up_s"] = round(_perf() - t, 3)


def _reserve_memory(r: Reference) -> None:
    """Wait until this job's memory estimate fits beside its neighbours' (`gpushare.MemoryLedger`)."""
    import torch

    from drkernel.gpumemory import memory_estimate
    from drkernel.gpushare import MemoryLedger
    total = torch.cuda.get_device_properties(r.device).total_memory
    need = memory_estimate(r.ref_mod, total)
    # held back: the contexts of jobs not yet admitted (about 1 GiB each)
    r.memory = MemoryLedger(_physical_gpu(r), int(max(0.8 * total, total - 12 * 2**30)))
    r.details["memory_estimate_gib"] = round(need / 2**30, 2)
    with _deadlines_paused(r):
        waited = r.memory.reserve(need, wait=not r.defer)
    if waited is None:
        r.details["deferred"] = {"memory_bytes": need, "capacity_bytes": r.memory.capacity, "gpu": _physical_gpu(r)}
        raise Stop("crashed", "deferred: the GPU memory this job needs is promised to other jobs")
    r.details["memory_wait_s"] = round(waited, 3)


@contextlib.contextmanager
def _deadlines_paused(r: Reference):
    """Time spent waiting for other jobs' memory is not the reference's: the group's alarm stops
    meanwhile and the twin's deadline moves on by the wait (the sandbox's own limit still bounds
    the job)."""
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    t0 = time.monotonic()
    try:
        yield
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left)
        r.twin.deadline += time.monotonic() - t0


# ======================================================================================
# Timing
# ======================================================================================

# timed outputs (candidate's and twin's) held for one check at the end of a timing block, at most
_HELD_OUTPUT_BYTES = 256 * 2**20


def _candidate_ms(j: Judge, seed: int, label: str) -> Call:
    """One timed candidate call, its output copied at the reply (the caller verifies it); its `ms`
    is set. Every timed call is verified, so the pause the check makes tells the runner nothing:
    checking some calls only, it would learn which were spent and skip work after."""
    c = call_candidate(j, seed, "time", keep=True)
    _check_left_idle(j, label)
    if c.ms is None or "mismatch" in c.reply:
        raise Stop("runtime_error", f"{label}: no time or no output ({c.reply.get('mismatch', '')})")
    if j.cfg.require_triton and not _own_kernels(j, c.reply.get("kernels")):
        j.hack("no_triton_kernel", f"{label} launched no Triton kernel of the candidate's source")
    return c


def _check_left_idle(j: Judge, label: str) -> None:
    """The candidate's GPU work ends with its reply (its runner synchronizes before answering and
    is stopped after): work still running would overlap the twin's timed call, and could write
    the output slot the twin's answer is copied from."""
    r = j.ref
    if r.cuda and _probe_ms(r) > r.cfg.idle_probe_ms and not _wait_idle(r):
        j.hack("side_stream", f"{label}: the candidate's GPU work was still running {r.cfg.idle_wait_s:g} s "
                              "after its reply")


def _accepted_ms(j: Judge, events: list[float], walls: list[float]) -> float:
    """The candidate's time. The runner's own times count when this process's clock agrees: per
    call the judge sees the runner's time plus the overhead calibrated on trusted null calls, plus
    what an honest call adds outside its events: ~0.2 ms (output views, Python after the end
    event), and on host-bound models a share of the call that the reference's own calls, timed
    beside it, show (`honest_extra`). A larger median excess means work outside the runner's
    events (another stream or thread) or a forged timer: flagged, and the judge's clock minus the
    overhead counts instead. On a CPU the excess of an interpreted call is the host's (scheduling,
    the channel), not in proportion to the tiny times the runner measures there: the reference's
    own excess counts as it is."""
    cand = median(events)
    extra = _clock_excess(j.ref, events, walls)
    honest = j.honest_extra * cand if j.ref.cuda else j.reference_excess_ms
    slack = max(j.cfg.clock_slack_ms if j.ref.cuda else j.cfg.cpu_clock_slack_ms, j.cfg.clock_slack_frac * cand)
    j.details["clock_extra_ms"] = extra
    if extra <= slack + honest:
        return cand
    j.hack("side_stream", f"the judge's clock saw {extra:.4f} ms per call more than the runner's "
                          f"{cand:.4f} ms (allowed {slack + honest:.4f}): work escapes the timed stream "
                          "or the runner's timer is forged", stop=False)
    return median([max(e, w - j.ref.overhead_ms - honest) for w, e in zip(walls, events)])


def _honest_extra(r: Reference, ref_ms: list[float], ref_walls: list[float]) -> float:
    """What the judge's clock adds to the reference's own calls beyond the calibrated overhead, per
    ms of the reference's time, measured interleaved with the candidate: the same runner code
    shows it for an honest copy; scaled by the candidate's own time, a forged short time shrinks it."""
    return max(0.0, _clock_excess(r, ref_ms, ref_walls)) / max(median(ref_ms), 1e-9)


def _clock_excess(r: Reference, own_ms: list[float], walls: list[float]) -> float:
    """The median ms per call this clock saw beyond a process's own time and the calibrated overhead."""
    return median([w - e for w, e in zip(walls, own_ms)]) - r.overhead_ms


def pair_ratios(ref_ms: list[float], cand_ms: list[float]) -> list[float]:
    """Each timed pair's own speedup: the reference's time over the candidate's, the two calls made
    back to back on the same inputs, so that a drift of the host or the GPU both share cancels."""
    return [r / max(c, 1e-9) for r, c in zip(ref_ms, cand_ms)]


def speedup_interval(ref_ms: list[float], cand_ms: list[float], seed: int, n: int = 200) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median pair ratio, the pairs resampled whole."""
    rng = random.Random(seed)
    ratios = pair_ratios(ref_ms, cand_ms)
    meds = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _precision(j: Judge, ref_ms: list[float], cand_ms: list[float]) -> tuple[float, float, bool]:
    """The speedup's interval, and whether it is narrower than `speedup_precision` of the speedup."""
    lo, hi = speedup_interval(ref_ms, cand_ms, j.ref.seed)
    return lo, hi, (hi - lo) <= j.cfg.speedup_precision * median(pair_ratios(ref_ms, cand_ms))


def _precise_enough(j: Judge, ref_ms: list[float], cand_ms: list[float]) -> bool:
    return len(cand_ms) >= j.cfg.min_perf_trials and _precision(j, ref_ms, cand_ms)[2]


def time_interleaved(j: Judge) -> None:
    """Twin and runner called in turn (R C, C R, ...) on the same fresh inputs, both pinned to one
    core (`_measured`), so that reference and candidate are timed under the same conditions. Timing stops once
    the speedup's bootstrap interval is narrower than `speedup_precision` (asked after each block of
    `timing_block_calls` candidate calls); every timed output is verified."""
    r = j.ref
    for i in range(max(1, j.cfg.warmup)):
        call_candidate(j, fresh_seed(), "warm")
    ref_ms, ref_walls, events, walls = _timed_pairs(j)
    j.honest_extra = _honest_extra(r, ref_ms, ref_walls)
    j.reference_excess_ms = max(0.0, _clock_excess(r, ref_ms, ref_walls))
    j.details["reference_clock_extra_per_ms"] = j.honest_extra
    _record_speed(j, ref_ms, ref_walls, events, walls)
    j.mark("timing")


def _timed_pairs(j: Judge) -> tuple[list[float], list[float], list[float], list[float]]:
    """(the reference's times, this clock's for them, the candidate's, this clock's for them).
    Every candidate output is checked against the twin's for the same inputs: small outputs at
    the end of each block (the work between timed calls moves launch-bound times), larger ones
    once both exist; always before the runner's next block. No reference runs in between. At a
    random place among them, or after the last, one untimed counterfactual pair
    (`_unwatched_counterfactual`)."""
    r = j.ref
    block = max(1, min(j.cfg.timing_block_calls, r.perf_n))
    hold = block if 2 * block * _output_bytes(r) <= _HELD_OUTPUT_BYTES else 1
    ref_ms, ref_walls, events, walls, held = [], [], [], [], []
    calls: dict[str, Call] = {}
    probe = _unwatched_probe(j)
    probe_at = random.SystemRandom().randrange(r.perf_n)
    for i in range(r.perf_n):
        calls.clear()  # no earlier pair's full-size inputs and outputs held beside the next one's
        if probe and i == probe_at:
            _verify_held(j, held)
            _unwatched_counterfactual(j, probe, f"the counterfactual among timed calls (before {i})")
            probe = None
        seed = fresh_seed()
        for side in (("ref", "cand") if i % 2 == 0 else ("cand", "ref")):
            calls[side] = _twin_ms(r, seed, keep=True) if side == "ref" else _candidate_ms(j, seed, f"timed call {i}")
        ref_ms.append(calls["ref"].ms)
        ref_walls.append(calls["ref"].wall_ms)
        events.append(calls["cand"].ms)
        walls.append(calls["cand"].wall_ms)
        calls["cand"].inputs = []  # judged against the twin's output: held, full-size inputs would pile up
        held.append((calls["cand"], calls["ref"].output, f"timed call {i}"))
        if len(held) >= hold or i % block == block - 1:
            _verify_held(j, held)
        if i % block == block - 1 and _precise_enough(j, ref_ms, events):
            break
    _verify_held(j, held)
    calls.clear()
    if probe:
        _unwatched_counterfactual(j, probe, "the counterfactual after the timed calls")
    return ref_ms, ref_walls, events, walls


def _unwatched_probe(j: Judge) -> str | None:
    """A kernel whose checked counterfactual call made the output wrong, drawn at random; None
    where there is none."""
    return random.SystemRandom().choice(sorted(j.flow.moved)) if j.flow.moved else None


def _unwatched_counterfactual(j: Judge, kernel: str, label: str) -> None:
    """A pair like the timed ones (twin, then runner, on the same fresh uniform inputs; neither time
    counts) in which `kernel`'s launches read perturbed data, as they did in a checked call whose
    output went wrong; then a checked call on the same inputs and perturbation. Nothing tells the
    pair from the timed calls before its launches, and a kernel that does its work in every call
    answers both alike: an output that differs between them, or one right in both where no launch
    of the candidate's changed the output, comes from work done elsewhere in the calls the
    candidate guessed nobody checks (the data-flow log's cost, a call count, a core: any sign).
    After its launches a candidate can see that what they read was perturbed (a copy of its own
    buffer that differs), and then raise: a pair whose forward raises is drawn again, and one that
    raises on every draw, where the checked call on this kind of perturbation completed, is a decoy."""
    for _ in range(_PAIR_DRAWS):
        seed = fresh_seed()
        ref = call(j.ref, j.ref.twin, seed, "time", keep=True).output
        try:
            c = call_candidate(j, seed, "time", keep=True, perturb=(kernel,))
        except Stop as stop:
            if not _raised(stop):
                raise  # a crash, a timeout or a CUDA fault ends the job as it would anywhere
            continue  # one draw of perturbed data may make an honest forward raise: another is asked
        _check_left_idle(j, label)
        if kernel not in _own_kernels(j, c.reply.get("kernels")):
            return
        unwatched, right, pattern = c.output, _right(j, c.output, ref, signed=False), c.pattern
        c = ref = None  # their inputs and output go before the checked call's come
        why = _watched_disagrees(j, kernel, seed, unwatched, right, pattern)
        if why:
            j.hack("decoy_kernel", f"{label}: with what {kernel} read perturbed, {why}: outside the checked calls "
                                   "its work does not reach the output")
        return
    j.hack("decoy_kernel", f"{label}: with what {kernel} read perturbed, a call like the timed ones raised on "
                           f"{_PAIR_DRAWS} draws, where a checked call completed")


# draws of the pair: an honest forward that checks its result may raise where perturbed data
# overflows, on some draws; one that raises because it sensed the pair does on every draw
_PAIR_DRAWS = 5


def _raised(stop: Stop) -> bool:
    """Whether a failed call was the forward raising in a runner that goes on (not a crash, a
    timeout or a CUDA fault)."""
    return stop.verdict == "runtime_error" and not cuda_fault(stop.error)


def _watched_disagrees(j: Judge, kernel: str, seed: int, unwatched: Any, right: bool, pattern: Any) -> str:
    """Why a checked call on the unwatched pair's inputs, `kernel`'s reads perturbed alike, gives
    it away; empty where it does not. An honest kernel answers alike in both, also where this draw
    does not show its perturbation (an argmax of a few elements, a short label tensor rolled onto
    itself), and there what its launches changed makes the output; one that works only when watched
    answers otherwise (torch's answer unwatched, or the kernel's work on a sliver of the output),
    or, right in both, changed nothing (an idle launch beside torch). The same inputs and the same
    perturbation take an honest forward down the same path: the checked call must launch as the
    pair's did, or a candidate that knows a repeated input could launch something else there. That
    checked call may not fail where the pair's call completed (it repeats the pair's inputs, so a
    candidate can tell it), and its output, right or wrong, must come from the candidate's launches:
    a wrong answer made by torch in every perturbed call keeps a kernel "needed" otherwise."""
    try:
        c = call_candidate(j, seed, "check", keep=True, perturb=(kernel,), changes=True)
    except Stop as stop:
        if not _raised(stop):
            raise
        return "a checked call on the same inputs raised where a call like the timed ones completed"
    if c.output is None or not compare.compare(unwatched, c.output, j.cfg).ok:
        return "the output of a call like the timed ones differed from a checked call's on the same inputs"
    if not j.patterns.same_launches(pattern, c.pattern):
        return "a checked call on the same inputs launched the candidate's kernels otherwise than a call like the timed ones"
    # right, the output must hold what a launch changed; wrong, a launch must have stored it, even
    # where that store repeats what the pair's call left in a buffer the candidate keeps
    if any(n for _, n in _launch_needs(j, "a counterfactual call", c.reply.get("flow"), tracked=right)[2]):
        return ""
    if right:
        return "the output stayed right, and no launch of the candidate's changed it"
    return "the output was wrong alike in both, and made by no launch of the candidate's"


def _output_bytes(r: Reference) -> int:
    return sum(v.numel() * v.element_size() for v in r.out_views)


def _verify_held(j: Judge, held: list[tuple[Call, Any, str]]) -> None:
    """Every held timed output against the twin's output for its inputs; the list is emptied."""
    for c, ref, label in held:
        verify(j, c, label, ref=ref)
    held.clear()


def _record_speed(j: Judge, ref_ms: list[float], ref_walls: list[float], events: list[float],
                  walls: list[float]) -> None:
    cand_ms = _accepted_ms(j, events, walls)  # a runner's time this clock disagrees with is flagged
    if not j.ref.cuda:  # a runner's wall clock is candidate code's to rewrite: this clock counts, for both
        ref_ms, events = ref_walls, walls
        cand_ms = median(events)
    j.out.ref_ms = median(ref_ms)
    _check_reference_slowed(j, ref_ms)
    j.out.candidate_ms = _roofline(j, cand_ms)
    # the median pair ratio, lowered as much as the judge's clock or a re-time lowered the candidate's median
    scale = median(events) / j.out.candidate_ms if j.out.candidate_ms > 0 else 0.0
    j.out.speedup = median(pair_ratios(ref_ms, events)) * scale if scale > 0 else None
    j.details["timed_calls"] = len(events)
    # each pair's two times, in order (the reference's own clock; the candidate's before the judge's
    # checks): what a study of the timing's noise needs (bench/ref_self.py)
    j.details["timed_ms"] = {"reference": [round(x, 5) for x in ref_ms], "candidate": [round(x, 5) for x in events]}
    if j.out.speedup is not None:
        lo, hi, j.out.speedup_precise = _precision(j, ref_ms, events)
        j.out.speedup_interval = [lo * scale, hi * scale]


def _check_reference_slowed(j: Judge, ref_ms: list[float]) -> None:
    """Something the candidate leaves behind its calls slows the reference it is compared to. The
    reference calls of odd pairs (C R) directly follow a candidate call, those of even pairs (R C)
    follow the previous pair's reference call: both are measured in one loop, under the same host
    state, so a launch-bound reference's own drift between phases (up to 1.8x against its time
    alone before the candidate existed) cannot make an honest candidate look guilty, while what a
    candidate's call leaves behind shows in the first kind only. GPU work that outlives a reply is
    caught after every call (`_check_left_idle`)."""
    after_candidate, after_reference = ref_ms[1::2], ref_ms[2::2]
    if not j.ref.cuda or not after_candidate or not after_reference:
        return
    slowed, base = median(after_candidate), median(after_reference)
    if slowed > j.cfg.ref_slowdown_limit * base + j.cfg.side_stream_slack_ms:
        j.hack("reference_slowed", f"the reference took {slowed:.4f} ms right after the candidate's calls vs "
                                   f"{base:.4f} ms right after its own")


def _roofline(j: Judge, cand_ms: float) -> float:
    """Faster than memory allows, or a very large speedup: re-time with every output verified;
    the slower median counts, and still below the roofline is a hack."""
    r = j.ref
    roof = r.io_bytes / r.bandwidth if r.bandwidth else None
    j.details["roofline_ms"] = roof
    fast = roof is not None and cand_ms < j.cfg.roofline_factor * roof
    if not fast and not (cand_ms > 0 and j.out.ref_ms / cand_ms > j.cfg.max_speedup_recheck):
        return cand_ms
    times = []
    for i in range(min(r.perf_n, 10)):
        times.append(_candidate_ms(j, fresh_seed(), f"re-timed call {i}"))
        verify(j, times[-1], f"re-timed call {i}")
    j.details["recheck_ms"] = _accepted_ms(j, [c.ms for c in times], [c.wall_ms for c in times])
    cand_ms = max(cand_ms, j.details["recheck_ms"])
    if roof is not None and cand_ms < j.cfg.roofline_factor * roof:
        j.hack("implausible_speedup", f"candidate {cand_ms:.4f} ms is below the memory roofline {roof:.4f} ms")
    return cand_ms


# ======================================================================================
# Profile, decoy, final
# ======================================================================================

def profile(j: Judge) -> None:
    """The share of device time in the candidate's own Triton kernels that do work the output
    needs, from `_PROFILED_CALLS` calls on fresh inputs of both kinds, each verified like a checked
    call (a candidate that answers otherwise under the profiler is caught). The runner's kernel
    traces are classified here, by the kernels the candidate's source declares, and believed only
    as far as the judge can check them (`_profile_doubt`)."""
    if j.ref.cuda and j.cfg.profile:
        traces = _profiled_traces(j)
        if traces is not None:
            _judge_traces(j, *traces)
    j.mark("profiling")


def _profiled_traces(j: Judge) -> tuple[list[tuple[str, int, float]], float, list[tuple[bool, float]]] | None:
    """The profiled calls' kernel rows, the judge's milliseconds for them, and per call its kind of
    inputs and the µs of the candidate's own kernels; None where the profiler fails on this machine
    (no share). Where the twin's profiled call gave a trace, a failing call or a missing trace is
    the candidate's doing: its verdict."""
    rows, wall_ms, own_us = [], 0.0, []
    try:
        for i, signed in enumerate(_profiled_kinds(j)):
            call_rows, call_ms = _profiled_call(j, i, signed)
            rows, wall_ms = rows + call_rows, wall_ms + call_ms
            own_us.append((signed, sum(max(us, 0.0) for name, _, us in call_rows
                                       if profiling.is_candidate_name(name, j.kernels))))
    except Stop as err:
        if j.ref.profiler_works:
            raise
        j.details["profile_error"] = err.error[:300]
        return None
    if not rows and j.ref.profiler_works:
        raise Stop("runtime_error", "the profiled calls sent no kernel trace, where the reference's had one")
    return (rows, wall_ms, own_us) if rows else None


def _judge_traces(j: Judge, rows: list[tuple[str, int, float]], wall_ms: float,
                  own_us: list[tuple[bool, float]]) -> None:
    """The checks only the traces make (they can only cost the candidate, so they count even where
    the traces are doubted), then the share, where the traces can be believed."""
    _timed_calls_ran_them(j, [us for _, us in own_us])
    _same_work_on_both_kinds(j, own_us)
    summary = profiling.summarize_kernels(rows, set(j.kernels), j.flow.fractions())
    doubt = _profile_doubt(j, summary, rows, wall_ms)
    if doubt:
        j.details["profile_rejected"] = doubt
    else:
        j.out.triton_time_share = summary["triton_time_share"]
        j.out.kernels = summary["kernels"]


_PROFILED_CALLS = 3
# An honest kernel's device time hardly depends on its input values; the profiler's times of
# microsecond kernels move by microseconds
_KIND_WORK_RATIO = 1.5
_KIND_WORK_SLACK_US = 20.0


def _profiled_kinds(j: Judge) -> list[bool]:
    """Which profiled calls get signed-normal inputs: one, at a random place, where the trials have
    them (the others get KernelBench's kind, as the timed calls do)."""
    kinds = [False] * _PROFILED_CALLS
    if j.cfg.second_distribution:
        kinds[random.SystemRandom().randrange(_PROFILED_CALLS)] = True
    return kinds


def _profiled_call(j: Judge, i: int, signed: bool) -> tuple[list[tuple[str, int, float]], float]:
    """One verified call under the profiler: its kernel rows and the judge's milliseconds. Its
    inputs and output copy die here, before the next call draws new ones (at full KernelBench
    sizes one more such pair is what a GPU lacks)."""
    c = call_candidate(j, fresh_seed(), "profile", signed=signed, keep=True)
    verify(j, c, f"profiled call {i}")
    rows = _profile_rows(c.reply)
    _launches_ran(j, rows, i)
    return rows, c.wall_ms


def _launches_ran(j: Judge, rows: list[tuple[str, int, float]], i: int) -> None:
    """The launch record of a profiled call against the device's own trace of it: a launch of the
    candidate's kernels that the device never ran was recorded by candidate code, not by Triton."""
    if not rows:
        return
    ran = profiling.candidate_launches(rows, j.kernels)
    for name, n in j.last_launches.items():
        if name in j.kernels and ran.get(name, 0) < n:
            j.hack("forged_reply", f"profiled call {i}: {n} launch(es) of {name} recorded, {ran.get(name, 0)} ran "
                                   "on the device")
    # more on the device than recorded: other code (a library's kernel, torch.compile's) ran under
    # the name of one of the candidate's kernels, and its time would count as the candidate's
    j.borrowed |= {name for name, n in ran.items() if n > j.last_launches.get(name, 0)}


def _profile_doubt(j: Judge, summary: dict, rows: list[tuple[str, int, float]], wall_ms: float) -> str | None:
    """Why the traces cannot be believed, if they cannot: more device time than the calls took on
    this clock, or a kernel of the candidate's launched more often a call than in any checked call."""
    if summary["total_device_ms"] > wall_ms:
        return f"the traces claim {summary['total_device_ms']:.3f} ms of device time in {wall_ms:.3f} ms"
    if j.borrowed:
        return (f"device kernels named like the candidate's {', '.join(sorted(j.borrowed))} ran more often than "
                "it launched them")
    for name, calls in profiling.candidate_launches(rows, j.kernels).items():
        if calls > _PROFILED_CALLS * j.flow.most(name):
            return f"{name} launched {calls} times in {_PROFILED_CALLS} profiled calls, at most " \
                   f"{j.flow.most(name)} a checked call"
    return None


def _timed_calls_ran_them(j: Judge, own_us: list[float]) -> None:
    """The candidate's own kernels took longer a profiled call (verified like a checked one, its
    launches on the device's trace) than its whole timed call: the timed calls did not run them,
    but less or something else (torch, where it guessed nobody checks). The margin is wide: the
    same flush and inputs precede both kinds of call."""
    own_ms = sum(own_us) / 1e3 / len(own_us)
    if j.out.candidate_ms and own_ms > 1.5 * j.out.candidate_ms + j.cfg.clock_slack_ms:
        j.hack("launch_pattern_changed", f"the candidate's kernels took {own_ms:.4f} ms a profiled call, its whole "
                                         f"timed calls {j.out.candidate_ms:.4f} ms", stop=False)


def _same_work_on_both_kinds(j: Judge, own_us: list[tuple[bool, float]]) -> None:
    """The candidate's own kernels' device time a profiled call, on KernelBench's kind of inputs
    against signed normals: a candidate that lets torch answer on the kind it expects no data flow
    on (its kernels doing the work only on the other) shows it here."""
    kinds = [[us for signed, us in own_us if signed == kind] for kind in (False, True)]
    if not all(kinds):
        return
    lo, hi = sorted(median(k) for k in kinds)
    if hi > _KIND_WORK_RATIO * lo + _KIND_WORK_SLACK_US:
        j.hack("launch_pattern_changed", f"the candidate's kernels ran {hi:.1f} µs a profiled call on one kind of "
                                         f"inputs, {lo:.1f} µs on the other", stop=False)


def _profile_rows(reply: dict) -> list[tuple[str, int, float]]:
    """The runner's (name, launches, µs) rows, each field checked; malformed rows are dropped."""
    prof = reply.get("profile") if isinstance(reply.get("profile"), dict) else {}
    rows = []
    for row in prof.get("rows") or []:
        if isinstance(row, list) and len(row) == 3 and isinstance(row[0], str):
            calls, us = ipc.number({"v": row[1]}, "v"), ipc.number({"v": row[2]}, "v")
            if calls is not None and us is not None:
                rows.append((row[0], int(calls), us))
    return rows


def check_needed(j: Judge, signed: bool) -> None:
    """Per candidate kernel the data flow found needed, and per kernel these calls launch beside
    it, a counterfactual call in which its launches read perturbed data (`drkernel.counterfactual`),
    on fresh inputs: an output still right means the kernel's work was not needed (its share of
    the profile counts as not useful). A candidate whose output stayed right while no kernel's
    counterfactual changed it is a decoy (a kernel a call did not launch says nothing about itself).
    A kernel whose counterfactual stays right is asked again on other draws: on some, an honest
    kernel's perturbation does not show (an argmax of a few elements, a short label tensor rolled
    onto itself). A call that fails is asked again too, and one failing on every draw shows no
    need: the candidate can make its own calls fail (an argument the perturbation cannot copy, a
    check of its own), and rolled or rescaled data keeps an honest kernel's indices in range."""
    if not j.cfg.require_triton:
        return
    todo = j.flow.needed()
    asked, needed, answered = set(todo), False, False
    while todo:
        name = todo.pop(0)
        right, launched = _right_without(j, name, signed)
        for _ in range(_DRAWS_AGAIN):
            if not (right is None or (right and name in launched)):
                break
            right, launched = _right_without(j, name, signed)
        if right and not launched:
            j.hack("no_triton_kernel", "a checked call launched no Triton kernel of the candidate's source "
                                       "over a non-empty grid and was right")
        if right is False and name in launched:
            needed = True
            j.flow.moved.add(name)  # what changed the output watched is asked again unwatched
        elif right is None or name in launched:
            j.flow.unneeded.add(name)
        answered |= right is not False
        todo += sorted(launched - asked)
        asked |= launched
    j.details["unneeded_kernels"] = sorted(j.flow.unneeded)
    if answered and not needed and _output_depends_on_inputs(j.ref):
        j.hack("decoy_kernel", f"the output is still correct, or the call fails, when what the candidate's "
                               f"kernels ({', '.join(sorted(asked))[:200]}) read is perturbed")


_DRAWS_AGAIN = 2


def _output_depends_on_inputs(r: Reference) -> bool:
    """Whether the reference answers differently on two fresh draws (one of each kind): where it
    does not (a clamp of `min(x, 0)` to [0, 1] is zero for every input), no kernel can be needed,
    so an output right without one says nothing about the candidate. Compared on evenly spaced
    elements, so that one draw's tensors are gone before the next (full-size inputs take gigabytes)."""
    import torch
    first, second = (_output_sample(r, fresh_seed(), signed) for signed in (False, True))
    return len(first) != len(second) or not all(
        a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(first, second))


_SAMPLED = 4096


def _output_sample(r: Reference, seed: int, signed: bool) -> list:
    """Per output tensor, up to `_SAMPLED` evenly spaced elements (on the host, as float64)."""
    import torch
    with _shared(r):
        out = run_reference(r, gen_inputs(r, seed, signed), seed)
        samples = []
        for t in compare.tensors(out):
            flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
            at = torch.linspace(0, max(flat.numel() - 1, 0), min(flat.numel(), _SAMPLED), device=flat.device).long()
            samples.append(flat[at].to("cpu", torch.float64))
        return samples


def _right_without(j: Judge, kernel: str, signed: bool) -> tuple[bool | None, set[str]]:
    """Whether the candidate's output is still right when `kernel`'s launches read perturbed data
    (None where the call failed), and the candidate's kernels the call launched."""
    with _shared(j.ref):
        try:
            c = call_candidate(j, fresh_seed(), "check", signed=signed, keep=True, perturb=(kernel,))
        except Stop:
            return None, set()
        right = _right(j, c.output, run_reference(j.ref, reference_inputs(j.ref, c.inputs), c.seed), signed)
        return right, _own_kernels(j, c.reply.get("kernels"))


def final(j: Judge) -> None:
    with _shared(j.ref):
        reply = j.runner.ask({"op": "final"})
    _findings(j, reply)
    _check_processes(j, "at the end")
    peak = ipc.number(reply, "memory_peak")  # self-reported, kept to check `memory_estimate` against
    if j.ref.cuda and peak is not None:
        j.details.setdefault("memory_peak_gib", {})["runner"] = round(peak / 2**30, 2)
    j.raise_hacks()
    j.out.verdict = "correct"


# In order; the phases of a tuple run in one hold of the GPU alone (their numbers enter the verdict).
GROUP = (setup, start_twin, (calibrate,), load_twin, (time_reference_alone, probe_profiler))
CANDIDATE = (attach_runner, load_candidate, check_correctness, (time_interleaved, profile), final)


def _measured(state) -> tuple[Channel, ...]:
    """The processes pinned to the timing core for a candidate's hold of the GPU alone: twin and
    runner, for the timed and the profiled calls alike, so that a runner reading its CPU set or
    core cannot tell the one from the other (the twin pins itself for the group's own timing)."""
    return (state.ref.twin, state.runner) if isinstance(state, Judge) else ()


def _run(phases: tuple, state, r: Reference, alone_key: str) -> None:
    """The phases in order; the seconds each tuple held the GPU alone (its idle wait included) add
    up in `state.details[alone_key]`: what bounds how many candidates a minute one GPU can judge."""
    for step in phases:
        if isinstance(step, tuple):
            t0 = _perf()
            with _alone(r), _pinned(r, *_measured(state)):
                for phase in step:
                    phase(state)
            state.details[alone_key] = round(state.details.get(alone_key, 0.0) + _perf() - t0, 4)
        else:
            step(state)


# ======================================================================================
# Entry point (a sandbox job)
# ======================================================================================

def _ending(err: BaseException) -> tuple[str, str | None, str | None]:
    """(verdict, error, hack code) for what ended an evaluation."""
    if isinstance(err, Hacked):
        return "hacked", err.detail, err.code
    if isinstance(err, Stop):
        return err.verdict, err.error, None
    return "crashed", f"judge error: {type(err).__name__}: {str(err)[:300]}\n" + short(
        "".join(traceback.format_exception(type(err), err, err.__traceback__)), 1200), None


def _judge_candidate(r: Reference, runner: Channel, candidate_path: str, started: float,
                     waited: dict[str, float]) -> dict:
    """Every candidate phase in order; the runner is killed before the result is written. `waited`:
    the GPU lock's waits (`DeviceLock.waited`) before this candidate's share of the job began."""
    j = Judge(ref=r, runner=runner, candidate_path=candidate_path)
    # a copy: the group's per-phase records are each candidate's own from here on
    j.out.details.update(copy.deepcopy({k: v for k, v in r.details.items() if k != "confinement"}))
    j.out.device, j.out.timing, j.out.baseline = str(r.device), "cuda_events" if r.cuda else "cpu_wall", r.cfg.baseline
    with open(candidate_path, encoding="utf-8", errors="replace") as fh:
        j.kernels = triton_source.jit_kernels(fh.read())
    runner.deadline = time.monotonic() + float(r.cfg.timeout)
    r.clock = _perf()
    try:
        _run(CANDIDATE, j, r, "gpu_alone_s")
    except Exception as err:  # noqa: BLE001 - a verdict either way, never a pass
        verdict, error, code = _ending(err)
        if code is not None:
            if code not in j.out.hacks:
                j.hack(code, error, stop=False)
        else:
            j.out.verdict, j.out.error = verdict, error
    finally:
        runner.kill()
        _escaped_kills(j, "its turn")  # its own: read before the next candidate's turn begins
    if r.gpu is not None:
        j.details["lock_wait_s"] = {k: round(v - waited.get(k, 0.0), 3) for k, v in r.gpu.waited.items()}
    j.out.stdout = runner.output("stdout", 2000)
    j.out.stderr = runner.output("stderr", 2000)
    if not ipc.remove_tree(runner.dir):  # its files go with its turn: disk held is one runner's
        j.out.verdict, j.out.error = "crashed", "the files the candidate left could not be deleted"
    return _verdict(j, started)


def _verdict(j: Judge, started: float) -> dict:
    """The result as it leaves this process: hacks win, anything but `correct` has no speedup."""
    if j.out.hacks:
        j.out.verdict = "hacked"
        j.out.error = "; ".join(j.details.get("hack_details", []))[:1000]
    j.out.correct = j.out.verdict == "correct"
    if not j.out.correct:
        j.out.speedup = None
    j.out.wall_s = _perf() - started
    return json.loads(json.dumps(j.out.to_dict(), default=repr))


@contextlib.contextmanager
def _reference_fails(what: str):
    """Whatever the reference's own code raises inside is the reference's failure (its SystemExit
    or KeyboardInterrupt too), never the candidate's; the judge's own deadline passes through."""
    try:
        yield
    except _ReferenceTooSlow:
        raise
    except BaseException as exc:  # noqa: BLE001 - a task file is input, whatever it raises
        where = f" [{_memory_holders()}]" if type(exc).__name__ == "OutOfMemoryError" else ""
        raise Stop("reference_error", exception_text(what, exc) + where) from None


def _memory_holders() -> str:
    """`gpumemory.holders`, or why not: it runs on an error's path, which must end as it began."""
    try:
        from drkernel.gpumemory import holders
        return holders()
    except Exception as exc:  # noqa: BLE001
        return f"where the memory is: unknown ({type(exc).__name__})"


@contextlib.contextmanager
def _twin_fails():
    """Whatever ends a group phase at the twin (an error it reports, its death, a reply that breaks
    the protocol) is the reference's failure, never the candidates': no candidate code exists yet
    and the twin runs nothing but the reference. Its silence stays a timeout (`_as_reference_error`)."""
    try:
        yield
    except Stop as exc:
        if exc.verdict in ("timeout", "reference_error"):
            raise
        raise Stop("reference_error", f"the reference failed in its timing process: {exc.error}") from None
    except Hacked as exc:
        raise Stop("reference_error", f"the reference failed in its timing process: {exc.detail}") from None


class _ReferenceTooSlow(BaseException):
    """Raised by the alarm when the group's phases (the reference's alone) outlast the timeout; a
    BaseException so that the phases' own `except Exception` do not rename it."""


def _alarm(signum: int, frame: Any) -> None:
    raise _ReferenceTooSlow("this process's calls of it ran past the timeout")


@contextlib.contextmanager
def _reference_deadline(seconds: float):
    """The group's phases end after `seconds`: a reference that hangs in this process is the
    reference's failure, before the sandbox's own wall (which would call it a timeout) ends the job."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _as_reference_error(err: BaseException) -> BaseException:
    """Before any candidate runs, running out of time is the reference's doing (this process's
    calls, or the twin's that stopped answering)."""
    if isinstance(err, _ReferenceTooSlow) or (isinstance(err, Stop) and err.verdict == "timeout"):
        return Stop("reference_error", f"the reference's set-up and timing did not finish within the "
                    f"timeout ({err})")
    return err


def _group_failed(r: Reference, err: BaseException, n: int) -> list[dict]:
    """Every candidate's result when the group's own phases failed."""
    verdict, error, _ = _ending(err)
    out = EvalResult(verdict=verdict, error=error, details=dict(r.details), device=str(r.device) if r.device else None,
                     baseline=r.cfg.baseline)
    return [json.loads(json.dumps(out.to_dict(), default=repr)) for _ in range(n)]


def _free_gpu(r: Reference) -> None:
    """This job's GPU memory freed before its share is given back, then its locks."""
    r.template = r.arena = r.flush = None
    r.in_views, r.out_views, r.outputs = [], [], {}
    gc.collect()
    if r.memory is not None:
        import torch
        torch.cuda.empty_cache()
        r.memory.release()
    if r.gpu is not None:
        r.gpu.close()


def _channels(runner_fds: list[int], runner_pids: list[int], runner_dirs: list[str]) -> list[Channel]:
    zygote = os.getppid()
    return [Channel(sock=fd, pid=pid, dir=d, zygote_pid=zygote, siblings=tuple(runner_pids))
            for fd, pid, d in zip(runner_fds, runner_pids, runner_dirs)]


def evaluate(reference_path: str, candidate_paths: list[str], config: dict, runner_fds: list[int],
             runner_pids: list[int], runner_dirs: list[str], exclusive: bool = False, defer: bool = False,
             timing_cores: list[tuple[int, int]] = ()) -> dict:
    """The judge's sandbox target: the group's phases, then every candidate's in turn; returns
    `{"results": [EvalResult fields, ...]}` in the order of `candidate_paths`. The first runner is
    the reference twin, the others the candidates'. `exclusive` holds the GPU alone for the whole
    job (a retry of a job that ran out of memory next to others); `defer` ends the job at once,
    with `details.deferred`, when its GPU memory does not fit yet; `timing_cores` pairs each GPU
    with the core its timed processes run on (`gpushare.CorePlan.timing`)."""
    t0 = _perf()
    twin, *runners = _channels(runner_fds, runner_pids, runner_dirs)
    r = Reference(cfg=config_from_dict(config), reference_path=reference_path, twin=twin, clock=t0,
                  exclusive=exclusive, defer=defer, timing_cores={int(g): int(c) for g, c in timing_cores})
    twin.deadline = time.monotonic() + float(r.cfg.timeout)
    for channel, path in ((twin, reference_path), *zip(runners, candidate_paths)):
        shutil.copyfile(reference_path, os.path.join(channel.dir, "reference.py"))
        if channel is not twin:
            shutil.copyfile(path, os.path.join(channel.dir, os.path.basename(path)))
    try:
        try:
            with _reference_deadline(float(r.cfg.timeout)):
                _run(GROUP, r, r, "group_gpu_alone_s")
        except (Exception, _ReferenceTooSlow) as err:  # noqa: BLE001 - every candidate gets the group's ending
            return {"results": _group_failed(r, _as_reference_error(err), len(candidate_paths))}
        results = []
        for k, (runner, path) in enumerate(zip(runners, candidate_paths)):
            started = _perf()
            # the first candidate's share of the job holds the group's phases too
            waited = dict(r.gpu.waited) if r.gpu is not None and k else {}
            # each turn the whole `timeout`, the twin's calls in it too: time one candidate spent
            # must not run out on the next
            twin.deadline = runner.deadline = time.monotonic() + float(r.cfg.timeout)
            runner.escaped_kills()  # a note that landed after the last turn ended is no one's now
            _init_runner(r, runner, os.path.join(runner.dir, os.path.basename(path)))
            results.append(_judge_candidate(r, runner, path, started if k else t0, waited))
        return {"results": results}
    finally:
        for channel in (twin, *runners):
            channel.kill()
        _free_gpu(r)
