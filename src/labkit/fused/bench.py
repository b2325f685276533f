"""Benchmarks of chapter ``qwen3-architecture``: the fused kernels against torch eager,
torch.compile, Liger-Kernel and the copy limit, and a profile of one Qwen3-0.6B step.

Bandwidth counts the bytes an op cannot avoid: each input read once, each output written
once (RMSNorm's forward: x in, y out; its backward: dy and x in, dx out; the weight and
the per-row statistics are a rounding error at these widths). Every implementation is
charged the same bytes, so a slower one shows up as a lower rate, and the copy bandwidth
measured in the same run is the ceiling. Each implementation's outputs (and, for the
backward, its gradients) are checked against the float64 reference before it is timed.

How the peers run: "torch" is :mod:`labkit.fused.reference` (HF's formulas) in eager mode;
"torch.compile" is the same function under ``torch.compile(dynamic=False)``, compiled
afresh for each shape (forward and, through AOTAutograd, backward), in mode
``"max-autotune-no-cudagraphs"`` for SwiGLU and RoPE, which autotunes Inductor's generated
kernels, and in the default mode for the two norms (see :data:`NORM_GPU_SHAPES`); "liger" is
Liger-Kernel's own ``autograd.Function`` with its defaults (the "llama" casting mode, as
HF's Qwen3 rounds). Forwards are timed under ``torch.no_grad()`` (for every
implementation alike); backwards by ``torch.autograd.grad`` over a graph built once, which
is why every measurement runs with AOTAutograd's buffer donation off (:func:`no_donated_buffers`).
Our kernels run with the launch tables of :mod:`labkit.fused.kernels`; where a table leaves a
choice to Triton's autotuner, the record's config says what it chose.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..models import QWEN3_SIZES, Decoder, DecoderConfig
from ..models.decoder import RotaryEmbedding
from ..results import Goal
from . import add_rms_norm, kernels, profile, reference, rms_norm, rope_, swiglu

CHAPTER = "qwen3-architecture"
PEERS = ("torch", "torch.compile", "liger")
GOALS = (("liger", 1.0), ("torch.compile", 1.0), ("limit", 0.85))
EPS = 1e-6

QWEN3 = QWEN3_SIZES
TINY_SHAPE = DecoderConfig(vocab_size=64, hidden_size=80, num_layers=1, num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=136)


GPU_SHAPES = (("Qwen3-0.6B", 16384), ("Qwen3-4B", 8192), ("Qwen3-8B", 4096))
# The norms' benchmarks run the first two shapes only (hidden 1024, and 2560, which is no
# power of two), with torch.compile in its default mode: on the H200, fused.rms_norm with
# three shapes and max-autotune (which compiles and times several variants of every
# Inductor kernel, forward and backward) did not finish within 100 s. Where that time
# went was not measured. With fewer shapes and no autotuning of the peer, the two norm
# benchmarks together ran well within one GPU command's time limit (at commit b05d198).
NORM_GPU_SHAPES = GPU_SHAPES[:2]


def shapes(gpu_shapes=GPU_SHAPES) -> list[tuple[str, DecoderConfig, int]]:
    """(model, its layer shapes, tokens) to measure: Qwen3 widths at 4K to 16K tokens on
    the GPU; odd sizes on the CPU."""
    return backend.pick(cpu=[("tiny", TINY_SHAPE, 37)],
                        gpu=[(model, QWEN3[model], tokens) for model, tokens in gpu_shapes])


@dataclass(frozen=True)
class Op:
    """One fused op as the benchmark drives it.

    ``inputs`` makes the tensors (float ones require grad); ``call(fn, t)`` runs an
    implementation on them and returns its outputs as a tuple; ``fwd_bytes`` and
    ``bwd_bytes`` are the unavoidable traffic; ``ours`` and ``liger`` are the
    implementations besides the reference; ``compile_mode`` is torch.compile's mode for
    the reference and ``gpu_shapes`` the (model, tokens) pairs measured on a GPU.
    """

    name: str
    inputs: Callable[[DecoderConfig, int, torch.dtype], dict[str, torch.Tensor]]
    call: Callable[[Callable, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
    reference: Callable
    ours: Callable
    liger: str  # the liger_kernel.ops attribute, resolved lazily
    fwd_bytes: Callable[[dict[str, torch.Tensor]], int]
    bwd_bytes: Callable[[dict[str, torch.Tensor]], int]
    compile_mode: str = "max-autotune-no-cudagraphs"
    gpu_shapes: tuple[tuple[str, int], ...] = GPU_SHAPES


def _randn(*shape, dtype, seed, grad=True):
    return check.randn(*shape, dtype=dtype, device=backend.device(), seed=seed).requires_grad_(grad)


def _norm_inputs(cfg, tokens, dtype):
    weight = (1.0 + 0.1 * check.randn(cfg.hidden_size, dtype=torch.float32, device=backend.device(), seed=3))
    return {"x": _randn(tokens, cfg.hidden_size, dtype=dtype, seed=1), "weight": weight.to(dtype).requires_grad_()}


def _add_norm_inputs(cfg, tokens, dtype):
    return {**_norm_inputs(cfg, tokens, dtype), "residual": _randn(tokens, cfg.hidden_size, dtype=dtype, seed=2)}


def _rope_inputs(cfg, tokens, dtype):
    cos, sin = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=backend.device())(
        torch.arange(tokens, device=backend.device()), dtype)
    return {"q": _randn(1, tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, seed=4),
            "k": _randn(1, tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, seed=5),
            "cos": cos, "sin": sin}


def _swiglu_inputs(cfg, tokens, dtype):
    return {"gate": _randn(tokens, cfg.intermediate_size, dtype=dtype, seed=6),
            "up": _randn(tokens, cfg.intermediate_size, dtype=dtype, seed=7)}


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _liger_rope(q, k, cos, sin):
    # Liger takes HF's [B, H, T, D] views and rotates their [B, T, H, D] storage in place.
    from liger_kernel.ops.rope import LigerRopeFunction
    qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _in_place_input(t):
    """RoPE rotates its inputs in place, which autograd allows on a non-leaf only: in a
    model q is the q-norm's output. A clone stands in for it; its backward moves no data."""
    return t.clone() if torch.is_grad_enabled() else t


