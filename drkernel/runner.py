"""The runner: the one process that imports candidate code. It decides nothing.

Started by the sandbox's zygote next to the judge (`drkernel.judge`), it talks to the judge over
one socket and sees the judge's arena (inputs and output slots, `drkernel.ipc`). In order:

1. a fresh network namespace; Triton's cache, TMPDIR and HOME beneath its own job directory;
2. `init`: CUDA initialised, the reference file imported for `get_init_inputs` only;
3. `attach`: the arena mapped, then the process confined (`drkernel.confine`), the launch hook
   installed and the integrity snapshot taken; `null` calls (a trusted stand-in forward) let the
   judge calibrate its clock against this process before any candidate code exists;
4. `load`: the candidate imported and `ModelNew(*get_init_inputs())` built under the reference's seed;
5. `call` (modes check / warm / time / noop), `profile`, `final`: forward on the inputs the judge
   wrote, the output committed into the judge's slots, and facts sent back.

Everything sent back is a self-report: once candidate code has run here it can rewrite any of it.
The judge re-derives what it can (values, mutations, its own clock) and only uses the rest for
hack codes and the profiling share (docs/security.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from typing import Any

from drkernel import compare, confine, ipc

_perf = time.perf_counter  # bound before any candidate code exists


class LaunchRecorder:
    """Wraps Triton's launch entry points; records (and in noop mode skips) the candidate's kernels."""

    def __init__(self, candidate_file: str):
        self.candidate_file = os.path.realpath(candidate_file)
        self.calls: list[dict] = []
        self.alive: list[Any] = []  # launched tensors stay alive until the call ends (allocator reuse)
        self.noop = False
        self.expected_stream: Any = None
        self.off_stream: set[str] = set()
        self._mine: dict[Any, bool] = {}
        self.installed: dict[str, tuple[Any, str]] = {}

    def install(self) -> dict[str, tuple[Any, str]]:
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
                self.installed[f"{owner.__module__}.{owner.__name__}.run (launch hook)"] = (owner, "run")
        return self.installed

    def _wrap(self, orig):
        rec = self

        def run(kernel, *args, grid, warmup, **kwargs):
            mine = not warmup and rec._is_mine(kernel)
            if mine and rec.noop:
                return None
            ret = orig(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            if mine:
                rec._record(kernel, args, kwargs)
            return ret

        return run

    def _is_mine(self, kernel) -> bool:
        code = getattr(getattr(kernel, "fn", None), "__code__", None)
        if code is None:
            return False
        if code not in self._mine:  # once per kernel: this runs inside every timed launch
            self._mine[code] = os.path.realpath(code.co_filename) == self.candidate_file
        return self._mine[code]

    def _record(self, kernel, args, kwargs) -> None:
        import torch
        name = getattr(getattr(kernel, "fn", None), "__name__", "?")
        if self.expected_stream is not None and torch.cuda.current_stream() != self.expected_stream:
            self.off_stream.add(name)
        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.alive.extend(ts)
        self.calls.append({"name": name, "ranges": compare.data_ranges(ts), "storage": compare.ranges(ts)})

    def begin(self) -> None:
        self.calls, self.alive = [], []

    def end(self) -> list[dict]:
        calls, self.calls, self.alive = self.calls, [], []
        return calls


class Runner:
    """State of one runner process; `handle(msg)` answers one judge message."""

    def __init__(self, job_dir: str, report: confine.Confinement):
        self.job_dir, self.report = job_dir, report
        self.torch: Any = None
        self.device: Any = None
        self.seed = 0
        self.ref_mod: Any = None
        self.recorder: LaunchRecorder | None = None
        self.inputs: list = []
        self.slots: list = []
        self.structure: Any = None
        self.model: Any = None
        self.snapshot: Any = None
        self.threads0: set[int] = set()
        self.prev_out: Any = None

    # ---- setup --------------------------------------------------------------------------

    def init(self, msg: dict) -> dict:
        import torch
        self.torch = torch
        self.device = torch.device(msg["device"])
        self.seed = int(msg["seed"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)  # CUDA must exist before Landlock (error 304 otherwise)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        self.ref_mod = import_file(msg["reference"], "_drk_runner_reference")
        self.recorder = LaunchRecorder(msg["candidate"])
        self.candidate = msg["candidate"]
        return {"ok": True}

    def attach(self, msg: dict) -> dict:
        from drkernel import integrity
        torch = self.torch
        layout = ipc.Layout.from_dict(msg["layout"])
        arena = ipc.attach(msg["handle"])
        self.inputs = [ipc.view(arena, s) if s else v for s, v in zip(layout.inputs, layout.input_values)]
        self.slots = [ipc.view(arena, s) for s in layout.outputs]
        self.structure = msg["structure"]
        import torch._dynamo  # noqa: F401  (rebinds torch.manual_seed: before the snapshot)
        import torch.profiler  # noqa: F401
        confine.restrict(self.job_dir, self.report)
        watched = self.recorder.install()
        for mod in (sys.modules[__name__], compare, ipc, integrity):
            watched.update({f"{mod.__name__}.{k}": (mod, k) for k, v in vars(mod).items()
                            if callable(v) and not k.startswith("__")})
        if self.device.type == "cuda":
            self.recorder.expected_stream = torch.cuda.current_stream(self.device)
        with torch.no_grad():
            self.snapshot = integrity.IntegritySnapshot(extra=watched)
        self.threads0 = integrity.python_threads()
        return {"ok": True, "confinement": self.report.to_dict()}

    def load(self, msg: dict) -> dict:
        torch = self.torch
        try:
            with torch.no_grad():
                mod = import_file(self.candidate, "_drk_candidate")
        except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is a verdict
            return {"error": _describe(exc), "stage": "import"}
        cls = getattr(mod, "ModelNew", None)
        if cls is None:
            return {"error": "no ModelNew defined in the candidate", "stage": "import"}
        with torch.no_grad():
            findings = self.integrity("after import")
        try:
            with torch.no_grad():
                self.model = build_model(cls, init_inputs(self.ref_mod, self.seed), self.seed, self.device)
                findings += self.integrity("after construction")
        except BaseException as exc:  # noqa: BLE001
            return {"error": _describe(exc), "stage": "construct", "findings": findings}
        return {"ok": True, "findings": findings}

    # ---- calls --------------------------------------------------------------------------

    def call(self, msg: dict) -> dict:
        mode = msg.get("mode")
        if mode == "null":
            if self.model is not None:
                return {"error": "null calls calibrate before the candidate exists"}
            forward = _NullForward(self.slots)
        else:
            forward = self.model
        torch = self.torch
        self.recorder.begin()
        self.recorder.noop = mode == "noop"
        try:
            with torch.no_grad():  # the snapshot was taken in no_grad: compare in the same mode
                ms, out = self._timed(forward)
                findings = self.integrity("call") if mode == "check" else []
        except BaseException as exc:  # noqa: BLE001
            self.recorder.end()
            return {"error": _describe(exc), "cuda": "CUDA" in str(exc) or "illegal memory" in str(exc)}
        finally:
            self.recorder.noop = False
        launches = self.recorder.end()
        reply = {"ms": ms, "launches": len(launches)}
        reply.update(self._commit(out))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if mode in ("check", "noop"):
            reply.update(self._facts(out, launches))
        if findings:
            reply["findings"] = findings
        self.prev_out = out if mode == "check" else None
        return reply

    def _timed(self, forward) -> tuple[float, Any]:
        torch = self.torch
        if self.device.type != "cuda":
            t0 = _perf()
            out = forward(*self.inputs)
            return (_perf() - t0) * 1e3, out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*self.inputs)
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out

    def _commit(self, out) -> dict:
        """Copy the output into the judge's slots; describe what does not fit instead of copying."""
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
        return {}

    def _facts(self, out, launches: list[dict]) -> dict:
        """What only this process can see: types, storage sharing, which tensors the kernels touched."""
        outs = compare.tensors(out)
        out_ranges = compare.data_ranges(outs)
        in_ranges = compare.data_ranges(compare.tensors(self.inputs))
        launch_ranges = [tuple(r) for call in launches for r in call["ranges"]]
        prev = compare.ranges(compare.tensors(self.prev_out)) if self.prev_out is not None else []
        return {"bad_type": compare.bad_type(out),
                "kernels": sorted({c["name"] for c in launches}),
                "aliases_input": compare.overlap(out_ranges, in_ranges),
                "reuses_previous_output": compare.overlap(compare.ranges(outs), prev),
                "output_from_kernels": bool(out_ranges) and compare.overlap(out_ranges, launch_ranges),
                "launch_bytes": sum(b - a for a, b in {tuple(r) for r in launch_ranges}),
                "io_bytes": compare.nbytes(outs) + compare.nbytes(compare.tensors(self.inputs)),
                "off_stream": sorted(self.recorder.off_stream)}

    def integrity(self, where: str) -> list[list[str]]:
        """The snapshot compared with now; callers are inside no_grad, as the snapshot was."""
        from drkernel import integrity
        found = []
        patched = self.snapshot.patched()
        changes = self.snapshot.state_changes()
        if patched:
            found.append(["patched_function", f"{where}: " + ", ".join(patched[:6])])
        if changes:
            found.append(["global_state_changed", f"{where}: " + ", ".join(changes[:6])])
        threads = integrity.python_threads() - self.threads0
        if threads:
            found.append(["thread_spawned", f"{where}: {len(threads)} new Python thread(s) alive"])
        return found

    def profile(self, msg: dict) -> dict:
        from drkernel import profiling
        names = set(msg.get("kernels") or [])

        def fn():
            self.recorder.begin()
            try:
                with self.torch.no_grad():
                    self.model(*self.inputs)
            finally:
                self.recorder.end()  # else the launch hook keeps every profiled call's tensors alive
        try:
            return {"profile": profiling.profile_cuda(fn, names, calls=int(msg.get("calls", 5)))}
        except BaseException as exc:  # noqa: BLE001
            return {"error": _describe(exc)}

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "init":
            return self.init(msg)
        if op == "attach":
            return self.attach(msg)
        if op == "load":
            return self.load(msg)
        if op == "call":
            return self.call(msg)
        if op == "profile":
            return self.profile(msg)
        if op == "final":
            with self.torch.no_grad():
                findings = self.integrity("final")
            cuda = self.device is not None and self.device.type == "cuda"
            return {"findings": findings, "memory_peak": self.torch.cuda.max_memory_reserved(self.device) if cuda else None}
        return {"error": f"unknown op {op!r}"}


