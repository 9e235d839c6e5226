"""The runner: the one process that imports candidate code. It decides nothing.

Started by the sandbox's zygote next to the judge (`drkernel.judge`), it talks to the judge over
one socket and sees the judge's arena (inputs and output slots, `drkernel.ipc`). In order:

1. a fresh network namespace; Triton's cache, TMPDIR and HOME beneath its own job directory;
2. `init`: CUDA initialised, the reference file imported for `get_init_inputs` only (then dropped,
   and in a candidate's runner its copy deleted with its bytecode);
3. `attach`: the arena mapped, then the process confined (`drkernel.confine`), the launch hook
   installed and the integrity snapshot taken; `null` calls (a trusted stand-in forward) let the
   judge calibrate its clock against this process before any candidate code exists;
4. `load`: the candidate imported and `ModelNew(*get_init_inputs())` built under the reference's seed;
5. `call` (modes check / warm / time / profile; a checked or timed call may name kernels whose
   launches read perturbed data, `drkernel.counterfactual`), `final`: forward on the inputs the judge wrote,
   under the call's seed (as the judge runs the reference), the output committed into the judge's
   slots, and facts sent back (a profiled call's kernel trace among them).

Every reply echoes the request's nonce and carries a digest of this process's evidence machinery
(launch hook, data-flow log, integrity checks) keyed by that nonce. Everything sent back is still
a self-report: once candidate code has run here it can rewrite any of it. The judge re-derives
what it can (values, mutations, its own clock, kernel names from the source text) and stops this
process between requests (docs/security.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import inspect
import json
import os
import shutil
import sys
import time
import traceback
from typing import Any, NoReturn

from drkernel import (channel, compare, confine, counterfactual, dataflow, integrity, ipc, launch_guard, launch_pattern,
                      profiling, triton_source)
from drkernel.channel import evidence_digest

_perf = time.perf_counter  # bound before any candidate code exists
CANDIDATE_MODULE = "_drk_candidate"


def _caller_code():
    """The code object of the function that called the caller."""
    return sys._getframe(2).f_code


def _hook_code(wrap) -> Any:
    """The code of the hook `LaunchRecorder._wrap` installs (a constant of its own code)."""
    return next(c for c in wrap.__code__.co_consts if getattr(c, "co_name", "") == "run")


def concrete_grid(grid, bound: dict) -> tuple[int, ...]:
    """The launch grid as Triton will use it: a callable grid is called with the bound arguments."""
    g = grid(bound) if callable(grid) else grid
    g = g if isinstance(g, (tuple, list)) else (g,)
    return tuple(int(x) for x in g)


@dataclasses.dataclass(frozen=True)
class ArgumentTypes:
    """The exact types a launch argument may have: every method Triton may call on one of these
    is the library's own (a subclass, or a look-alike with `data_ptr`, runs candidate Python
    inside the launch, where the data-flow log is paused and the launch's checksums are taken)."""
    plain: frozenset  # numbers, strings, None, dtypes, Triton's kernels
    tensors: frozenset  # torch.Tensor, nn.Parameter
    sequences: frozenset  # tuple, torch.Size: each item is checked too
    constexpr: type  # Triton's constexpr: what it holds is checked too
    descriptors: frozenset  # Triton's tensor descriptors: their base tensor and sizes are checked too
    wrapper: type | None = None  # `triton.reinterpret`'s view of a tensor as another dtype

    def foreign(self, v: Any, depth: int = 0) -> str | None:
        """What in `v` is of no allowed type (its type's name), or None when nothing is."""
        cls = type(v)
        if cls in self.plain:
            return None
        if cls in self.tensors:  # an instance attribute would shadow a method Triton calls (data_ptr)
            return f"{launch_pattern.type_name(cls)} with attributes of its own" if _shadows(v) else None
        inner: list = []
        if depth < 4 and cls in self.sequences:
            inner = list(v)
        elif depth < 4 and cls is self.constexpr:
            inner = [v.value]
        elif depth < 4 and cls in self.descriptors:
            inner = [v.base, *v.shape, *v.strides, *v.block_shape]
            if type(v.base) not in self.tensors:
                return f"{launch_pattern.type_name(cls)} over a {launch_pattern.type_name(type(v.base))}"
        elif depth < 4 and cls is self.wrapper:
            if set(vars(v)) != _WRAPPER_FIELDS or type(v.base) not in self.tensors or (v.device, v.shape) != (
                    v.base.device, v.base.shape):
                return f"{launch_pattern.type_name(cls)} with fields of its own"
            inner = [v.base, v.data, v.dtype]
        else:
            return launch_pattern.type_name(cls)
        return next(filter(None, (self.foreign(x, depth + 1) for x in inner)), None)