OPS = {
    "rms_norm": Op(
        "rms_norm", _norm_inputs,
        call=lambda fn, t: (fn(t["x"], t["weight"], EPS),),
        reference=reference.rms_norm_reference, ours=rms_norm, liger="rms_norm.LigerRMSNormFunction",
        fwd_bytes=lambda t: 2 * _nbytes(t["x"]), bwd_bytes=lambda t: 3 * _nbytes(t["x"]),
        compile_mode="default", gpu_shapes=NORM_GPU_SHAPES),
    "add_rms_norm": Op(
        "add_rms_norm", _add_norm_inputs,
        call=lambda fn, t: tuple(fn(t["x"], t["residual"], t["weight"], EPS)),
        reference=reference.add_rms_norm_reference, ours=add_rms_norm,
        liger="fused_add_rms_norm.LigerFusedAddRMSNormFunction",
        # forward: x, residual in; y, x + residual out. backward: dy, d(sum), the sum in; dx out
        # (the residual's gradient is the same tensor).
        fwd_bytes=lambda t: 4 * _nbytes(t["x"]), bwd_bytes=lambda t: 4 * _nbytes(t["x"]),
        compile_mode="default", gpu_shapes=NORM_GPU_SHAPES),
    "rope": Op(
        "rope", _rope_inputs,
        call=lambda fn, t: tuple(fn(_in_place_input(t["q"]), _in_place_input(t["k"]), t["cos"], t["sin"])),
        reference=reference.rope_reference, ours=rope_, liger="rope",
        # q and k read and written; half of each angle table read (the halves are equal).
        fwd_bytes=lambda t: 2 * _nbytes(t["q"], t["k"]) + _nbytes(t["cos"]),
        bwd_bytes=lambda t: 2 * _nbytes(t["q"], t["k"]) + _nbytes(t["cos"])),
    "swiglu": Op(
        "swiglu", _swiglu_inputs,
        call=lambda fn, t: (fn(t["gate"], t["up"]),),
        reference=reference.swiglu_reference, ours=swiglu, liger="swiglu.LigerSiLUMulFunction",
        fwd_bytes=lambda t: 3 * _nbytes(t["gate"]), bwd_bytes=lambda t: 5 * _nbytes(t["gate"])),
}


