"""labkit.fused: the four fused ops forward and backward against float64 and against HF's
Qwen3 modules, the model's fused switch, the profile's categories, the benchmarks, and the
errors on bad input. Mirrors src/labkit/fused/."""

import dataclasses
import itertools

import pytest
import torch
from labkit import backend, benchmarks, check, models, sass
from labkit.fused import (DTYPES, add_rms_norm, bench, kernels, profile, qkv_norm_rope, reference, rms_norm, rope_,
                          swiglu, swiglu_halves, tiles)
from labkit.models.decoder import RotaryEmbedding

from test_models import hf_twin, token_ids

DEV = backend.device()
# float64 checks the algebra exactly; fp32 and bf16 check the rounding at the book's tolerances.
CHECKED_DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# Rows x width: widths not a power of two (a ragged last block), a single row, an odd count.
NORM_SHAPES = [(1, 8), (37, 80), (5, 3, 200)]


def _leaf(*shape, dtype, seed, scale=1.0):
    return check.randn(*shape, dtype=dtype, device=DEV, seed=seed, scale=scale).requires_grad_()


def _exact(t):
    return t.detach().double().requires_grad_()


def _grads(outputs, inputs, seed):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cotangents = [check.randn(*o.shape, dtype=o.dtype, device=o.device, seed=seed + i) for i, o in enumerate(outputs)]
    return torch.autograd.grad(outputs, inputs, cotangents)


def _assert_all_close(got, want, dtype, names):
    for g, w, name in zip(got, want, names):
        check.assert_close(g, w, dtype=dtype, name=name)


# --- each op against the float64 reference, forward and backward -------------------------

@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_matches_float64(shape, dtype):
    seed = sum(shape)
    x = _leaf(*shape, dtype=dtype, seed=seed, scale=3.0)  # rms far from 1: the normalisation matters
    w = (1 + 0.2 * check.randn(shape[-1], dtype=dtype, device=DEV, seed=seed + 1)).requires_grad_()
    y = rms_norm(x, w, 1e-6)
    x64, w64 = _exact(x), _exact(w)
    ref = reference.rms_norm_reference(x64, w64, 1e-6)
    check.assert_close(y, ref, dtype=dtype, name="y")
    _assert_all_close(_grads(y, (x, w), seed=7), _grads(ref, (x64, w64), seed=7), dtype, ["dx", "dw"])


@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_add_rms_norm_matches_float64(shape, dtype):
    seed = sum(shape) + 100
    x, r = _leaf(*shape, dtype=dtype, seed=seed), _leaf(*shape, dtype=dtype, seed=seed + 1, scale=2.0)
    w = (1 + 0.2 * check.randn(shape[-1], dtype=dtype, device=DEV, seed=seed + 2)).requires_grad_()
    out = add_rms_norm(x, r, w, 1e-6)
    exact = [_exact(t) for t in (x, r, w)]
    ref = reference.add_rms_norm_reference(*exact, 1e-6)
    _assert_all_close(out, ref, dtype, ["y", "x + residual"])
    _assert_all_close(_grads(out, (x, r, w), seed=9), _grads(ref, tuple(exact), seed=9), dtype,
                      ["dx", "dresidual", "dw"])


def _angles(tokens, head_dim, dtype, theta=10_000.0):
    return RotaryEmbedding(head_dim, theta, device=DEV)(torch.arange(tokens, device=DEV), dtype)


@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 2), (2, 37, 4, 2, 16), (1, 9, 3, 1, 24)], ids=str)
def test_rope_matches_float64(shape, dtype):
    batch, tokens, q_heads, k_heads, head_dim = shape
    seed = sum(shape)
    q = _leaf(batch, tokens, q_heads, head_dim, dtype=dtype, seed=seed)
    k = _leaf(batch, tokens, k_heads, head_dim, dtype=dtype, seed=seed + 1)
    cos, sin = _angles(tokens, head_dim, dtype)
    q_in, k_in = q * 1, k * 1  # rope_ works in place, which autograd allows on non-leaves
    out = rope_(q_in, k_in, cos, sin)
    assert out[0] is q_in and out[1] is k_in  # in place: the same tensors come back
    q64, k64 = _exact(q), _exact(k)
    ref = reference.rope_reference(q64, k64, cos.double(), sin.double())
    _assert_all_close(out, ref, dtype, ["q", "k"])
    _assert_all_close(_grads(out, (q, k), seed=11), _grads(ref, (q64, k64), seed=11), dtype, ["dq", "dk"])


