"""Benchmarks of chapter ``lora-family``: the fused LoRA linear, multi-LoRA serving, and the
fine-tuning comparison.

``lora.fused_linear`` times one training step of a layer (forward, then the backward to
``x`` and to the adapters) at rank 16 against: the *frozen* base linear (``F.linear`` with
``W`` frozen: forward and ``dx``, the work a LoRA layer cannot avoid), the same base linear
trained in full (``dW`` as well), peft's LoRA layer (its own module, unfused: three matmuls
and an add), the Unsloth-style composition ``torch.addmm(x W^T, x A^T, B^T, alpha=s)`` (the
add in cuBLAS's epilogue), and :func:`labkit.lora.reference.lora_linear` under
``torch.compile``. Every implementation's output and gradients are checked against float64
first. Speed-ups are ``ours/<peer>`` = peer time / our time.

``lora.multi_lora`` times adding each token's adapter to a base output: decode batches
with BGMV, prefill segments with SGMV, against the loop over the adapters present (peft's
mixed-batch forward) and against the same batch with one adapter for everyone, run as plain
LoRA (two cuBLAS matmuls: what serving a single fine-tune costs).

``lora.finetune`` runs :func:`labkit.lora.finetune.compare_methods`: quality against
trainable parameters for every variant, and the spectra of a full fine-tune's updates.
"""

from __future__ import annotations

import importlib.metadata

import torch
import torch.nn.functional as F
from torch import nn

from .. import backend, ceilings, check, profiling, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import bgmv, finetune, kernels, lora_linear, reference, sgmv

CHAPTER = "lora-family"
RANK = 16
FUSED_GOAL = 1.15          # fused fwd+bwd time at most this times the frozen base linear's
STEP_KERNELS = 12          # kernels of our step recorded per shape, the longest first
LOOP_GOAL = 5.0            # BGMV with 32 adapters at least this much faster than the loop
SINGLE_ADAPTER_GOAL = 1.3  # ... and at most this times the single-adapter batch's time

# (tokens, K, N): Qwen3-8B's attention projection and MLP up/down at 8K tokens a step.
GPU_LINEAR_SHAPES = ((8192, 4096, 4096), (8192, 4096, 12288), (8192, 12288, 4096))
CPU_LINEAR_SHAPES = ((67, 48, 80),)


def _dtype():
    return backend.pick(cpu=torch.float32, gpu=torch.bfloat16)


def _peft_layer(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, alpha: float):
    """peft's LoRA ``Linear`` around ``weight`` with our adapter weights, or ``None`` and why not."""
    try:
        import peft
    except ImportError as e:
        return None, f"not importable: {e}"
    holder = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                                     device=weight.device))
    with torch.no_grad():
        holder[0].weight.copy_(weight)
    # Adapters in the base's dtype, as ours are (peft's default would keep them in fp32 and cast x for them).
    model = peft.get_peft_model(holder, peft.LoraConfig(r=lora_a.shape[0], lora_alpha=alpha, target_modules=["0"]),
                                autocast_adapter_dtype=False)
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(lora_a)
        layer.lora_B["default"].weight.copy_(lora_b)
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    return (model, params), (f"peft {importlib.metadata.version('peft')}, LoraConfig(r, lora_alpha), no dropout, "
                             "autocast_adapter_dtype=False (adapters in bf16)")


def _compiled_reference():
    torch._dynamo.reset()
    return torch.compile(reference.lora_linear, dynamic=False)


@benchmark("lora.fused_linear", chapter=CHAPTER,
           title="LoRA linear layer, forward + backward at rank 16, bf16: the fused Triton kernel against the "
                 "frozen base linear, peft, torch.addmm and torch.compile")
