"""Hidden tests of lora-merge: peft is the oracle, on fresh weights, odd sizes, fp32 and bf16."""

import copy

import torch
from torch import nn

from labkit import check

import peft


def peft_pair(k, n, rank, alpha, dtype=torch.float32, bias=False, use_rslora=False, seed=0):
    """(model, its LoRA layer, base weight, A, B, bias): peft's LoRA around fresh weights with a nonzero B."""
    base = nn.Sequential(nn.Linear(k, n, bias=bias))
    with torch.no_grad():
        base[0].weight.copy_(check.randn(n, k, seed=seed + 1) * k**-0.5)
        if bias:
            base[0].bias.copy_(check.randn(n, seed=seed + 2))
    base = base.to(dtype)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["0"],
                                                                     use_rslora=use_rslora),
                                   autocast_adapter_dtype=False)  # adapters in the base's dtype, as here
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(check.randn(rank, k, seed=seed + 3) * k**-0.5)
        layer.lora_B["default"].weight.copy_(check.randn(n, rank, seed=seed + 4) * 0.2)
    model.eval()
    a = layer.lora_A["default"].weight.detach().clone()
    b = layer.lora_B["default"].weight.detach().clone()
    w = layer.base_layer.weight.detach().clone()
    bias_t = layer.base_layer.bias.detach().clone() if bias else None
    return model, w, a, b, bias_t


def test_forward_matches_peft(submission):
    """Odd sizes, fp32, x with a batch and a sequence axis."""
    model, w, a, b, _ = peft_pair(37, 29, 6, 12)
    x = check.randn(3, 5, 37, seed=10)
    out = submission.call("lora_forward", x, w, a, b, 12, 6)
    submission.expect_close(out, model(x).detach().double(), dtype=torch.float32, name="lora_forward vs peft")


def test_forward_with_bias_matches_peft(submission):
    model, w, a, b, bias = peft_pair(41, 17, 3, 5, bias=True, seed=20)
    x = check.randn(9, 41, seed=11)
    out = submission.call("lora_forward", x, w, a, b, 5, 3, bias)
    submission.expect_close(out, model(x).detach().double(), dtype=torch.float32, name="lora_forward with bias vs peft")


def test_forward_bf16_matches_peft(submission):
    model, w, a, b, _ = peft_pair(64, 48, 8, 16, dtype=torch.bfloat16, seed=30)
    x = check.randn(21, 64, seed=12).to(torch.bfloat16)
    out = submission.call("lora_forward", x, w, a, b, 16, 8)
    submission.expect_close(out, model(x).detach().double(), dtype=torch.bfloat16, name="bf16 lora_forward vs peft")


def test_rslora_matches_peft(submission):
    """use_rslora=True: the scale is alpha / sqrt(r)."""
    model, w, a, b, _ = peft_pair(33, 31, 16, 8, use_rslora=True, seed=40)
    x = check.randn(6, 33, seed=13)
    out = submission.call("lora_forward", x, w, a, b, 8, 16, None, True)
    submission.expect_close(out, model(x).detach().double(), dtype=torch.float32, name="rsLoRA forward vs peft")
    merged = submission.call("merge", w, a, b, 8, 16, True)
    submission.expect_close(merged, model.merge_and_unload()[0].weight.detach().double(), dtype=torch.float32,
                            name="rsLoRA merge vs peft")


def test_merge_matches_peft(submission):
    model, w, a, b, _ = peft_pair(45, 27, 5, 20, seed=50)
    merged = submission.call("merge", w, a, b, 20, 5)
    submission.expect_close(merged, model.merge_and_unload()[0].weight.detach().double(), dtype=torch.float32,
                            name="merge vs peft's merge_and_unload")


def test_unmerge_recovers_the_base_weight(submission):
    """peft merges the adapter into the weight; unmerge must give the base weight back."""
    model, w, a, b, _ = peft_pair(39, 35, 4, 4, seed=60)
    merged = model.merge_and_unload()[0].weight.detach().clone()
    back = submission.call("unmerge", merged, a, b, 4, 4)
    submission.expect_close(back, w.double(), dtype=torch.float32, name="unmerge of peft's merged weight")


def test_merge_rounds_once(submission):
    """bf16: W + s B A summed in fp32 and rounded once; rounding B A and the sum separately in bf16
    lands on a different bf16 neighbour for a large share of the weights."""
    w = check.randn(64, 96, seed=70).to(torch.bfloat16)
    a = check.randn(8, 96, seed=71).to(torch.bfloat16)
    b = (check.randn(64, 8, seed=72) * 0.05).to(torch.bfloat16)
    merged = submission.call("merge", w, a, b, 16, 8)
    want = (w.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16)
    assert isinstance(merged, torch.Tensor) and merged.dtype == torch.bfloat16, \
        f"merge must return the weight's dtype (bfloat16), got {getattr(merged, 'dtype', type(merged).__name__)}"
    same = (merged == want).float().mean().item()
    assert same >= 0.99, (f"only {same:.1%} of the merged bf16 weights equal the once-rounded fp32 sum; "
                          "compute W + s B A in fp32 and round once")
