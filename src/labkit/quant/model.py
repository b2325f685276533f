"""Quantizing the book's model and scoring it: perplexity per format and method.

Quantization here is *simulated* for accuracy: each linear layer of every block gets the
dequantized weight back in float, so the model computes exactly what a dequantizing kernel
would (up to accumulation order) while the embedding, norms and tied LM head stay in
float, as in deployed INT4 checkpoints. GPTQ and AWQ-style methods need each layer's inputs:
they are captured once from the float model on calibration text (the reference GPTQ
quantizes layer by layer and feeds quantized outputs forward; at four layers the
difference is small, and this keeps the code short).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import models
from ..validate import check_choice
from .methods import awq_scales, gptq_quantize, hessian
from .reference import dequantize, quantize_rtn

METHODS = ("rtn", "gptq", "awq")


def linear_layers(model: models.Decoder) -> dict[str, nn.Linear]:
    """The blocks' linear layers by name (attention q/k/v/o, MLP gate/up/down)."""
    return {name: m for name, m in model.blocks.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def capture_inputs(model: models.Decoder, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each linear layer's input ``[tokens, K]`` on ``tokens`` ``[batch, T]``."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(
        name, args[0].reshape(-1, args[0].shape[-1]).float()))
        for name, m in linear_layers(model).items()]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def quantize_model(model: models.Decoder, bits: int, group_size: int | None, method: str = "rtn",
                   calibration: torch.Tensor | None = None) -> tuple[models.Decoder, dict[str, float]]:
    """A copy of ``model`` with its linear weights quantized and dequantized; and the weight errors.

    ``group_size=None`` is per-channel. ``calibration`` ``[batch, T]`` token ids are needed
    by ``gptq`` and ``awq``. The stats are the max and mean ``|W - Q|`` over all layers.
    """
    check_choice(method, "method", METHODS)
    if method != "rtn" and calibration is None:
        raise ValueError(f"method {method!r} needs calibration tokens")
    inputs = capture_inputs(model, calibration) if method != "rtn" else {}
    out = copy.deepcopy(model)
    max_err, abs_sum, count = 0.0, 0.0, 0
    for name, layer in linear_layers(out).items():
        w = layer.weight.float()
        g = group_size or w.shape[1]
        if method == "rtn":
            q = dequantize(quantize_rtn(w, bits, g))
        elif method == "gptq":
            q = dequantize(gptq_quantize(w, hessian(inputs[name]), bits, g))
        else:
            s, _ = awq_scales(w, inputs[name], bits, g)
            q = dequantize(quantize_rtn(w * s, bits, g)) / s
        diff = (q - w).abs()
        max_err = max(max_err, diff.max().item())
        abs_sum += diff.sum().item()
        count += diff.numel()
        layer.weight.copy_(q.to(layer.weight.dtype))
    return out, {"max_abs_error": max_err, "mean_abs_error": abs_sum / count}


@torch.no_grad()
def perplexity(model: models.Decoder, tokens: torch.Tensor, seq_len: int = 256) -> float:
    """``exp`` of the mean next-token cross-entropy over non-overlapping ``seq_len`` windows."""
    if tokens.ndim != 1 or tokens.numel() < seq_len + 1:
        raise ValueError(f"tokens must be 1-D with at least seq_len + 1 = {seq_len + 1} ids, "
                         f"got shape {tuple(tokens.shape)}")
    windows = (tokens.numel() - 1) // seq_len
    x = tokens[:windows * seq_len].reshape(windows, seq_len)
    y = tokens[1:windows * seq_len + 1].reshape(windows, seq_len)
    logits = model(x.to(model.embed.weight.device))
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1).to(logits.device))
    return math.exp(loss.item())