def bench_fused_linear() -> Measurement:
    dtype, dev = _dtype(), backend.device()
    target_ms = backend.pick(cpu=1.0, gpu=40.0)
    reps = backend.pick(cpu=1, gpu=None)
    alpha = 2.0 * RANK
    scaling = reference.lora_scaling(alpha, RANK)
    limits = ceilings.limits()
    rows, goals, failures = [], [], []
    notes = {}
    step_kernels = {}
    for m, k, n in backend.pick(cpu=CPU_LINEAR_SHAPES, gpu=GPU_LINEAR_SHAPES):
        x = check.randn(m, k, dtype=dtype, device=dev, seed=1).requires_grad_()
        w = check.randn(n, k, dtype=dtype, device=dev, seed=2, scale=k**-0.5)
        a = check.randn(RANK, k, dtype=dtype, device=dev, seed=3, scale=k**-0.5).requires_grad_()
        b = check.randn(n, RANK, dtype=dtype, device=dev, seed=4, scale=0.1).requires_grad_()
        w_trained = w.detach().clone().requires_grad_()
        dy = check.randn(m, n, dtype=dtype, device=dev, seed=5)
        exact = [t.detach().double().requires_grad_() for t in (x, a, b)]
        y_exact = reference.lora_linear(exact[0], w.double(), exact[1], exact[2], scaling)
        grads_exact = torch.autograd.grad(y_exact, exact, dy.double())
        del exact
        peft_pair, notes["peft"] = _peft_layer(w, a.detach(), b.detach(), alpha)
        compiled = _compiled_reference() if backend.on_gpu() else None
        lora_leaves = [x, a, b]
        impls = {
            "ours": (lambda: lora_linear(x, w, a, b, scaling), lora_leaves),
            "base": (lambda: F.linear(x, w), [x]),
            "base_trainable": (lambda: F.linear(x, w_trained), [x, w_trained]),
            "addmm": (lambda: torch.addmm(F.linear(x, w), F.linear(x, a), b.T, alpha=scaling), lora_leaves),
        }
        if peft_pair is not None:
            model, params = peft_pair
            impls["peft"] = (lambda: model(x), [x, *params])
        if compiled is not None:
            impls["torch.compile"] = (lambda: compiled(x, w, a, b, scaling), lora_leaves)
        row = {"tokens": m, "K": k, "N": n, "rank": RANK}
        for name, (forward, leaves) in impls.items():
            try:
                if name not in ("base", "base_trainable"):
                    y = forward()
                    got = torch.autograd.grad(y, leaves[:3], dy)
                    check.assert_close(y, y_exact, dtype=dtype, name=f"{name} y")
                    for g, e, what in zip(got, grads_exact, "xAB"):
                        check.assert_close(g, e, dtype=dtype, name=f"{name} d{what}")
                    del y, got

                def step(forward=forward, leaves=leaves):
                    torch.autograd.grad(forward(), leaves, dy)

                row[f"{name}_ms"] = timing.measure(step, target_ms=target_ms, reps=reps).median_ms
            except Exception as e:  # a peer failing is recorded, not fatal
                if name == "ours":
                    raise
                failures.append(f"{name} at {m}x{k}x{n}: {type(e).__name__}: {e}"[:300])
        # The Triton kernel alone against cuBLAS on the same matmuls, the forward's and the
        # backward's dx: what the big matmuls cost in each, apart from the thin products
        # (u = x A^T and du = s dy B are made once, outside the timing). What the step spends
        # beyond the two kernels is the thin products' GPU time, and any time the GPU waits for
        # the host to issue the next launch (Python, autograd, the launchers).
        with torch.no_grad():
            u = F.linear(x, a)
            du = (dy @ b) * scaling
            for what, kernel_call, cublas_call in (
                    ("fwd", lambda: kernels.matmul_lowrank(x, w.T, u, b.T, scaling), lambda: F.linear(x, w)),
                    ("dx", lambda: kernels.matmul_lowrank(dy, w, du, a, 1.0), lambda: dy @ w)):
                row[f"kernel_{what}_ms"] = timing.measure(kernel_call, target_ms=target_ms, reps=reps).median_ms
                row[f"base_{what}_ms"] = timing.measure(cublas_call, target_ms=target_ms, reps=reps).median_ms
                row[f"kernel/base_{what}"] = row[f"kernel_{what}_ms"] / row[f"base_{what}_ms"]
            # The host's share of one of those calls: the autotuner's lookup, the TMA descriptors
            # and Triton's launcher (a step makes two).
            row["kernel_host_ms"] = timing.host_ms(lambda: kernels.matmul_lowrank(x, w.T, u, b.T, scaling))
            del u, du
        row["rest_ms"] = row["ours_ms"] - row["kernel_fwd_ms"] - row["kernel_dx_ms"]
        # The host's time to issue one step (the GPU held busy meanwhile): where it exceeds the
        # step's kernels, the GPU waits for launches and rest_ms holds that wait.
        row["ours_host_ms"] = timing.host_ms(lambda: torch.autograd.grad(lora_linear(x, w, a, b, scaling),
                                                                         lora_leaves, dy))
        # Our step's kernels one by one (the thin products are the cuBLAS GEMMs beside the two
        # Triton ones), where rest_ms is only a difference of separate timings.
        profiled = backend.pick(cpu=1, gpu=10)
        by_time = sorted(profiling.kernels_run(lambda: torch.autograd.grad(lora_linear(x, w, a, b, scaling),
                                                                           lora_leaves, dy), profiled),
                         key=lambda kernel: -kernel.us)
        step_kernels[f"{m}x{k}x{n}"] = [{"kernel": kernel.name, "launches_per_step": kernel.launches / profiled,
                                         "us_per_step": kernel.us / profiled} for kernel in by_time[:STEP_KERNELS]]
        ours = row["ours_ms"]
        for peer in ("base", "base_trainable", "peft", "addmm", "torch.compile"):
            if f"{peer}_ms" in row:
                row[f"ours/{peer}"] = row[f"{peer}_ms"] / ours
        flops = 4.0 * m * n * k + 6.0 * m * RANK * (k + n)
        row["ours_tflops"] = flops / (ours * 1e-3) / 1e12
        row["ours/limit"] = row["ours_tflops"] / limits["matmul_bf16_tflops"]
        row["time_vs_base"] = ours / row["base_ms"]
        best = getattr(kernels.matmul_lowrank_kernel, "best_config", None)
        row["last_tile"] = str(best) if best is not None else "n/a"
        rows.append(row)
        if backend.on_gpu():
            goals.append(Goal(f"fused LoRA fwd+bwd time / frozen base linear's, r={RANK}, {m}x{k}x{n}",
                              row["time_vs_base"], "<=", FUSED_GOAL))
        del x, w, a, b, w_trained, dy, impls, peft_pair, compiled
    notes.update({
        "ours": "labkit.lora.lora_linear: Triton matmul_lowrank for y and dx, cuBLAS for x A^T, dy B, dA, dB",
        "base": "F.linear(x, W), W frozen: forward and dx",
        "kernel_fwd / base_fwd": "labkit.lora.kernels.matmul_lowrank (x W^T + s u B^T, u given) against "
                                 "F.linear(x, W), forward only, under no_grad",
        "kernel_dx / base_dx": "labkit.lora.kernels.matmul_lowrank (dy W + du A, du given) against dy @ W, "
                               "under no_grad",
        "rest": "ours - kernel_fwd - kernel_dx: the thin products (x A^T, dy B, dA, dB), and any time the GPU "
                "waits for the host's next launch",
        "ours_host": "labkit.timing.host_ms: the host's time to issue one step of ours, the GPU held busy",
        "kernel_host": "labkit.timing.host_ms of one forward matmul_lowrank call (a step makes two such calls)",
        "base_trainable": "F.linear(x, W), W trained: forward, dx and dW",
        "addmm": "torch.addmm(F.linear(x, W), F.linear(x, A), B^T, alpha=s): the add in cuBLAS's epilogue",
        "torch.compile": ("torch.compile(labkit.lora.reference.lora_linear, dynamic=False), default mode, "
                          "fresh per shape" if backend.on_gpu() else "not run: GPU only"),
    })
    return Measurement(
        rows=rows, metric="ms per forward + backward (median); ours/<peer> = peer time / our time",
        limits=limits, goals=goals,
        config={"dtype": str(dtype).replace("torch.", ""), "rank": RANK, "alpha": alpha, "peers": notes,
                "peer_failures": failures, "checked": "y, dx, dA, dB against float64, before timing",
                # per shape: the longest kernels of our step (labkit.profiling.kernels_run; under the
                # interpreter, ATen ops and their CPU time)
                "ours_step_kernels": step_kernels,
                "flops": "4 M N K (forward and dx) + 6 M r (K + N) (the six rank-r products)"},
    )


