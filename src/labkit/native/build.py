"""Build the RMSNorm library two ways, and read what each built library depends on.

:func:`build_ffi` compiles it against TVM FFI (``tvm_ffi.cpp.load_inline``), a few seconds
of g++ on the CPU; :func:`build_torch_extension` against libtorch
(``torch.utils.cpp_extension.load_inline``), which compiles torch's headers and takes
about a minute. Both cache the build by a hash of its sources and flags, so a second call
only loads the library. :func:`needed_libraries` and :func:`undefined_symbols` read the
built file with binutils, which shows the difference the bindings make: what the dynamic
loader must find, and which of torch's C++ symbols the library calls by their mangled
names (the names change whenever torch's C++ API does: that is the ABI tie).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import sources

BUILD_ROOT = Path(os.environ.get("LABKIT_NATIVE_BUILD", Path(tempfile.gettempdir()) / "labkit-native"))


@dataclass
class Built:
    """A built library: the loaded module, its file, and how long the call took."""

    module: Any
    path: Path
    seconds: float


def _newest_library(folder: Path) -> Path:
    libraries = sorted(folder.rglob("*.so"), key=lambda p: p.stat().st_mtime)
    if not libraries:
        raise FileNotFoundError(f"no shared library was built under {folder}")
    return libraries[-1]


def build_ffi(device: str = "cpu") -> Built:
    """The TVM FFI library for ``device`` ("cpu": g++; "cuda": nvcc), exporting ``rms_norm(x, weight, out, eps)``."""
    import tvm_ffi.cpp

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    folder = BUILD_ROOT / f"ffi-{device}"
    start = time.perf_counter()
    if device == "cpu":
        module = tvm_ffi.cpp.load_inline("labkit_rms_norm_cpu", functions="rms_norm", build_directory=str(folder),
                                         cpp_sources=sources.FFI_BINDING + sources.ROW_KERNELS_CPU + sources.FFI_CPU_ENTRY)
    else:
        module = tvm_ffi.cpp.load_inline("labkit_rms_norm_cuda", functions="rms_norm", build_directory=str(folder),
                                         cuda_sources=sources.FFI_BINDING + sources.ROW_KERNELS_CUDA
                                         + sources.FFI_CUDA_ENTRY)
    return Built(module, _newest_library(folder), time.perf_counter() - start)


def build_torch_extension(device: str = "cpu") -> Built:
    """The libtorch extension for ``device``, exporting ``rms_norm(x, weight, out, eps)``."""
    from torch.utils import cpp_extension

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    folder = BUILD_ROOT / f"torch-{device}"
    folder.mkdir(parents=True, exist_ok=True)
    declaration = "void rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor out, double eps);\n"
    start = time.perf_counter()
    if device == "cpu":
        module = cpp_extension.load_inline(
            "labkit_rms_norm_torch_cpu", functions=["rms_norm"], build_directory=str(folder),
            cpp_sources=sources.TORCH_BINDING + sources.ROW_KERNELS_CPU + sources.TORCH_CPU_ENTRY)
    else:
        module = cpp_extension.load_inline(
            "labkit_rms_norm_torch_cuda", functions=["rms_norm"], build_directory=str(folder),
            cpp_sources="#include <torch/extension.h>\n" + declaration,
            cuda_sources=sources.TORCH_BINDING + sources.ROW_KERNELS_CUDA + sources.TORCH_CUDA_ENTRY)
    return Built(module, _newest_library(folder), time.perf_counter() - start)

# Where an undefined symbol of a built library is expected to come from, by its demangled name.
# (A name may start with a return type: "float* at::TensorBase::data_ptr<float>() const".)
_LIBTORCH = re.compile(r"(?:^|[\s*&(<,])(c10|at|torch|caffe2)::")
_ORIGINS = (
    ("libtorch (c10, ATen, torch)", _LIBTORCH),
    ("TVM FFI", re.compile(r"(?:^|[\s*&(<,])(TVMFFI|tvm::ffi::)")),
    ("Python and pybind11", re.compile(r"^(Py|_Py|pybind11::)")),
    ("CUDA runtime", re.compile(r"^(cuda|__cuda)")),
    ("C++ runtime", re.compile(r"^(std::|__cxa|__gxx|__dynamic_cast|_Unwind|operator (new|delete)|vtable for|typeinfo for)")),
)


def needed_libraries(path: Path | str) -> list[str]:
    """The shared libraries the dynamic loader must find for ``path`` (its ELF ``NEEDED`` entries)."""
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)


def undefined_symbols(path: Path | str, *, demangle: bool = True) -> list[str]:
    """The dynamic symbols ``path`` uses and does not define: what it calls in other libraries."""
    args = ["nm", "-D", "--undefined-only"] + (["--demangle"] if demangle else []) + [str(path)]
    listing = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [line.split(None, 1)[1] for line in listing.splitlines() if line.strip()]


def torch_symbols(path: Path | str) -> list[str]:
    """The undefined symbols of ``path`` that live in libtorch's C++ namespaces (c10::, at::, torch::)."""
    return [s for s in undefined_symbols(path) if _LIBTORCH.search(s)]



def symbol_origins(path: Path | str) -> dict[str, int]:
    """How many of ``path``'s undefined symbols each library provides (by name; the rest are the C library's)."""
    counts = {name: 0 for name, _ in _ORIGINS} | {"C library and the rest": 0}
    for symbol in undefined_symbols(path):
        origin = next((name for name, pattern in _ORIGINS if pattern.search(symbol)), "C library and the rest")
        counts[origin] += 1
    return counts
