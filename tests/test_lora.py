"""labkit.lora against float64 and against peft (LoRA, rsLoRA, DoRA, PiSSA, QLoRA-style) on the
same weights; labkit.quant.nf4 against the QLoRA paper's table."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import labkit  # noqa: F401  (sets the interpreter before triton)
from labkit import backend, check, lora, models, quant, sass
from labkit.lora import finetune, kernels, reference as R
from labkit.quant import nf4

peft = pytest.importorskip("peft")

DEV = backend.device()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# NF4's levels as the QLoRA paper (Dettmers et al., 2023) and bitsandbytes' NF4 code table
# give them: computed there, in fp32, from the normal quantiles.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return check.randn(*shape, dtype=torch.float32, device=DEV, seed=seed).mul(scale).to(dtype)


# ---- NF4 -------------------------------------------------------------------------------

def test_nf4_levels_match_the_published_table():
    levels = quant.nf4_levels()
    assert levels.shape == (16,) and levels[7] == 0.0
    assert torch.allclose(levels, torch.tensor(PUBLISHED_NF4), atol=1e-6), levels.tolist()


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_codes_are_the_nearest_level(double_quant):
    w = _randn(45, 71, seed=3, scale=0.05)  # 3195 weights: the last block is padded
    qw = quant.quantize_nf4(w, double_quant=double_quant)
    absmax = nf4.nf4_absmax(qw)
    flat = torch.nn.functional.pad(w.reshape(-1), (0, -w.numel() % nf4.BLOCK_SIZE)).reshape(-1, nf4.BLOCK_SIZE)
    exact_absmax = flat.abs().amax(1)
    if double_quant:  # the second level rounds each absmax to a step of its block's range / 127
        step = (exact_absmax - exact_absmax.mean()).abs().max() / 127
        assert ((absmax - exact_absmax).abs() <= step / 2 + 1e-6).all()
    else:
        assert torch.equal(absmax, exact_absmax)
    codes = quant.unpack_int4(qw.codes).long()
    levels = quant.nf4_levels().to(DEV)
    distance = (flat / exact_absmax[:, None])[..., None] - levels
    assert torch.equal(codes, distance.abs().argmin(-1)), "a weight's code is not its nearest level"
    out = quant.dequantize_nf4(qw, torch.float32)
    assert out.shape == w.shape
    want = (levels[codes] * absmax[:, None]).reshape(-1)[: w.numel()].reshape(w.shape)
    check.assert_close(out, want, dtype=torch.float32, name="dequantized NF4")


def test_nf4_double_quant_saves_bits():
    w = _randn(256, 512, seed=4, scale=0.02)
    single, double = quant.quantize_nf4(w, double_quant=False), quant.quantize_nf4(w, double_quant=True)
    assert single.bits_per_weight == pytest.approx(4.5)
    assert double.bits_per_weight == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / w.numel(), rel=1e-6)


def test_nf4_errors():
    with pytest.raises(ValueError, match="2 dimensions"):
        quant.quantize_nf4(torch.randn(64))
    with pytest.raises(TypeError, match="double_quant must be a bool"):
        quant.quantize_nf4(torch.randn(4, 64), double_quant=1)
    with pytest.raises(TypeError, match="NF4Weight"):
        quant.dequantize_nf4(torch.randn(4, 64))


# ---- the fused LoRA linear ---------------------------------------------------------------

# Odd sizes take the pointer path; 16-byte-aligned rows take the TMA path (ragged tiles still).
SHAPES = {"odd": (37, 53, 45, 5), "aligned": (37, 96, 72, 16)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lora_linear_matches_float64(dtype, bias, shape):
    m, k, n, r = SHAPES[shape]
    x = _randn(2, m, k, dtype=dtype, seed=1).requires_grad_()
    w = _randn(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    a = _randn(r, k, dtype=dtype, seed=3, scale=k**-0.5).requires_grad_()
    b = _randn(n, r, dtype=dtype, seed=4, scale=r**-0.5).requires_grad_()
    bb = _randn(n, dtype=dtype, seed=5).requires_grad_() if bias else None
    leaves = [t for t in (x, a, b, bb) if t is not None]
    y = lora.lora_linear(x, w, a, b, 0.75, bb)
    dy = _randn(*y.shape, dtype=dtype, seed=6)
    grads = torch.autograd.grad(y, leaves, dy)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    xe, ae, be = exact[:3]
    ye = R.lora_linear(xe, w.double(), ae, be, 0.75, exact[3] if bias else None)
    want = torch.autograd.grad(ye, exact, dy.double())
    check.assert_close(y, ye, dtype=dtype, name="y")
    for name, g, e in zip("xAB" + "b" * bias, grads, want):
        check.assert_close(g, e, dtype=dtype, name=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("loads_stores", ["pointers", "tma_loads", "tma_loads_and_store"])
@pytest.mark.parametrize("transposed_q", [False, True])
def test_matmul_lowrank_every_path(dtype, persistent, loads_stores, transposed_q):
    """One tile a program or persistent programs, pointer or TMA loads (and the output stored by
    TMA or not), Q as a transposed view (the forward's W^T) or row-major (the backward's W): the
    same result, ragged tiles included."""
    m, kr, n, r = 45, 80, 56, 7  # 16-byte rows for TMA, yet no multiple of the 32x32 tile
    p = _randn(m, kr, dtype=dtype, seed=1)
    q = _randn(n, kr, dtype=dtype, seed=2).T if transposed_q else _randn(kr, n, dtype=dtype, seed=2)
    u, v = _randn(m, r, dtype=dtype, seed=3), _randn(r, n, dtype=dtype, seed=4)
    config = kernels.matmul_config(32, 32, 32, persistent=persistent, tma_store=loads_stores == "tma_loads_and_store")
    out = kernels.matmul_lowrank(p, q, u, v, 0.5, config=config, use_tma=loads_stores != "pointers")
    want = p.double() @ q.double() + 0.5 * u.double() @ v.double()
    check.assert_close(out, want, dtype=dtype, name=f"matmul_lowrank persistent={persistent} {loads_stores}")


def test_matmul_lowrank_stores_by_tma_only_where_it_can():
    p, u = _randn(8, 32, dtype=torch.bfloat16), _randn(8, 4, dtype=torch.bfloat16, seed=1)
    q, v = _randn(32, 21, dtype=torch.bfloat16, seed=2), _randn(4, 21, dtype=torch.bfloat16, seed=3)
    store = kernels.matmul_config(32, 32, 32, tma_store=True)
    with pytest.raises(ValueError, match="tma_store=True stores by TMA"):  # 21 bf16 columns: 42-byte rows
        kernels.matmul_lowrank(p, q, u, v, 1.0, config=store)
    with pytest.raises(ValueError, match="tma_store=True stores by TMA"):
        kernels.matmul_lowrank(p, q[:, :16], u, v[:, :16], 1.0, config=store, use_tma=False)
    tiles = [kernels.matmul_config(128, 256, 64, 8, 3, tma_store=flag) for flag in (False, True)]
    # the output tile in shared memory: 128 x 256 bf16 = 64 KiB more
    assert (kernels.shared_memory_bytes(tiles[1], 2, 16) - kernels.shared_memory_bytes(tiles[0], 2, 16)
            == 128 * 256 * 2)


def _tile_name(config) -> str:
    kw = config.kwargs
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}-w{config.num_warps}-s{config.num_stages}"
            + ("-persistent" if kw["PERSISTENT"] else "") + ("-tma_store" if kw["TMA_STORE"] else ""))


@pytest.mark.parametrize("config", kernels.GPU_MATMUL_CONFIGS, ids=_tile_name)
def test_matmul_lowrank_tiles_keep_their_registers(config):
    """Every tile the H200's autotuner may pick compiles for sm_90 without spilling registers
    to local memory: the low-rank product starting the accumulator keeps one fp32
    accumulator alive, where adding it after the K loop spilled the 128x256 tiles."""
    opcodes = sass.opcodes(sass.disassemble(kernels.compile_matmul_lowrank_sm90(config)))
    assert "STL" not in opcodes and "LDL" not in opcodes, f"{_tile_name(config)} spills registers"


@pytest.mark.gpu
@pytest.mark.parametrize("config", kernels.GPU_MATMUL_CONFIGS, ids=_tile_name)
@pytest.mark.parametrize("transposed_q", [False, True])
def test_every_gpu_tile_matches_float64(config, transposed_q):
    """Each tile the autotuner may pick, forced, on ragged sizes larger than every tile (edge
    tiles in both directions, persistent programs walking several tiles): the forward's
    layout (Q = W^T) and the backward's (Q = W) in bf16, against float64."""
    m, kr, n, r = 700, 520, 600, 16
    p = _randn(m, kr, dtype=torch.bfloat16, seed=1)
    q = (_randn(n, kr, dtype=torch.bfloat16, seed=2).T if transposed_q
         else _randn(kr, n, dtype=torch.bfloat16, seed=2))
    u, v = (_randn(m, r, dtype=torch.bfloat16, seed=3),
            _randn(r, n, dtype=torch.bfloat16, seed=4))
    out = kernels.matmul_lowrank(p, q, u, v, 0.5, config=config)
    want = p.double() @ q.double() + 0.5 * u.double() @ v.double()
    check.assert_close(out, want, dtype=torch.bfloat16, name=f"matmul_lowrank {_tile_name(config)}")