def _liger(op: Op) -> tuple[Callable | None, str]:
    """Liger-Kernel's implementation of ``op`` and its version, or ``None`` and why not.

    Imported lazily and on a GPU only: Liger is a peer to measure against, not a
    dependency of the book (and its kernels do not run in Triton's interpreter)."""
    if not backend.on_gpu():
        return None, "not run: Liger-Kernel is measured on a GPU only"
    if op.liger == "rope":
        fn = _liger_rope
    else:
        module, attr = op.liger.split(".")
        try:
            mod = importlib.import_module(f"liger_kernel.ops.{module}")
        except ImportError as e:
            return None, f"missing: {e}"
        fn = getattr(mod, attr).apply
    return fn, f"liger-kernel {importlib.metadata.version('liger-kernel')}, defaults"


def _compiled(fn: Callable, mode: str) -> Callable:
    # A fresh compile per shape, specialised to it; the reset keeps dynamo's recompile
    # limit out of the way.
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, mode=mode)


def no_donated_buffers():
    """The context every measurement runs in. The backward is timed by replaying one graph
    (``retain_graph=True``), which a compiled backward that donates its saved buffers
    refuses: the norms' did on the H200. Donation reuses memory; it does not change the
    kernels, so it is switched off, for the compile *and* the backward: torch checks the
    switch again when the backward runs, and with it off only at compile time the check
    still fired (fused.tiles' first run, in its failures)."""
    return torch._functorch.config.patch(donated_buffer=False)


def _leaves(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [v for v in t.values() if v.requires_grad]


def _check(name: str, op: Op, fn: Callable, t: dict[str, torch.Tensor], dtype) -> None:
    """``fn``'s outputs and gradients against the float64 reference, on fresh copies of ``t``."""
    fresh = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in t.items()}
    exact = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in t.items()}
    outs = op.call(fn, fresh)
    refs = op.call(op.reference, exact)
    grads_out = [check.randn(*o.shape, dtype=dtype, device=o.device, seed=20 + i) for i, o in enumerate(outs)]
    got = torch.autograd.grad(outs, _leaves(fresh), [g.clone() for g in grads_out])
    want = torch.autograd.grad(refs, _leaves(exact), [g.double() for g in grads_out])
    for i, (o, r) in enumerate(zip(outs, refs)):
        check.assert_close(o, r, dtype=dtype, name=f"{name} {op.name} output {i}")
    for leaf, g, r in zip([k for k, v in fresh.items() if v.requires_grad], got, want):
        check.assert_close(g, r, dtype=dtype, name=f"{name} {op.name} d{leaf}")


def _rates(op: Op, fn: Callable, t: dict[str, torch.Tensor], target_ms: float) -> tuple[float, float]:
    """(forward TB/s, backward TB/s) of ``fn``."""
    reps = backend.pick(cpu=1, gpu=None)

    def forward():
        with torch.no_grad():
            op.call(fn, t)

    fwd = timing.measure(forward, target_ms=target_ms, reps=reps)
    outs = op.call(fn, t)
    leaves = _leaves(t)
    grads_out = [torch.randn_like(o) for o in outs]
    bwd = timing.measure(lambda: torch.autograd.grad(outs, leaves, grads_out, retain_graph=True),
                         target_ms=target_ms, reps=reps)
    return timing.bandwidth_tbps(op.fwd_bytes(t), fwd), timing.bandwidth_tbps(op.bwd_bytes(t), bwd)


def measure_op(op: Op) -> Measurement:
    with no_donated_buffers():
        return _measure_op(op)


