"""The grader's wire format: values sent to and from the sandboxed submission.

The sandbox runs code we do not trust, so nothing it sends back may execute anything in
the grader: no pickle, no ``torch.load``. A frame is a JSON header plus raw tensor bytes;
the decoder accepts only JSON scalars, lists, dicts with string keys, and tensors whose
dtype is on a short list and whose byte count matches their shape. Anything else is an
error, which the grader reports as a failed test, never as a pass.
"""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time

import torch

MAX_FRAME_BYTES = 1 << 31
_LENGTH = struct.Struct("<Q")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
    """A frame that does not follow the format (truncated, oversized, or ill-typed)."""


def dtype_of(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"unsupported dtype {name!r}")
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise WireError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
    return _NAMES[dtype]


def _encode(value: object, blobs: list[bytes]) -> object:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no NaN/inf; keep them exact as tagged strings.
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        dtype = name_of(value.dtype)
        # A fresh dense copy: .contiguous() keeps odd strides of size-1 dims, and views,
        # conjugate or negative bits and subclasses must all arrive as plain values.
        t = torch.empty(tuple(value.shape), dtype=value.dtype)
        if t.numel():
            t.copy_(value.detach().resolve_conj().resolve_neg())
        blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {"__tensor__": len(blobs) - 1, "dtype": dtype, "shape": list(t.shape)}
    if isinstance(value, (list, tuple)):
        return {"__seq__": type(value).__name__, "items": [_encode(v, blobs) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: _encode(v, blobs) for k, v in value.items()}}
    raise WireError(f"cannot send a value of type {type(value).__name__}")


def _decode(obj: object, blobs: list[bytes]) -> object:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if not isinstance(obj, dict):
        raise WireError(f"unexpected JSON value of type {type(obj).__name__}")
    if "__float__" in obj:
        text = obj["__float__"]
        if text not in ("nan", "inf", "-inf"):
            raise WireError(f"bad float {text!r}")
        return float(text)
    if "__tensor__" in obj:
        index, shape = obj["__tensor__"], obj.get("shape")
        dtype = dtype_of(obj.get("dtype"))
        if not isinstance(index, int) or not 0 <= index < len(blobs):
            raise WireError("tensor refers to a missing blob")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WireError(f"bad tensor shape {shape!r}")
        data = blobs[index]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(data) != math.prod(shape) * itemsize:
            raise WireError(f"tensor of shape {shape} {obj['dtype']} has {len(data)} bytes")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    if "__seq__" in obj:
        items = [_decode(v, blobs) for v in obj.get("items", [])]
        return tuple(items) if obj["__seq__"] == "tuple" else items
    if "__dict__" in obj and isinstance(obj["__dict__"], dict):
        return {str(k): _decode(v, blobs) for k, v in obj["__dict__"].items()}
    raise WireError(f"unexpected object with keys {sorted(obj)[:5]}")


def pack(message: dict) -> bytes:
    """One frame: length, JSON header (with blob sizes), then the blobs."""
    blobs: list[bytes] = []
    body = _encode(message, blobs)
    header = json.dumps({"body": body, "blobs": [len(b) for b in blobs]}).encode()
    payload = _LENGTH.pack(len(header)) + header + b"".join(blobs)
    return _LENGTH.pack(len(payload)) + payload


def unpack(payload: bytes) -> dict:
    if len(payload) < _LENGTH.size:
        raise WireError("frame too short")
    (header_len,) = _LENGTH.unpack_from(payload)
    end = _LENGTH.size + header_len
    if end > len(payload):
        raise WireError("frame header overruns the frame")
    try:
        header = json.loads(payload[_LENGTH.size:end])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame header is not JSON: {e}") from None
    sizes = header.get("blobs") if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise WireError("frame header has no blob table")
    if end + sum(sizes) != len(payload):
        raise WireError("frame blobs do not add up to the frame length")
    blobs, offset = [], end
    for size in sizes:
        blobs.append(payload[offset:offset + size])
        offset += size
    message = _decode(header.get("body"), blobs)
    if not isinstance(message, dict):
        raise WireError("a frame must carry a dict")
    return message


def read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes:
    """Read ``n`` bytes; raise ``TimeoutError`` past ``deadline`` (a ``time.monotonic()``)."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError("no answer before the deadline")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send(fd: int, message: dict) -> None:
    data = pack(message)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def receive(fd: int, deadline: float | None = None) -> dict:
    (length,) = _LENGTH.unpack(read_exactly(fd, _LENGTH.size, deadline))
    if length > MAX_FRAME_BYTES:
        raise WireError(f"frame of {length} bytes exceeds the limit")
    return unpack(read_exactly(fd, length, deadline))