def test_lora_linear_gives_the_base_weight_a_gradient_when_it_asks():
    x = _randn(19, 33, seed=1).requires_grad_()
    w, a, b = (_randn(21, 33, seed=2).requires_grad_(), _randn(4, 33, seed=3).requires_grad_(),
               _randn(21, 4, seed=4).requires_grad_())
    y = lora.lora_linear(x, w, a, b, 2.0)
    dw, = torch.autograd.grad(y, [w], torch.ones_like(y))
    dw_ref, = torch.autograd.grad(R.lora_linear(x, w, a, b, 2.0), [w], torch.ones_like(y))
    check.assert_close(dw, dw_ref, dtype=torch.float32, name="dW")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backwards_scaled_matmul_matches_float64_and_ignores_its_input(dtype):
    # du = s dy B and dB = s dy^T u take the scale in the GEMM's epilogue (torch.addmm's alpha,
    # beta 0): its 0-d input is ignored, so NaN there must not reach the result.
    from labkit.lora import autograd as lora_autograd

    a, b = _randn(37, 19, dtype=dtype, seed=5), _randn(19, 5, dtype=dtype, seed=6)
    got = lora_autograd._scaled_mm(a, b, 1.75)
    check.assert_close(got, 1.75 * (a.double() @ b.double()), dtype=dtype, name="scaled matmul")
    nan_input = torch.full((), float("nan"), dtype=dtype, device=a.device)
    assert torch.isfinite(torch.addmm(nan_input, a, b, beta=0, alpha=1.75)).all()