_WRAPPER_FIELDS = {"base", "dtype", "data", "device", "shape"}  # what Triton's TensorWrapper sets


def unwrapped(v: Any, types: ArgumentTypes) -> Any:
    """`v`, or the tensor it stands for where it is a `triton.reinterpret` view or a host-side
    tensor descriptor: what a kernel reads and writes through either is that tensor's storage."""
    cls = type(v)
    return v.base if (types.wrapper is not None and cls is types.wrapper) or cls in types.descriptors else v


def _shadows(t) -> bool:
    """A tensor with an instance attribute named like one of torch.Tensor's."""
    import torch
    return any(hasattr(torch.Tensor, k) for k in vars(t))


def _launch_argument_types() -> ArgumentTypes:
    """The `ArgumentTypes` of the installed torch, Triton and numpy."""
    import torch
    import triton.language as tl
    plain = {*launch_pattern.SCALAR_TYPES, torch.dtype, tl.dtype, tl.pointer_type}
    for module, names in (("triton.runtime.jit", ("JITFunction",)), ("triton.runtime.interpreter", ("InterpretedFunction",)),
                          ("numpy", ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                     "float16", "float32", "float64"))):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(module)
            plain.update(t for t in (getattr(mod, n, None) for n in names) if isinstance(t, type))
    descriptors = set()
    with contextlib.suppress(ImportError):
        descriptors.add(importlib.import_module("triton.tools.tensor_descriptor").TensorDescriptor)
    wrapper = getattr(importlib.import_module("triton.runtime.jit"), "TensorWrapper", None)
    return ArgumentTypes(frozenset(plain), frozenset({torch.Tensor, torch.nn.Parameter}), frozenset({tuple, torch.Size}),
                         tl.constexpr, frozenset(descriptors), wrapper if isinstance(wrapper, type) else None)


