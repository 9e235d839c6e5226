"""The judge: decides the verdict, hack codes and speedup, and never imports candidate code.

It runs as a sandbox job (`drkernel.sandbox`) whose zygote also started a runner
(`drkernel.runner`) for it: the judge builds the reference, makes every input, writes it into
the shared arena, asks the runner to call the candidate, and checks what comes back in its own
slots against the reference it computed itself. The phases, one function each, share a `Judge`:

1. `setup`: device, true fp32, the reference imported and built once (a never-run template from
   which every later reference is copied), the output layout;
2. `attach_runner`: the arena shared, the runner confined (its report in `details.confinement`);
3. `time_reference_alone`: the reference timed before any candidate code exists (guard against a
   candidate that slows the reference) and the device copy bandwidth (roofline);
4. `calibrate`: trusted null calls through the runner give the judge's clock overhead per call;
5. `load_candidate`: the runner imports the candidate and builds `ModelNew`;
6. `check_correctness`: trials on fresh uniform and signed-normal inputs;
7. `time_interleaved`: reference (here) and candidate (there) in alternating blocks; runner
   CUDA-event times count only when they agree with this process's clock over the same calls,
   and outputs of calls picked afterwards are checked;
8. `profile`: the Triton share of device time (reported by the runner);
9. `check_decoy`: the candidate once more with its Triton launches turned into no-ops;
10. `final`: the runner's last integrity report.

On a GPU shared by several evaluations (`sandbox.DeviceLock`), phases 3-4 and 7-8 each run in
one hold of the GPU alone (a job waits for the GPU twice, not once per phase); every other piece
of GPU work holds it shared, one short burst at a time. A phase ends the evaluation by raising
`Stop` (a plain verdict) or `Hacked`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import random
import signal
import time
import traceback
from typing import Any

from drkernel import compare, ipc

_perf = time.perf_counter


class Stop(Exception):
    """A final non-hack verdict."""

    def __init__(self, verdict: str, error: str):
        super().__init__(error)
        self.verdict, self.error = verdict, error


class Hacked(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclasses.dataclass
class Call:
    """One candidate call as the judge saw it: the runner's reply, the judge's own seconds, the inputs."""
    reply: dict
    wall_ms: float
    inputs: list


@dataclasses.dataclass
class Judge:
    """What the phases share."""
    cfg: dict
    sock: int
    runner_pid: int
    runner_dir: str
    reference_path: str
    candidate_path: str
    out: dict = dataclasses.field(default_factory=lambda: {"compiled": False, "hacks": [], "details": {},
                                                            "trials": 0, "trials_passed": 0})
    device: Any = None
    seed: int = 0
    perf_n: int = 1
    deadline: float = 0.0
    ref_mod: Any = None
    template: Any = None
    layout: ipc.Layout | None = None
    arena: Any = None
    in_views: list = dataclasses.field(default_factory=list)
    out_views: list = dataclasses.field(default_factory=list)
    flush: Any = None
    io_bytes: int = 0
    ref_aliases: bool = False
    ref_mutates: bool = True  # the reference writes into its inputs (known after setup)
    ref_alone_ms: float = 0.0
    bandwidth: float | None = None
    overhead_ms: float = 0.0
    kernels: set = dataclasses.field(default_factory=set)
    output_from_kernels: bool = True  # every checked call's output was passed to a candidate launch
    clock: float = 0.0
    gpu: Any = None  # sandbox.DeviceLock of this GPU
    memory: Any = None  # sandbox.MemoryLedger of this GPU, holding this job's estimate
    exclusive: bool = False  # hold the GPU alone for the whole job (a retry after out-of-memory)
    defer: bool = False  # give the job back at once when its GPU memory does not fit (the caller requeues it)

    @property
    def details(self) -> dict:
        return self.out["details"]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def hack(self, code: str, detail: str, stop: bool = True) -> None:
        if code not in self.out["hacks"]:
            self.out["hacks"].append(code)
        self.details.setdefault("hack_details", []).append(f"{code}: {detail}")
        if stop:
            raise Hacked(code, detail)

    def spend(self, part: str, since: float) -> float:
        """Add the seconds since `since` to `details.split_s[part]` (where the job's time goes by
        kind of work, across phases); returns now."""
        now = _perf()
        split = self.details.setdefault("split_s", {})
        split[part] = round(split.get(part, 0.0) + now - since, 4)
        return now

    def mark(self, phase: str) -> None:
        now = _perf()
        self.details.setdefault("phase_s", {})[phase] = round(now - self.clock, 4)
        self.clock = now
        if self.memory is not None:  # each phase's peak GPU memory here, to check `memory_estimate` against
            import torch
            peak = torch.cuda.max_memory_reserved(self.device)
            self.details.setdefault("memory_peak_gib_by_phase", {})[phase] = round(peak / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(self.device)

    def ask(self, msg: dict) -> dict:
        """One request to the runner; its death or silence ends the evaluation."""
        try:
            ipc.send(self.sock, msg)
            return ipc.recv(self.sock, self.deadline)
        except (OSError, ipc.ChannelClosed) as exc:
            raise _runner_gone(self, exc) from None


# ======================================================================================
# Helpers
# ======================================================================================

def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gen_inputs(j: Judge, seed: int, signed: bool = False) -> list:
    """The reference's `get_inputs()` under `seed`, on the device; float inputs replaced by
    signed standard normals when `signed` (KernelBench draws uniform [0, 1) inputs, on which
    ReLU(x) = x and other shortcuts pass)."""
    import torch
    torch.manual_seed(seed)
    if j.cuda:
        torch.cuda.manual_seed_all(seed)
        with torch.device(j.device):
            inputs = list(j.ref_mod.get_inputs())
    else:
        inputs = list(j.ref_mod.get_inputs())
    inputs = compare.map_tensors(inputs, lambda t: t.to(j.device))
    if signed:
        _redraw_signed(inputs, torch.Generator(device=j.device).manual_seed(seed + 7919))
    return inputs


def _redraw_signed(inputs: list, g) -> None:
    """Float tensors replaced, in order, by standard normals; each top-level one is let go before
    its replacement is drawn, so that multi-GB inputs are never held twice."""
    import torch

    def draw(t):
        return torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=g) if t.is_floating_point() else t
    for i in range(len(inputs)):
        item, inputs[i] = inputs[i], None
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            shape, dtype, device = item.shape, item.dtype, item.device
            item = None
            inputs[i] = torch.randn(shape, dtype=dtype, device=device, generator=g)
        else:  # integers, integer tensors, nested structures
            inputs[i] = compare.map_tensors(item, draw)


def _clone(obj):
    return compare.map_tensors(obj, lambda t: t.detach().clone())


def new_reference(j: Judge):
    """A fresh copy of the never-run template (building a KernelBench model can take 0.6 s)."""
    try:
        return copy.deepcopy(j.template)
    except Exception:
        return _build_reference(j)


def _build_reference(j: Judge):
    from drkernel.runner import build_model, init_inputs
    return build_model(j.ref_mod.Model, init_inputs(j.ref_mod, j.seed), j.seed, j.device)


def run_reference(j: Judge, inputs: list):
    import torch
    with torch.no_grad():
        out = new_reference(j)(*inputs)
    _sync(j.device)
    return out


def reference_inputs(j: Judge, inputs: list) -> list:
    """What the reference may run on: `inputs` themselves, or a copy where the reference writes
    into its inputs (they are compared with the candidate's afterwards)."""
    return _clone(inputs) if j.ref_mutates else inputs


def _first_reference_run(j: Judge, inputs: list) -> tuple[Any, bool]:
    """The reference's output, and whether it writes into its inputs: an in-place op bumps a
    tensor's version counter even where it leaves the values as they were (ReLU on uniform
    inputs), and the values catch what bypasses the counter."""
    import torch
    ts = compare.tensors(inputs)
    before, copies = [t._version for t in ts], [t.detach().clone() for t in ts]
    with torch.no_grad():
        out = new_reference(j)(*inputs)
    _sync(j.device)
    return out, any(t._version != v or not compare.same_values(t, c) for t, v, c in zip(ts, before, copies))


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


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
    return best


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + "\n...[truncated]...\n" + text[-n // 2:]


def _exc_error(prefix: str, exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    if "CUDA error" in msg or "illegal memory access" in msg or "device-side assert" in msg:
        return "CUDA error: " + _short(msg, 400)
    return _short(f"{prefix}: {msg}", 600)


def _runner_gone(j: Judge, exc: BaseException) -> Stop:
    """The runner died or stopped answering: a crash (how, from /proc while it is a zombie) or a timeout."""
    if isinstance(exc, ipc.ChannelClosed) and "in time" in str(exc):
        return Stop("timeout", "the candidate did not answer before the time limit")
    how = "exited"
    try:
        with open(f"/proc/{j.runner_pid}/stat", "rb") as fh:
            status = int(fh.read().rsplit(b")", 1)[1].split()[49])  # exit_code, readable while a zombie
        if os.WIFSIGNALED(status):
            how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        elif os.WIFEXITED(status):
            how = f"exited with code {os.WEXITSTATUS(status)} (os._exit?)"
    except (OSError, ValueError, IndexError):
        pass
    return Stop("crashed", f"the candidate's process {how} without a result ({exc})")


def _runner_error(reply: dict, what: str) -> Stop:
    err = str(reply.get("error", ""))[:1500]
    if "CUDA error" in err or "illegal memory" in err or "device-side assert" in err:
        return Stop("runtime_error", "CUDA error: " + err[:600])
    return Stop("runtime_error", f"{what}: {err}")


# ======================================================================================
# Candidate calls through the runner
# ======================================================================================

def _poison_slots(j: Judge) -> None:
    """Slots hold NaN (or an integer sentinel) until the runner commits: an answer not written
    when the runner replies is never mistaken for a correct one."""
    import torch
    for v in j.out_views:
        if v.is_floating_point() or v.is_complex():
            v.fill_(float("nan"))
        elif v.dtype == torch.bool:
            v.fill_(True)
        else:
            v.fill_(torch.iinfo(v.dtype).max)


def _write_inputs(j: Judge, inputs: list) -> None:
    for view, t in zip(j.in_views, inputs):
        if view is not None:
            view.copy_(t)


def call_candidate(j: Judge, seed: int, mode: str, signed: bool = False) -> Call:
    """Fresh inputs into the arena, slots poisoned, L2 flushed; then one call, timed by this clock."""
    t = _perf()
    inputs = gen_inputs(j, seed, signed)
    _write_inputs(j, inputs)
    _poison_slots(j)
    if j.flush is not None:
        j.flush.fill_(float(seed % 7))
    _sync(j.device)
    t0 = j.spend("inputs", t)
    reply = j.ask({"op": "call", "mode": mode})
    wall = (_perf() - t0) * 1e3
    j.spend("candidate", t0)
    if "error" in reply:
        raise _runner_error(reply, "forward raised")
    return Call(reply=reply, wall_ms=wall, inputs=inputs)


def committed(j: Judge, call: Call):
    """The output the runner committed, in the reference's structure: views of the slots, read
    before the next call rewrites them (a copy would cost another output's worth of memory)."""
    if "mismatch" in call.reply:
        return None
    if not j.out_views:
        return call.reply.get("value")
    ts = list(j.out_views)
    return ts[0] if j.details["output_structure"] == "T" else _rebuild(j.details["output_structure"], iter(ts))


def _rebuild(struct, ts):
    if struct == "T":
        return next(ts)
    if isinstance(struct, list) and len(struct) == 2 and struct[0] in ("tuple", "list"):
        items = [_rebuild(s, ts) for s in struct[1]]
        return tuple(items) if struct[0] == "tuple" else items
    if isinstance(struct, list) and len(struct) == 2 and struct[0] == "dict":
        return {k: _rebuild(s, ts) for k, s in struct[1]}
    return None


def verify(j: Judge, call: Call, label: str, code: str = "output_cached") -> None:
    """The committed output of a call against the reference on the same inputs."""
    t = _perf()
    out = committed(j, call)
    ref = run_reference(j, reference_inputs(j, call.inputs))
    cmp = compare.compare(out, ref, j.cfg) if out is not None else {"ok": False, "why": call.reply["mismatch"]}
    j.spend("verify", t)
    if not cmp["ok"]:
        j.hack(code, f"{label}: the output is stale or wrong for its fresh inputs ({cmp['why']})")


# ======================================================================================
# Phases
# ======================================================================================

def setup(j: Judge) -> None:
    import torch
    dev = str(j.cfg["device"])
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    j.device = torch.device(dev)
    if j.cuda:
        if not torch.cuda.is_available():
            raise Stop("runtime_error", "CUDA requested but not available")
        if j.device.index is None:
            j.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(j.device)
    j.out["device"] = str(j.device)
    j.details["config"] = dict(j.cfg)
    j.out["timing"] = "cuda_events" if j.cuda else "cpu_wall"
    j.seed = int(j.cfg["seed"])
    j.perf_n = int(j.cfg["perf_trials"] if j.cuda else j.cfg["cpu_perf_trials"])
    try:  # the runner initialises CUDA while the reference is built here; its answer is read on attach
        ipc.send(j.sock, {"op": "init", "device": str(j.device), "seed": j.seed,
                          "reference": os.path.join(j.runner_dir, "reference.py"),
                          "candidate": os.path.join(j.runner_dir, os.path.basename(j.candidate_path))})
    except OSError as exc:
        raise _runner_gone(j, exc) from None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        from drkernel.runner import import_file
        j.ref_mod = import_file(j.reference_path, "_drk_judge_reference")
    except Exception as exc:
        raise Stop("runtime_error", _exc_error("the reference failed", exc)) from None
    if j.cuda:  # memory first: waiting for it while holding the GPU lock could deadlock
        _warm_up_comparisons(j)
        _reserve_memory(j)
        _lock_gpu(j, alone=j.exclusive)
    try:
        with _shared(j):
            j.template = _build_reference(j)
            warm = gen_inputs(j, j.seed)
            ref_out, j.ref_mutates = _first_reference_run(j, warm)
    except Exception as exc:
        raise Stop("runtime_error", _exc_error("the reference failed", exc)) from None
    j.io_bytes = compare.nbytes(compare.tensors(warm)) + compare.nbytes(compare.tensors(ref_out))
    j.ref_aliases = compare.overlap(compare.ranges(compare.tensors(ref_out)), compare.ranges(compare.tensors(warm)))
    j.layout = ipc.plan(warm, compare.tensors(ref_out))
    j.details["output_structure"] = json.loads(json.dumps(compare.structure(ref_out), default=str))
    if j.cuda and j.cfg["l2_flush"]:
        j.flush = torch.empty(2**26, dtype=torch.float32, device=j.device)  # 256 MB, more than L2
    j.mark("setup")


def _time_reference(j: Judge, seeds: list[int]) -> list[float]:
    """The reference under the same protocol as the candidate: fresh inputs, L2 flush, events."""
    model = new_reference(j)
    return [_reference_ms(j, model, s) for s in seeds]


def _reference_ms(j: Judge, model, seed: int) -> float:
    """One timed reference call (its inputs and output are freed before the next call's are made)."""
    import torch
    inputs = gen_inputs(j, seed)
    if j.flush is not None:
        j.flush.fill_(float(seed % 7))
    _sync(j.device)
    with torch.no_grad():
        if not j.cuda:
            t0 = _perf()
            model(*inputs)
            return (_perf() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(*inputs)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def time_reference_alone(j: Judge) -> None:
    n = max(1, min(j.perf_n, int(j.cfg["ref_isolated_trials"])))
    j.ref_alone_ms = median(_time_reference(j, [j.seed + 100000 + i for i in range(n)]))
    j.bandwidth = _copy_bandwidth(j.device) if j.cuda else None
    if j.cuda:
        import torch
        torch.cuda.empty_cache()  # the probe's 2 GiB, cached, would be split by later temporaries
    j.details["ref_ms_isolated"] = j.ref_alone_ms
    j.details["io_bytes"] = j.io_bytes
    if j.cuda:
        j.details["copy_bandwidth_gbs"] = j.bandwidth / 1e6 if j.bandwidth else None
        if j.bandwidth and j.ref_alone_ms > 0:  # torch's own kernels can beat a plain copy
            j.bandwidth = max(j.bandwidth, j.io_bytes / j.ref_alone_ms)
    j.mark("reference_alone")


def attach_runner(j: Judge) -> None:
    try:
        reply = ipc.recv(j.sock, j.deadline)  # the answer to `init`
    except (OSError, ipc.ChannelClosed) as exc:
        raise _runner_gone(j, exc) from None
    if "error" in reply:
        raise Stop("runtime_error", f"the runner could not start: {str(reply['error'])[:600]}")
    j.arena, handle = ipc.allocate(j.layout, j.device, j.runner_dir)
    j.in_views = [ipc.view(j.arena, s) if s else None for s in j.layout.inputs]
    j.out_views = [ipc.view(j.arena, s) for s in j.layout.outputs]
    reply = j.ask({"op": "attach", "handle": handle, "layout": j.layout.to_dict(),
                   "structure": j.details["output_structure"]})
    if "error" in reply:
        raise Stop("runtime_error", f"the runner could not attach: {str(reply['error'])[:600]}")
    conf = reply.get("confinement") if isinstance(reply.get("confinement"), dict) else {}
    j.details["confinement"] = conf
    if j.cfg["require_confinement"] and not conf.get("complete"):
        raise Stop("runtime_error", "refused: the runner could not be confined "
                                    f"({'; '.join(map(str, conf.get('errors') or [])) or 'incomplete'})")
    j.mark("attach_runner")


def calibrate(j: Judge) -> None:
    """Null calls through the runner, which has run no candidate code yet: what the judge's clock
    adds to the runner's own time per call (messages, the commit copy, the sync)."""
    j.overhead_ms = median([_residual_ms(j, j.seed + 900000 + i) for i in range(10 if j.cuda else 3)])
    j.details["clock_overhead_ms"] = j.overhead_ms
    j.mark("calibrate")


def _residual_ms(j: Judge, seed: int) -> float:
    """The judge's time for one null call minus the runner's."""
    c = call_candidate(j, seed, "null")
    ms = ipc.number(c.reply, "ms")
    if ms is None:
        raise Stop("runtime_error", "the runner's calibration call returned no time")
    return c.wall_ms - ms


def _findings(j: Judge, reply: dict) -> None:
    """Hack codes the runner reported (self-reports: they can only cost the candidate)."""
    from drkernel.evaluator import HACK_CODES
    for item in reply.get("findings") or []:
        if isinstance(item, list) and len(item) == 2 and item[0] in HACK_CODES:
            j.hack(str(item[0]), str(item[1])[:500])


def load_candidate(j: Judge) -> None:
    with _shared(j):  # importing and building may already run candidate GPU work
        reply = j.ask({"op": "load"})
    if reply.get("stage") == "import":
        raise Stop("compile_error", "candidate failed to import: " + str(reply.get("error"))[:1400])
    j.out["compiled"] = True
    _findings(j, reply)
    if "error" in reply:
        raise Stop("runtime_error", "ModelNew(*get_init_inputs()) failed (constructor must match Model's): "
                   + str(reply["error"])[:1200])
    j.mark("load_candidate")


def _trial_hacks(j: Judge, ti: int, call: Call) -> None:
    """Hack codes from one checked call's self-reported facts."""
    r, cfg = call.reply, j.cfg
    _findings(j, r)
    if r.get("bad_type"):
        j.hack("bad_output_type", str(r["bad_type"])[:300])
    if r.get("structure"):
        j.hack("bad_output_type", str(r.get("mismatch"))[:300])
    if r.get("reuses_previous_output"):
        j.hack("output_cached", f"trial {ti}: output shares storage with an earlier call's output")
    launches = int(ipc.number(r, "launches", 0))
    if cfg["require_triton"] and launches == 0:
        j.hack("no_triton_kernel", f"trial {ti}: forward launched no Triton kernel defined in the candidate file")
    if r.get("off_stream"):
        j.hack("side_stream", f"trial {ti}: kernel(s) {', '.join(map(str, r['off_stream']))[:200]} launched on "
                              "a stream other than the one forward was called on")
    io, lb = ipc.number(r, "io_bytes", 0), ipc.number(r, "launch_bytes", 0)
    if (cfg["require_triton"] and launches and not r.get("output_from_kernels") and io
            and lb < cfg["decoy_bytes_frac"] * io):
        j.hack("decoy_kernel", f"trial {ti}: output never passed to a candidate Triton launch and the launches "
                               f"touch {lb:.0f} of {io:.0f} input+output bytes")
    j.kernels.update(str(k) for k in r.get("kernels") or [])
    j.output_from_kernels = j.output_from_kernels and bool(r.get("output_from_kernels"))


def _mutations(j: Judge, ti: int, call: Call, pristine: list, ref_in: list) -> None:
    """Inputs the candidate changed (seen here, in the arena), unless it left them as the
    reference leaves its own."""
    shared = [v for v in j.in_views if v is not None]
    if any(not compare.same_values(a, b) for a, b in zip(shared, compare.tensors(pristine))):
        if not j.ref_mutates:
            j.hack("input_mutated", f"trial {ti}: the candidate modified its inputs (the reference does not)",
                   stop=False)
        elif not compare.compare(shared, compare.tensors(ref_in), j.cfg)["ok"]:
            j.hack("input_mutated", f"trial {ti}: the candidate modified its inputs otherwise than the reference",
                   stop=False)
    if call.reply.get("aliases_input") and not j.ref_aliases:
        j.hack("output_aliases_input", f"trial {ti}: output shares storage with an input", stop=False)


def _judge_values(j: Judge, ti: int, signed: bool, out, ref, pristine: list, degenerate: bool) -> None:
    import torch
    t = _perf()
    cmp = compare.compare(out, ref, j.cfg)
    t = j.spend("compare", t)
    j.out["trials"] += 1
    j.details.setdefault("trials", []).append({"trial": ti, "signed": signed, "ok": cmp["ok"],
                                               "max_abs": cmp["max_abs"], "rel_l2": cmp["rel_l2"]})
    if cmp.get("max_abs") is not None:
        j.out["max_abs_err"] = max(j.out.get("max_abs_err") or 0.0, cmp["max_abs"])
        j.out["max_rel_err"] = max(j.out.get("max_rel_err") or 0.0, cmp["max_rel"])
    if j.out["hacks"]:
        raise Hacked(j.out["hacks"][-1], j.details["hack_details"][-1])
    deg = compare.degenerate(out, ref, pristine, j.cfg) if degenerate or not cmp["ok"] else None
    j.spend("degenerate", t)
    if deg:
        j.hack("degenerate_output", f"trial {ti}: {deg}")
    if cmp["ok"]:
        j.out["trials_passed"] += 1
        return
    floats = [t for t in compare.tensors(ref) if t.is_floating_point()]
    if floats and all(t.dtype == torch.float32 for t in floats) and compare.compare(out, ref, j.cfg, loose=True)["ok"]:
        j.hack("precision_downgrade", f"trial {ti}: fails the fp32 tolerance ({cmp['why']}) but passes "
                                      f"{j.cfg['loose_tol']:g}: reduced precision inside an fp32 problem")
    kind = "fails on signed-normal inputs" if signed else f"trial {ti} failed"
    raise Stop("incorrect", f"{kind}: {cmp['why']}; max abs err {cmp['max_abs']}, rel L2 err {cmp['rel_l2']}")


def check_correctness(j: Judge) -> None:
    n = int(j.cfg["trials"])
    n_signed = (2 if n >= 4 else 1) if j.cfg["second_distribution"] else 0
    plan = [(j.seed + 1 + i, False) for i in range(n)] + [(j.seed + 5000 + i, True) for i in range(n_signed)]
    # The degenerate check (two passes over multi-GB outputs) runs on every signed trial, where
    # trivial answers differ most from the reference, on one uniform trial the candidate cannot
    # predict, and on a failing trial (the last one).
    checked = set(range(n, n + n_signed)) | {random.SystemRandom().randrange(max(1, n))}
    for ti, (seed, signed) in enumerate(plan):
        with _shared(j):
            _trial(j, ti, seed, signed, degenerate=ti in checked)
    j.details["launched_kernels"] = sorted(j.kernels)
    j.mark("correctness")


def _trial(j: Judge, ti: int, seed: int, signed: bool, degenerate: bool) -> None:
    """One correctness trial: the candidate on fresh inputs, then the reference on the same ones."""
    call = call_candidate(j, seed, "check", signed)
    pristine = call.inputs
    _trial_hacks(j, ti, call)
    t = _perf()
    ref_in = reference_inputs(j, pristine)
    ref = run_reference(j, ref_in)
    t = j.spend("reference", t)
    _mutations(j, ti, call, pristine, ref_in)
    j.spend("mutations", t)
    if signed and not all(compare.all_finite(x) for x in compare.tensors(ref) if x.is_floating_point()):
        j.details.setdefault("trials", []).append({"trial": ti, "signed": True, "skipped": "reference not finite"})
        return
    if "mismatch" in call.reply:
        if j.out["hacks"]:
            raise Hacked(j.out["hacks"][-1], j.details["hack_details"][-1])
        raise Stop("incorrect", f"trial {ti}: {str(call.reply['mismatch'])[:400]}")
    _judge_values(j, ti, signed, committed(j, call), ref, pristine, degenerate)


def _alone(j: Judge):
    """This GPU to this evaluation alone (timing, calibration, profiling); no-op on the CPU."""
    import contextlib
    return j.gpu.alone() if j.gpu is not None else contextlib.nullcontext()


def _physical_gpu(j: Judge) -> int:
    """The physical GPU, not the per-worker index (workers see one GPU each)."""
    idx = j.device.index or 0
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(vis[idx]) if idx < len(vis) and vis[idx].isdigit() else idx


def _lock_gpu(j: Judge, alone: bool) -> None:
    """This job's lock on its physical GPU (held alone for the whole job on a retry)."""
    from drkernel.sandbox import DeviceLock
    j.gpu = DeviceLock(_physical_gpu(j))
    if alone:
        j.gpu.acquire(alone=True)


def memory_estimate(ref_mod, total: int) -> int:
    """GPU bytes one evaluation may hold at once: the reference's parameters three times (the
    template, a fresh copy, the candidate's model); its inputs three times (the arena, the fresh
    inputs the reference also runs on, and one more input's worth that the judge's caching
    allocator holds in practice, measured on an H200; a reference that writes into its inputs
    runs on yet another copy, not counted); its outputs three times (the arena's slots, the
    candidate's output and its previous one in the runner); the peak of the reference's forward
    (output and intermediates); and 2 GiB for the two CUDA contexts. Sizes come from the meta
    device (no memory, no work). A forward that does not run there within two seconds (recurrent
    layers step by step) counts its output and peak as large as its inputs; a reference that
    cannot even be built there is assumed to need half the GPU."""
    import torch
    try:
        with torch.device("meta"):
            model = ref_mod.Model(*ref_mod.get_init_inputs())
            inputs = list(ref_mod.get_inputs())
        held = [*model.parameters(), *model.buffers()] if isinstance(model, torch.nn.Module) else []
        params, ins = compare.nbytes(held), compare.nbytes(compare.tensors(inputs))
    except Exception:
        return total // 2
    outs, peak = _meta_forward_bytes(model, inputs, ins)
    return 3 * params + 3 * ins + 3 * outs + peak + 2 * 2**30


def _live_bytes_mode():
    """A TorchDispatchMode that counts the bytes of the storages created under it while they are
    alive (`live`) and their high-water mark (`peak`); views and in-place results add nothing."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.storages: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            known = self.storages | {t.untyped_storage()._cdata for t in compare.tensors([args, kwargs])}
            for t in compare.tensors(out):
                st = t.untyped_storage()
                if st._cdata not in known:
                    known.add(st._cdata)
                    self.storages.add(st._cdata)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._freed, st._cdata, st.nbytes())
            return out

        def _freed(self, key: int, nbytes: int) -> None:
            self.storages.discard(key)
            self.live -= nbytes
    return LiveBytes()


def _meta_forward_bytes(model, inputs: list, fallback: int, limit_s: float = 2.0) -> tuple[int, int]:
    """(output bytes, peak live bytes) of the reference's forward on the meta device, or
    (`fallback`, `fallback`) when it cannot tell in time."""
    import torch

    def stop(signum, frame):
        raise TimeoutError
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    live = _live_bytes_mode()
    try:
        with torch.device("meta"), torch.no_grad(), live:
            out = model(*inputs)
        return compare.nbytes(compare.tensors(out)), live.peak
    except Exception:
        return fallback, fallback
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _warm_up_comparisons(j: Judge) -> None:
    """Triton's start for the comparison kernels, paid before this job holds the GPU (CPU work
    only). A failure here costs nothing but time: the first comparison compiles them anyway."""
    from drkernel import compare_kernels
    t = _perf()
    try:
        compare_kernels.warm_up(j.device)
    except Exception as exc:  # noqa: BLE001 - an optimisation, never a verdict
        j.details["warm_up_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    j.details["warm_up_s"] = round(_perf() - t, 3)


def _reserve_memory(j: Judge) -> None:
    """Wait until this job's memory estimate fits beside its neighbours' (`sandbox.MemoryLedger`)."""
    import torch
    from drkernel.sandbox import MemoryLedger
    total = torch.cuda.get_device_properties(j.device).total_memory
    need = memory_estimate(j.ref_mod, total)
    # held back: the contexts of jobs not yet admitted (about 1 GiB each)
    j.memory = MemoryLedger(_physical_gpu(j), int(max(0.8 * total, total - 12 * 2**30)))
    j.details["memory_estimate_gib"] = round(need / 2**30, 2)
    waited = j.memory.reserve(need, wait=not j.defer)
    if waited is None:
        j.details["deferred"] = {"memory_bytes": need, "capacity_bytes": j.memory.capacity, "gpu": _physical_gpu(j)}
        raise Stop("crashed", "deferred: the GPU memory this job needs is promised to other jobs")
    j.details["memory_wait_s"] = round(waited, 3)


def _shared(j: Judge):
    """The GPU shared with other evaluations' unmeasured work, for one short burst (a trial), so
    that a neighbour waiting to measure gets in between."""
    import contextlib
    if j.gpu is None or j.gpu.mode is not None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def burst():
        j.gpu.acquire(alone=False)
        try:
            yield
        finally:
            j.gpu.release()
    return burst()


def _time_candidate(j: Judge, seeds: list[int], checked: set[int], label: str) -> tuple[list[float], list[float]]:
    """The runner's times and this clock's; calls in `checked` are verified right after they
    return, from the slots they were committed to (the runner cannot know which)."""
    times = [_candidate_ms(j, s, f"{label} call {k}", k in checked) for k, s in enumerate(seeds)]
    return [e for e, _ in times], [w for _, w in times]


def _candidate_ms(j: Judge, seed: int, label: str, check: bool) -> tuple[float, float]:
    """One timed candidate call: (the runner's time, this clock's); its inputs are freed before
    the next call's are made."""
    c = call_candidate(j, seed, "time")
    ms = ipc.number(c.reply, "ms")
    if ms is None or "mismatch" in c.reply:
        raise Stop("runtime_error", f"{label}: no time or no output ({c.reply.get('mismatch', '')})")
    if j.cfg["require_triton"] and not ipc.number(c.reply, "launches", 0):
        j.hack("no_triton_kernel", f"{label} launched no candidate Triton kernel")
    if check:
        verify(j, c, label)
    return ms, c.wall_ms


def _accepted_ms(j: Judge, events: list[float], walls: list[float]) -> float:
    """The candidate's time. The runner's own times count when this process's clock agrees: per
    call the judge sees the runner's time plus the overhead calibrated on trusted null calls, and
    honest calls exceed that by up to ~0.2 ms (output views, Python after the end event). A larger
    median excess means work outside the runner's events (another stream or thread) or a forged
    timer: flagged, and the judge's clock minus the overhead counts instead."""
    extra = median([w - e for w, e in zip(walls, events)]) - j.overhead_ms
    slack = max(j.cfg["clock_slack_ms"] if j.cuda else j.cfg["cpu_clock_slack_ms"],
                j.cfg["clock_slack_frac"] * median(events))
    j.details["clock_extra_ms"] = extra
    if extra <= slack:
        return median(events)
    j.hack("side_stream", f"the judge's clock saw {extra:.4f} ms per call more than the runner's "
                          f"{median(events):.4f} ms (allowed {slack:.4f}): work escapes the timed stream "
                          "or the runner's timer is forged", stop=False)
    return median([max(e, w - j.overhead_ms) for w, e in zip(walls, events)])


def speedup_interval(ref_ms: list[float], cand_ms: list[float], seed: int, n: int = 200) -> tuple[float, float]:
    """A 95 % bootstrap interval of median(reference) / median(candidate)."""
    rng = random.Random(seed)
    ratios = sorted(median(rng.choices(ref_ms, k=len(ref_ms))) / max(median(rng.choices(cand_ms, k=len(cand_ms))),
                                                                     1e-9) for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def _precise_enough(j: Judge, ref_ms: list[float], cand_ms: list[float]) -> bool:
    if len(cand_ms) < int(j.cfg["min_perf_trials"]):
        return False
    lo, hi = speedup_interval(ref_ms, cand_ms, j.seed)
    return (hi - lo) <= j.cfg["speedup_precision"] * median(ref_ms) / max(median(cand_ms), 1e-9)


def time_interleaved(j: Judge) -> None:
    """Reference and candidate alternate in blocks (R C, C R, ...) so both are timed in the same
    allocator, cache, clock and thermal state (timed apart, the later one measured 5-10 % slower).
    Timing stops once the speedup's bootstrap interval is narrower than `speedup_precision`, and
    in every candidate block one call picked here is verified."""
    warm = max(1, int(j.cfg["warmup"]))
    for i in range(warm):
        call_candidate(j, j.seed + 200000 + i, "warm")
    _time_reference(j, [j.seed + 200000 + i for i in range(warm)])
    size = max(1, min(int(j.cfg["timing_block_calls"]), j.perf_n))
    pick = random.SystemRandom()
    ref_ms, events, walls = [], [], []
    for b, start in enumerate(range(0, j.perf_n, size)):
        idx = range(start, min(start + size, j.perf_n))
        for side in (("ref", "cand") if b % 2 == 0 else ("cand", "ref")):
            if side == "ref":
                ref_ms += _time_reference(j, [j.seed + 100000 + i for i in idx])
                continue
            e, w = _time_candidate(j, [j.seed + 300000 + i for i in idx], {pick.randrange(len(idx))},
                                   f"timed (block {b})")
            events += e
            walls += w
        if b % 2 == 1 and _precise_enough(j, ref_ms, events):
            break
    j.out["ref_ms"] = median(ref_ms)
    cand_ms = _accepted_ms(j, events, walls)
    _check_reference_slowed(j)
    j.out["candidate_ms"] = _roofline(j, cand_ms)
    j.out["speedup"] = j.out["ref_ms"] / j.out["candidate_ms"] if j.out["candidate_ms"] > 0 else None
    j.details["timed_calls"] = len(events)
    if j.out["speedup"] is not None:
        lo, hi = speedup_interval(ref_ms, events, j.seed)
        scale = median(events) / j.out["candidate_ms"]  # the judge's clock or a re-time only lowers it
        j.out["speedup_interval"] = [lo * scale, hi * scale]
    j.mark("timing")


def _check_reference_slowed(j: Judge) -> None:
    """Something the candidate left running (GPU work, a hog) slows the reference it is compared to."""
    if j.cuda and j.out["ref_ms"] > j.cfg["ref_slowdown_limit"] * j.ref_alone_ms + j.cfg["side_stream_slack_ms"]:
        j.hack("reference_slowed", f"the reference took {j.out['ref_ms']:.4f} ms next to the candidate vs "
                                   f"{j.ref_alone_ms:.4f} ms before the candidate existed")


def _roofline(j: Judge, cand_ms: float) -> float:
    """Faster than memory allows, or a very large speedup: re-time with every output verified;
    the slower median counts, and still below the roofline is a hack."""
    roof = j.io_bytes / j.bandwidth if j.bandwidth else None
    j.details["roofline_ms"] = roof
    fast = roof is not None and cand_ms < j.cfg["roofline_factor"] * roof
    if not fast and not (cand_ms > 0 and j.out["ref_ms"] / cand_ms > j.cfg["max_speedup_recheck"]):
        return cand_ms
    n = min(j.perf_n, 10)
    events, walls = _time_candidate(j, [j.seed + 400000 + i for i in range(n)], set(range(n)), "re-timed")
    j.details["recheck_ms"] = _accepted_ms(j, events, walls)
    cand_ms = max(cand_ms, j.details["recheck_ms"])
    if roof is not None and cand_ms < j.cfg["roofline_factor"] * roof:
        j.hack("implausible_speedup", f"candidate {cand_ms:.4f} ms is below the memory roofline {roof:.4f} ms")
    return cand_ms


def profile(j: Judge) -> None:
    """Device-time share of the candidate's Triton kernels (torch.profiler inside the runner)."""
    if not (j.cuda and j.cfg["profile"]):
        j.mark("profiling")
        return
    inputs = gen_inputs(j, j.seed + 500000)
    _write_inputs(j, inputs)
    _sync(j.device)
    reply = j.ask({"op": "profile", "kernels": sorted(j.kernels), "calls": 5})
    prof = reply.get("profile") if isinstance(reply.get("profile"), dict) else None
    if "error" in reply:
        j.details["profile_error"] = str(reply["error"])[:300]
    if prof:
        share = ipc.number(prof, "triton_time_share")
        j.out["triton_time_share"] = min(share, 1.0) if share is not None else None
        j.out["kernels"] = [k for k in prof.get("kernels") or [] if isinstance(k, dict)][:10]
        if j.cfg["require_triton"] and share is not None and share < j.cfg["decoy_share"] \
                and not j.output_from_kernels:
            j.hack("decoy_kernel", f"candidate kernels are {share:.1%} of device time and the output is not "
                                   "produced by them")
    j.mark("profiling")


def check_decoy(j: Judge) -> None:
    """The candidate with its own Triton launches skipped, on signed-normal inputs: still right
    means the kernels were not needed for the output."""
    if not j.cfg["require_triton"]:
        return
    with _shared(j):
        try:
            call = call_candidate(j, j.seed + 600000, "noop", signed=True)
        except Stop:
            return  # it failed without its kernels: they were needed
        out = committed(j, call)
        ok = out is not None and compare.compare(out, run_reference(j, reference_inputs(j, call.inputs)), j.cfg)["ok"]
    if ok:
        j.hack("decoy_kernel", "the output is still correct with every candidate Triton launch skipped")
    j.mark("decoy_check")


def final(j: Judge) -> None:
    reply = j.ask({"op": "final"})
    _findings(j, reply)
    peak = ipc.number(reply, "memory_peak")  # self-reported, kept to check `memory_estimate` against
    if j.cuda and peak is not None:
        j.details.setdefault("memory_peak_gib", {})["runner"] = round(peak / 2**30, 2)
    if j.out["hacks"]:
        raise Hacked(j.out["hacks"][-1], j.details["hack_details"][-1])
    j.out["verdict"] = "correct"


# In order; the phases of a tuple run in one hold of the GPU alone (their numbers enter the verdict).
PHASES = (setup, attach_runner, (time_reference_alone, calibrate), load_candidate, check_correctness,
          (time_interleaved, profile), check_decoy, final)


def _run_phases(j: Judge) -> None:
    for step in PHASES:
        if isinstance(step, tuple):
            with _alone(j):
                for phase in step:
                    phase(j)
        else:
            step(j)


# ======================================================================================
# Entry point (a sandbox job)
# ======================================================================================

def _runner_output(j: Judge, name: str, limit: int) -> str:
    try:
        with open(os.path.join(j.runner_dir, name), "rb") as fh:
            data = fh.read(4 * limit)
    except OSError:
        return ""
    return _short(data.decode("utf-8", "replace"), limit)


def _stop_runner(j: Judge) -> None:
    """The runner is gone before the verdict is written: nothing it does can reach the result."""
    try:
        os.kill(j.runner_pid, signal.SIGKILL)
    except OSError:
        return
    for _ in range(2000):
        try:
            with open(f"/proc/{j.runner_pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return
        except OSError:
            return
        time.sleep(0.001)


def _free_gpu(j: Judge) -> None:
    """This job's GPU memory freed before its share is given back, then its locks."""
    j.template = j.arena = j.flush = None
    j.in_views, j.out_views = [], []
    gc.collect()
    if j.memory is not None:
        import torch
        phases = j.details.get("memory_peak_gib_by_phase", {}).values()
        j.details.setdefault("memory_peak_gib", {})["judge"] = round(
            max([torch.cuda.max_memory_reserved(j.device) / 2**30, *phases]), 2)
        torch.cuda.empty_cache()
        j.memory.release()
    if j.gpu is not None:
        j.details["lock_wait_s"] = {k: round(v, 3) for k, v in j.gpu.waited.items()}
        j.gpu.close()


def evaluate(reference_path: str, candidate_path: str, config: dict, runner_fd: int, runner_pid: int,
             runner_dir: str, exclusive: bool = False, defer: bool = False) -> dict:
    """The judge's sandbox target: every phase in order; returns EvalResult fields. `exclusive`
    holds the GPU alone for the whole job (a retry of a job that ran out of memory next to others);
    `defer` ends the job at once, with `details.deferred`, when its GPU memory does not fit yet."""
    import shutil
    t0 = _perf()
    j = Judge(cfg=config, sock=runner_fd, runner_pid=runner_pid, runner_dir=runner_dir,
              reference_path=reference_path, candidate_path=candidate_path, clock=t0, exclusive=exclusive,
              defer=defer)
    j.deadline = time.monotonic() + float(config["timeout"])
    shutil.copyfile(reference_path, os.path.join(runner_dir, "reference.py"))
    shutil.copyfile(candidate_path, os.path.join(runner_dir, os.path.basename(candidate_path)))
    try:
        _run_phases(j)
    except Hacked as h:
        if h.code not in j.out["hacks"]:
            j.hack(h.code, h.detail, stop=False)
    except Stop as s:
        j.out["verdict"], j.out["error"] = s.verdict, s.error
    except Exception as exc:  # the judge's own failure: never a pass
        j.out["verdict"], j.out["error"] = "crashed", f"judge error: {type(exc).__name__}: {str(exc)[:300]}\n" + _short(
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), 1200)
    finally:
        _stop_runner(j)
        _free_gpu(j)
    if j.out["hacks"]:
        j.out["verdict"] = "hacked"
        j.out["error"] = "; ".join(j.details.get("hack_details", []))[:1000]
    j.out.setdefault("verdict", "crashed")
    j.out["correct"] = j.out["verdict"] == "correct"
    if not j.out["correct"]:
        j.out["speedup"] = None
    j.out["stdout"] = _runner_output(j, "stdout", 2000)
    j.out["stderr"] = _runner_output(j, "stderr", 2000)
    j.out["wall_s"] = _perf() - t0
    return json.loads(json.dumps(j.out, default=repr))