class _NullForward:
    """The trusted stand-in for calibration: returns tensors shaped like the output, no work."""

    def __init__(self, slots: list):
        self.outs = [s.clone() for s in slots]

    def __call__(self, *inputs):
        return self.outs[0] if len(self.outs) == 1 else tuple(self.outs)


def import_file(path: str, name: str):
    """A Python file imported as module `name` (the judge imports the reference with it too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and Triton's source lookup need the module registered
    spec.loader.exec_module(mod)
    return mod


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


def _describe(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{type(exc).__name__}: {exc}"[:600] + "\n" + tb[-800:]


def preflight(candidate_path: str) -> dict:
    """A sandbox target run before the judge's job, with no GPU visible: the candidate imported
    once in a confined process of its own, so that a candidate that cannot even be imported costs
    no GPU time. The answer is a self-report: a failure can only cost the candidate itself (the
    evaluator accepts only failures that cannot depend on the missing GPU), and success decides
    nothing."""
    job_dir = os.getcwd()  # the sandbox child's own directory
    report = confine.Confinement()
    confine.enter_network_namespace(report)
    confine.point_caches_at(job_dir)
    confine.restrict(job_dir, report)
    if not report.complete:
        return {"skipped": "could not be confined"}
    try:
        import_file(candidate_path, "_drk_candidate")
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is data
        frames = traceback.extract_tb(exc.__traceback__)
        here = bool(frames) and os.path.realpath(frames[-1].filename) == os.path.realpath(candidate_path)
        return {"error": _describe(exc), "type": type(exc).__name__, "raised_in_candidate": here}
    return {"ok": True}


def main(sock_fd: int, job_dir: str) -> None:
    """Serve the judge until it says `exit` or goes away."""
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
        ipc.send(sock_fd, json.loads(json.dumps(reply, default=str)))
