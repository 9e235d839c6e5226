"""drkernel.launch_guard, on Triton's own kernel objects: what a launch would run or be named is
what the judged text says. The hack corpus has the interpreter's cases end to end; these are the
compiled path's (a GPU's), which a CPU can build but not launch."""

import importlib.util
import sys
import textwrap

import pytest

from drkernel import launch_guard, triton_source

TEXT = textwrap.dedent('''
    import triton
    import triton.language as tl

    SCALE = 2.0
    LIMIT = tl.constexpr(8)
    BOXES = [1]


    def copy_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) * SCALE, mask=offs < LIMIT)


    def boxed_kernel(x_ptr):
        tl.store(x_ptr, BOXES)
''')


@pytest.fixture
def compiled(tmp_path):
    """The file's functions as Triton's compiled-path kernels (JITFunction), and a guard of its text."""
    from triton.runtime.jit import JITFunction

    path = tmp_path / "cand.py"
    path.write_text(TEXT)
    spec = importlib.util.spec_from_file_location("guard_cand", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    guard = launch_guard.LaunchGuard(str(path), TEXT)
    guard.kernel_types = guard.kernel_types | {JITFunction}
    guard.class_attrs[JITFunction] = frozenset(a for t in JITFunction.__mro__ for a in vars(t))
    yield guard, JITFunction(mod.copy_kernel), JITFunction(mod.boxed_kernel)
    sys.modules.pop("guard_cand", None)


def _set_source(kernel, text: str) -> None:
    vars(kernel)["_src" if "_src" in vars(kernel) else "src"] = text


def test_an_untouched_kernel_may_launch_and_its_globals_are_constants(compiled):
    guard, kernel, boxed = compiled
    assert guard.problem(kernel, {}) is None
    assert "boxed_kernel reads BOXES, a list" in guard.problem(boxed, {})


def test_the_code_a_kernel_runs_is_what_importing_the_judged_text_made(compiled):
    """Code put in the kernel function's place, or its first line moved (the interpreter finds the
    text it runs by that line), is not the judged text's."""
    guard, kernel, _ = compiled
    original = kernel.fn.__code__
    kernel.fn.__code__ = original.replace(co_firstlineno=original.co_firstlineno + 1)
    assert "code is not the judged text's" in guard.problem(kernel, {})
    kernel.fn.__code__ = (lambda x_ptr, out_ptr, BLOCK: None).__code__.replace(
        co_name="copy_kernel", co_firstlineno=original.co_firstlineno, co_filename=original.co_filename)
    assert "code is not the judged text's" in guard.problem(kernel, {})
    kernel.fn.__code__ = original
    assert guard.problem(kernel, {}) is None


def test_what_the_text_reads_is_checked_where_it_is_found(compiled):
    """Its module's builtins are Python's own, and an attribute of a module it reads is one the
    module had before the candidate (a function added to `triton.language` or `math` is the
    candidate's Python)."""
    import triton.language as tl

    guard, kernel, _ = compiled
    g = kernel.fn.__globals__
    g["__builtins__"] = {"range": range}
    assert "module has builtins of its own" in guard.problem(kernel, {})
    g["__builtins__"] = __builtins__
    tl.drk_probe = lambda *args: None
    try:
        _reads_also(guard, "copy_kernel", ("tl", "drk_probe"))
        assert "reads triton.language.drk_probe, which that module did not have" in guard.problem(kernel, {})
    finally:
        del tl.drk_probe


def test_the_text_a_kernel_would_compile_is_the_judged_one(compiled):
    guard, kernel, _ = compiled
    _set_source(kernel, kernel.src.replace("* SCALE", "* SCALE + 1"))
    assert "would compile other text than the file's" in guard.problem(kernel, {})


def test_a_kernel_renamed_for_the_device_may_not_launch(compiled):
    guard, kernel, _ = compiled
    assert guard.problem(kernel, {}) is None
    vars(kernel)["_fn_name"] = "cand.nvjet_tst_64x8"  # what Triton names the device function after
    assert "named 'cand.nvjet_tst_64x8' on the device" in guard.problem(kernel, {})
    del vars(kernel)["_fn_name"]
    kernel.fn.__qualname__ = "ampere_sgemm_128x64_nn"
    assert "named 'ampere_sgemm_128x64_nn' on the device" in guard.problem(kernel, {})


def test_compiled_kernels_changed_after_their_launch_may_not_launch_again(compiled):
    guard, kernel, _ = compiled

    class Compiled:
        def run(self, *args):
            return None

    built = Compiled()
    kernel.device_caches[0] = ({"key": built}, {}, "target", "backend", lambda *a: None)
    assert "was compiled outside a launch" in guard.problem(kernel, {})
    guard.seen(kernel)
    assert guard.problem(kernel, {}) is None
    built.run = lambda *args: None  # its launcher swapped: candidate Python inside the launch
    assert "compiled kernels were changed after its launch" in guard.problem(kernel, {})


def test_triton_hooks_holding_the_candidates_python_stop_its_launches(compiled):
    """A hook added to Triton's chain (its identity unchanged) or set in its place runs inside the
    launch; hooks of Triton's or torch's own code do not count."""
    import triton.knobs

    guard, kernel, _ = compiled
    runtime = triton.knobs.runtime
    chain = getattr(runtime, "launch_enter_hook", None)
    if not isinstance(getattr(chain, "calls", None), list):
        pytest.skip("this Triton has no chain of launch hooks")
    own = triton.cdiv  # a function of Triton's own code
    chain.add(own)
    try:
        assert guard.problem(kernel, {}) is None
        chain.add(_candidates_hook)
        assert "Triton's hooks hold the candidate's _candidates_hook" in guard.problem(kernel, {})
    finally:
        chain.remove(own)
        chain.remove(_candidates_hook)
    assert guard.problem(kernel, {}) is None


def _reads_also(guard, kernel: str, chain: tuple[str, ...]) -> None:
    """As if the kernel's text also read `chain`."""
    key = next(k for k in guard.reads if k[0] == kernel)
    r = guard.reads[key]
    guard.reads[key] = triton_source.Reads(r.names | {chain[0]}, r.chains | {chain})


def _candidates_hook(*args, **kwargs):
    return None


@pytest.mark.parametrize("text, finding", [
    ("import triton\n@triton.jit(repr=lambda _: 'k')\ndef k(x):\n    pass\n", "renames its kernel on the device"),
    ("import triton\nG = object()\n@triton.jit\ndef k(x):\n    if G:\n        pass\n", "reads G, a module-level object"),
    ("import triton\nimport torch\ndef f(x):\n    torch.relu(x)\nk = triton.jit(fn=f)\n", "f calls torch.relu"),
    ("import triton\n@triton.jit\ndef k(x):\n    globals()['t'].relu(x)\n", "k uses the builtin globals"),
    ("import triton\nG = [1]\n@triton.jit\ndef k(x, B=G[0]):\n    pass\n", "k reads G, a module-level object"),
    ("import triton\n@triton.jit\ndef k(x):\n    pass\nif False:\n    def k(x):\n        pass\n",
     "k is defined more than once"),
    ("import triton\n@triton.jit\ndef k(x):\n    pass\nfirst = k\n@triton.jit\ndef k(x):\n    pass\n",
     "k is defined more than once"),  # the first def kept under another name
])
def test_the_source_scan_refuses_what_would_run_python_or_show_another_name(text, finding):
    assert any(finding in f for f in triton_source.python_calls(text)), triton_source.python_calls(text)


def test_constants_may_be_built_from_math_but_not_from_a_rebound_math():
    """`tl.constexpr(math.sqrt(2 / math.pi))` is what GELU kernels write (and what Triton's own error
    message recommends); a `math` the module rebinds could be anything."""
    kernel = "@triton.jit\ndef k(x):\n    tl.store(x, C + D)\n"
    honest = ("import math\nimport triton\nimport triton.language as tl\nA = math.log(2.0)\n"
              "C = tl.constexpr(math.sqrt(2.0 / math.pi) / A)\nD = tl.constexpr(float('-inf'))\n" + kernel)
    assert triton_source.python_calls(honest) == []
    rebound = honest.replace("A = math.log(2.0)", "math = object()\nA = math.log(2.0)")
    assert any("reads C" in f for f in triton_source.python_calls(rebound)), triton_source.python_calls(rebound)
    called = honest.replace("math.log(2.0)", "open('x').tell()")
    assert any("reads C" in f for f in triton_source.python_calls(called)), triton_source.python_calls(called)
    block = honest.replace("A = math.log(2.0)", "A = triton.next_power_of_2(300) // triton.cdiv(7, 2)")
    assert triton_source.python_calls(block) == []  # Triton's host arithmetic gives plain ints
    other = honest.replace("A = math.log(2.0)", "A = triton.compile(300)")
    assert any("reads C" in f for f in triton_source.python_calls(other)), triton_source.python_calls(other)


@pytest.mark.parametrize("header, constant, part", [
    ("from math import sqrt, pi", "C = sqrt(2.0 / pi)", "pi"),  # names imported from math
    ("import math as m", "C = m.sqrt(2.0 / m.pi)", "m"),  # math under another name
    ("FP64 = False", "C = tl.float64 if FP64 else tl.float32", "FP64"),  # a choice between constants
    ("N = 3", "C = tl.constexpr(4 if N > 2 and N != 5 else 8)", "N"),
    ("DIM = 100", "C = tl.constexpr(max(16, triton.next_power_of_2(DIM)))", "max"),  # numeric builtins
    ("DIM = 100", "C = tl.constexpr(min(abs(-DIM), round(2.5)))", "abs"),
    ("import numpy as np", "C = tl.constexpr(float(np.finfo(np.float32).min))", "np"),  # numpy's dtype limits
    ("import torch", "C = tl.constexpr(torch.pi / 2)", "torch"),  # torch's numbers
    ("N = 3", "C, E = tl.constexpr(N * 2), 5", "N"),  # a tuple unpacked into constants
])
def test_the_source_scan_knows_constants_the_way_kernels_write_them(header, constant, part):
    """Constants that LLM-written kernels hold; the same with any part rebound or made by a call of
    the file's own is no constant."""
    text = (f"import triton\nimport triton.language as tl\n{header}\n{constant}\n"
            "@triton.jit\ndef k(x):\n    tl.store(x, tl.full((1,), 1, C))\n")
    assert triton_source.python_calls(text) == []
    rebound = text.replace(constant, f"{part} = object()\n{constant}")
    assert any("reads C" in f for f in triton_source.python_calls(rebound)), (rebound, triton_source.python_calls(rebound))


@pytest.mark.parametrize("binding", [
    "try:\n    import triton.language.math as tmath\nexcept ImportError:\n    tmath = tl\n",
    "if hasattr(tl, 'math'):\n    tmath = tl.math\nelse:\n    import triton.language as tmath\n",
])
def test_a_name_for_a_triton_module_may_be_bound_in_two_ways_but_never_to_another_object(binding):
    """Code written for several Triton versions picks its math module at import; a branch that binds
    the name to anything but Triton's own makes the kernel's calls through it Python."""
    text = (f"import triton\nimport triton.language as tl\n{binding}"
            "@triton.jit\ndef k(x):\n    tl.store(x, tmath.exp(tl.load(x)))\n")
    assert triton_source.python_calls(text) == []
    other = text.replace("tmath = tl\n", "tmath = object()\n").replace("tmath = tl.math\n", "tmath = object()\n")
    assert any("calls tmath.exp" in f for f in triton_source.python_calls(other)), triton_source.python_calls(other)
    # a name for what is no Triton module, however it is spelled: `tl` itself rebound to torch
    for rebound in ("import torch as tl\ntl = tl.nn.functional\n", "import torch\ntl = torch\n"):
        borrowed = (f"import triton\n{rebound}tmath = tl\n"
                    "@triton.jit\ndef k(x):\n    tl.store(x, tmath.relu(tl.load(x)))\n")
        assert any("calls tmath.relu" in f for f in triton_source.python_calls(borrowed)), (
            rebound, triton_source.python_calls(borrowed))
    chosen = "import triton\nimport triton.language as tl\nEXP = tl.math.exp if hasattr(tl, 'math') else tl.exp\n" \
             "@triton.jit\ndef k(x):\n    tl.store(x, EXP(tl.load(x)))\n"
    assert triton_source.python_calls(chosen) == []
    elsewhere = chosen.replace("else tl.exp", "else print")
    assert any("calls EXP" in f for f in triton_source.python_calls(elsewhere)), triton_source.python_calls(elsewhere)


def test_the_source_scan_reads_a_jit_call_as_a_kernel_and_ignores_tensor_annotations():
    """`helper = triton.jit(_impl)` is a kernel under its bound name; `x_ptr: torch.Tensor` is a
    parameter's type Triton ignores; neither is Python inside the kernel."""
    text = ("import torch\nimport triton\nimport triton.language as tl\ndef _impl(x):\n    return x * 2\n"
            "helper = triton.jit(_impl)\n@triton.jit\ndef k(x_ptr: torch.Tensor, n: int):\n"
            "    tl.store(x_ptr, helper(tl.load(x_ptr)))\n")
    assert triton_source.python_calls(text) == []
    assert set(triton_source.jit_kernels(text)) == {"_impl", "helper", "k"}
    plain = text.replace("helper = triton.jit(_impl)", "helper = _impl")
    assert any("calls helper" in f for f in triton_source.python_calls(plain)), triton_source.python_calls(plain)
    other = text.replace("torch.Tensor", "torch.relu")
    assert any("reads torch" in f for f in triton_source.python_calls(other)), triton_source.python_calls(other)


def test_the_source_scan_lets_kernels_read_constants_and_tritons_own_values():
    text = ("import triton\nimport triton.language as tl\nA = 1\nB = -2.5\nC = tl.constexpr(4)\nD = tl.float16\n"
            "SIG = tl.sigmoid\n"  # a name for Triton's own function (what it holds is checked at the launch)
            "CONFIGS = [triton.Config({'BLOCK': 8})]\n@triton.autotune(configs=CONFIGS, key=[])\n@triton.jit\n"
            "def gemm_kernel(x, BLOCK: tl.constexpr):\n    tl.store(x, SIG(A + B + C) * BLOCK, mask=D is not None)\n")
    assert triton_source.python_calls(text) == []
    for other in ("SIG = torch.sigmoid", "SIG = tl.sigmoid\nSIG = lambda v: v"):
        assert any("calls SIG" in f for f in triton_source.python_calls(text.replace("SIG = tl.sigmoid", other)))


def test_a_kernel_from_another_file_than_the_candidates_may_not_launch(compiled, tmp_path):
    """Text the judge never read (a file the candidate wrote and imported at run time)."""
    from triton.runtime.jit import JITFunction

    guard, _, _ = compiled
    other = tmp_path / "written_later.py"
    other.write_text(TEXT)
    spec = importlib.util.spec_from_file_location("written_later", other)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "defined outside the candidate's file" in guard.problem(JITFunction(mod.copy_kernel), {})


def test_a_submodule_imported_since_is_no_addition(compiled):
    """Triton's compile imports some of its own submodules after the guard is made: reading one
    through its package (`tl.extra.cuda`) is not reading a name the candidate added."""
    import triton.language as tl

    guard, kernel, _ = compiled
    guard.module_values["triton.language"].pop("math")
    _reads_also(guard, "copy_kernel", ("tl", "math", "exp"))
    assert type(tl.math).__name__ == "module" and guard.problem(kernel, {}) is None


class _Truthy:
    """Candidate Python that Triton's launch would run (`kwargs.get("debug", self.debug) or ...`)."""

    def __bool__(self):
        return False


def test_kernel_settings_and_caches_of_the_candidates_may_not_launch(compiled):
    """A flag Triton reads at every launch holding an object, and a compiled-kernel cache whose
    entries another factory makes (kernels built outside any launch, or a binder of the candidate's),
    would run other code than the judged text; Triton's own may launch."""
    import collections
    guard, kernel, _ = compiled
    assert guard.problem(kernel, {}) is None
    vars(kernel)["debug"] = _Truthy()
    assert "debug" in guard.problem(kernel, {})
    vars(kernel)["debug"] = None
    vars(kernel)["device_caches"] = collections.defaultdict(lambda: ({}, {}, None, None, None))
    assert "cache" in guard.problem(kernel, {})


def test_a_kernel_may_call_tritons_math_libraries_the_candidate_imports(tmp_path):
    """`from triton.language.extra import libdevice` is a common import of honest kernels (erf,
    tanh): the guard imports Triton's math libraries before it records Triton's modules, so the
    candidate's import finds the same module and a kernel may read it."""
    from triton.runtime.jit import JITFunction

    names = [n for n in list(sys.modules) if n.startswith("triton.language.extra.")]
    saved = {n: sys.modules.pop(n) for n in names}  # as in a fresh runner: nothing imported them yet
    text = textwrap.dedent('''
        import triton.language as tl
        from triton.language.extra import libdevice


        def gelu_kernel(x_ptr):
            x = tl.load(x_ptr)
            tl.store(x_ptr, 0.5 * x * (1.0 + libdevice.erf(x * 0.7071067811865476)))
    ''')
    path = tmp_path / "cand.py"
    path.write_text(text)
    try:
        guard = launch_guard.LaunchGuard(str(path), text)
        spec = importlib.util.spec_from_file_location("guard_libdevice", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        guard.kernel_types = guard.kernel_types | {JITFunction}
        guard.class_attrs[JITFunction] = frozenset(a for t in JITFunction.__mro__ for a in vars(t))
        assert guard.problem(JITFunction(mod.gelu_kernel), {}) is None
    finally:
        sys.modules.update(saved)
        sys.modules.pop("guard_libdevice", None)
