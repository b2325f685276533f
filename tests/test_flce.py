"""labkit.flce: the fused linear cross-entropy, its kernel, the torch chunked versions and
the benchmarks, against F.cross_entropy in float64 (and Liger-Kernel on a GPU), and the
errors on bad input. Mirrors src/labkit/flce/."""

import math

import pytest
import torch
from labkit import backend, benchmarks, check
from labkit.flce import DTYPES, default_chunk_tokens, fused_linear_cross_entropy, kernels
from labkit.flce.chunked import token_chunked_linear_cross_entropy, vocab_chunked_linear_cross_entropy
from labkit.flce.reference import (LossOptions, cross_entropy_rows, linear_cross_entropy_reference,
                                   loss_scale)

DEV = backend.device()
CHECKED_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Every option at once, each alone, and the sum reduction: the formulas interact (z-loss and
# smoothing both change the gradient of every logit; the cap multiplies all of it).
OPTIONS = {
    "plain": LossOptions(),
    "all options": LossOptions(ignore_index=5, label_smoothing=0.1, z_loss=1e-3, softcap=4.0),
    "smoothing": LossOptions(label_smoothing=0.2),
    "z-loss": LossOptions(z_loss=1e-2),
    "softcap": LossOptions(softcap=2.5),
    "sum": LossOptions(reduction="sum", ignore_index=0),
}
# Tokens, hidden, vocab: odd sizes, a vocabulary over one interpreter block (1024) with a
# ragged last block, and a single token.
SHAPES = [(37, 24, 1100), (1, 16, 300)]


def _problem(tokens, hidden, vocab, dtype, opts, seed=0, logit_scale=1.0):
    h = check.randn(tokens, hidden, dtype=dtype, device=DEV, seed=seed)
    w = check.randn(vocab, hidden, dtype=dtype, device=DEV, seed=seed + 1, scale=logit_scale * hidden ** -0.5)
    t = torch.randint(0, vocab, (tokens,), generator=check.make_generator(seed + 2, DEV), device=DEV)
    if tokens > 2:  # some ignored tokens (the label may also be a real class id, as 5 and 0 are here)
        t[1::4] = opts.ignore_index
    return h, w, t


def _loss_and_grads(fn, h, w, t, exact=False):
    h = (h.double() if exact else h).detach().requires_grad_()
    w = (w.double() if exact else w).detach().requires_grad_()
    loss = fn(h, w, t)
    return (loss, *torch.autograd.grad(loss, (h, w)))


def _ours(opts, chunk_tokens):
    return lambda h, w, t: fused_linear_cross_entropy(
        h, w, t, ignore_index=opts.ignore_index, label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss, softcap=opts.softcap, reduction=opts.reduction, chunk_tokens=chunk_tokens)


def _assert_matches_float64(fn, h, w, t, opts, name):
    want = _loss_and_grads(lambda a, b, c: linear_cross_entropy_reference(a, b, c, opts), h, w, t, exact=True)
    got = _loss_and_grads(fn, h, w, t)
    for g, e, what in zip(got, want, ("loss", "grad hidden", "grad weight")):
        check.assert_close(g, e, dtype=h.dtype, name=f"{name}: {what}")


@pytest.mark.parametrize("dtype", CHECKED_DTYPES, ids=str)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_fused_matches_float64(opts, dtype):
    """Loss and both gradients, in chunks of 10 tokens (four chunks, the last ragged)."""
    h, w, t = _problem(*SHAPES[0], dtype, opts)
    _assert_matches_float64(_ours(opts, 10), h, w, t, opts, f"fused {dtype}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_default_chunk_and_single_token(shape):
    h, w, t = _problem(*shape, torch.float32, OPTIONS["all options"])
    _assert_matches_float64(_ours(OPTIONS["all options"], None), h, w, t, OPTIONS["all options"], f"fused {shape}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opts", [OPTIONS["plain"], OPTIONS["all options"]], ids=["plain", "all options"])
def test_torch_chunked_versions_match_float64(opts, dtype):
    """The chapter's middle stages: tokens in chunks of 8, the vocabulary in chunks of 300."""
    h, w, t = _problem(*SHAPES[0], dtype, opts)
    _assert_matches_float64(lambda a, b, c: token_chunked_linear_cross_entropy(a, b, c, opts, 8), h, w, t, opts,
                            "token-chunked")
    _assert_matches_float64(lambda a, b, c: vocab_chunked_linear_cross_entropy(a, b, c, opts, 300), h, w, t, opts,
                            "vocab-chunked")


@pytest.mark.parametrize("loop_stages,l2_hints", [(1, False), (3, False), (1, True)],
                         ids=["plain", "pipelined", "l2-hints"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_kernel_rows_match_the_closed_form_gradient(dtype, loop_stages, l2_hints):
    """The kernel alone against the row formulas (and those against autograd), with logits
    of magnitude ~40 (exp overflows without the running maximum), in blocks of 256, each
    pass over a row plain, software-pipelined, or with the L2 told what to keep."""
    opts = OPTIONS["all options"]
    logits = check.randn(9, 1100, dtype=dtype, device=DEV, seed=3, scale=40.0)
    t = torch.randint(0, 1100, (9,), generator=check.make_generator(4, DEV), device=DEV)
    t[2] = opts.ignore_index
    scale = loss_scale(t, opts, torch.float64)
    loss_rows = torch.empty(9, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=DEV)
    grad = logits.clone()
    params = kernels.kernel_params(opts, scale.to(loss_rows.dtype))
    kernels.cross_entropy_grad_(grad, t, loss_rows, params, opts, block=256, loop_stages=loop_stages,
                                l2_hints=l2_hints)
    want_rows, want_grad = cross_entropy_rows(logits.double(), t, opts, scale)
    check.assert_close(loss_rows, want_rows, dtype=dtype, name="row losses")
    check.assert_close(grad, want_grad, dtype=dtype, name="logit gradient")
    # the closed form is autograd's answer
    z = logits.double().requires_grad_()
    from labkit.flce.reference import cross_entropy_reference
    (autograd_grad,) = torch.autograd.grad(cross_entropy_reference(z, t, opts), z)
    check.assert_close(want_grad, autograd_grad, dtype=torch.float64, name="closed form vs autograd")


def test_loss_only_when_no_gradient_is_needed():
    opts = OPTIONS["all options"]
    h, w, t = _problem(*SHAPES[0], torch.float32, opts)
    with torch.no_grad():
        got = _ours(opts, 10)(h, w, t)
    check.assert_close(got, linear_cross_entropy_reference(h.double(), w.double(), t, opts), dtype=torch.float32)


def test_ignored_tokens_get_no_gradient_and_all_ignored_is_nan_like_torch():
    opts = LossOptions(ignore_index=-100)
    h, w, t = _problem(*SHAPES[0], torch.float64, opts)
    _, grad_h, _ = _loss_and_grads(_ours(opts, 10), h, w, t)
    assert torch.all(grad_h[t == -100] == 0) and torch.all(grad_h[t != -100].abs().sum(-1) > 0)
    t_all = torch.full_like(t, -100)
    loss, grad_h, grad_w = _loss_and_grads(_ours(opts, 10), h, w, t_all)
    assert math.isnan(loss.item()) and math.isnan(linear_cross_entropy_reference(h, w, t_all).item())
    assert torch.all(grad_h == 0) and torch.all(grad_w == 0)


def test_backward_scales_by_the_incoming_gradient():
    """A loss that is not the end of the graph (scaled, or one of several) gets its scale."""
    opts = OPTIONS["all options"]
    h, w, t = _problem(*SHAPES[0], torch.float64, opts)
    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    (2.5 * _ours(opts, 10)(hd, wd, t)).backward()
    want = _loss_and_grads(lambda a, b, c: 2.5 * linear_cross_entropy_reference(a, b, c, opts), h, w, t)
    check.assert_close(hd.grad, want[1], name="2.5 x loss: grad hidden")
    check.assert_close(wd.grad, want[2], name="2.5 x loss: grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_scaling_kernel_leaves_ones_alone_and_scales_the_rest(dtype):
    """The backward's in-place scale: exactly 1 changes no bit; anything else multiplies
    every element (5000 elements: more than the programs' first blocks)."""
    x = check.randn(5000, dtype=dtype, device=DEV, seed=8)
    same = kernels.scale_unless_one_(x.clone(), torch.ones(1, device=DEV))
    assert torch.equal(same, x)
    scaled = kernels.scale_unless_one_(x.clone(), torch.full((1,), -0.75, device=DEV))
    check.assert_close(scaled, -0.75 * x.double(), dtype=dtype, name="x * -0.75")


def test_leading_dimensions_and_int32_targets():
    """hidden [B, T, H] with target [B, T] (int32): the gradient comes back as [B, T, H]."""
    opts = OPTIONS["plain"]
    h, w, t = _problem(2 * 13, 24, 500, torch.float64, opts)
    h3 = h.reshape(2, 13, 24).requires_grad_()
    loss = fused_linear_cross_entropy(h3, w, t.reshape(2, 13).to(torch.int32), chunk_tokens=7)
    (grad,) = torch.autograd.grad(loss, h3)
    want = _loss_and_grads(lambda a, b, c: linear_cross_entropy_reference(a, b, c, opts), h, w, t)
    assert grad.shape == (2, 13, 24)
    check.assert_close(grad.reshape(26, 24), want[1], name="grad hidden [B, T, H]")


def test_default_chunk_fits_the_budget():
    # the headline: 2048 tokens of a 128256 vocabulary in bf16 fit 512 MiB
    assert default_chunk_tokens(8192, 128256, torch.bfloat16) == 2048
    assert default_chunk_tokens(8192, 151936, torch.bfloat16) == 1536
    assert default_chunk_tokens(100, 1000, torch.float32) == 100  # everything fits
    assert default_chunk_tokens(10**6, 10**7, torch.float32) == 256  # never below a tile
    for tokens, vocab, dtype in ((8192, 128256, torch.bfloat16), (30000, 50000, torch.float32)):
        chunk = default_chunk_tokens(tokens, vocab, dtype)
        assert chunk % 256 == 0 and chunk * vocab * torch.empty((), dtype=dtype).element_size() <= 512 * 2**20


def test_dtypes_are_the_documented_ones():
    assert set(DTYPES) == {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def _args(**change):
    h = torch.zeros(4, 8, device=DEV)
    w = torch.zeros(10, 8, device=DEV)
    t = torch.zeros(4, dtype=torch.int64, device=DEV)
    args = {"hidden": h, "weight": w, "target": t}
    args.update(change)
    return args


BAD_INPUTS = [
    (dict(hidden=[[1.0]]), TypeError, "hidden must be a torch.Tensor"),
    (dict(hidden=torch.zeros(8, device=DEV)), ValueError, "at least 2 dimensions"),
    (dict(hidden=torch.zeros(4, 8, dtype=torch.int32, device=DEV)), TypeError, "hidden must have dtype"),
    (dict(hidden=torch.zeros(8, 4, device=DEV).T), ValueError, "hidden must be contiguous"),
    (dict(weight=torch.zeros(10, 9, device=DEV)), ValueError, r"weight must be \[V, H=8\]"),
    (dict(weight=torch.zeros(10, 8, dtype=torch.float64, device=DEV)), TypeError, "share one dtype"),
    (dict(target=torch.zeros(5, dtype=torch.int64, device=DEV)), ValueError, "target must have hidden's leading shape"),
    (dict(target=torch.zeros(4, device=DEV)), TypeError, "target must have dtype"),
    (dict(target=torch.tensor([0, 1, 10, 2], device=DEV)), ValueError, r"in \[0, 10\) or ignore_index=-100, got 10"),
    (dict(target=torch.tensor([0, -1, 3, 2], device=DEV)), ValueError, "got -1"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a number"),
    (dict(z_loss=-1.0), ValueError, "z_loss must be in"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive finite number"),
    (dict(reduction="none"), ValueError, "reduction must be one of"),
    (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
    (dict(chunk_tokens=0), ValueError, "chunk_tokens must be positive"),
]


@pytest.mark.parametrize("change, error, match", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_public_function_rejects_bad_input(change, error, match):
    args = _args(**change)
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"), **args)


def test_benchmarks_check_and_report_every_contender():
    rec = benchmarks.run("flce.compare", record=False)
    impls = {r["impl"] for r in rec.rows}
    assert {"eager", "ours"} <= impls and any("vocab-chunked" in i for i in impls)
    sweep = benchmarks.run("flce.chunk_sweep", record=False)
    assert [r["chunk_tokens"] for r in sweep.rows] == sorted(r["chunk_tokens"] for r in sweep.rows)
    kernel = benchmarks.run("flce.kernel", record=False)
    assert all(r["tbps"] > 0 and r["ours/limit"] > 0 for r in kernel.rows)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [OPTIONS["plain"], OPTIONS["all options"]], ids=["plain", "all options"])
def test_matches_liger_on_the_gpu(opts):
    """Liger-Kernel's fused linear cross-entropy, same options, bf16, a real-sized vocabulary."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(ignore_index=opts.ignore_index, lse_square_scale=opts.z_loss,
                                             label_smoothing=opts.label_smoothing, softcap=opts.softcap)
    # Liger accumulates grad_weight in bf16 over chunks of about H/V of the tokens (16 here);
    # more chunks would round it more often than the bf16 tolerance allows.
    h, w, t = _problem(1000, 2048, 32003, torch.bfloat16, opts)
    got = _loss_and_grads(_ours(opts, 384), h, w, t)
    theirs = _loss_and_grads(lambda a, b, c: liger(b, a, c), h, w, t)
    want = _loss_and_grads(lambda a, b, c: linear_cross_entropy_reference(a, b, c, opts), h, w, t, exact=True)
    for g, l, e, what in zip(got, theirs, want, ("loss", "grad hidden", "grad weight")):
        check.assert_close(g, e, dtype=torch.bfloat16, name=f"ours: {what}")
        check.assert_close(l.float(), e, dtype=torch.bfloat16, name=f"liger: {what}")