def _adapter_stack(adapters: int, k: int, n: int, dtype, dev):
    a = check.randn(adapters, RANK, k, dtype=dtype, device=dev, seed=11, scale=k**-0.5)
    b = check.randn(adapters, n, RANK, dtype=dtype, device=dev, seed=12, scale=0.1)
    scalings = torch.full((adapters,), 2.0, dtype=torch.float32, device=dev)
    return a, b, scalings


# (tokens, distinct adapters) of decode batches, and (segments, tokens each) of prefills
GPU_DECODE = ((32, 1), (32, 4), (32, 32), (8, 8), (128, 32), (256, 32))
CPU_DECODE = ((9, 1), (9, 9))
GPU_PREFILL = ((8, 256), (32, 64))
CPU_PREFILL = ((2, 17),)


@benchmark("lora.multi_lora", chapter=CHAPTER,
           title="Multi-LoRA: every token its own adapter (BGMV for decode, SGMV for prefill) against the loop "
                 "over adapters and a single-adapter batch, rank 16, bf16")
def bench_multi_lora() -> Measurement:
    dtype, dev = _dtype(), backend.device()
    k, n = backend.pick(cpu=(72, 56), gpu=(4096, 4096))
    adapters = backend.pick(cpu=9, gpu=32)
    a, b, scalings = _adapter_stack(adapters, k, n, dtype, dev)
    target_ms = backend.pick(cpu=1.0, gpu=30.0)
    reps = backend.pick(cpu=1, gpu=None)
    copy = ceilings.copy_bandwidth_tbps()
    element = torch.finfo(dtype).bits // 8

    def single(y, x):  # one adapter for the whole batch: plain LoRA, two cuBLAS matmuls
        return y.addmm_(x @ a[0].T, b[0].T, alpha=2.0)

    rows, goals = [], []
    cases = [("decode", t, d, None) for t, d in backend.pick(cpu=CPU_DECODE, gpu=GPU_DECODE)]
    cases += [("prefill", s * length, s, length) for s, length in backend.pick(cpu=CPU_PREFILL, gpu=GPU_PREFILL)]
    for kind, tokens, distinct, seg_len in cases:
        x = check.randn(tokens, k, dtype=dtype, device=dev, seed=13)
        y = check.randn(tokens, n, dtype=dtype, device=dev, seed=14)
        if kind == "decode":  # requests in arrival order, adapters interleaved
            indices = (torch.arange(tokens, device=dev) % distinct).to(torch.int32)
        else:
            indices = torch.arange(distinct, device=dev).repeat_interleave(seg_len).to(torch.int32)
        want = reference.bgmv(y, x, a, b, indices, scalings)
        check.assert_close(bgmv(y.clone(), x, a, b, indices, scalings), want, dtype=dtype, name=f"bgmv {kind}")
        check.assert_close(reference.lora_loop(y, x, a, b, indices, scalings), want, dtype=dtype, name="loop")
        # Timed through the launchers: the checked entry points read the indices on the host
        # (a sync), which a server does once per step for all layers, not per layer call.
        impls = {"ours_bgmv": lambda: kernels.bgmv(y, x, a, b, indices, scalings),
                 "loop": lambda: reference.lora_loop(y, x, a, b, indices, scalings),
                 "single_adapter": lambda: single(y, x)}
        if kind == "prefill":
            starts = torch.arange(0, tokens + 1, seg_len, device=dev, dtype=torch.int32)
            seg_adapters = torch.arange(distinct, device=dev, dtype=torch.int32)
            check.assert_close(sgmv(y.clone(), x, a, b, starts, seg_adapters, scalings), want, dtype=dtype,
                               name="sgmv")
            impls["ours_sgmv"] = lambda: kernels.sgmv(y, x, a, b, starts, seg_adapters, scalings, seg_len)
        row = {"kind": kind, "tokens": tokens, "adapters_in_batch": distinct, "K": k, "N": n, "rank": RANK,
               "segment_tokens": seg_len}
        for name, fn in impls.items():
            row[f"{name}_ms"] = timing.measure(fn, target_ms=target_ms, reps=reps).median_ms
        ours = row["ours_sgmv_ms"] if kind == "prefill" else row["ours_bgmv_ms"]
        row["ours_ms"] = ours
        row["ours/loop"] = row["loop_ms"] / ours
        row["ours/single_adapter"] = row["single_adapter_ms"] / ours
        # bytes that cannot be avoided: x read, y read and written, each distinct adapter read once
        moved = element * (tokens * k + 2 * tokens * n + distinct * RANK * (k + n))
        row["ours_tbps"] = moved / (ours * 1e-3) / 1e12
        row["ours/limit"] = row["ours_tbps"] / copy
        rows.append(row)
        if backend.on_gpu() and kind == "decode" and tokens == 32 and distinct == 32:
            goals += [Goal("BGMV speed-up over the loop, 32 tokens x 32 adapters", row["ours/loop"], ">=", LOOP_GOAL),
                      Goal("BGMV time / single-adapter batch's, 32 tokens x 32 adapters",
                           ours / row["single_adapter_ms"], "<=", SINGLE_ADAPTER_GOAL)]
    return Measurement(
        rows=rows, metric="ms to add every token's adapter to the base output (median)", limits={"copy_tbps": copy},
        goals=goals,
        config={"dtype": str(dtype).replace("torch.", ""), "adapters_loaded": adapters, "rank": RANK,
                "ours": "labkit.lora.kernels.bgmv (decode) and .sgmv (prefill), in place; their checked entry points "
                        "labkit.lora.bgmv/sgmv validated the same arguments once before timing",
                "loop": "labkit.lora.reference.lora_loop: per adapter present, gather its rows, two matmuls, "
                        "scatter-add (what peft's mixed-batch forward does)",
                "single_adapter": "the same tokens all on one adapter: y.addmm_(x @ A^T, B^T) in cuBLAS",
                "checked": "BGMV, SGMV and the loop against float64 before timing"},
    )


