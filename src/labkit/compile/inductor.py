"""Read what Inductor wrote: the wrapper, its kernels, and the buffers the wrapper allocates.

Inductor's output for one graph is one Python module (the *wrapper*). Its ``call(args)``
allocates buffers, launches kernels in the scheduler's order, calls extern kernels
(cuBLAS, oneDNN) for matmuls, frees (``del``) each buffer after its last use and hands a
dead buffer's memory to a new one (``# reuse``). The kernels are defined above it: Triton
source in ``async_compile.triton(...)`` on a GPU, C++ in ``async_compile.cpp_pybinding(...)``
on the CPU. Kernel names say what was fused: ``triton_poi_fused_add_mul_0`` is a pointwise
kernel holding an add and a mul; ``red`` a reduction over a loop, ``per`` a *persistent*
reduction whose whole row fits in one program's registers.
"""

from __future__ import annotations

import re
import textwrap
import types
from collections.abc import Callable
from contextlib import contextmanager
from unittest import mock
from dataclasses import dataclass

import torch

# A kernel definition: ``name = async_compile.triton('name', '''source''', ...)`` or
# ``name = async_compile.cpp_pybinding([...], r'''source''')``.
_KERNEL = re.compile(r"^(\w+) = async_compile\.(triton|cpp_pybinding|cpp)\((.*?)'''(.*?)'''", re.S | re.M)
_ALLOC = re.compile(r"^\s*(buf\d+) = empty_strided\w*\(\(([^)]*)\)")
# ``buf3 = buf0; del buf0  # reuse`` or ``buf4 = reinterpret_tensor(buf2, ...); del buf2  # reuse``
_REUSE = re.compile(r"^\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b[^;]*; del \2\s*# reuse")
_DEL = re.compile(r"^\s*del ((?:buf\d+, )*buf\d+)\s*$")


@dataclass(frozen=True)
class InductorOutput:
    """The code Inductor generated for one call: each graph's wrapper, and its kernels by name."""

    wrappers: tuple[str, ...]
    kernels: dict[str, str]
    language: str  # "triton" or "c++"

    @property
    def call_code(self) -> str:
        """The (last) wrapper's ``call``: the launch order and the buffer bookkeeping."""
        return call_function(self.wrappers[-1])

    def kernel_kinds(self) -> dict[str, int]:
        """How many kernels of each kind: ``pointwise``, ``reduction``, ``persistent_reduction``, ``cpp``."""
        kinds: dict[str, int] = {}
        for name in self.kernels:
            kind = kernel_kind(name)
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds


def call_function(wrapper: str) -> str:
    """The ``def call(...)`` of a wrapper module, dedented (a module-level function in some
    torch versions, a method of a ``Runner`` class in others)."""
    lines = wrapper.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("def call(")), None)
    if start is None:
        raise ValueError("no 'def call(' in this wrapper")
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])).rstrip()


def kernel_kind(name: str) -> str:
    """The kind of kernel a name says Inductor made (see the module docstring)."""
    for prefix, kind in (("triton_poi_", "pointwise"), ("triton_red_", "reduction"),
                         ("triton_per_", "persistent_reduction"), ("triton_tem_", "template"),
                         ("cpp_", "cpp")):
        if name.startswith(prefix):
            return kind
    return "other"


def parse_wrapper(wrappers: list[str] | tuple[str, ...]) -> InductorOutput:
    """The kernels defined in Inductor wrapper modules."""
    if not isinstance(wrappers, (list, tuple)) or not wrappers or not all(isinstance(w, str) for w in wrappers):
        raise ValueError("wrappers must be a non-empty list of generated source strings")
    kernels: dict[str, str] = {}
    languages = set()
    for wrapper in wrappers:
        for name, kind, _, source in _KERNEL.findall(wrapper):
            kernels[name] = source.strip("\n")
            languages.add("triton" if kind == "triton" else "c++")
    language = languages.pop() if len(languages) == 1 else ("mixed" if languages else "none")
    return InductorOutput(tuple(wrappers), kernels, language)


@contextmanager
def captured_code(*, fresh: bool = True):
    """Collect the wrapper module of every graph Inductor compiles inside the ``with``.

    ``fresh`` bypasses the FX graph cache, so that every graph is generated (and seen)
    rather than loaded from an earlier run; ``fresh=False`` keeps the cache and so sees
    only the graphs it had not compiled before. Nothing else is reset: graphs Dynamo
    compiled earlier stay compiled.
    """
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    wrappers: list[str] = []

    def save_output_code(code: str) -> None:
        if code not in wrappers:
            wrappers.append(code)

    with mock.patch.object(GraphLowering, "save_output_code", save_output_code), \
            config.patch(fx_graph_cache=not fresh):
        yield wrappers


def fresh_function(fn: Callable) -> Callable:
    """A function that calls ``fn``, with a code object of its own.

    Dynamo caches what it compiled on the code object of the frame it traced, and reuses it
    when the guards pass: a second ``torch.compile`` of the same function (or of another
    closure made by the same ``def``) can silently get the first one's graph. Compiling a
    fresh function compiles anew, without ``torch._dynamo.reset()``, which would also throw
    away every other compiled function's graphs.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, getattr(fn, "__name__", "call"), None,
                              call.__closure__)


def generated_code(fn: Callable, *args, **compile_options) -> tuple[object, InductorOutput]:
    """Compile ``fn`` with Inductor, call it on ``args``; its result and the code generated.

    ``compile_options`` go to ``torch.compile`` (``dynamic=True``, ``mode=...``).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    with captured_code() as wrappers:
        result = torch.compile(fresh_function(fn), **compile_options)(*args)
    if not wrappers:
        raise RuntimeError("nothing was compiled: Dynamo reused a graph it had compiled before for this "
                           "function and these inputs (torch._dynamo.reset() forgets them)")
    return result, parse_wrapper(wrappers)


@dataclass(frozen=True)
class BufferEvent:
    """One line of the wrapper's memory plan: a buffer allocated, freed, or reusing a dead one."""

    line: int
    action: str  # "alloc", "free", "reuse"
    buffer: str
    detail: str = ""


def buffer_plan(call_code: str) -> list[BufferEvent]:
    """The allocations, frees and reuses in a wrapper's ``call``, in order."""
    if not isinstance(call_code, str):
        raise TypeError(f"call_code must be a str, got {type(call_code).__name__}")
    events: list[BufferEvent] = []
    for i, line in enumerate(call_code.splitlines()):
        if m := _REUSE.match(line):
            events.append(BufferEvent(i, "reuse", m.group(1), m.group(2)))
        elif m := _ALLOC.match(line):
            events.append(BufferEvent(i, "alloc", m.group(1), m.group(2)))
        elif m := _DEL.match(line):
            events.extend(BufferEvent(i, "free", b) for b in m.group(1).split(", "))
    return events
