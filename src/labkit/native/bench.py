"""Benchmark of chapter ``native-kernels``: one RMSNorm, shipped four ways, called from two frameworks.

``native.interop`` builds the C++/CUDA RMSNorm against TVM FFI and (on a GPU) against
libtorch, and times, in float32 at a launch-bound shape (one row of 1024) and a
bandwidth-bound one: the Triton kernel behind the ``labkit::rms_norm`` custom op, the
same op under ``torch.compile(fullgraph=True)``, the libtorch extension, the TVM FFI
library called with torch tensors and (where CuPy is installed) with CuPy arrays, and
eager torch. Every output is checked against float64 first, and every TVM FFI call
writes into an array the *calling* framework allocated, read back through that framework
and through DLPack at the same address: that is the zero-copy check. Beside the times it
records what each built library asks the dynamic loader for, and how many of libtorch's
C++ symbols it calls.
"""

from __future__ import annotations

import torch

from .. import backend, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from ..fused import reference
from . import build, dlpack, ops

CHAPTER = "native-kernels"
SHAPES = backend.pick(cpu=[(1, 64), (16, 256)], gpu=[(1, 1024), (16384, 4096)])
EPS = 1e-6


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy if backend.on_gpu() else None


def _into(out, library, *args):
    """Call a library's ``rms_norm(x, weight, out, eps)``, which writes ``out`` and returns nothing."""
    library.module.rms_norm(*args, out, EPS)
    return out


@benchmark("native.interop", chapter=CHAPTER,
           title="RMSNorm as a custom op, a libtorch extension and a TVM FFI library, called from torch and CuPy")
def bench_interop() -> Measurement:
    device = "cuda" if backend.on_gpu() else "cpu"
    libraries = {"TVM FFI": build.build_ffi(device)}
    if backend.on_gpu():  # a libtorch build compiles torch's headers: about a minute, so only where it runs for real
        libraries["libtorch extension"] = build.build_torch_extension(device)
    cupy = _cupy()
    compiled = torch.compile(ops.rms_norm, fullgraph=True)
    rows, zero_copy = [], {}
    for n_rows, n_cols in SHAPES:
        x = check.randn(n_rows, n_cols, device=backend.device(), seed=1)
        w = check.randn(n_cols, device=backend.device(), seed=2)
        expected = reference.rms_norm_reference(x.double(), w.double(), EPS)
        out = torch.empty_like(x)
        calls = {
            "custom op labkit::rms_norm (Triton)": lambda: ops.rms_norm(x, w, EPS),
            "custom op under torch.compile(fullgraph=True)": lambda: compiled(x, w, EPS),
            "TVM FFI, torch tensors": lambda: _into(out, libraries["TVM FFI"], x, w),
            "eager torch": lambda: reference.rms_norm_reference(x, w, EPS),
        }
        if "libtorch extension" in libraries:
            calls["libtorch extension"] = lambda: _into(out, libraries["libtorch extension"], x, w)
        if cupy is not None:
            x_cp, w_cp = cupy.from_dlpack(x), cupy.from_dlpack(w)
            out_cp = cupy.empty_like(x_cp)
            calls["TVM FFI, CuPy arrays"] = lambda: _into(out_cp, libraries["TVM FFI"], x_cp, w_cp)
        bytes_moved = (2 * x.numel() + w.numel()) * x.element_size()
        for impl, call in calls.items():
            result = torch.from_dlpack(call())
            check.assert_close(result, expected, dtype=torch.float32, name=f"{impl} at {n_rows}x{n_cols}")
            t = timing.measure(call)
            rows.append({"impl": impl, "rows": n_rows, "cols": n_cols, "us": t.median_ms * 1e3,
                         "tbps": bytes_moved / (t.median_ms * 1e-3) / 1e12})
        # Zero copy: the library wrote into memory the caller allocated, visible through DLPack at one address.
        zero_copy[f"torch out {n_rows}x{n_cols}"] = dlpack.same_memory(out, torch.from_dlpack(out))
        if cupy is not None:
            zero_copy[f"cupy out {n_rows}x{n_cols}"] = (dlpack.same_memory(out_cp, torch.from_dlpack(out_cp))
                                                        and torch.from_dlpack(out_cp).data_ptr() == out_cp.data.ptr)
    eager = {(r["rows"], r["cols"]): r["us"] for r in rows if r["impl"] == "eager torch"}
    for r in rows:
        r["eager/impl"] = eager[r["rows"], r["cols"]] / r["us"]
    opcheck = ops.check_ops(check.randn(7, 96, device=backend.device(), seed=3),
                            check.randn(96, device=backend.device(), seed=4))
    return Measurement(
        rows=rows, metric="us per call (median); TB/s of x read + out written + weight; eager/impl > 1 is faster",
        # The compiled op's output was checked against float64 above: reaching here means it matched.
        goals=[Goal("torch.library.opcheck tests passed, forward and backward ops", sum(v == "SUCCESS" for v in
                                                                                        opcheck.values()),
                    ">=", len(opcheck))],
        config={
            "dtype": "float32", "eps": EPS, "zero_copy": zero_copy, "cupy": cupy.__version__ if cupy else None,
            "libraries": {name: {"needed": build.needed_libraries(b.path), "symbol_origins": build.symbol_origins(b.path),
                                 "build_seconds": b.seconds, "file": b.path.name}
                          for name, b in libraries.items()},
            "opcheck": {test: str(result) for test, result in opcheck.items()},
        },
    )