CPU_SETUP = finetune.Setup(hidden=64, layers=2, heads=4, head_dim=16, intermediate=128, alphabet=24, length=6,
                           changed=12, batch=32, base_steps=300, finetune_steps=40)
GPU_SETUP = finetune.Setup(hidden=256, layers=4, heads=4, head_dim=64, intermediate=704, alphabet=96, length=12,
                           changed=48, batch=64, base_steps=800, finetune_steps=120)


@benchmark("lora.finetune", chapter=CHAPTER,
           title="Fine-tuning the book's model on a second task: each LoRA variant's accuracy against its "
                 "trainable parameters, and the singular values of a full fine-tune's updates")
def bench_finetune() -> Measurement:
    setup = backend.pick(cpu=CPU_SETUP, gpu=GPU_SETUP)
    result = finetune.compare_methods(setup, device=backend.device())
    rows = [{"kind": "method", **m} for m in result["methods"]]
    rows += [{"kind": "spectrum", **s} for s in result["spectra"]]
    cfg = setup.config()
    return Measurement(
        rows=rows, metric="answer accuracy and loss (nats per answer token) on the second task, 512 fresh sequences",
        config={"setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(setup).items()},
                "model_parameters": cfg.num_parameters(),
                "base_accuracy_on_base_task": result["base_accuracy_on_base_task"],
                "base_losses": result["base_losses"],
                "alpha": "2 x rank for every adapter; learning rates: base_lr, full_lr, lora_lr of the setup",
                "targets": "every block's wq, wk, wv, wo, gate, up, down"},
    )
