"""Benchmarks of chapter ``fused-linear-cross-entropy``: time and memory of the LM head's
loss, forward and backward, for every way of computing it.

What one call measures: ``loss = f(hidden, weight, target)`` and
``torch.autograd.grad(loss, (hidden, weight))``, the whole training-step work of the
head, on inputs allocated beforehand.

- **time**: CUDA-event median of that call (:func:`labkit.timing.measure`, L2 flushed).
- **peak memory**: ``torch.cuda.max_memory_allocated()`` during one call, minus what was
  allocated before it (the inputs). ``total_gb`` is that number; ``working_gb`` subtracts
  the outputs every implementation must return (the loss and the two gradients, in the
  inputs' dtype: 1.1 GB at the headline shape), leaving the memory the method itself
  needs. The goal of 0.8 GB is on ``working_gb``; both are recorded, for every contender
  the same way, after one untimed warm-up call (which compiles, autotunes and allocates
  cuBLAS's workspace).
- **limit**: the three matmuls (logits, and the two gradients: ``3 x 2 N H V`` FLOPs) at
  the best bf16 matmul rate measured in the same run; no method can take less.

Every contender's loss and gradients are checked against a float64 answer before they
are timed (at the GPU sizes the float64 answer comes from the torch token-chunked version,
which the tests check against ``F.cross_entropy``; a full float64 logits tensor would not
fit).
"""

from __future__ import annotations

import gc
import importlib.metadata
from collections.abc import Callable

import torch

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import default_chunk_tokens, fused_linear_cross_entropy
from .chunked import token_chunked_linear_cross_entropy, vocab_chunked_linear_cross_entropy
from .kernels import GPU_CONFIGS, cross_entropy_grad_, kernel_params, tuned_cross_entropy_grad_kernel
from .reference import LossOptions, linear_cross_entropy_reference, loss_scale

