"""DLPack, read field by field: what one framework hands another when it shares a tensor.

``x.__dlpack__()`` returns a ``PyCapsule`` named ``"dltensor"`` around a C struct,
``DLManagedTensor``: a ``DLTensor`` (data pointer, device, dtype, shape, strides, byte
offset) plus the producer's context and a deleter the consumer calls when it is done. A
consumer (``torch.from_dlpack``, ``np.from_dlpack``, CuPy, JAX, TVM FFI) wraps the same
memory; nothing is copied. :func:`describe` opens the capsule with ``ctypes`` and reads
the struct as the consumer would (the layout is DLPack's ``dlpack.h``), without consuming
it: the capsule's own destructor still returns it to the producer.
"""

from __future__ import annotations

import ctypes
from typing import Any

DEVICE_TYPES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm",
                13: "CUDA managed", 14: "oneAPI"}
DTYPE_CODES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool"}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _ManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def describe(array: Any) -> dict[str, Any]:
    """The ``DLTensor`` that ``array.__dlpack__()`` exports (``array``: any DLPack producer).

    ``strides`` is ``None`` where the producer left them out (DLPack's way of saying
    "compact row-major"); ``address`` is the first element's address, ``data + byte_offset``."""
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"expected an array that exports DLPack (with __dlpack__), got {type(array).__name__}")
    capsule = array.__dlpack__()
    if not _is_valid(capsule, b"dltensor"):
        raise TypeError("__dlpack__() did not return an unconsumed 'dltensor' capsule")
    managed = ctypes.cast(_get_pointer(capsule, b"dltensor"), ctypes.POINTER(_ManagedTensor)).contents
    t = managed.dl_tensor
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else None
    return {
        "data": t.data or 0, "byte_offset": t.byte_offset, "address": (t.data or 0) + t.byte_offset,
        "device": DEVICE_TYPES.get(t.device.device_type, f"type {t.device.device_type}"),
        "device_id": t.device.device_id,
        "dtype": f"{DTYPE_CODES.get(t.dtype.code, t.dtype.code)}{t.dtype.bits}"
                 + (f"x{t.dtype.lanes}" if t.dtype.lanes != 1 else ""),
        "shape": shape, "strides": strides,
    }


def same_memory(a: Any, b: Any) -> bool:
    """Whether DLPack producers ``a`` and ``b`` start at the same element of the same device's memory."""
    da, db = describe(a), describe(b)
    return (da["device"], da["device_id"], da["address"]) == (db["device"], db["device_id"], db["address"])