def test_lora_linear_errors():
    x, w, a, b = _randn(4, 16), _randn(8, 16, seed=1), _randn(2, 16, seed=2), _randn(8, 2, seed=3)
    with pytest.raises(ValueError, match="expects K = 16"):
        lora.lora_linear(_randn(4, 15), w, a, b, 1.0)
    with pytest.raises(ValueError, match=r"lora_a must be \[r, K = 16\]"):
        lora.lora_linear(x, w, _randn(2, 15), b, 1.0)
    with pytest.raises(ValueError, match=r"lora_b must be \[N = 8, r = 2\]"):
        lora.lora_linear(x, w, a, _randn(8, 3), 1.0)
    with pytest.raises(TypeError, match="share one dtype"):
        lora.lora_linear(x, w.half(), a, b, 1.0)
    with pytest.raises(TypeError, match="scaling must be a number"):
        lora.lora_linear(x, w, a, b, torch.tensor(1.0))
    with pytest.raises(ValueError, match="contiguous"):
        lora.lora_linear(_randn(16, 4).T, w, a, b, 1.0)
    with pytest.raises(TypeError, match="dtype in"):
        lora.lora_linear(x.long(), w, a, b, 1.0)
    with pytest.raises(ValueError, match=r"bias must be \[N = 8\]"):
        lora.lora_linear(x, w, a, b, 1.0, _randn(7))


# ---- the layer against peft -------------------------------------------------------------

