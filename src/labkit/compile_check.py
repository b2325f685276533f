"""Compile every kernel the CPU run launches for the H200 as well, without a GPU.

Triton's interpreter runs a kernel's Python, and it accepts programs the compiler refuses:
a plain (not ``tl.constexpr``) module global read inside a kernel, Python the compiler has
no translation for, a tile whose pipeline stages need more shared memory than an SM has. A
kernel that only ever ran on the CPU machine can pass every test and still fail on the
first GPU. With ``LABKIT_COMPILE_CHECK=1`` (``make test`` sets it), every interpreted
launch is first compiled for ``sm_90`` with the same arguments, constexprs and launch
options, through Triton's real compiler and ``ptxas`` (both ship in the triton wheel and
need no GPU), and checked against the H200's limits. A kernel that does not compile, or
does not fit, raises :class:`KernelCompileError` from the launch.

Each distinct specialisation compiles once per process (Triton's own cache makes repeats
across processes cheap). Under the interpreter ``triton.jit`` made interpreted functions,
the compiler wants ``JITFunction`` objects, so each kernel is compiled through a mirror: the
same code over a copy of its globals in which every interpreted function, its own helpers
and ``triton.language``'s, is a ``JITFunction`` again.
"""

from __future__ import annotations

import contextlib
import types

from triton.backends.compiler import GPUTarget
from triton.runtime import interpreter
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# The book's GPU: an H200 is compute capability 9.0, 32 lanes a warp.
TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_MEMORY = 227 * 1024  # bytes a program may opt in to on sm_90
MAX_THREADS = 1024


class KernelCompileError(RuntimeError):
    """A kernel the interpreter ran does not compile for, or does not fit, the H200."""


class _CompileOnlyDriver:
    """As much of a driver as ``JITFunction.warmup`` asks for: a target, a device, a stream.

    Warmup compiles and returns before any launch, so nothing here touches a GPU.
    """

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


_mirrors: dict[interpreter.InterpretedFunction, JITFunction] = {}
# id(a module's globals) -> (those globals, their mirrored copy). Holding the original keeps
# its id from being reused by a later module's globals.
_scopes: dict[int, tuple[dict, dict]] = {}


def _mirror(function: interpreter.InterpretedFunction) -> JITFunction:
    """The JIT twin of ``function``: its code over the mirrored copy of its module's globals."""
    if function not in _mirrors:
        fn = function.fn
        original = fn.__globals__
        scope = _scopes.setdefault(id(original), (original, {}))[1]  # filled by _sync_scopes
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
        copy.__annotations__, copy.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
        _mirrors[function] = JITFunction(copy, **function.kwargs)
    return _mirrors[function]


def _sync_scopes() -> None:
    """Give each mirrored scope its module's globals as they are now, interpreted functions
    mirrored (a notebook cell may have redefined a helper since the last launch)."""
    done: set[int] = set()
    while len(done) < len(_scopes):  # mirroring a function may add its module's scope
        for key, (original, scope) in list(_scopes.items()):
            if key not in done:
                done.add(key)
                for name, value in list(original.items()):
                    scope[name] = _mirror(value) if isinstance(value, interpreter.InterpretedFunction) else value


def _language_objects() -> list[object]:
    """What the interpreter patches when it runs a kernel: ``triton.language``'s namespaces."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.standard, tl.core.tensor, tl.core.tensor_descriptor_base]


# ``triton.language`` as it was before anything was interpreted. The interpreter swaps its
# builtins for NumPy-backed ones while a kernel runs, and (triton 3.9) a helper called from
# a kernel leaves its swaps in place, so the compiler must be handed these originals.
_pristine: list[tuple[object, dict]] = []


_ABSENT = object()


def _compiler_view() -> list[tuple[object, str, object]]:
    """(owner, name, value) that give ``triton.language`` back to the compiler, where it differs now.

    That is the pristine namespace with every interpreted function (reached as ``tl.max``,
    or as a tensor method ``x.max()`` through a wrapper that holds the function) replaced by
    its JIT mirror.
    """
    view = []
    for owner, original in _pristine:
        current = dict(vars(owner))
        for name in original.keys() | current.keys():
            value = original.get(name, _ABSENT)
            held = [c.cell_contents for c in getattr(value, "__closure__", None) or ()]
            if len(held) == 1 and isinstance(held[0], interpreter.InterpretedFunction):
                value = _mirror(held[0])
            elif isinstance(value, interpreter.InterpretedFunction):
                value = _mirror(value)
            if value is not current.get(name, _ABSENT):
                view.append((owner, name, value))
    return view


def _apply(state: list[tuple[object, str, object]]) -> None:
    for owner, name, value in state:
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


@contextlib.contextmanager
def _compiling():
    compiler_view = _compiler_view()
    interpreter_view = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in compiler_view]
    previous_driver = driver._active  # None until a driver is first asked for; restored as it was
    try:
        _apply(compiler_view)
        driver.set_active(_CompileOnlyDriver())
        yield
    finally:
        driver._active = previous_driver
        _apply(interpreter_view)


def compile_launch(function: interpreter.InterpretedFunction, args: tuple, kwargs: dict):
    """Compile one launch of ``function`` for :data:`TARGET`; return Triton's compiled kernel."""
    name = function.fn.__name__
    options = dict(kwargs)
    # FMA contraction, as triton 3.6 on the H200 does by default (3.9 warns until it is named).
    options.setdefault("enable_fp_fusion", True)
    try:
        with _compiling():
            mirror = _mirror(function)
            _sync_scopes()
            kernel = mirror.warmup(*args, grid=(1,), **options)
    except Exception as e:  # the compiler's errors carry the kernel source and the position
        raise KernelCompileError(f"{name} does not compile for sm_90 (the H200): {type(e).__name__}: {e}") from e
    shared, threads = kernel.metadata.shared, kernel.metadata.num_warps * TARGET.warp_size
    if shared > MAX_SHARED_MEMORY:
        raise KernelCompileError(f"{name} needs {shared} bytes of shared memory on sm_90; an H200 program "
                                 f"has at most {MAX_SHARED_MEMORY} (fewer stages or a smaller tile fit)")
    if threads > MAX_THREADS:
        raise KernelCompileError(f"{name} asks for {threads} threads a program; sm_90 allows {MAX_THREADS}")
    return kernel


def snapshot() -> None:
    """Remember ``triton.language`` before anything is interpreted (idempotent), so that
    :func:`compile_launch` can compile on demand (a chapter showing a kernel's PTX) even
    where launches are not checked. ``labkit.backend`` calls it on import on a CPU."""
    if not _pristine:
        _pristine.extend((owner, dict(vars(owner))) for owner in _language_objects())


def install() -> None:
    """Compile each interpreted launch for the H200 before interpreting it (idempotent)."""
    run = interpreter.InterpretedFunction.run
    if getattr(run, "_labkit_compile_check", False):
        return
    snapshot()

    def checked_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            compile_launch(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    checked_run._labkit_compile_check = True  # type: ignore[attr-defined]
    interpreter.InterpretedFunction.run = checked_run