def test_rope_is_a_rotation_by_position():
    """Position 0 is the identity, and the rotation keeps each pair's length (HF's rotate-half pairs i and i + D/2)."""
    q = check.randn(1, 5, 2, 8, dtype=torch.float64, device=DEV, seed=3)
    k = check.randn(1, 5, 1, 8, dtype=torch.float64, device=DEV, seed=4)
    cos, sin = _angles(5, 8, torch.float64)
    q_rot, _ = rope_(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(q_rot[:, 0], q[:, 0])
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(q_rot), pair_norm(q))
    assert not torch.allclose(q_rot[:, 1:], q[:, 1:])


@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (37, 136), (3, 5, 99)], ids=str)
def test_swiglu_matches_float64(shape, dtype):
    seed = sum(shape) + 200
    gate, up = _leaf(*shape, dtype=dtype, seed=seed, scale=3.0), _leaf(*shape, dtype=dtype, seed=seed + 1)
    out = swiglu(gate, up)
    exact = (_exact(gate), _exact(up))
    ref = reference.swiglu_reference(*exact)
    check.assert_close(out, ref, dtype=dtype, name="silu(gate) * up")
    _assert_all_close(_grads(out, (gate, up), seed=13), _grads(ref, exact, seed=13), dtype, ["dgate", "dup"])


# --- the inference ops of the stacked projections -----------------------------------------

def _x(*shape, dtype=torch.float32):
    return check.randn(*shape, dtype=dtype, device=DEV, seed=0)



@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (37, 136), (3, 5, 198)], ids=str)
def test_swiglu_halves_matches_float64_and_the_separate_op(shape, dtype):
    gate_up = check.randn(*shape, dtype=dtype, device=DEV, seed=sum(shape), scale=3.0)
    width = shape[-1] // 2
    out = swiglu_halves(gate_up)
    assert out.shape == (*shape[:-1], width)
    check.assert_close(out, reference.swiglu_halves_reference(gate_up.double()), dtype=dtype, name="swiglu halves")
    # The same kernel reading the halves in place: the very numbers of the contiguous op.
    torch.testing.assert_close(out, swiglu(gate_up[..., :width].contiguous(), gate_up[..., width:].contiguous()),
                               rtol=0, atol=0)


def _qkv_case(tokens, q_heads, kv_heads, head_dim, dtype, seed, row_pad=0):
    """A stacked projection's output (rows padded by ``row_pad`` columns: strided rows), norm
    weights away from one, and angles of scattered positions."""
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = check.randn(tokens, width + row_pad, dtype=dtype, device=DEV, seed=seed, scale=3.0)[:, :width]
    q_w = 1 + 0.3 * check.randn(head_dim, dtype=dtype, device=DEV, seed=seed + 1)
    k_w = 1 + 0.3 * check.randn(head_dim, dtype=dtype, device=DEV, seed=seed + 2)
    positions = torch.randperm(4 * tokens, generator=torch.Generator().manual_seed(seed))[:tokens].to(DEV)
    cos, sin = RotaryEmbedding(head_dim, 10_000.0, device=DEV)(positions, dtype)
    return qkv, q_w, k_w, cos, sin


@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (7, 4, 2, 16), (5, 6, 3, 24)], ids=str)
@pytest.mark.parametrize("slots", [False, True], ids=["rows", "slots"])
def test_qkv_norm_rope_matches_float64(shape, dtype, slots):
    """Queries and keys normed and rotated, values copied, keys and values to their slots only."""
    tokens, q_heads, kv_heads, head_dim = shape
    qkv, q_w, k_w, cos, sin = _qkv_case(*shape, dtype, seed=sum(shape), row_pad=3)
    store_rows = 3 * tokens + 2
    k_out = torch.zeros(store_rows, kv_heads, head_dim, dtype=dtype, device=DEV)
    v_out = torch.zeros_like(k_out)
    slot_mapping = (torch.randperm(store_rows, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEV)
                    if slots else None)
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=dtype, device=DEV)
    got = qkv_norm_rope(qkv, q_w, k_w, 1e-6, cos, sin, q_out=q_out, k_out=k_out, v_out=v_out,
                        slot_mapping=slot_mapping)
    assert got is q_out
    q, k, v = reference.qkv_norm_rope_reference(*(t.double() for t in (qkv, q_w, k_w)), 1e-6, cos.double(),
                                                sin.double(), q_heads, kv_heads)
    rows = slot_mapping if slots else torch.arange(tokens, device=DEV)
    check.assert_close(q_out, q, dtype=dtype, name="q")
    check.assert_close(k_out[rows], k, dtype=dtype, name="k at its rows")
    torch.testing.assert_close(v_out[rows].double(), v, rtol=0, atol=0)  # values travel unchanged
    untouched = torch.ones(store_rows, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert not k_out[untouched].any() and not v_out[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_norm_rope_rounds_like_the_separate_kernels(dtype):
    """One launch for what q_norm, k_norm and rope_ do one after another: the same roundings,
    so the same numbers, up to the order of the sum of squares and where the compiler fuses a
    multiply into an add. Either moves a normed value by about an ulp, and the rotation's
    difference ``x * cos - y * sin`` carries that ulp of its larger input into an output that
    may be far smaller (on the H100, one float32 output of 0.011 differed by 1.4e-7): so the
    absolute tolerance is an ulp at the scale of the normed values, not of each output."""
    tokens, q_heads, kv_heads, head_dim = 9, 4, 2, 16
    qkv, q_w, k_w, cos, sin = _qkv_case(tokens, q_heads, kv_heads, head_dim, dtype, seed=5)
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=dtype, device=DEV)
    k_out, v_out = (torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device=DEV) for _ in range(2))
    qkv_norm_rope(qkv, q_w, k_w, 1e-6, cos, sin, q_out=q_out, k_out=k_out, v_out=v_out)
    q, k, _ = qkv.unflatten(-1, (q_heads + 2 * kv_heads, head_dim)).split([q_heads, kv_heads, kv_heads], dim=1)
    q, k = rope_(rms_norm(q[None].contiguous(), q_w, 1e-6), rms_norm(k[None].contiguous(), k_w, 1e-6), cos, sin)
    for got, want in ((q_out, q[0]), (k_out, k[0])):
        ulp_at_scale = torch.finfo(dtype).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=2 * ulp_at_scale)