class _OneLinear(nn.Module):
    def __init__(self, k, n, bias, dtype):
        super().__init__()
        self.lin = nn.Linear(k, n, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.lin(x)


PEFT_OPTIONS = {  # our LoRALinear options -> peft's LoraConfig options
    "lora": ({}, {}),
    "rslora": ({"rslora": True}, {"use_rslora": True}),
    "dora": ({"dora": True}, {"use_dora": True}),
    "gaussian": ({"init": "gaussian"}, {"init_lora_weights": "gaussian"}),
    "pissa": ({"init": "pissa"}, {"init_lora_weights": "pissa"}),
}


def _pair(variant, k, n, rank, alpha, dtype, bias=True, seed=0):
    """Our layer and peft's on the same base weights, with the same (nonzero) adapter weights."""
    torch.manual_seed(seed)
    base = _OneLinear(k, n, bias, torch.float32)
    with torch.no_grad():
        base.lin.weight.copy_(_randn(n, k, seed=seed + 1, scale=k**-0.5))
    base = base.to(device=DEV, dtype=dtype)
    ours_kw, peft_kw = PEFT_OPTIONS[variant]
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["lin"],
                                                                      **peft_kw))
    peft_layer = theirs.base_model.model.lin
    ours = lora.LoRALinear.from_linear(base.lin, rank=rank, alpha=alpha, **ours_kw)
    with torch.no_grad():
        if variant == "pissa":  # the init itself is under test: peft's must equal ours
            for mine, theirs_t in ((ours.lora_A, peft_layer.lora_A["default"].weight),
                                   (ours.lora_B, peft_layer.lora_B["default"].weight),
                                   (ours.weight, peft_layer.base_layer.weight)):
                check.assert_close(mine, theirs_t, dtype=dtype, name="PiSSA init")
        b = _randn(n, rank, dtype=dtype, seed=seed + 2, scale=0.1)
        ours.lora_B.copy_(b)
        peft_layer.lora_B["default"].weight.copy_(b)
        peft_layer.lora_A["default"].weight.copy_(ours.lora_A)
        peft_layer.base_layer.weight.copy_(ours.base_weight())
        if variant == "dora":
            m = ours.magnitude * (1 + 0.1 * _randn(n, dtype=dtype, seed=seed + 3))
            ours.magnitude.copy_(m)
            peft_layer.lora_magnitude_vector["default"].weight.copy_(m)
    return ours, theirs, peft_layer


def _peft_params(variant, layer):
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    return params + ([layer.lora_magnitude_vector["default"].weight] if variant == "dora" else [])


