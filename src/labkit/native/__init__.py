"""Shipping a kernel beyond a notebook: chapter "Native kernels".

>>> y = rms_norm(x, weight)                 # labkit::rms_norm, a torch.library custom op
>>> check_ops(x, weight)                     # torch.library.opcheck on it and its backward
>>> built = build_ffi("cpu")                 # the same RMSNorm in C++, against TVM FFI
>>> built.module.rms_norm(x, w, out, 1e-6)   # callable with torch, NumPy, CuPy... arrays
>>> describe(x)                              # the DLTensor that x.__dlpack__() exports

:mod:`labkit.native.ops` holds the custom ops, :mod:`labkit.native.sources` the C++/CUDA
text, :mod:`labkit.native.build` the two toolchains (TVM FFI and libtorch extensions)
and the readers of what a built library depends on, :mod:`labkit.native.dlpack` the
DLPack reader, :mod:`labkit.native.bench` the GPU measurements.
"""

from __future__ import annotations

from .build import (Built, build_ffi, build_torch_extension, needed_libraries, symbol_origins, torch_symbols,
                    undefined_symbols)
from .dlpack import describe, same_memory
from .ops import check_ops, rms_norm

__all__ = ["Built", "build_ffi", "build_torch_extension", "check_ops", "describe", "needed_libraries", "rms_norm",
           "same_memory", "symbol_origins", "torch_symbols", "undefined_symbols"]