def test_inference_ops_refuse_to_run_under_autograd():
    gate_up = check.randn(3, 8, dtype=torch.float32, device=DEV, seed=1).requires_grad_()
    with pytest.raises(RuntimeError, match="forward only"):
        swiglu_halves(gate_up)
    with torch.no_grad():
        swiglu_halves(gate_up)


def _qkv_call(tokens=3, q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, **override):
    qkv, q_w, k_w, cos, sin = _qkv_case(tokens, q_heads, kv_heads, head_dim, dtype, seed=1)
    args = dict(qkv=qkv, q_weight=q_w, k_weight=k_w, eps=1e-6, cos=cos, sin=sin,
                q_out=torch.empty(tokens, q_heads, head_dim, dtype=dtype, device=DEV),
                k_out=torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device=DEV),
                v_out=torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device=DEV), slot_mapping=None)
    args.update(override)
    return lambda: qkv_norm_rope(**args)


@pytest.mark.parametrize("call, error, match", [
    (_qkv_call(qkv=_x(3, 32).t()), ValueError, "each row of qkv must be contiguous"),
    (_qkv_call(qkv=_x(3, 40)), ValueError, r"qkv must be \[N=3, \(Hq=2 \+ 2 \* Hk=1\) \* D=8\]"),
    (_qkv_call(k_out=_x(3, 8, 2).transpose(1, 2)), ValueError, "k_out must be .* contiguous"),
    (_qkv_call(v_out=_x(3, 2, 8)), ValueError, "the same kv_heads"),
    (_qkv_call(k_out=_x(2, 1, 8), v_out=_x(2, 1, 8)), ValueError, "need a row per token"),
    (_qkv_call(slot_mapping=torch.arange(2, device=DEV)), ValueError, r"slot_mapping must be \[N=3\]"),
    (_qkv_call(slot_mapping=torch.arange(3, device=DEV).float()), TypeError, "slot_mapping must have dtype"),
    (_qkv_call(cos=_x(4, 8)), ValueError, r"cos must be \[N=3, D=8\]"),
    (_qkv_call(q_weight=_x(7)), ValueError, r"q_weight must be \[D=8\]"),
    (_qkv_call(q_out=_x(3, 2, 8, dtype=torch.float64)), TypeError, "must share one dtype"),
    (_qkv_call(eps=-1.0), ValueError, "eps must be a positive number"),
    (lambda: swiglu_halves(_x(3, 5)), ValueError, "must be even"),
    (lambda: swiglu_halves(_x(6, 3).t()), ValueError, "gate_up must be contiguous"),
])
def test_inference_ops_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("tile", [kernels.NormBackwardTile(4, 4, 1, 1), kernels.NormBackwardTile(2, 4, 3, 2),
                                  kernels.NormBackwardTile(1, 2, 100, 1), kernels.NormBackwardTile(4, 4, 1, 1, True),
                                  kernels.NormBackwardTile(2, 4, 3, 2, True),
                                  kernels.NormBackwardTile(2, 4, 3, 2, False, True),
                                  kernels.NormBackwardTile(1, 2, 100, 1, True, True)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add+norm"])
def test_norm_backward_any_split_of_the_rows(tile, with_residual):
    """Programs with several tiles each, a last program with a ragged run, one row each:
    every split must give every row its dx and add every row into dw once."""
    rows, width = 37, 24
    x = check.randn(rows, width, dtype=torch.float64, device=DEV, seed=5)
    w = check.randn(width, dtype=torch.float64, device=DEV, seed=6)
    dy = check.randn(rows, width, dtype=torch.float64, device=DEV, seed=7)
    dres = check.randn(rows, width, dtype=torch.float64, device=DEV, seed=8) if with_residual else None
    _, _, rstd = kernels.rms_norm_forward(x, w, 1e-6)
    dx, dw = kernels.rms_norm_backward(dy, x, w, rstd, dresidual=dres, tile=tile)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    dx_ref, dw_ref = torch.autograd.grad(reference.rms_norm_reference(x64, w64, 1e-6), (x64, w64), dy)
    check.assert_close(dx, dx_ref + (dres if with_residual else 0), dtype=torch.float64, name="dx")
    check.assert_close(dw, dw_ref, dtype=torch.float64, name="dw")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_atomic_dw_leaves_its_row_and_ticket_at_zero_for_the_next_launch(dtype):
    """The atomic reduction's accumulator row and ticket outlive a launch: each launch must
    hand them on zeroed, or the next one (another width's, another dtype's) starts wrong."""
    tile = kernels.NormBackwardTile(2, 4, 3, 1, False, True)
    for rows, width in ((37, 24), (5, 24), (64, 40)):
        x = check.randn(rows, width, dtype=dtype, device=DEV, seed=rows)
        w = check.randn(width, dtype=dtype, device=DEV, seed=2)
        dy = check.randn(rows, width, dtype=dtype, device=DEV, seed=3)
        _, _, rstd = kernels.rms_norm_forward(x, w, 1e-6)
        partial_rows = kernels.rms_norm_backward(dy, x, w, rstd, tile=dataclasses.replace(tile, dw_atomic=False))
        for _ in range(2):
            dx, dw = kernels.rms_norm_backward(dy, x, w, rstd, tile=tile)
            assert torch.equal(dx, partial_rows[0])
            check.assert_close(dw, partial_rows[1], dtype=dtype, name=f"atomic dw {rows}x{width}")
            assert not kernels.dw_accumulator(x.device, rstd.dtype, width).any()
            assert not kernels.matmul_kernels.tickets(x.device, 1).any()


@pytest.mark.parametrize("dw_atomic", [False, True], ids=["partial rows", "atomics"])
def test_norm_backward_is_right_launch_after_launch_at_every_table_tile(dw_atomic):
    """Each tile of the launch table, at widths it serves, launched back to back: every
    launch's dx and dw match float64. The atomic sum's order changes from launch to launch,
    so one right launch proves little: without the barrier before the last program zeroes
    the row, the 32-warp tile at width 5120 (Qwen3-14B) gave a wrong dw in some launches on
    an H100 and on the H200 (zeros where another warp had not yet read the sum), while the
    narrower tiles' atomics passed."""
    widths = backend.pick(cpu=(24, 40), gpu=(1024, 2048, 2560, 4096, 5120, 8192))
    rows = backend.pick(cpu=37, gpu=4096)
    launches = backend.pick(cpu=2, gpu=16)
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    for width in widths:
        tile = dataclasses.replace(kernels.pick_tile(kernels.NORM_BACKWARD_TILES, width), dw_atomic=dw_atomic)
        x = check.randn(rows, width, dtype=dtype, device=DEV, seed=width)
        w = 1 + 0.3 * check.randn(width, dtype=dtype, device=DEV, seed=width + 1)
        dy = check.randn(rows, width, dtype=dtype, device=DEV, seed=width + 2)
        _, _, rstd = kernels.rms_norm_forward(x, w, 1e-6)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        dx_ref, dw_ref = torch.autograd.grad(reference.rms_norm_reference(x64, w64, 1e-6), (x64, w64), dy.double())
        runs = [kernels.rms_norm_backward(dy, x, w, rstd, tile=tile) for _ in range(launches)]
        for launch, (dx, dw) in enumerate(runs):
            check.assert_close(dx, dx_ref, dtype=dtype, name=f"dx, width {width}, launch {launch}")
            check.assert_close(dw, dw_ref, dtype=dtype, name=f"dw, width {width}, launch {launch}")


def test_atomic_dw_compiles_to_vector_reductions_without_a_returned_value():
    """On the H200 each program's dw share must go out as fire-and-forget vector reductions
    (SASS ``REDG...F32x4``): a float ``ATOMG`` returns the old value, which makes every thread
    wait for a round trip to L2. (Triton 3.6 writes an ``atom`` with unused results in the
    PTX, 3.9 a ``red``; ptxas makes both ``REDG``.)"""
    x, w = torch.empty(64, 1024, dtype=torch.bfloat16, device=DEV), torch.empty(1024, dtype=torch.bfloat16, device=DEV)
    row, rstd = torch.empty(1024, device=DEV), torch.empty(64, device=DEV)
    compiled = sass.compile_sm90(
        kernels.rms_norm_bwd_kernel,
        (x, x, x, w, rstd, x, row, w, torch.zeros(1, dtype=torch.int32, device=DEV), 64, 1024, 16),
        dict(HAS_RESIDUAL=False, ACC=kernels.compute_dtype(x.dtype), BLOCK_COLS=1024, BLOCK_ROWS=1, NUM_STAGES=1,
             PREFETCH=False, DW_ATOMIC=True, num_warps=8))
    code = sass.disassemble(compiled)
    assert any("REDG" in line and "F32x4" in line for line in code.splitlines())
    assert not any("ATOMG" in line and "F32" in line for line in code.splitlines())
    assert not {"STL", "LDL"} & set(sass.opcodes(code))


def test_atomic_dw_row_is_zeroed_only_after_every_thread_has_read_it():
    """The last program reads the summed row, stores dw, and zeroes the row for the next
    launch. Triton lays the read and the zeroing store out over the threads independently (at
    the 32-warp tile of width 5120, 8 and 4 columns a thread), so a warp could zero columns
    another warp had not read yet unless a barrier stands between them: read the sm_90 TTGIR."""
    width, block = 5120, 8192
    x = torch.empty(64, width, dtype=torch.bfloat16, device=DEV)
    w = torch.empty(width, dtype=torch.bfloat16, device=DEV)
    row, rstd = torch.empty(width, device=DEV), torch.empty(64, device=DEV)
    compiled = sass.compile_sm90(
        kernels.rms_norm_bwd_kernel,
        (x, x, x, w, rstd, x, row, w, torch.zeros(1, dtype=torch.int32, device=DEV), 64, width, 2),
        dict(HAS_RESIDUAL=False, ACC=kernels.compute_dtype(x.dtype), BLOCK_COLS=block, BLOCK_ROWS=2, NUM_STAGES=1,
             PREFETCH=False, DW_ATOMIC=True, num_warps=32))
    lines = compiled.asm["ttgir"].splitlines()
    # The IR names values after the kernel's variables; the barrier op's name varies with Triton's version.
    read = next(i for i, line in enumerate(lines) if "%total = tt.load" in line)
    reset_ticket = next(i for i in range(read, len(lines)) if "atomic_rmw exch" in lines[i])
    stores = [i for i in range(read, reset_ticket) if "tt.store" in lines[i]]
    assert len(stores) == 2, "the last program stores dw, then zeroes the row"
    assert any("barrier" in lines[i] for i in range(stores[0], stores[1])), \
        "no barrier between the last program's store of dw and its zeroing of the summed row"


def test_atomic_dw_gives_way_to_partial_rows_under_deterministic_algorithms(monkeypatch):
    """torch's switch for run-to-run identical results must reach the norm: with it on, a tile
    that asks for atomics sums partial rows instead (the atomic path's row is never asked for)."""
    def no_atomics(*args):
        raise AssertionError("the atomic dw reduction ran under torch.use_deterministic_algorithms(True)")

    tile = kernels.NormBackwardTile(2, 4, 3, 1, False, True)
    x, w, dy = (check.randn(*shape, dtype=torch.float32, device=DEV, seed=seed)
                for seed, shape in enumerate(((37, 24), (24,), (37, 24))))
    _, _, rstd = kernels.rms_norm_forward(x, w, 1e-6)
    monkeypatch.setattr(kernels, "dw_accumulator", no_atomics)
    with pytest.raises(AssertionError, match="atomic dw reduction ran"):
        kernels.rms_norm_backward(dy, x, w, rstd, tile=tile)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        dx, dw = kernels.rms_norm_backward(dy, x, w, rstd, tile=tile)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = torch.autograd.grad(reference.rms_norm_reference(x64, w64, 1e-6), (x64, w64), dy.double())
    check.assert_close(dx, want[0], dtype=torch.float32, name="dx")
    check.assert_close(dw, want[1], dtype=torch.float32, name="dw")


def test_norm_backward_split_covers_the_rows_in_whole_tiles():
    for n_rows in (1, 7, 37, 1000):
        for tile in (kernels.NormBackwardTile(4, 4, 1, 1), kernels.NormBackwardTile(8, 4, 8, 1)):
            programs, per_program = kernels.norm_backward_split(n_rows, tile)
            assert per_program % tile.block_rows == 0
            assert (programs - 1) * per_program < n_rows <= programs * per_program


# --- against Hugging Face's own Qwen3 modules --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_match_hf_qwen3_modules(dtype):
    hf = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    x = check.randn(2, 7, 80, dtype=dtype, device=DEV, seed=1, scale=2.0)
    norm = hf.Qwen3RMSNorm(80, eps=1e-6).to(device=DEV, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * check.randn(80, dtype=dtype, device=DEV, seed=2))
        check.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), dtype=dtype, name="RMSNorm vs HF")
        residual = check.randn(2, 7, 80, dtype=dtype, device=DEV, seed=3)
        y, total = add_rms_norm(x, residual, norm.weight, 1e-6)
        check.assert_close(y, norm(x + residual), dtype=dtype, name="add + RMSNorm vs HF")
        # HF rotates [B, H, T, D] tensors with cos/sin [B, T, D]; ours takes [B, T, H, D].
        q = check.randn(2, 7, 4, 16, dtype=dtype, device=DEV, seed=4)
        k = check.randn(2, 7, 2, 16, dtype=dtype, device=DEV, seed=5)
        cos, sin = _angles(7, 16, dtype)
        want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
        got_q, got_k = rope_(q.clone(), k.clone(), cos, sin)
        check.assert_close(got_q.transpose(1, 2), want_q, dtype=dtype, name="RoPE q vs HF")
        check.assert_close(got_k.transpose(1, 2), want_k, dtype=dtype, name="RoPE k vs HF")
        gate, up = (check.randn(2, 7, 136, dtype=dtype, device=DEV, seed=s) for s in (6, 7))
        act = hf.ACT2FN["silu"]
        check.assert_close(swiglu(gate, up), act(gate) * up, dtype=dtype, name="SwiGLU vs HF")


