"""Boundary checks for labkit's public functions.

A kernel handed a tensor of the wrong shape, dtype, device or memory layout rarely fails
cleanly: it reads past the end of a buffer, or returns garbage. So every public function
checks its arguments here first and raises an error that says what it expected and what
it was given. ``TypeError`` is for the wrong kind of thing (not a tensor, wrong dtype);
``ValueError`` for the right kind with the wrong value (shape, device, layout, size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

_DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def check_tensor(
    x: object,
    name: str,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
    nonempty: bool = True,
) -> torch.Tensor:
    """Check one tensor argument and return it; raise a clear error otherwise.

    ``device`` compares the device *type* (``cuda`` and ``cuda:0`` agree).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None:
        allowed_dtypes = tuple(dtypes)
        if x.dtype not in allowed_dtypes:
            want = ", ".join(dtype_name(d) for d in allowed_dtypes)
            raise TypeError(f"{name} must have dtype in ({want}), got {dtype_name(x.dtype)}")
    if device is not None:
        want_type = torch.device(device).type
        if x.device.type != want_type:
            raise ValueError(f"{name} must be on {want_type}, got a tensor on {x.device}")
    if contiguous and not x.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major), got strides {tuple(x.stride())} for "
            f"shape {tuple(x.shape)}; call .contiguous() first"
        )
    if nonempty and x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len({d for d in devices.values()}) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device, got {listed}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{n} {s}" for n, s in shapes.items())
        raise ValueError(f"tensors must have the same shape, got {listed}")


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_power_of_two(value: object, name: str) -> int:
    check_positive_int(value, name)
    assert isinstance(value, int)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two (Triton block sizes are), got {value}")
    return value


def check_choice(value: object, name: str, choices: Iterable[object]) -> object:
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def check_cuda_graph_flag(value: object, name: str, device: torch.device) -> bool:
    """Whether to use CUDA graphs for a model on ``device``: ``value`` True or False, or None
    for "whenever the device is a GPU"; True for a model that is not on one is an error."""
    on_cuda = torch.device(device).type == "cuda"
    if value is None:
        return on_cuda
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
    if value and not on_cuda:
        raise ValueError(f"{name}=True needs the model on a CUDA device, it is on {device}")
    return value
