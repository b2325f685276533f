"""labkit.native: the custom op against the fused kernels and float64, opcheck, torch.compile
without graph breaks, the C++ library built against TVM FFI and against libtorch, what each
built library depends on, and DLPack read field by field. Mirrors src/labkit/native/."""

import os

import numpy as np
import pytest
import torch
from labkit import backend, check
from labkit.fused import reference
from labkit.native import build, dlpack, ops

DEV = backend.device()
SHAPES = [(1, 8), (37, 80), (5, 3, 200)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_custom_op_matches_float64_forward_and_backward(shape, dtype):
    x = check.randn(*shape, dtype=dtype, device=DEV, seed=1).requires_grad_()
    w = check.randn(shape[-1], dtype=dtype, device=DEV, seed=2).requires_grad_()
    y = ops.rms_norm(x, w, 1e-5)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = reference.rms_norm_reference(x64, w64, 1e-5)
    check.assert_close(y, y64, dtype=dtype, name="y")
    dy = check.randn(*shape, dtype=dtype, device=DEV, seed=3)
    for got, want, name in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(y64, (x64, w64), dy.double()),
                               ("dx", "dw")):
        check.assert_close(got, want, dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_passes_on_both_ops(dtype):
    report = ops.check_ops(check.randn(6, 40, dtype=dtype, device=DEV, seed=4),
                           check.randn(40, dtype=dtype, device=DEV, seed=5))
    assert len(report) == 8 and all(v == "SUCCESS" for v in report.values()), report


def test_fake_kernel_gives_shapes_without_computing():
    with torch.device("meta"):
        y, rstd = ops.rms_norm_forward(torch.empty(3, 5, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16),
                                       1e-6)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == ((3, 5, 64), torch.bfloat16, (15,), torch.float32)


def block(x, w):
    return ops.rms_norm(torch.nn.functional.silu(x) * 2.0, w) + x


def test_compiles_with_fullgraph_and_no_graph_break():
    x = check.randn(9, 48, device=DEV, seed=6)
    w = check.randn(48, device=DEV, seed=7)
    explained = torch._dynamo.explain(block)(x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled(xg, wg).sum().backward()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    block(xe, we).sum().backward()
    check.assert_close(compiled(x, w), block(x, w), dtype=torch.float32, name="compiled forward")
    check.assert_close(xg.grad, xe.grad, dtype=torch.float32, name="compiled dx")
    check.assert_close(wg.grad, we.grad, dtype=torch.float32, name="compiled dw")


def test_compiles_with_inductor():
    x = check.randn(4, 32, device=DEV, seed=8)
    w = check.randn(32, device=DEV, seed=9)
    torch._dynamo.reset()
    environment = dict(os.environ)
    try:
        compiled = torch.compile(block, fullgraph=True)(x, w)
    finally:  # Inductor sets TRITON_ variables of its own on a GPU; the next tests must not inherit them
        os.environ.clear()
        os.environ.update(environment)
    check.assert_close(compiled, block(x, w), dtype=torch.float32, name="inductor")


def test_custom_op_rejects_bad_input():
    x = check.randn(4, 16, device=DEV, seed=10)
    with pytest.raises(TypeError, match="weight"):
        ops.rms_norm(x, torch.ones(16, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="last dimension"):
        ops.rms_norm(x, torch.ones(15, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(check.randn(16, 4, device=DEV, seed=11).t(), torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, torch.ones(16, device=DEV), eps=0.0)


@pytest.fixture(scope="module")
def ffi_cpu():
    return build.build_ffi("cpu")


@pytest.mark.parametrize("shape", [(1, 8), (37, 80), (3, 1000)])
def test_ffi_library_matches_float64_from_torch_and_numpy(ffi_cpu, shape):
    x = check.randn(*shape, seed=12)
    w = check.randn(shape[-1], seed=13)
    expected = reference.rms_norm_reference(x.double(), w.double(), 1e-6)
    out = torch.empty_like(x)
    ffi_cpu.module.rms_norm(x, w, out, 1e-6)
    check.assert_close(out, expected, dtype=torch.float32, name="from torch")
    x_np, w_np = x.numpy().copy(), w.numpy().copy()
    out_np = np.zeros_like(x_np)
    ffi_cpu.module.rms_norm(x_np, w_np, out_np, 1e-6)  # written in place: NumPy's own memory
    check.assert_close(torch.from_numpy(out_np), expected, dtype=torch.float32, name="from NumPy")


def test_ffi_library_checks_its_arguments(ffi_cpu):
    x, w = check.randn(4, 16, seed=14), check.randn(16, seed=15)
    for bad, message in (((x.double(), w, torch.empty_like(x)), "float32"),
                         ((x, w[:15].contiguous(), torch.empty_like(x)), "weight must have shape"),
                         ((x, w, torch.empty(4, 15)), "out must have x's shape"),
                         ((check.randn(16, 4, seed=16).t(), w, torch.empty(16, 4).t()), "contiguous"),
                         ((x[0], w, torch.empty(16)), "2-D")):
        with pytest.raises(RuntimeError, match=message):
            ffi_cpu.module.rms_norm(*bad, 1e-6)


def test_ffi_library_needs_no_torch(ffi_cpu):
    needed = build.needed_libraries(ffi_cpu.path)
    assert any(n.startswith("libtvm_ffi") for n in needed), needed
    assert not any("torch" in n or "c10" in n for n in needed), needed
    assert build.torch_symbols(ffi_cpu.path) == []


def test_torch_extension_builds_and_is_tied_to_libtorch():
    # Compiling torch's headers takes about a minute: the one slow test of this module.
    built = build.build_torch_extension("cpu")
    x, w = check.randn(5, 72, seed=17), check.randn(72, seed=18)
    out = torch.empty_like(x)
    built.module.rms_norm(x, w, out, 1e-6)
    check.assert_close(out, reference.rms_norm_reference(x.double(), w.double(), 1e-6), dtype=torch.float32,
                       name="torch extension")
    with pytest.raises(RuntimeError, match="float32"):
        built.module.rms_norm(x.double(), w, out, 1e-6)
    needed = build.needed_libraries(built.path)
    assert "libc10.so" in needed and any(n.startswith("libtorch") for n in needed), needed
    assert build.torch_symbols(built.path), "a libtorch extension calls c10/at symbols"


def test_build_rejects_unknown_device():
    with pytest.raises(ValueError, match="device"):
        build.build_ffi("tpu")
    with pytest.raises(ValueError, match="device"):
        build.build_torch_extension("rocm")


def test_dlpack_fields_of_torch_and_numpy_arrays():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    d = dlpack.describe(t)
    assert (d["device"], d["dtype"], d["shape"], d["address"]) == ("CPU", "float32", [4, 6], t.data_ptr())
    assert d["strides"] in (None, [6, 1])
    view = t[1:, 2:5]
    dv = dlpack.describe(view)
    assert dv["shape"] == [3, 3] and dv["strides"] == [6, 1] and dv["address"] == view.data_ptr()
    assert dlpack.describe(t.to(torch.bfloat16))["dtype"] == "bfloat16"
    assert dlpack.describe(np.zeros((2, 3), dtype=np.int16))["dtype"] == "int16"
    assert dlpack.describe(torch.zeros(3, dtype=torch.bool))["dtype"] == "bool8"


def test_dlpack_exchange_is_zero_copy():
    t = torch.zeros(3, 5)
    a = np.from_dlpack(t)
    assert dlpack.same_memory(a, t)
    a[1, 2] = 7.0
    assert t[1, 2] == 7.0
    assert not dlpack.same_memory(t, t.clone())
    assert not dlpack.same_memory(t, t[1:])


def test_dlpack_rejects_non_producers():
    with pytest.raises(TypeError, match="__dlpack__"):
        dlpack.describe([1, 2, 3])