# --- the model's switch --------------------------------------------------------------------

def test_fused_model_matches_eager_and_hf_with_gradients():
    hf_model, eager = hf_twin(models.TINY)  # both on the CPU
    fused = models.Decoder(models.TINY, fused=True, device=DEV)  # where the kernels run
    fused.load_state_dict(eager.state_dict())
    ids = token_ids(2, 13, models.TINY.vocab_size, seed=3)
    with torch.no_grad():
        want = hf_model(ids).logits
    got_eager, got_fused = eager(ids), fused(ids.to(DEV))
    check.assert_close(got_fused, want, dtype=torch.float32, name="fused logits vs HF")
    check.assert_close(got_fused, got_eager, dtype=torch.float32, name="fused vs eager logits")
    cotangent = check.randn(*got_eager.shape, dtype=torch.float32, seed=4)
    got_eager.backward(cotangent)
    got_fused.backward(cotangent.to(DEV))
    for (name, p_eager), p_fused in zip(eager.named_parameters(), fused.parameters()):
        check.assert_close(p_fused.grad, p_eager.grad, dtype=torch.float32, name=f"d{name}")


@pytest.mark.parametrize("cache", models.CACHE_MODES)
def test_fused_model_decodes_like_the_eager_one(cache):
    """Every cache mode, the static one's device-side position included (its CUDA graph on a GPU)."""
    eager = models.Decoder(models.TINY, init_std=0.2, device=DEV)
    fused = models.Decoder(models.TINY, init_std=0.2, fused=True, device=DEV)
    prompt = token_ids(2, 9, models.TINY.vocab_size, seed=5, device=DEV)
    a = models.generate_greedy(eager, prompt, 4, cache=cache)
    b = models.generate_greedy(fused, prompt, 4, cache=cache)
    assert torch.equal(a.tokens, b.tokens)
    check.assert_close(b.logits, a.logits, dtype=torch.float32, name=f"decode logits ({cache})")