def _measure_op(op: Op) -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    target_ms = backend.pick(cpu=1.0, gpu=30.0)
    copy = ceilings.copy_bandwidth_tbps()
    liger, liger_note = _liger(op)
    notes = {"torch": f"labkit.fused.reference.{op.reference.__name__}, eager, torch {torch.__version__}",
             "torch.compile": (f"torch.compile(reference, dynamic=False, mode='{op.compile_mode}'), "
                               "fresh per shape" if backend.on_gpu() else
                               "not run: measured on a GPU only (the interpreter times nothing real)"),
             "liger": liger_note}
    failures: list[str] = []
    rows, goals = [], []
    for model, cfg, tokens in shapes(op.gpu_shapes):
        t = op.inputs(cfg, tokens, dtype)
        impls: dict[str, Callable | None] = {
            "ours": op.ours, "torch": op.reference,
            "torch.compile": _compiled(op.reference, op.compile_mode) if backend.on_gpu() else None,
            "liger": liger}
        found: dict[str, tuple[float, float] | None] = {}
        for name, fn in impls.items():
            if fn is None:
                found[name] = None
                continue
            try:
                _check(name, op, fn, t, dtype)
                found[name] = _rates(op, fn, t, target_ms)
            except Exception as e:  # a peer failing at a shape is recorded, not fatal
                if name == "ours":
                    raise
                failures.append(f"{name} at {model} x {tokens}: {type(e).__name__}: {e}"[:300])
                found[name] = None
        for direction, index, moved in (("forward", 0, op.fwd_bytes(t)), ("backward", 1, op.bwd_bytes(t))):
            ours = found["ours"][index]
            peers = {p: (found[p][index] if found[p] else None) for p in PEERS}
            ratios = {f"ours/{p}": (ours / v if v else None) for p, v in peers.items()}
            ratios["ours/limit"] = ours / copy
            # A copy moving as many bytes, timed alike: what a call of this size can reach when it
            # only moves bytes (the 2 GiB copy of the ceiling hides a launch's start and its last
            # wave; a call of tens of MB does not).
            same_size_copy = ceilings.copy_bandwidth_at_tbps(int(moved))
            label = f"{model} x {tokens} {direction}"
            rows.append({"model": model, "tokens": tokens, "width": _width(op, cfg), "direction": direction,
                         "shape": label.rsplit(" ", 1)[0], "ours": ours, **peers, "copy": copy, **ratios,
                         "bytes": int(moved), "same_size_copy": same_size_copy,
                         "ours/same-size copy": ours / same_size_copy})
            if backend.on_gpu():
                goals += [Goal(f"ours/{ref} {label}", ratios[f"ours/{ref}"], ">=", threshold)
                          for ref, threshold in GOALS if ratios[f"ours/{ref}"] is not None]
        del t
    config = {"dtype": str(dtype).replace("torch.", ""), "peers": notes, "peer_failures": failures,
              "checked": "outputs and gradients against float64, before timing",
              "autotuned": kernels.autotuned_choices()}
    if op.name in ("rms_norm", "add_rms_norm"):
        # the backward's launch per width, from the table (the autotuner's share is in "autotuned")
        config["norm_backward_tiles"] = {
            _width(op, cfg): dataclasses.asdict(kernels.pick_tile(kernels.NORM_BACKWARD_TILES, cfg.hidden_size))
            for _, cfg, _ in shapes(op.gpu_shapes)}
    config["same_size_copy"] = ("labkit.ceilings.copy_bandwidth_at_tbps(bytes): a device copy moving as many "
                                "bytes (half read, half written), timed alike")
    return Measurement(rows=rows, metric="TB/s (unavoidable bytes: inputs read once, outputs written once)",
                       limits={"copy_tbps": copy}, goals=goals, config=config)


def _width(op: Op, cfg: DecoderConfig) -> str:
    if op.name == "swiglu":
        return f"intermediate {cfg.intermediate_size}"
    if op.name == "rope":
        return f"{cfg.num_heads}+{cfg.num_kv_heads} heads x {cfg.head_dim}"
    return f"hidden {cfg.hidden_size}"