CHAPTER = "fused-linear-cross-entropy"
GB = 1e9
# (tokens, hidden, vocab): the issue's headline (Llama 3's vocabulary at hidden 4096),
# twice the tokens, and Qwen3-4B's head (hidden 2560, vocabulary 151936).
GPU_SHAPES = ((8192, 4096, 128256), (16384, 4096, 128256), (8192, 2560, 151936))
CPU_SHAPES = ((67, 48, 1100),)
HEADLINE = GPU_SHAPES[0]
MEMORY_GOAL_GB = 0.8
# The torch versions of the two chunking schemes, measured at the headline shape only
# (they are the chapter's middle stages, not contenders).
TORCH_TOKEN_CHUNK, TORCH_VOCAB_CHUNK = 1024, 8192
# Chunk sizes of the sweep; the default (labkit.flce.default_chunk_tokens) is among them.
SWEEP_CHUNKS = backend.pick(cpu=(16, 32, 67), gpu=(256, 512, 1024, 1536, 2048, 3072, 4096, 8192))


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Hidden states of unit variance, a head initialised like nn.Linear's (std 1/sqrt(H)
    makes logits of order 1), labels uniform over the vocabulary."""
    dev = backend.device()
    h = check.randn(tokens, hidden, dtype=dtype, device=dev, seed=seed).requires_grad_()
    w = check.randn(vocab, hidden, dtype=dtype, device=dev, seed=seed + 1, scale=hidden ** -0.5).requires_grad_()
    gen = check.make_generator(seed + 2, dev)
    t = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)
    return h, w, t


def fwd_bwd(fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """The call every contender is measured on: the loss and both gradients."""
    loss = fn(h, w, t)
    return (loss, *torch.autograd.grad(loss, (h, w)))


def peak_memory_gb(fn: Callable, h, w, t) -> tuple[float | None, float | None]:
    """(working GB, total GB) of one :func:`fwd_bwd` call, as the module docstring defines
    them; ``(None, None)`` without a GPU (the interpreter's CPU tensors are not counted)."""
    if not backend.on_gpu():
        return None, None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outputs = fwd_bwd(fn, h, w, t)
    torch.cuda.synchronize()
    total = torch.cuda.max_memory_allocated() - before
    returned = sum(o.numel() * o.element_size() for o in outputs)
    return (total - returned) / GB, total / GB


ERROR_FIELDS = ("err_loss", "err_grad_hidden", "err_grad_weight")


def _errors(fn: Callable, h, w, t, exact) -> dict[str, float]:
    """Relative errors of the loss and both gradients against the float64 answer."""
    got = fwd_bwd(fn, h, w, t)
    return {field: check.rel_error(g.float(), e) for field, g, e in zip(ERROR_FIELDS, got, exact)}


def _exact(h, w, t) -> tuple[torch.Tensor, ...]:
    """Loss and gradients in float64, from the torch token-chunked version (the tests check
    it against F.cross_entropy): one chunk of float64 logits at a time."""
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    chunk = backend.pick(cpu=hd.shape[0], gpu=512)
    out = fwd_bwd(lambda a, b, c: token_chunked_linear_cross_entropy(a, b, c, chunk_tokens=chunk), hd, wd, t)
    return tuple(o.detach().float() for o in out)


def _liger() -> tuple[Callable | None, str]:
    if not backend.on_gpu():
        return None, "not run: Liger-Kernel is measured on a GPU only"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        return None, f"missing: {e}"
    module = LigerFusedLinearCrossEntropyLoss()
    return (lambda h, w, t: module(w, h, t),
            f"liger-kernel {importlib.metadata.version('liger-kernel')}, LigerFusedLinearCrossEntropyLoss() defaults")


def _compiled() -> Callable | None:
    if not backend.on_gpu():
        return None
    torch._dynamo.reset()
    return torch.compile(linear_cross_entropy_reference, dynamic=False)


def _eager(h, w, t):
    return linear_cross_entropy_reference(h, w, t)


def _contenders(shape) -> dict[str, Callable | None]:
    impls: dict[str, Callable | None] = {
        "eager": _eager, "torch.compile": _compiled(), "liger": _liger()[0],
        "ours": fused_linear_cross_entropy}
    if shape == backend.pick(cpu=CPU_SHAPES[0], gpu=HEADLINE):
        chunk_t = backend.pick(cpu=16, gpu=TORCH_TOKEN_CHUNK)
        chunk_v = backend.pick(cpu=256, gpu=TORCH_VOCAB_CHUNK)
        impls[f"torch token-chunked ({chunk_t})"] = (
            lambda h, w, t: token_chunked_linear_cross_entropy(h, w, t, LossOptions(), chunk_t))
        impls[f"torch vocab-chunked ({chunk_v})"] = (
            lambda h, w, t: vocab_chunked_linear_cross_entropy(h, w, t, LossOptions(), chunk_v))
    return impls


def _measure(fn, h, w, t) -> dict:
    fwd_bwd(fn, h, w, t)  # warm-up: compilation, autotuning, cuBLAS workspace
    working, total = peak_memory_gb(fn, h, w, t)
    ms = timing.measure(lambda: fwd_bwd(fn, h, w, t), target_ms=backend.pick(cpu=1.0, gpu=300.0),
                        reps=backend.pick(cpu=1, gpu=None)).median_ms
    return {"ms": ms, "working_gb": working, "total_gb": total}


def _flops(tokens, hidden, vocab) -> float:
    return 3 * 2 * tokens * hidden * vocab


@benchmark("flce.compare", chapter=CHAPTER,
           title="LM head + cross-entropy, forward and backward, bf16: time and peak memory of "
                 "eager torch, torch.compile, Liger-Kernel and ours")
def bench_compare() -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    matmul = ceilings.matmul_tflops()
    rows, goals, failures = [], [], []
    for shape in backend.pick(cpu=CPU_SHAPES, gpu=GPU_SHAPES):
        tokens, hidden, vocab = shape
        h, w, t = make_inputs(tokens, hidden, vocab, dtype)
        exact = _exact(h, w, t)
        limit_ms = _flops(*shape) / (matmul * 1e12) * 1e3
        found = {}
        for name, fn in _contenders(shape).items():
            if fn is None:
                continue
            try:
                errors = _errors(fn, h, w, t, exact)
                if name == "ours":  # ours must pass; a peer's errors are recorded beside its time
                    for field, err in errors.items():
                        if not err <= check.tolerance(dtype):
                            raise check.CheckFailed(f"ours at {shape}: {field} {err:.3g} > {check.tolerance(dtype)}")
                found[name] = {**_measure(fn, h, w, t), **errors}
            except Exception as e:  # a peer failing at a shape is recorded, not fatal
                if name == "ours":
                    raise
                failures.append(f"{name} at {shape}: {type(e).__name__}: {e}"[:300])
            gc.collect()
        ours = found["ours"]
        for name, m in found.items():
            rows.append({"tokens": tokens, "hidden": hidden, "vocab": vocab, "impl": name, **m,
                         "tflops": _flops(*shape) / m["ms"] / 1e9, "limit_ms": limit_ms,
                         "limit/impl": limit_ms / m["ms"], "impl_ms/ours_ms": m["ms"] / ours["ms"]})
        if backend.on_gpu() and shape == HEADLINE:
            label = f"{tokens}x{hidden}x{vocab}"
            goals.append(Goal(f"ours working memory GB {label}", ours["working_gb"], "<=", MEMORY_GOAL_GB))
            for peer in ("torch.compile", "liger"):
                if peer in found:
                    goals.append(Goal(f"ours/{peer} time {label}", ours["ms"] / found[peer]["ms"], "<=", 1.0))
                    goals.append(Goal(f"ours/{peer} working memory {label}",
                                      ours["working_gb"] / found[peer]["working_gb"], "<=", 1.0))
        del h, w, t, exact
        gc.collect()
    return Measurement(
        rows=rows, metric="ms per forward+backward; GB of peak memory beyond the inputs "
                          "(total, and working = total minus the returned loss and gradients)",
        limits={"matmul_bf16_tflops": matmul}, goals=goals,
        config={"dtype": str(dtype).replace("torch.", ""), "peak_memory": "max_memory_allocated during one "
                "fwd+bwd minus memory_allocated before it, after a warm-up call",
                "ours_chunk_tokens": {str(s): default_chunk_tokens(s[0], s[2], dtype)
                                      for s in backend.pick(cpu=CPU_SHAPES, gpu=GPU_SHAPES)},
                "autotuned": {"cross_entropy_grad_kernel": {
                    str(key): str(config) for key, config in tuned_cross_entropy_grad_kernel.cache.items()}},
                "peers": {"eager": "labkit.flce.reference.linear_cross_entropy_reference (HF's: bf16 logits, "
                                   "upcast to fp32, F.cross_entropy)",
                          "torch.compile": "torch.compile(the eager function, dynamic=False), default mode",
                          "liger": _liger()[1]},
                "peer_failures": failures,
                "checked": "loss and both gradients against float64 before timing (err_* columns: "
                           "relative errors; ours must be within the dtype's tolerance)",
                "tolerance": check.tolerance(dtype)},
    )


@benchmark("flce.chunk_sweep", chapter=CHAPTER,
           title="Ours at the headline shape, bf16: time and peak memory against the chunk size")
def bench_chunk_sweep() -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    tokens, hidden, vocab = backend.pick(cpu=CPU_SHAPES[0], gpu=HEADLINE)
    h, w, t = make_inputs(tokens, hidden, vocab, dtype)
    rows = []
    for chunk in SWEEP_CHUNKS:
        def fn(a, b, c, chunk=chunk):
            return fused_linear_cross_entropy(a, b, c, chunk_tokens=chunk)
        m = _measure(fn, h, w, t)
        rows.append({"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk_tokens": chunk,
                     "chunk_logits_gb": chunk * vocab * h.element_size() / GB, **m,
                     "tflops": _flops(tokens, hidden, vocab) / m["ms"] / 1e9})
    return Measurement(
        rows=rows, metric="ms per forward+backward and GB of peak memory, by chunk size",
        config={"dtype": str(dtype).replace("torch.", ""),
                "default_chunk_tokens": default_chunk_tokens(tokens, vocab, dtype)},
    )


@benchmark("flce.kernel", chapter=CHAPTER,
           title="The Triton kernel alone on one chunk of bf16 logits, by configuration: bandwidth against the copy limit")
def bench_kernel() -> Measurement:
    """The in-place loss-and-gradient kernel on one chunk, with each configuration the
    launch is tuned over (``labkit.flce.kernels.GPU_CONFIGS``). It reads each logit twice
    (the logsumexp pass, then the gradient pass) and writes it once: those are its bytes.
    The ceiling is the copy bandwidth measured in the same run (bytes read plus written)."""
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    copy = ceilings.copy_bandwidth_tbps()
    shapes = backend.pick(cpu=[(16, 1100)], gpu=[(2048, 128256), (1536, 151936)])
    configs = backend.pick(cpu=((256, 4, 1, False), (1024, 4, 1, False), (1024, 4, 3, False), (1024, 4, 1, True)),
                           gpu=GPU_CONFIGS)
    rows = []
    for chunk, vocab in shapes:
        logits = check.randn(chunk, vocab, dtype=dtype, device=backend.device(), seed=5)
        target = torch.randint(0, vocab, (chunk,), generator=check.make_generator(6, logits.device),
                               device=logits.device)
        opts = LossOptions()
        loss_rows = torch.empty(chunk, dtype=torch.float32, device=logits.device)
        params = kernel_params(opts, loss_scale(target, opts, torch.float32))
        moved = 3 * logits.numel() * logits.element_size()
        for block, warps, stages, hints in configs:
            # Each call overwrites the chunk with its gradient, which the next call takes as
            # logits: finite values of the same size, the same work.
            t = timing.measure(lambda: cross_entropy_grad_(logits, target, loss_rows, params, opts, block=block,
                                                           num_warps=warps, loop_stages=stages, l2_hints=hints))
            tbps = timing.bandwidth_tbps(moved, t)
            rows.append({"chunk_tokens": chunk, "vocab": vocab, "block": block, "num_warps": warps,
                         "loop_stages": stages, "l2_hints": hints, "ms": t.median_ms, "tbps": tbps,
                         "copy_tbps": copy, "ours/limit": tbps / copy})
    return Measurement(rows=rows, metric="TB/s (each logit read twice, written once)",
                       limits={"copy_tbps": copy}, config={"dtype": str(dtype).replace("torch.", "")})