class LaunchRecorder:
    """Wraps Triton's launch entry points for the candidate's own kernels. Per call it records the
    real launches (a launch over an empty grid runs nothing and is no launch) and, when a data-flow
    log is attached, their tensor arguments by parameter. The launches of kernels named in
    `perturb` read perturbed data (`drkernel.counterfactual`); they are recorded and logged as
    they would be otherwise."""

    def __init__(self, candidate_file: str, device_type: str = "cpu"):
        self.candidate_file = os.path.realpath(candidate_file)
        self.device_type = device_type  # the run's: every tensor a launch gets lives there
        # (kernel, grid, arguments by parameter); it also keeps the launched tensors alive until the
        # call ends (a freed kernel buffer cannot be handed to a torch-made output)
        self.launches: list[tuple[str, tuple, dict]] = []
        self.perturb: frozenset[str] = frozenset()
        text = _source_text(self.candidate_file)
        self.kernels = triton_source.jit_kernels(text)  # what each kernel reads and writes, by its text
        self.guard = launch_guard.LaunchGuard(self.candidate_file, text)
        self.track_changes = False  # where a launch changed its arguments (`dataflow.block_sums`)
        self.flow: dataflow.FlowLog | None = None
        self.expected_stream: Any = None
        self.off_stream: set[str] = set()
        self._signatures: dict[Any, inspect.Signature] = {}
        self.installed: dict[str, tuple[Any, str]] = {}
        self.originals: tuple = ()  # Triton's own `run`s, the only launchers `_launch` accepts
        self.argument_types: ArgumentTypes | None = None  # `install` knows them
        self.snapshot: Any = None  # the runner's integrity snapshot, asked before a watched launch
        self.hooks0: tuple = ()  # `integrity.python_hooks()` before any candidate code
        self.threads0: set[int] = set()  # the process's Python threads before any candidate code
        self.refusals: list[list[str]] = []  # findings behind the call's refused launches

    def install(self) -> dict[str, tuple[Any, str]]:
        self.argument_types = _launch_argument_types()
        self.hooks0 = integrity.python_hooks()
        self.threads0 = integrity.python_threads()
        owners = []
        for mod, cls in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
            try:
                owners.append(getattr(importlib.import_module(mod), cls))
            except (ImportError, AttributeError):
                pass
        for owner in owners:
            orig = owner.__dict__.get("run")
            if orig is not None:
                owner.run = self._wrap(orig)
                self.originals += (orig,)
                self.installed[f"{owner.__module__}.{owner.__name__}.run (launch hook)"] = (owner, "run")
        return self.installed

    def _wrap(self, orig):
        """The hook installed on Triton's class: a plain function (a closure over this recorder),
        so that `kernel.run(...)` binds the kernel as its first argument."""
        rec = self

        def run(kernel, *args, grid, warmup, **kwargs):
            if not rec._is_mine(kernel):
                return orig(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            if warmup:  # a compile: what it builds is the kernel's from here on
                if refused := rec.guard.options_problem(kernel, kwargs):
                    raise RuntimeError(f"compile of {kernel.fn.__name__} refused: {refused}")
                ret = orig(kernel, *args, grid=grid, warmup=True, **kwargs)
                rec.guard.seen(kernel)
                return ret
            return rec._launch(orig, kernel, args, kwargs, grid)

        return run

    def _launch(self, orig, kernel, args: tuple, kwargs: dict, grid):
        # entered from the hook only, with Triton's own launcher: candidate code that reaches this
        # recorder cannot record a launch that does not run
        if _caller_code() is not _hook_code(self._wrap) or not any(orig is o for o in self.originals):
            raise RuntimeError("the launch recorder is entered through Triton's launch only")
        bound = self._bind(kernel, args, kwargs)
        refused = self._refused(kernel, bound, kwargs)
        if refused:
            raise RuntimeError(f"launch of {kernel.fn.__name__} refused: {refused}")
        grid = concrete_grid(grid, bound)
        real = bool(grid) and all(g > 0 for g in grid)
        name = kernel.fn.__code__.co_name
        if (self.flow is not None or name in self.perturb) and (found := self._window_problem()):
            self._refuse(name, *found)
        tensors = {p: unwrapped(v, self.argument_types) for p, v in bound.items()}
        released = self.guard.pin()  # what it drops goes once this launch is recorded, never inside it
        collecting = gc.isenabled()
        gc.disable()  # no finalizer of the candidate's between the checksums and the launch
        if self.flow is not None:
            self.flow.paused += 1  # Triton's interpreter moves its arguments (and checksums run) with torch ops
        try:
            with (counterfactual.perturbed(tensors, self.kernels.get(name)) if real and name in self.perturb
                  else contextlib.nullcontext()):
                before = self._sums(tensors) if real and self.track_changes else None
                ret = orig(kernel, *args, grid=grid, warmup=False, **kwargs)
                self.guard.seen(kernel)
                changed = self._changes(before) if before is not None else None
        finally:
            if self.flow is not None:
                self.flow.paused -= 1
            if collecting:
                gc.enable()
        if self.flow is not None and self.flow.inside:
            ops, self.flow.inside = sorted(set(self.flow.inside))[:3], []
            self._refuse(name, "patched_function", f"torch ran inside it ({', '.join(ops)})")
        if real:
            self._record(kernel, tensors, grid, changed)
        del released
        return ret

    def _refuse(self, name: str, code: str, problem: str) -> NoReturn:
        """A watched launch that may not run: the forward fails, and the runner says why beside it."""
        self.refusals.append([code, f"launch of {name} refused: {problem}"])
        raise RuntimeError(f"launch of {name} refused: {problem}")

    def _window_problem(self) -> tuple[str, str] | None:
        """Candidate Python that would run inside a watched launch, where the data-flow log is paused
        and the launch's checksums and perturbation happen (its torch work would count as the
        kernel's): a trace, profile or monitoring function, a thread, or anything the integrity
        snapshot watches (torch, Triton's launch path, numpy) replaced since before the candidate.
        Torch work that gets there another way is seen by the data-flow log (`FlowLog.inside`)."""
        if integrity.python_hooks() != self.hooks0:
            return "patched_function", "a trace, profile, monitoring function or signal handler is set"
        if integrity.python_threads() - self.threads0:  # its torch work no dispatch mode of this thread sees
            return "thread_spawned", "a thread of the candidate's is running"
        patched = self.snapshot.patched() if self.snapshot is not None else []
        return ("patched_function", f"{', '.join(patched[:3])} (candidate code inside the launch)") if patched else None

    def _refused(self, kernel, bound: dict, kwargs: dict) -> str | None:
        """Why a launch may not run: candidate Python inside Triton's launch (a pre-run hook, any
        method or attribute of an argument Triton asks, such as `data_ptr` or `untyped_storage`)
        would run where the data-flow log is paused and the launch's own checksums are taken. So
        arguments are of exact, known types only."""
        if problem := self.guard.problem(kernel, bound) or self.guard.options_problem(kernel, kwargs):
            return problem
        given = (*bound.items(), *((k, v) for k, v in kwargs.items() if k not in bound))  # launch options too
        for param, v in given:
            if foreign := self.argument_types.foreign(v):
                return f"argument {param} is a {foreign}: not a tensor, number, string, dtype or Triton's own"
            # a GPU kernel can read pinned host memory: torch on the CPU would then do the work,
            # beside device kernels that only copy, and the device's trace would show only those
            elsewhere = {t.device.type for t in compare.tensors(unwrapped(v, self.argument_types))} \
                - {self.device_type}
            if elsewhere:
                return f"argument {param} is a tensor on {', '.join(sorted(elsewhere))}, not on the run's {self.device_type}"
        return None

    @staticmethod
    def _sums(bound: dict) -> list:
        import torch
        return [(p, v, dataflow.block_sums(v)) for p, v in bound.items() if isinstance(v, torch.Tensor)]

    @staticmethod
    def _changes(before: list) -> list[tuple[str, int, int]]:
        """(parameter, first byte, end byte) where the launch changed its argument's storage."""
        spans = ((p, dataflow.changed_span(sums, dataflow.block_sums(t), t.untyped_storage().nbytes()))
                 for p, t, sums in before)
        return [(p, *span) for p, span in spans if span is not None]

    def _is_mine(self, kernel) -> bool:
        return self.guard.is_candidates(getattr(kernel, "fn", None))

    def _bind(self, kernel, args: tuple, kwargs: dict) -> dict:
        """The kernel's parameters by name (defaults applied), as a grid callable expects them."""
        fn = kernel.fn
        sig = self._signatures.get(fn.__code__) or self._signatures.setdefault(fn.__code__, inspect.signature(fn))
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        return dict(bound.arguments)

    def _record(self, kernel, bound: dict, grid: tuple, changed: list | None) -> None:
        import torch
        if _caller_code() is not LaunchRecorder._launch.__code__:
            raise RuntimeError("launches are recorded by the launch hook only")
        name = kernel.fn.__code__.co_name  # its def's name: `__name__` is the candidate's to rename
        if self.expected_stream is not None and torch.cuda.current_stream() != self.expected_stream:
            self.off_stream.add(name)
        ts = [(p, v) for p, v in bound.items() if isinstance(v, torch.Tensor)]
        self.launches.append((name, tuple(grid), bound))
        if self.flow is not None:
            self.flow.launch(name, ts, changed)

    def begin(self, flow: dataflow.FlowLog | None = None, track_changes: bool = False,
              perturb: frozenset[str] = frozenset()) -> None:
        self.launches, self.flow, self.perturb, self.refusals = [], flow, perturb, []
        self.track_changes = flow is not None and track_changes

    def end(self) -> list[tuple[str, tuple, dict]]:
        launches = self.launches
        self.launches, self.perturb, self.flow, self.track_changes = [], frozenset(), None, False
        return launches


class Runner:
    """State of one runner process; `handle(msg)` answers one judge message."""

    def __init__(self, job_dir: str, report: confine.Confinement):
        self.job_dir, self.report = job_dir, report
        self.torch: Any = None
        self.device: Any = None
        self.seed = 0
        self.init_args: list = []
        self.recorder: LaunchRecorder | None = None
        self.candidate = ""
        self.keys: dataflow.Keys | None = None
        self.inputs: list = []
        self.slots: list = []
        self.structure: Any = None
        self.model: Any = None
        self.snapshot: Any = None
        self.numerics: integrity.NumericsWatch | None = None
        self.audit: integrity.AuditHookGate | None = None
        self.watched: dict[str, tuple[Any, str]] = {}
        self.evidence_state = ""
        self.prev_out: list = []  # the last checked call's output storages (`_kept_storages`)
        self.generators: list = []  # torch's default generators, bound before any candidate code
        self.null: _NullForward | None = None  # the calibration's stand-in, made once (its copy is no call's cost)
        self.last_launches: tuple[list, list[int]] = ([], [])  # the last call's launches and output keys

    # ---- setup --------------------------------------------------------------------------

    def init(self, msg: dict) -> dict:
        import torch
        self.torch = torch
        self.device = torch.device(msg["device"])
        self.seed = int(msg["seed"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)  # CUDA must exist before Landlock (error 304 otherwise)
        self.generators = [torch.default_generator, *(torch.cuda.default_generators if self.device.type == "cuda" else ())]
        if self.device.type == "cpu":
            _autotune_on_the_interpreter()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        self.init_args = _reference_init_args(msg["reference"], self.seed)
        # the copy a candidate's code could read later; the twin's candidate is that file itself
        if os.path.realpath(msg["candidate"]) != os.path.realpath(msg["reference"]):
            _remove_source(msg["reference"])
        self.recorder = LaunchRecorder(msg["candidate"], self.device.type)
        self.candidate = msg["candidate"]
        return {"ok": True}

    def attach(self, msg: dict) -> dict:
        torch = self.torch
        layout = ipc.Layout.from_dict(msg["layout"])
        arena = ipc.attach(msg["handle"])
        self.keys = dataflow.Keys(arena)
        self.inputs = [ipc.view(arena, s) if s else v for s, v in zip(layout.inputs, layout.input_values)]
        self.slots = [ipc.view(arena, s) for s in layout.outputs]
        self.structure = msg["structure"]
        importlib.import_module("torch._dynamo")  # rebinds torch.manual_seed: before the snapshot
        importlib.import_module("torch.profiler")
        # its CPU set is the judge's to move (onto the timing core while measured), not its own
        confine.restrict(self.job_dir, self.report, hidden=msg.get("hidden") or [], fixed_cores=True)
        self.audit = integrity.AuditHookGate()
        self.watched = {**self.recorder.install(), **_evidence_machinery()}
        if self.device.type == "cuda":
            self.recorder.expected_stream = torch.cuda.current_stream(self.device)
        with torch.no_grad():
            self.snapshot = integrity.IntegritySnapshot(extra=self.watched)
        self.recorder.snapshot = self.snapshot
        self.numerics = integrity.NumericsWatch()
        self.evidence_state = self.describe()
        _forget_harness_modules()
        return {"ok": True, "confinement": self.report.to_dict(), "evidence_state": self.evidence_state}

    def load(self, msg: dict) -> dict:
        """The model built: `ModelNew` of the candidate, or (the reference twin) `Model` of the
        reference, compiled with torch.compile when asked."""
        torch, name = self.torch, str(msg.get("cls", "ModelNew"))
        self.null = None  # null calls end where a model begins: the stand-in's memory goes back
        try:
            with torch.no_grad():
                mod = import_file(self.candidate, CANDIDATE_MODULE)
        except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is a verdict
            return {"error": _describe(exc), "stage": "import"}
        cls = getattr(mod, name, None)
        if cls is None:
            return {"error": f"no {name} defined in the candidate", "stage": "import"}
        with torch.no_grad():
            findings = self.integrity("after import")
        try:
            with torch.no_grad():
                self.model = build_model(cls, self.init_args, self.seed, self.device)
                findings += self.integrity("after construction")
        except BaseException as exc:  # noqa: BLE001
            return {"error": _describe(exc), "stage": "construct", "findings": findings}
        if msg.get("compile"):
            self.model = torch.compile(self.model)
        return {"ok": True, "findings": findings}

    # ---- calls --------------------------------------------------------------------------

    def call(self, msg: dict) -> dict:
        mode = msg.get("mode")
        if mode == "null" and self.model is not None:
            return {"error": "null calls calibrate before the candidate exists"}
        if mode == "null":
            self.null = self.null or _NullForward(self.slots)
        forward = self.null if mode == "null" else self.model
        flow = dataflow.FlowLog(self.keys, self.numerics.changed) if mode == "check" else None
        for g in self.generators:  # as the judge seeds the reference's forward; `torch.manual_seed`
            g.manual_seed(int(msg["seed"]))  # would also call backends a candidate can register
        self.recorder.begin(flow, bool(msg.get("changes")), frozenset(map(str, msg.get("perturb") or ())))
        self.last_launches = ([], [])
        rows = None
        t0 = _perf()
        try:
            with self.torch.no_grad():  # the snapshot was taken in no_grad: compare in the same mode
                if mode == "profile":
                    ms = 0.0  # the judge times nothing profiled
                    out, rows = profiling.profile_cuda(functools.partial(forward, *self.inputs))
                else:
                    ms, out = self._timed(forward, flow)
                t1 = _perf()
                findings = self.integrity("call") if mode == "check" else self._numerics(mode)
        except BaseException as exc:  # noqa: BLE001
            self.recorder.end()
            return {"error": _describe(exc), "findings": self.recorder.refusals}
        launches = self.recorder.end()
        self.last_launches = (launches, [self.keys.key(t) for t in compare.tensors(out)])
        reply = {"ms": ms, "launches": len(launches), "kernels": sorted({name for name, _, _ in launches}),
                 **self._commit(out)}
        if "mismatch" not in reply:  # every call: a view of the arena skips the copy into the slot
            reply["output_in_arena"] = self._in_arena(out)
        if rows is not None:
            reply["profile"] = {"rows": rows}
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        if flow is not None and not reply.get("structure"):  # an output of the wrong kind is judged already
            reply.update(self._facts(out, flow))
        if flow is not None and flow.changed:
            findings.append(["global_state_changed", "inside a checked call: " + ", ".join(flow.changed)])
        if findings:
            reply["findings"] = findings
        self.prev_out = _kept_storages(out) if mode == "check" else []
        # where this process's time went (diagnostics for `split_s`, never evidence)
        reply["spent_ms"] = {"forward": (t1 - t0) * 1e3, "after": (_perf() - t1) * 1e3}
        return reply

    def pattern(self, msg: dict) -> dict:
        """The last call's launch pattern, asked for after its reply (describing it inside the call
        would add to the time the judge's clock sees)."""
        launches, output_keys = self.last_launches
        self.last_launches = ([], [])
        input_keys = [self.keys.key(t) for t in compare.tensors(self.inputs)]
        return {"pattern": launch_pattern.describe(launches, self.keys.key, input_keys, output_keys)}

    def _timed(self, forward, flow: dataflow.FlowLog | None) -> tuple[float, Any]:
        torch = self.torch
        if self.device.type != "cuda":
            t0 = _perf()
            out = _forward(forward, self.inputs, flow)
            return (_perf() - t0) * 1e3, out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = _forward(forward, self.inputs, flow)
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out

    def _commit(self, out) -> dict:
        """Copy the output into the judge's slots; describe what does not fit instead of copying."""
        if not all(map(compare.strided, compare.tensors(out))):
            return {"mismatch": "an output tensor is not strided (sparse or nested): nothing to copy into a slot",
                    "structure": True}
        got = json.loads(json.dumps(compare.structure(out), default=str))
        if got != self.structure:
            return {"mismatch": f"output structure {got} vs reference {self.structure}", "structure": True}
        ts = compare.tensors(out)
        if not self.slots:
            try:
                return {"value": json.loads(json.dumps(out, allow_nan=False))}
            except (TypeError, ValueError):
                return {"mismatch": f"output {type(out).__name__} is not a plain value"}
        for i, (t, slot) in enumerate(zip(ts, self.slots)):
            if tuple(t.shape) != tuple(slot.shape) or t.dtype != slot.dtype or t.device.type != slot.device.type:
                return {"mismatch": f"output {i}: shape {tuple(t.shape)} {t.dtype} on {t.device.type} vs "
                                    f"reference {tuple(slot.shape)} {slot.dtype} on {slot.device.type}"}
            slot.copy_(t)
        try:  # the values that are not tensors (an int beside a tensor) travel as JSON
            return {"leaves": json.loads(json.dumps(compare.leaves(out), allow_nan=False))}
        except (TypeError, ValueError):
            return {"mismatch": "an output value is neither a tensor nor a plain value"}

    def _in_arena(self, out) -> bool:
        """An output tensor lies in the judge's arena (an input, its own output slot)."""
        return self.keys.arena is not None and compare.overlap(compare.data_ranges(compare.tensors(out)),
                                                               [self.keys.arena])

    def _facts(self, out, flow: dataflow.FlowLog) -> dict:
        """What only this process can see: types, storage sharing and the data-flow log."""
        outs = compare.tensors(out)
        out_ranges = compare.data_ranges(outs)
        in_ranges = compare.data_ranges(compare.tensors(self.inputs))
        prev = [span for ref, span in self.prev_out if _still_held(ref)]
        return {"bad_type": compare.bad_type(out),
                "aliases_input": compare.overlap(out_ranges, in_ranges),
                "reuses_previous_output": compare.overlap(compare.ranges(outs), prev),
                "off_stream": sorted(self.recorder.off_stream),
                "flow": {"events": [e.to_list() for e in flow.events], "truncated": flow.truncated,
                         "outputs": [self.keys.key(t) for t in outs],
                         "output_spans": [[self.keys.key(t), *_byte_span(t)] for t in outs]}}

    def integrity(self, where: str) -> list[list[str]]:
        """The snapshot compared with now; callers are inside no_grad, as the snapshot was."""
        found = []
        patched = self.snapshot.patched()
        changes = self.snapshot.state_changes()
        if patched:
            found.append(["patched_function", f"{where}: " + ", ".join(patched[:6])])
        if changes:
            found.append(["global_state_changed", f"{where}: " + ", ".join(changes[:6])])
        if self.audit.refused:
            found.append(["patched_function", f"{where}: {self.audit.refused} audit hook(s) added (refused: a hook "
                                              "runs inside the runner's own steps)"])
        threads = integrity.python_threads() - self.recorder.threads0
        if threads:
            found.append(["thread_spawned", f"{where}: {len(threads)} new Python thread(s) alive"])
        return found

    def _numerics(self, mode: str) -> list[list[str]]:
        """After a call not checked in full: the numerics flags only (a few reads)."""
        changed = self.numerics.changed()
        return [["global_state_changed", f"after a {mode} call: " + ", ".join(changed)]] if changed else []

    def final(self, msg: dict) -> dict:
        with self.torch.no_grad():
            findings = self.integrity("final")
        cuda = self.device is not None and self.device.type == "cuda"
        return {"findings": findings, "memory_peak": self.torch.cuda.max_memory_reserved(self.device) if cuda else None}

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        handler = {"init": self.init, "attach": self.attach, "load": self.load, "call": self.call,
                   "pattern": self.pattern, "final": self.final}.get(op)
        return handler(msg) if handler is not None else {"error": f"unknown op {op!r}"}

    def describe(self) -> str:
        """The evidence machinery as it is now: the watched functions and classes, and the objects
        that hold it (an attribute set on one of them would shadow its class's method)."""
        objects = {"runner": (self, _RUNNER_FIXED), "recorder": (self.recorder, _RECORDER_FIXED),
                   "snapshot": (self.snapshot, ()),
                   "argument types": (self.recorder.argument_types, tuple(f.name for f in dataclasses.fields(ArgumentTypes)))}
        return _describe_state(self.watched) + "\n" + _describe_objects(objects)

    def evidence(self, nonce: str) -> str | None:
        """A digest of the evidence machinery as it is now, keyed by the request's nonce."""
        return evidence_digest(nonce, self.describe()) if self.watched else None


# what stays the same object from the integrity snapshot on (per-call state such as the model,
# the launch names or the data-flow log is replaced as it should be)
_RUNNER_FIXED = ("torch", "device", "recorder", "keys", "inputs", "slots", "structure", "snapshot", "watched",
                 "generators", "job_dir", "candidate", "report", "audit")
_RECORDER_FIXED = ("candidate_file", "argument_types", "_signatures", "installed", "expected_stream", "originals",
                   "guard", "snapshot", "hooks0", "threads0")


def _source_text(path: str) -> str:
    """The candidate's text as the judge sent it (empty where it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError):
        return ""


def _describe_objects(objects: dict[str, tuple[Any, tuple[str, ...]]]) -> str:
    """Each object's class, attribute names and the identities of its `fixed` attributes."""
    parts = []
    for label, (obj, fixed) in objects.items():
        attrs = vars(obj)
        parts.append(f"{label}:{id(type(obj))}:{sorted(attrs)}:{[id(attrs.get(k)) for k in fixed]}")
    return "\n".join(parts)


def _byte_span(t) -> tuple[int, int]:
    """(first byte, end byte) of what tensor `t` covers in its storage."""
    first = t.storage_offset() * t.element_size()
    return first, first + compare.extent(t)


def _forget_harness_modules() -> None:
    """This package leaves `sys.modules`: candidate code cannot import its way to the live
    recorder or integrity checks (an import would load fresh copies with no hold on them)."""
    for name in [m for m in sys.modules if m == "drkernel" or m.startswith("drkernel.")]:
        del sys.modules[name]


def _forward(forward, inputs: list, flow: dataflow.FlowLog | None):
    if flow is None:
        return forward(*inputs)
    with flow, dataflow.HostReads(flow):
        return forward(*inputs)


def _evidence_machinery() -> dict[str, tuple[Any, str]]:
    """(owner, attribute) of every function and class the evidence depends on: this module's,
    the data-flow log's and the counterfactual's, the integrity checks', the profiler summary's and
    the comparisons'."""
    out: dict[str, tuple[Any, str]] = {}
    for mod in (sys.modules[__name__], channel, compare, ipc, integrity, dataflow, counterfactual, launch_pattern,
                launch_guard, profiling, confine):
        for k, v in vars(mod).items():
            if callable(v) and not k.startswith("__"):
                out[f"{mod.__name__}.{k}"] = (mod, k)
            if isinstance(v, type) and v.__module__ == mod.__name__:
                out.update({f"{mod.__name__}.{k}.{a}": (v, a) for a in vars(v) if not a.startswith("__")})
    return out


def _describe_state(watched: dict[str, tuple[Any, str]]) -> str:
    """Identities of the watched objects, their code and their closures' contents, as text."""
    parts = []
    for label in sorted(watched):
        obj = integrity.own_attribute(*watched[label])
        fn = getattr(obj, "__func__", obj)
        cells = [id(c.cell_contents) for c in getattr(fn, "__closure__", None) or () if launch_guard.filled(c)]
        parts.append(f"{label}:{id(obj)}:{id(getattr(fn, '__code__', None))}:{cells}")
    return "\n".join(parts)


class _NullForward:
    """The trusted stand-in for calibration: returns tensors shaped like the output, no work."""

    def __init__(self, slots: list):
        self.outs = [s.clone() for s in slots]

    def __call__(self, *inputs):
        return self.outs[0] if len(self.outs) == 1 else tuple(self.outs)


def _bench_once(kernel_call, quantiles=None, **_) -> Any:
    """The benchmarker `triton.autotune` gets under Triton's interpreter, which has none (no active
    driver): each config runs once and all tie, so the first config is kept."""
    kernel_call()
    return [1.0] * len(quantiles) if quantiles else 1.0


def _autotune_on_the_interpreter() -> None:
    """Autotuned kernels run on a CPU as on a GPU, before any candidate code exists."""
    from triton.runtime.autotuner import Autotuner
    Autotuner.do_bench = property(lambda tuner: tuner._do_bench or _bench_once)


def import_file(path: str, name: str):
    """A Python file imported as module `name` (the judge imports the reference with it too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and Triton's source lookup need the module registered
    spec.loader.exec_module(mod)
    return mod


def _reference_init_args(path: str, seed: int) -> list:
    """The reference's `get_init_inputs()` under `seed`; the module is not kept (candidate code
    finds no reference model in this process, by import or otherwise)."""
    name = "_drk_runner_reference"
    try:
        return init_inputs(import_file(path, name), seed)
    finally:
        sys.modules.pop(name, None)
        gc.collect()  # the module's classes sit in reference cycles


def _remove_source(path: str) -> None:
    """`path` deleted with the bytecode its import may have written: candidate code, run later in
    this directory, finds nothing of it there."""
    for p in (path, importlib.util.cache_from_source(path)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


def init_inputs(ref_mod, seed: int) -> list:
    """The reference's `get_init_inputs()` under `seed`."""
    import torch
    torch.manual_seed(seed)
    return list(ref_mod.get_init_inputs())


def build_model(cls, init: list, seed: int, device):
    """`cls(*init)` on `device` under `seed`: the judge's reference and the runner's candidate
    start from the same parameters."""
    import torch
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    model = cls(*init)
    return model.to(device) if hasattr(model, "to") else model


def _kept_storages(out) -> list:
    """An output's storages and byte ranges, for the next checked call: a storage the candidate
    still holds when its next output lands on it is a cached answer; one it let go may be reused
    by the allocator honestly. Storages of the caching allocator are referenced weakly (holding
    them would cost an output's memory); memory it does not own (`from_dlpack`, `from_blob`),
    whose storage objects are new each time, is held (its owner keeps it alive anyway)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    kept = []
    for t in compare.tensors(out):
        try:
            st = t.untyped_storage()
            kept += [(StorageWeakRef(st) if st.resizable() else st, span) for span in compare.ranges([t])]
        except Exception:  # noqa: BLE001 - a tensor without storage (sparse, meta) leaves nothing to compare
            continue
    return kept


def _still_held(ref) -> bool:
    return not ref.expired() if hasattr(ref, "expired") else True


def _describe(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{type(exc).__name__}: {exc}"[:600] + "\n" + tb[-800:]


def preflight(candidate_path: str, hidden: list[str]) -> dict:
    """A sandbox target run before the judge's job, with no GPU visible: the candidate imported
    once in a confined process of its own, so that a candidate that cannot even be imported costs
    no GPU time. The answer is a self-report: a failure can only cost the candidate itself (the
    evaluator accepts only failures that cannot depend on the missing GPU), and success decides
    nothing."""
    job_dir = os.getcwd()  # the sandbox child's own directory
    candidate_path = shutil.copy(candidate_path, job_dir)  # the original lies in a hidden directory
    report = confine.Confinement()
    confine.enter_network_namespace(report)
    confine.point_caches_at(job_dir)
    confine.restrict(job_dir, report, hidden=hidden, fixed_cores=True, gpu=False)  # it runs with no GPU
    if not report.complete:
        return {"skipped": "could not be confined"}
    try:
        import_file(candidate_path, CANDIDATE_MODULE)
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is data
        frames = traceback.extract_tb(exc.__traceback__)
        here = bool(frames) and os.path.realpath(frames[-1].filename) == os.path.realpath(candidate_path)
        return {"error": _describe(exc), "type": type(exc).__name__, "raised_in_candidate": here}
    return {"ok": True}


def main(sock_fd: int, job_dir: str) -> None:
    """Serve the judge until it says `exit` or goes away. Every reply echoes the request's nonce."""
    report = confine.Confinement()
    confine.enter_network_namespace(report)
    confine.point_caches_at(job_dir)
    runner = Runner(job_dir, report)
    while True:
        try:
            msg = ipc.recv(sock_fd)
        except ipc.ChannelClosed:
            return
        if msg.get("op") == "exit":
            return
        try:
            reply = runner.handle(msg)
        except BaseException as exc:  # noqa: BLE001 - our own failure still gets an answer
            reply = {"error": _describe(exc)}
        nonce = str(msg.get("nonce", ""))
        reply = {**json.loads(json.dumps(reply, default=str)), "nonce": nonce, "evidence": runner.evidence(nonce)}
        ipc.send(sock_fd, reply)