@benchmark("fused.rms_norm", chapter=CHAPTER,
           title="Fused RMSNorm, forward and backward, bf16: ours against torch, torch.compile, Liger and the copy limit")
def bench_rms_norm() -> Measurement:
    return measure_op(OPS["rms_norm"])


@benchmark("fused.add_rms_norm", chapter=CHAPTER,
           title="Residual add + RMSNorm, forward and backward, bf16: ours against torch, torch.compile, Liger "
                 "and the copy limit")
def bench_add_rms_norm() -> Measurement:
    return measure_op(OPS["add_rms_norm"])


@benchmark("fused.rope", chapter=CHAPTER,
           title="RoPE on q and k, forward and backward, bf16: ours against torch, torch.compile, Liger and "
                 "the copy limit")
def bench_rope() -> Measurement:
    return measure_op(OPS["rope"])


@benchmark("fused.swiglu", chapter=CHAPTER,
           title="SwiGLU activation, forward and backward, bf16: ours against torch, torch.compile, Liger and "
                 "the copy limit")
def bench_swiglu() -> Measurement:
    return measure_op(OPS["swiglu"])


@benchmark("fused.tiles", chapter=CHAPTER,
           title="Every candidate launch of each fused kernel, forward and backward, bf16, at Qwen3 shapes: "
                 "the sweep the launch tables come from")
def bench_tiles() -> Measurement:
    from . import tiles  # imported here: the sweep is built on this module's OPS

    return tiles.sweep()


@benchmark("fused.prefetch", chapter=CHAPTER,
           title="RMSNorm backward, bf16: each program's walk over its rows, plain and double-buffered, "
                 "at 1 to 16 programs per SM")
def bench_prefetch() -> Measurement:
    from . import tiles

    return tiles.prefetch_sweep()


@benchmark("fused.dw_reduction", chapter=CHAPTER,
           title="RMSNorm backward, bf16: dw summed from partial rows by torch, or by atomics in the kernel, "
                 "each walk, at 1 to 16 programs per SM")
def bench_dw_reduction() -> Measurement:
    from . import tiles

    return tiles.dw_reduction_sweep()


PROFILE_TOKENS = 4096


@benchmark("fused.step_profile", chapter=CHAPTER,
           title="Where one Qwen3-0.6B step's GPU time goes (bf16, random weights, 4096 tokens): "
                 "kernels by kind, eager and fused, forward and forward + backward")
def step_profile() -> Measurement:
    cfg = backend.pick(cpu=TINY_SHAPE, gpu=QWEN3["Qwen3-0.6B"])
    tokens = backend.pick(cpu=37, gpu=PROFILE_TOKENS)
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=backend.device(),
                        generator=check.make_generator(0, backend.device()))
    rows = []
    for fused in (False, True):
        model = Decoder(cfg, dtype=dtype, device=backend.device(), fused=fused)
        logits_grad = None

        def forward():
            with torch.no_grad():
                model(ids)

        def train_step():
            nonlocal logits_grad
            logits = model(ids)
            if logits_grad is None:
                logits_grad = torch.randn_like(logits)
            logits.backward(logits_grad)
            model.zero_grad(set_to_none=True)

        for phase, step in (("forward", forward), ("forward + backward", train_step)):
            shares = profile.kernel_breakdown(step)
            total = sum(s.ms for s in shares)
            rows += [{"model": "fused" if fused else "eager", "phase": phase, "category": s.category,
                      "ms": s.ms, "kernels": s.kernels, "share": s.ms / total} for s in shares]
        del model
    return Measurement(
        rows=rows, metric="ms of device time in one step (summed kernel durations)",
        config={"model": "Qwen3-0.6B shapes" if backend.on_gpu() else "tiny shapes (CPU op time)",
                "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
                "categories": "by kernel name: labkit.fused.profile.CATEGORIES",
                "backward": "logits.backward(random) with every weight requiring grad"},
    )