@pytest.mark.parametrize("variant", list(PEFT_OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_peft(variant, dtype):
    k, n, rank = 53, 45, 6
    ours, theirs, layer = _pair(variant, k, n, rank, alpha=9, dtype=dtype)
    assert ours.scaling == pytest.approx(layer.scaling["default"])
    x = _randn(3, 11, k, dtype=dtype, seed=7)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yt = ours(xo), theirs(xt)
    check.assert_close(yo, yt.detach().double(), dtype=dtype, name=f"{variant} output")
    dy = _randn(*yo.shape, dtype=dtype, seed=8)
    ours_params = [ours.lora_A, ours.lora_B] + ([ours.magnitude] if variant == "dora" else [])
    got = torch.autograd.grad(yo, [xo] + ours_params, dy)
    want = torch.autograd.grad(yt, [xt] + _peft_params(variant, layer), dy)
    for name, g, w in zip(["x", "A", "B", "magnitude"], got, want):
        check.assert_close(g, w.double(), dtype=dtype, name=f"{variant} d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_matches_peft(dtype):
    ours, theirs, layer = _pair("lora", 61, 39, 7, alpha=14, dtype=dtype, seed=5)
    ours.fused = True
    x = _randn(2, 13, 61, dtype=dtype, seed=9)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yt = ours(xo), theirs(xt)
    check.assert_close(yo, yt.detach().double(), dtype=dtype, name="fused output")
    dy = _randn(*yo.shape, dtype=dtype, seed=10)
    got = torch.autograd.grad(yo, [xo, ours.lora_A, ours.lora_B], dy)
    want = torch.autograd.grad(yt, [xt] + _peft_params("lora", layer), dy)
    for name, g, w in zip("xAB", got, want):
        check.assert_close(g, w.double(), dtype=dtype, name=f"fused d{name}")


def test_qlora_layer_is_peft_lora_on_the_dequantized_weight():
    """QLoRA-style: the frozen base is NF4; peft's LoRA on the dequantized weight is the oracle
    (peft's own 4-bit layer needs bitsandbytes and a GPU)."""
    k, n, rank = 128, 48, 8
    w = _randn(n, k, seed=11, scale=k**-0.5)
    linear = nn.Linear(k, n, bias=False, device=DEV)
    with torch.no_grad():
        linear.weight.copy_(w)
    ours = lora.LoRALinear.from_linear(linear, rank=rank, alpha=16, quantize="nf4")
    assert ours.weight is None and ours.nf4_weight is not None
    dequantized = quant.dequantize_nf4(quant.quantize_nf4(w))
    assert torch.equal(ours.base_weight(), dequantized)
    holder = _OneLinear(k, n, False, torch.float32).to(DEV)
    with torch.no_grad():
        holder.lin.weight.copy_(dequantized)
    theirs = peft.get_peft_model(holder, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=["lin"]))
    layer = theirs.base_model.model.lin
    with torch.no_grad():
        ours.lora_B.copy_(_randn(n, rank, seed=12, scale=0.1))
        layer.lora_A["default"].weight.copy_(ours.lora_A)
        layer.lora_B["default"].weight.copy_(ours.lora_B)
    x = _randn(17, k, seed=13)
    yo, yt = ours(x), theirs(x)
    check.assert_close(yo, yt.detach().double(), dtype=torch.float32, name="QLoRA output")
    dy = _randn(*yo.shape, seed=14)
    for name, g, w_ in zip("AB", torch.autograd.grad(yo, [ours.lora_A, ours.lora_B], dy),
                           torch.autograd.grad(yt, _peft_params("lora", layer), dy)):
        check.assert_close(g, w_.double(), dtype=torch.float32, name=f"QLoRA d{name}")


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_init_starts_at_the_base_layer(init):
    linear = nn.Linear(64, 40, device=DEV)
    layer = lora.LoRALinear.from_linear(linear, rank=8, alpha=16, init=init)
    assert torch.count_nonzero(layer.lora_B) == 0 and torch.count_nonzero(layer.lora_A) == layer.lora_A.numel()
    if init == "kaiming":  # kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(K), 1/sqrt(K)), as in peft
        assert layer.lora_A.abs().max() <= 64**-0.5
        assert layer.lora_A.abs().max() > 0.9 * 64**-0.5
    else:
        assert layer.lora_A.std().item() == pytest.approx(1 / 8, rel=0.1)
    x = _randn(5, 64, seed=1)
    check.assert_close(layer(x), linear(x).double(), dtype=torch.float32, name="output at init")


@pytest.mark.parametrize("variant", ["lora", "rslora", "dora", "pissa"])
def test_merge_then_unmerge(variant):
    ours, _, _ = _pair(variant if variant != "lora" else "lora", 40, 36, 4, alpha=8, dtype=torch.float32)
    x = _randn(9, 40, seed=3)
    before = ours(x)
    weight = ours.weight.detach().clone()
    ours.merge()
    check.assert_close(ours(x), before.double(), dtype=torch.float32, name=f"{variant} merged output")
    with pytest.raises(RuntimeError, match="already merged"):
        ours.merge()
    ours.unmerge()
    check.assert_close(ours.weight, weight.double(), dtype=torch.float32, name=f"{variant} unmerged weight")
    with pytest.raises(RuntimeError, match="not merged"):
        ours.unmerge()


def test_merge_matches_peft_merge():
    ours, theirs, _ = _pair("dora", 40, 36, 4, alpha=8, dtype=torch.float32)
    ours.merge()
    merged = theirs.merge_and_unload()
    check.assert_close(ours.weight, merged.lin.weight.detach().double(), dtype=torch.float32, name="merged DoRA weight")


def test_qlora_refuses_to_merge():
    layer = lora.LoRALinear.from_linear(nn.Linear(64, 32), rank=4, alpha=8, quantize="nf4")
    with pytest.raises(RuntimeError, match="NF4"):
        layer.merge()


def test_layer_errors():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rank 9 exceeds"):
        lora.LoRALinear(w, rank=9, alpha=1)
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        lora.LoRALinear(w, rank=2, alpha=0)
    with pytest.raises(ValueError, match="init"):
        lora.LoRALinear(w, rank=2, alpha=1, init="zeros")
    with pytest.raises(TypeError, match="dora must be a bool"):
        lora.LoRALinear(w, rank=2, alpha=1, dora="yes")
    with pytest.raises(TypeError, match="nn.Linear"):
        lora.LoRALinear.from_linear(w, rank=2, alpha=1)
    with pytest.raises(ValueError, match="variant"):
        lora.add_lora(models.Decoder(models.TINY), rank=2, alpha=1, variant="lokr")
    with pytest.raises(ValueError, match="no nn.Linear named"):
        lora.add_lora(models.Decoder(models.TINY), rank=2, alpha=1, targets=("q_proj",))


# ---- the model --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_decoder_with_adapters_matches_peft(variant):
    """The book's model with adapters on every block linear, against peft wrapping the same model."""
    base = models.Decoder(models.TINY, seed=1, init_std=0.1)
    targets = ["wq", "wk", "wv", "wo", "gate", "up", "down"]
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, use_dora=variant == "dora"))
    ours = lora.add_lora(base, rank=4, alpha=8, variant=variant)
    assert lora.trainable_parameters(ours) == theirs.get_nb_trainable_parameters()[0]
    peft_layers = {n.removeprefix("base_model.model."): m for n, m in theirs.named_modules()
                   if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert set(peft_layers) == set(lora.lora_layers(ours))
    with torch.no_grad():
        for i, (name, layer) in enumerate(lora.lora_layers(ours).items()):
            layer.lora_B.copy_(_randn(*layer.lora_B.shape, seed=20 + i, scale=0.2))
            peft_layers[name].lora_A["default"].weight.copy_(layer.lora_A)
            peft_layers[name].lora_B["default"].weight.copy_(layer.lora_B)
    ids = torch.randint(0, models.TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    lo, lt = models.lm_loss(ours, ids), models.lm_loss(theirs, ids)
    check.assert_close(lo, lt.detach().double(), dtype=torch.float32, name="loss")
    lo.backward()
    lt.backward()
    for name, layer in lora.lora_layers(ours).items():
        check.assert_close(layer.lora_A.grad, peft_layers[name].lora_A["default"].weight.grad.double(),
                           dtype=torch.float32, name=f"{name} dA")


def test_merge_all_keeps_the_logits():
    model = lora.add_lora(models.Decoder(models.TINY, seed=2, init_std=0.1), rank=4, alpha=8)
    with torch.no_grad():
        for i, layer in enumerate(lora.lora_layers(model).values()):
            layer.lora_B.copy_(_randn(*layer.lora_B.shape, seed=i, scale=0.2))
    ids = torch.randint(0, models.TINY.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids)
        lora.merge_all(model)
        check.assert_close(model(ids), before.double(), dtype=torch.float32, name="merged logits")
        lora.unmerge_all(model)
        check.assert_close(model(ids), before.double(), dtype=torch.float32, name="unmerged logits")


# ---- multi-LoRA: BGMV and SGMV -----------------------------------------------------------

def _stack(adapters, rank, k, n, dtype, seed=0):
    a = _randn(adapters, rank, k, dtype=dtype, seed=seed, scale=k**-0.5)
    b = _randn(adapters, n, rank, dtype=dtype, seed=seed + 1, scale=rank**-0.5)
    scalings = torch.rand(adapters, generator=torch.Generator().manual_seed(seed + 2)).to(DEV) + 0.5
    return a, b, scalings


@pytest.mark.parametrize("dtype", DTYPES)
def test_bgmv_matches_float64(dtype):
    tokens, k, n, rank, adapters = 11, 75, 43, 6, 5
    a, b, scalings = _stack(adapters, rank, k, n, dtype)
    x, y = _randn(tokens, k, dtype=dtype, seed=5), _randn(tokens, n, dtype=dtype, seed=6)
    indices = torch.tensor([4, 0, -1, 2, 2, 1, 0, 3, -1, 4, 4], device=DEV)
    want = R.bgmv(y, x, a, b, indices, scalings)
    out = y.clone()
    assert lora.bgmv(out, x, a, b, indices, scalings) is out
    check.assert_close(out, want, dtype=dtype, name="bgmv")
    assert torch.equal(out[indices < 0], y[indices < 0]), "tokens without an adapter must keep the base output"


def test_bgmv_is_what_peft_mixed_batches_compute():
    """peft's forward with ``adapter_names`` (one adapter per sample) is the definition BGMV computes."""
    k, n, rank, adapters = 40, 24, 4, 3
    holder = _OneLinear(k, n, False, torch.float32).to(DEV)
    model = peft.get_peft_model(holder, peft.LoraConfig(r=rank, lora_alpha=8, target_modules=["lin"]),
                                adapter_name="a0")
    for i in range(1, adapters):
        model.add_adapter(f"a{i}", peft.LoraConfig(r=rank, lora_alpha=8 * (i + 1), target_modules=["lin"]))
    model.eval()  # peft serves mixed batches in inference only
    layer = model.base_model.model.lin
    a, b, _ = _stack(adapters, rank, k, n, torch.float32, seed=3)
    with torch.no_grad():
        for i in range(adapters):
            layer.lora_A[f"a{i}"].weight.copy_(a[i])
            layer.lora_B[f"a{i}"].weight.copy_(b[i])
    scalings = torch.tensor([layer.scaling[f"a{i}"] for i in range(adapters)], dtype=torch.float32, device=DEV)
    names = ["a2", "__base__", "a0", "a1", "a2", "a0", "a1"]
    x = _randn(len(names), k, seed=9)
    want = model(x[:, None, :], adapter_names=names)[:, 0]
    indices = torch.tensor([-1 if s == "__base__" else int(s[1:]) for s in names], device=DEV)
    out = lora.bgmv(layer.base_layer(x).detach(), x, a, b, indices, scalings)
    check.assert_close(out, want.detach().double(), dtype=torch.float32, name="bgmv vs peft mixed batch")
    check.assert_close(R.lora_loop(layer.base_layer(x).detach(), x, a, b, indices, scalings),
                       want.detach().double(), dtype=torch.float32, name="loop vs peft mixed batch")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgmv_matches_float64(dtype):
    k, n, rank, adapters = 70, 50, 5, 4
    a, b, scalings = _stack(adapters, rank, k, n, dtype, seed=4)
    lengths, seg_adapters = [19, 0, 3, 1, 23], [2, 0, -1, 3, 2]  # an empty segment, one without adapter
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    tokens = sum(lengths)
    x, y = _randn(tokens, k, dtype=dtype, seed=7), _randn(tokens, n, dtype=dtype, seed=8)
    per_token = torch.repeat_interleave(torch.tensor(seg_adapters), torch.tensor(lengths)).to(DEV)
    out = y.clone()
    lora.sgmv(out, x, a, b, starts, torch.tensor(seg_adapters, device=DEV), scalings)
    check.assert_close(out, R.bgmv(y, x, a, b, per_token, scalings), dtype=dtype, name="sgmv")


def test_multi_lora_errors():
    a, b, s = _randn(3, 2, 16), _randn(3, 8, 2, seed=1), torch.ones(3, device=DEV)
    x, y = _randn(4, 16, seed=2), _randn(4, 8, seed=3)

    def ints(*values):
        return torch.tensor(values, device=DEV)

    with pytest.raises(ValueError, match="adapter numbers below 3"):
        lora.bgmv(y, x, a, b, ints(0, 1, 3, 0), s)
    with pytest.raises(ValueError, match=">= -1"):
        lora.bgmv(y, x, a, b, ints(0, 1, -2, 0), s)
    with pytest.raises(ValueError, match="4 entries"):
        lora.bgmv(y, x, a, b, ints(0, 1), s)
    with pytest.raises(TypeError, match="dtype in"):
        lora.bgmv(y, x, a, b, ints(0.0, 1, 1, 0), s)
    with pytest.raises(ValueError, match=r"lora_b must be \[adapters = 3, N = 8, r = 2\]"):
        lora.bgmv(y, x, a, _randn(3, 8, 3), ints(0, 1, 1, 0), s)
    with pytest.raises(ValueError, match="one float32 per adapter"):
        lora.bgmv(y, x, a, b, ints(0, 1, 1, 0), torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="a row per token"):
        lora.bgmv(_randn(5, 8), x, a, b, ints(0, 1, 1, 0), s)
    with pytest.raises(ValueError, match="rise from 0 to T = 4"):
        lora.sgmv(y, x, a, b, ints(0, 3, 2), ints(0, 1), s)
    with pytest.raises(ValueError, match="one more entry"):
        lora.sgmv(y, x, a, b, ints(0, 4), ints(0, 1), s)


def test_nf4_block_size():
    w = _randn(32, 96, seed=5, scale=0.02)
    coarse, fine = quant.quantize_nf4(w, double_quant=False, block_size=256), quant.quantize_nf4(w, False, 32)
    assert coarse.codes.shape == (12, 128) and fine.codes.shape == (96, 16)
    assert check.rel_error(quant.dequantize_nf4(fine), w) < check.rel_error(quant.dequantize_nf4(coarse), w)
    with pytest.raises(ValueError, match="block_size must be even"):
        quant.quantize_nf4(w, block_size=33)


# ---- the fine-tuning experiment and the benchmarks ---------------------------------------

def test_symbol_map_task_and_its_variant():
    task = finetune.SymbolMapTask.make(alphabet=10, length=4, seed=0)
    ids, mask = task.batch(6, torch.Generator().manual_seed(1))
    assert ids.shape == mask.shape == (6, 10)
    assert (ids[:, 0] == task.BOS).all() and (ids[:, 5] == task.SEP).all()
    assert torch.equal(ids[:, 6:] - 2, torch.tensor(task.perm)[ids[:, 1:5] - 2]), "answers are the images"
    assert mask[:, 6:].all() and not mask[:, :6].any(), "only the answers are targets"
    second = task.variant(4, seed=2)
    differs = [a != b for a, b in zip(task.perm, second.perm)]
    assert sum(differs) == 4 and sorted(second.perm) == list(range(10))
    with pytest.raises(ValueError, match="changed must be"):
        task.variant(11, seed=0)


def test_update_spectra_sees_a_low_rank_update():
    """A rank-2 change to one matrix puts all of its energy in two directions; the Gaussian
    yardstick of the same shape does not."""
    base = nn.Sequential(nn.Linear(24, 40, bias=False))
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned[0].weight += _randn(40, 2, seed=1).cpu() @ _randn(2, 24, seed=2).cpu()
    # block_matrices reads the parameters named blocks.*, as the decoder names its blocks
    rows = finetune.update_spectra(nn.ModuleDict({"blocks": base}), nn.ModuleDict({"blocks": tuned}), ranks=(1, 2))
    assert len(rows) == 1 and rows[0]["matrix"] == "blocks.0"
    assert rows[0]["delta_energy_top2"] == pytest.approx(1.0, abs=1e-9)
    assert rows[0]["random_energy_top2"] < 0.5
    assert 1.0 <= rows[0]["delta_stable_rank"] <= 2.0


@pytest.mark.skipif(backend.on_gpu(), reason="on a GPU they run at full size: python -m labkit.bench lora-family")
def test_benchmarks_run_and_check_on_this_machine():
    """Each registered benchmark runs (at the CPU's sizes) and returns the columns the chapter reads."""
    from labkit import benchmarks

    fused = benchmarks.run("lora.fused_linear", record=False)
    assert {"ours_ms", "base_ms", "peft_ms", "addmm_ms", "time_vs_base", "kernel/base_fwd", "kernel/base_dx",
            "rest_ms", "ours_host_ms", "kernel_host_ms"} <= set(fused.rows[0])
    assert all(r["ours_host_ms"] > 0 and r["kernel_host_ms"] > 0 for r in fused.rows)
    multi = benchmarks.run("lora.multi_lora", record=False)
    assert {r["kind"] for r in multi.rows} == {"decode", "prefill"}
    assert all({"ours_ms", "loop_ms", "single_adapter_ms", "ours/loop"} <= set(r) for r in multi.rows)


# ---- the paged optimizer -------------------------------------------------------------------

def test_paged_adamw_steps_are_adamw_steps():
    """Five steps on a small model: the same parameters as torch.optim.AdamW, the moments kept
    on the state device and in fp32."""
    from labkit.lora.optim import PagedAdamW

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(13, 9), nn.Tanh(), nn.Linear(9, 5)).to(DEV)

    ours, theirs = make(), make()
    opt_ours = PagedAdamW(ours.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(5):
        x = _randn(7, 13, seed=step)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        check.assert_close(a, b.detach().double(), dtype=torch.float32, name="PagedAdamW vs AdamW")
    state = opt_ours.state[next(ours.parameters())]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="betas"):
        PagedAdamW(ours.parameters(), betas=(0.9, 1.0))