def test_fused_switch_reaches_every_module_and_checks_its_type():
    model = models.Decoder(models.TINY)
    model.fused = True
    assert all(m.fused for m in model.modules() if hasattr(m, "fused") and m is not model)
    with pytest.raises(TypeError, match="fused must be a bool"):
        model.fused = "yes"


# --- the profile and the benchmarks -----------------------------------------------------

@pytest.mark.parametrize("name, kind", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention (SDPA)"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "matmul (cuBLAS)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul (cuBLAS)"),
    ("rms_norm_bwd_kernel", "fused Triton (labkit)"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>", "embedding"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>", profile.REST),
])
def test_profile_sorts_kernels_by_name(name, kind):
    assert profile.category(name) == kind


def test_kernel_breakdown_counts_what_a_step_runs():
    x = check.randn(64, 64, dtype=torch.float32, device=DEV, seed=1)
    shares = profile.kernel_breakdown(lambda: (x @ x).relu(), warmup=0)
    kinds = {s.category: s for s in shares}
    assert kinds["matmul (cuBLAS)"].kernels >= 1 and kinds[profile.REST].kernels >= 1
    assert all(s.ms >= 0 for s in shares)


@pytest.mark.parametrize("name", ["fused.rms_norm", "fused.add_rms_norm", "fused.rope", "fused.swiglu"])
def test_op_benchmarks_check_and_report_every_direction(name):
    rec = benchmarks.run(name, record=False)
    assert [r["direction"] for r in rec.rows] == ["forward", "backward"] * (len(rec.rows) // 2)
    for row in rec.rows:
        assert row["ours"] > 0 and row["ours/limit"] == pytest.approx(row["ours"] / row["copy"])
        assert row["ours/torch"] == pytest.approx(row["ours"] / row["torch"])
    if name in ("fused.rms_norm", "fused.add_rms_norm"):  # which backward launch each width ran
        for row in rec.rows:
            ran = kernels.NormBackwardTile(**rec.config["norm_backward_tiles"][row["width"]])
            assert ran == kernels.pick_tile(kernels.NORM_BACKWARD_TILES, int(row["width"].split()[-1]))


def test_step_profile_runs_both_models_and_both_phases():
    rec = benchmarks.run("fused.step_profile", record=False)
    seen = {(r["model"], r["phase"]) for r in rec.rows}
    assert seen == {(m, p) for m in ("eager", "fused") for p in ("forward", "forward + backward")}
    for key in seen:
        shares = [r["share"] for r in rec.rows if (r["model"], r["phase"]) == key]
        assert sum(shares) == pytest.approx(1.0)


# --- errors on bad input --------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda: rms_norm([1.0], _x(4)), TypeError, "x must be a torch.Tensor"),
    (lambda: rms_norm(_x(3, 4).int(), _x(4)), TypeError, "x must have dtype"),
    (lambda: rms_norm(_x(3, 4), _x(5)), ValueError, r"weight must have x's last dimension \(4\)"),
    (lambda: rms_norm(_x(3, 4), _x(4, dtype=torch.float64)), TypeError, "must share one dtype"),
    (lambda: rms_norm(_x(4, 3).t(), _x(4)), ValueError, "x must be contiguous"),
    (lambda: rms_norm(_x(3, 4), _x(4), eps=0.0), ValueError, "eps must be a positive number"),
    (lambda: rms_norm(torch.empty(3, 4, device="meta"), _x(4)), ValueError, "x must be on"),
    (lambda: rms_norm(torch.empty(0, 4, device=DEV), _x(4)), ValueError, "x must not be empty"),
    (lambda: add_rms_norm(_x(3, 4), _x(2, 4), _x(4)), ValueError, "same shape"),
    (lambda: add_rms_norm(_x(3, 4), _x(3, 4, dtype=torch.bfloat16), _x(4)), TypeError, "must share one dtype"),
    (lambda: swiglu(_x(3, 4), _x(3, 5)), ValueError, "same shape"),
    (lambda: swiglu(_x(3, 4), _x(4, 3).t()), ValueError, "up must be contiguous"),
    (lambda: swiglu(_x(3, 4, dtype=torch.float16), _x(3, 4)), TypeError, "must share one dtype"),
    (lambda: rope_(_x(1, 5, 2, 8), _x(1, 5, 1, 8), _x(5, 8), _x(5, 8)[None]), ValueError, "sin must have 2 dimensions"),
    (lambda: rope_(_x(5, 2, 8), _x(1, 5, 1, 8), _x(5, 8), _x(5, 8)), ValueError, "q must have 4 dimensions"),
    (lambda: rope_(_x(1, 5, 2, 8), _x(1, 4, 1, 8), _x(5, 8), _x(5, 8)), ValueError, "k must be"),
    (lambda: rope_(_x(1, 5, 2, 7), _x(1, 5, 1, 7), _x(5, 7), _x(5, 7)), ValueError, "head_dim must be even"),
    (lambda: rope_(_x(1, 5, 2, 8), _x(1, 5, 1, 8), _x(6, 8), _x(6, 8)), ValueError, r"cos and sin must be \[T=5"),
    (lambda: rope_(_x(1, 5, 2, 8), _x(1, 5, 1, 8), _x(5, 8, dtype=torch.float64), _x(5, 8)), TypeError,
     "must share one dtype"),
])
def test_public_functions_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_dtypes_are_the_documented_ones():
    assert DTYPES == (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# The sweeps at the smallest shape, on any machine: what they do with candidates, not how fast.
TINY_SWEEP = {op: [("tiny", bench.TINY_SHAPE)] for op in bench.OPS}
TINY_TOKENS = (37,)


def test_tile_sweep_checks_and_times_every_candidate():
    rec = tiles.sweep(shapes=TINY_SWEEP, token_counts=TINY_TOKENS, peers=False)
    assert not rec.config["failures"] and not rec.config["skipped (time budget)"]
    for op in bench.OPS:
        for direction in ("forward", "backward"):
            timed = {tuple(r[f] for f in tiles.TILE_FIELDS)
                     for r in rec.rows if (r["op"], r["direction"], r["impl"]) == (op, direction, "ours")}
            wanted = {tuple(dataclasses.asdict(c).get(f) for f in tiles.TILE_FIELDS)
                      for c in tiles.candidates(op, direction, bench.TINY_SHAPE)}
            assert timed == wanted, (op, direction)
            assert set(tiles.best(rec, op, direction)) == {bench._width(bench.OPS[op], bench.TINY_SHAPE)}


def test_compile_once_reports_a_failing_launch_instead_of_raising():
    ok = tiles.compile_once(("swiglu", "backward", bench.TINY_SHAPE, kernels.FlatTile(64, 2)))
    bad = tiles.compile_once(("swiglu", "forward", bench.TINY_SHAPE, kernels.FlatTile(48, 2)))
    assert ok is None and "swiglu forward" in bad


def test_prefetch_sweep_times_both_walks_at_every_width():
    rec = tiles.prefetch_sweep(shapes=TINY_SWEEP["rms_norm"], token_counts=TINY_TOKENS)
    assert not rec.config["failures"]
    seen = {(r["width"], r["prefetch"], r["programs_per_sm"]) for r in rec.rows}
    assert seen == {(bench._width(bench.OPS["rms_norm"], bench.TINY_SHAPE), f, p)
                    for f in (False, True) for p in tiles.PREFETCH_PROGRAMS_PER_SM}
    assert not any(r["dw_atomic"] for r in rec.rows)  # the partial rows the chapter reads it as


def test_dw_reduction_sweep_times_both_reductions_and_walks_at_every_width():
    rec = tiles.dw_reduction_sweep(shapes=TINY_SWEEP["rms_norm"], token_counts=TINY_TOKENS)
    assert not rec.config["failures"] and not rec.config["skipped (time budget)"]
    seen = {(r["width"], r["dw_atomic"], r["prefetch"], r["programs_per_sm"]) for r in rec.rows}
    assert seen == {(bench._width(bench.OPS["rms_norm"], bench.TINY_SHAPE), a, f, p)
                    for a in (False, True) for f in (False, True) for p in tiles.PREFETCH_PROGRAMS_PER_SM}


def test_dw_reduction_sweep_rejects_a_reduction_wrong_in_any_of_its_checked_launches(monkeypatch):
    """A reduction that is right only every other launch (as an order-dependent one can be)
    must not pass on one lucky launch: each candidate is checked on several in a row."""
    real = tiles.LAUNCHES["rms_norm"]
    calls = itertools.count()

    def wrong_every_other_launch(t, saved, cot, tile):
        dx, dw = real.backward(t, saved, cot, tile)
        return (dx, dw + 1) if next(calls) % 2 else (dx, dw)

    monkeypatch.setitem(tiles.LAUNCHES, "rms_norm", dataclasses.replace(real, backward=wrong_every_other_launch))
    assert tiles.DW_REDUCTION_CHECKED_LAUNCHES >= 2
    rec = tiles.dw_reduction_sweep(shapes=TINY_SWEEP["rms_norm"], token_counts=TINY_TOKENS)
    candidates = tiles.dw_reduction_candidates("rms_norm", "backward", bench.TINY_SHAPE)
    assert rec.rows == [] and len(rec.config["failures"]) == len(candidates)
    assert all("launch 1" in failure for failure in rec.config["failures"])


@pytest.mark.parametrize("table", ["GPU_NORM_FORWARD_TILES", "GPU_NORM_BACKWARD_TILES", "GPU_ROPE_TILES",
                                   "GPU_SWIGLU_TILES"])
def test_gpu_launch_tables_cover_every_width_in_order(table):
    entries = getattr(kernels, table)
    bounds = [widest for widest, _ in entries]
    assert bounds[-1] is None and None not in bounds[:-1] and bounds[:-1] == sorted(bounds[:-1])
    for widest, tile in entries:
        if tile is None:  # left to the autotuner
            continue
        rows = getattr(tile, "block_rows", None) or tile.block
        assert rows & (rows - 1) == 0 and tile.num_warps in (1, 2, 4, 8, 16, 32), (widest, tile)
        assert kernels.pick_tile(entries, widest or 1 << 20) is tile
