"""Where the book's code runs: on a CUDA GPU, or on the CPU through Triton's interpreter.

The same ``@triton.jit`` kernels serve both modes. Without a GPU, Triton must be told to
interpret kernels *before* it is first imported (it reads ``TRITON_INTERPRET`` when a
kernel is decorated), so this module is the first thing ``labkit`` imports.

``LABKIT_MODE=cpu`` forces the interpreter on a GPU machine (useful to check what CI
will see); ``LABKIT_MODE=gpu`` makes a missing GPU an error instead of a fallback.
``LABKIT_COMPILE_CHECK=1`` also compiles every interpreted launch for the H200
(:mod:`labkit.compile_check`), so the CPU run catches kernels only the interpreter accepts.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from typing import TypeVar

import torch

T = TypeVar("T")

_requested = os.environ.get("LABKIT_MODE", "").strip().lower()
if _requested not in ("", "cpu", "gpu"):
    raise ValueError(f"LABKIT_MODE must be 'cpu', 'gpu' or unset; got {_requested!r}")
if _requested == "gpu" and not torch.cuda.is_available():
    raise RuntimeError("LABKIT_MODE=gpu but torch sees no CUDA device")

MODE: str = "gpu" if (_requested != "cpu" and torch.cuda.is_available()) else "cpu"
# Interpreted launches are also compiled for the H200 (labkit.compile_check); a GPU compiles anyway.
COMPILE_CHECK: bool = MODE == "cpu" and os.environ.get("LABKIT_COMPILE_CHECK", "").strip() == "1"

if MODE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before labkit without TRITON_INTERPRET=1, and there is no "
            "GPU: kernels would fail to compile. Import labkit first, or set "
            "TRITON_INTERPRET=1 in the environment."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _fix_interpreter_bf16_dot() -> None:
    """Make ``tl.dot`` on bfloat16 operands correct under Triton's interpreter.

    The interpreter keeps bfloat16 values as their raw 16 bits in ``uint16`` arrays, and its
    ``create_dot`` (seen in triton 3.9) hands those to ``np.matmul`` unconverted: a bf16 dot
    multiplies bit patterns and returns numbers near 1e10. Widening each operand to the
    float32 it stands for (bf16 is the top half of a float32) gives the exact products a GPU
    tensor core forms before its fp32 accumulation. Compiled kernels are not affected.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_labkit_bf16_fix", False):
        return

    def widen(handle):
        if handle.dtype == tl.bfloat16:
            bits = np.asarray(handle.data, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._labkit_bf16_fix = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _fix_interpreter_bf16_rounding() -> None:
    """Make float32 -> bfloat16 casts round to nearest even under Triton's interpreter.

    Compiled kernels round (LLVM ``fptrunc``); the interpreter's ``cast_impl`` (seen in
    triton 3.9) drops the low 16 bits instead, which doubles the rounding error of every bf16
    result and makes a correct kernel look worse on the CPU than on the GPU. This rounds the
    way the GPU does (NaN stays NaN). Compiled kernels are not affected.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or getattr(original, "_labkit_bf16_fix", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = np.asarray(src.data, dtype=np.float32)
            bits = f32.view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._labkit_bf16_fix = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl


def _fix_interpreter_scalar_index() -> None:
    """Let a program id (or any one-element tensor) bound a ``range`` under Triton 3.6's interpreter.

    The interpreter keeps ``tl.program_id`` as a one-element array of shape ``(1,)``, and
    3.6 converts a loop bound with ``int(array)``, which NumPy refuses for anything but a
    0-d array: ``for tile in tl.range(tl.program_id(0), n, step)`` fails with "only
    0-dimensional arrays can be converted to Python scalars". Triton 3.9 squeezes first;
    this does the same on versions that do not. Compiled kernels are not affected.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_labkit_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._labkit_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_language_once_per_launch() -> None:
    """Stop Triton's interpreter re-patching ``triton.language`` at every helper call.

    A launch swaps ``triton.language``'s builtins for NumPy-backed ones (``_patch_lang``),
    and (triton 3.6) so does every call of a ``@triton.jit`` helper from inside the kernel,
    once per program and loop iteration: each call scans the modules with
    ``inspect.getmembers`` and finds everything already swapped. That was a fifth of the time
    of a CPU replay of the serving engine (its split-KV decode kernel calls a helper per KV
    tile). Within a launch, a helper that sees no namespace the launch has not already
    swapped now skips the scan; outside a launch, and for any other namespace, the
    interpreter patches as before. Compiled kernels are not affected.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or not hasattr(interpreter, "_LangPatchScope") \
            or getattr(original, "_labkit_once", False):
        return
    swapped: set[int] | None = None  # the namespaces the running launch swapped (None: no launch)

    def patch_lang(fn):
        nonlocal swapped
        namespaces = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if swapped is not None and namespaces and namespaces <= swapped:
            return interpreter._LangPatchScope()  # nothing to swap, so nothing to restore
        scope = original(fn)
        if swapped is not None:
            swapped |= namespaces
        return scope

    launch = executor.__call__

    def call(self, *args, **kwargs):
        nonlocal swapped
        outer, swapped = swapped, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped = outer

    patch_lang._labkit_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    executor.__call__ = call


if MODE == "cpu":
    _patch_language_once_per_launch()
    _fix_interpreter_bf16_dot()
    _fix_interpreter_bf16_rounding()
    _fix_interpreter_scalar_index()
    from . import compile_check

    compile_check.snapshot()  # before any launch: compiling on demand needs the pristine triton.language
    if COMPILE_CHECK:
        compile_check.install()


def on_gpu() -> bool:
    """True when kernels compile for a CUDA device; False under the interpreter."""
    return MODE == "gpu"


def device() -> torch.device:
    """The device the book's tensors live on in this mode."""
    return torch.device("cuda" if on_gpu() else "cpu")


def pick(*, cpu: T, gpu: T) -> T:
    """The one way a chapter chooses a problem size (or any mode-dependent setting).

    >>> n = pick(cpu=1000, gpu=2**28)   # CPU sizes keep the interpreter under a minute
    """
    return gpu if on_gpu() else cpu


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=device())


def allow_device_descriptors() -> None:
    """Let kernels build TMA tensor descriptors on the device (``tl.make_tensor_descriptor``):
    each descriptor lives in global scratch memory that the launch asks Triton's allocator
    for, and this sets that allocator. Call it before such a launch (it is cheap)."""
    import triton

    triton.set_allocator(_descriptor_scratch)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device | None = None, *, interpreter: int = 4) -> int:
    """The streaming multiprocessors of ``device`` (default: the current CUDA device), which is
    how many programs fill the GPU. Under Triton's interpreter (no GPU, or a CPU ``device``)
    ``interpreter`` stands in: a few programs, so that the tests see work split among several."""
    if device is None:
        if not on_gpu():
            return interpreter
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cuda":
        return interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def free_memory() -> None:
    """Collect what Python no longer references and, on a GPU, hand the allocator's cached
    blocks back, so that what one run of a benchmark left behind does not count against the next."""
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()


def describe() -> str:
    """One line that says where this notebook is running, for the top of each chapter."""
    if on_gpu():
        props = torch.cuda.get_device_properties(0)
        return (
            f"GPU mode: {props.name}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB; Triton compiles for the device; "
            f"timings are CUDA-event medians."
        )
    return (
        "CPU mode: no CUDA device, so Triton kernels run in its interpreter "
        "(TRITON_INTERPRET=1) on small sizes. Correctness checks are real; timings are "
        "not performance. Figures of GPU speed show numbers recorded on a GPU."
    )
