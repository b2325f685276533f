"""labkit.formats: every representable value round-trips, rounding matches torch's casts
bit for bit, ties go to even, overflow follows each format's rules, block scaling follows
the OCP MX spec and NVFP4's recipe, and bad input gets clear errors."""

import pytest
import torch

from labkit import formats
from labkit.check import rel_error
from labkit.formats import reference
from labkit.quant.reference import quantize_rtn, dequantize

SMALL = [formats.E4M3, formats.E5M2, formats.E3M2, formats.E2M3, formats.E2M1, formats.FP16, formats.BF16]
TORCH_FORMATS = [formats.FP32, formats.BF16, formats.FP16, formats.E4M3, formats.E5M2]


def random_float32(n, seed):
    """Random fp32 bit patterns, NaN and inf removed: every binade and subnormals equally."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_range_matches_torch_finfo(fmt):
    info = torch.finfo(fmt.torch_dtype)
    d = formats.describe(fmt)
    assert (d["max"], d["min_normal"], d["epsilon"]) == (info.max, info.smallest_normal, info.eps)
    assert d["bits"] == info.bits


def test_formats_without_a_torch_dtype_match_their_specs():
    """TF32: fp32's range with fp16's 10 mantissa bits; E2M1 (OCP MX v1.0 table): max 6,
    smallest normal 1, smallest subnormal 0.5, no inf, no NaN."""
    tf32, fp4 = formats.describe("tf32"), formats.describe("fp4_e2m1")
    assert tf32["min_normal"] == torch.finfo(torch.float32).smallest_normal and tf32["epsilon"] == 2.0**-10
    assert (fp4["max"], fp4["min_normal"], fp4["min_subnormal"], fp4["inf"], fp4["nan"]) == (6.0, 1.0, 0.5, False, False)
    assert formats.E4M3.min_subnormal == 2.0**-9 and formats.E5M2.min_subnormal == 2.0**-16


def test_fp6_ranges_match_the_mx_spec():
    """OCP MX v1.0: E3M2 max 28, min normal 0.25, min subnormal 0.0625; E2M3 max 7.5, 1, 0.125."""
    for name, expected in (("fp6_e3m2", (28.0, 0.25, 0.0625)), ("fp6_e2m3", (7.5, 1.0, 0.125))):
        d = formats.describe(name)
        assert (d["max"], d["min_normal"], d["min_subnormal"], d["bits"]) == (*expected, 6)


def test_fp4_has_exactly_the_spec_values():
    _, values = reference.all_values(formats.E2M1)
    assert sorted(set(values.abs().tolist())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_every_value_round_trips(fmt):
    codes, values = reference.all_values(fmt)
    number = ~values.isnan()
    assert torch.equal(formats.quantize(values[number], fmt), codes[number])
    assert int(number.sum()) == 2**fmt.bits - {"ieee": 2 * (2**fmt.mantissa_bits - 1), "fn": 2, "none": 0}[fmt.specials]


@pytest.mark.parametrize("fmt", [f for f in SMALL if f.torch_dtype is not None], ids=lambda f: f.name)
def test_decode_matches_torch_bit_for_bit(fmt):
    codes, values = reference.all_values(fmt)
    storage = torch.int16 if fmt.bits == 16 else torch.uint8
    ours = formats.decode(codes, fmt)
    theirs = codes.to(torch.int32).to(storage).view(fmt.torch_dtype).double()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])
    assert torch.equal(torch.signbit(ours[~ours.isnan()]), torch.signbit(theirs[~theirs.isnan()]))


@pytest.mark.parametrize("fmt", [formats.BF16, formats.FP16, formats.E5M2], ids=lambda f: f.name)
def test_rounding_matches_torch_casts_on_every_binade(fmt):
    """Random fp32 bit patterns (all exponents, subnormals, overflow to inf) cast by torch."""
    x = random_float32(400_000, seed=hash(fmt.name) % 1000)
    ours, theirs = formats.round_to_format(x, fmt), x.to(fmt.torch_dtype).double()
    assert torch.equal(ours, theirs)


def test_e4m3_rounding_matches_torch_in_range():
    x = random_float32(400_000, seed=3)
    x = x[x.abs() <= 464]  # past 464, OCP's non-saturating E4M3 gives NaN; torch versions differ
    assert torch.equal(formats.round_to_format(x, "fp8_e4m3"), x.to(torch.float8_e4m3fn).double())


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_ties_go_to_even(fmt):
    """The midpoint of two neighbours rounds to the one whose mantissa is even."""
    codes, values = reference.all_values(fmt)
    positive = (values > 0) & torch.isfinite(values) & (values < fmt.max)
    lo_codes, lo = codes[positive], values[positive]
    hi = reference.decode(lo_codes + 1, fmt)
    mid = (lo + hi) / 2
    expected = torch.where(lo_codes % 2 == 0, lo_codes, lo_codes + 1)
    assert torch.equal(formats.quantize(mid, fmt), expected)
    assert torch.equal(formats.quantize(-mid, fmt), expected | (1 << (fmt.bits - 1)))


def test_overflow_rules_per_format():
    big = torch.tensor([470.0, 1e6, float("inf"), -1e6])
    assert torch.isnan(formats.round_to_format(big, "fp8_e4m3")[:3]).all()      # OCP E4M3: no inf, NaN
    assert formats.round_to_format(big, "fp8_e4m3", saturate=True).tolist() == [448, 448, 448, -448]
    assert formats.round_to_format(torch.tensor([464.0]), "fp8_e4m3").item() == 448  # a tie, to even
    assert formats.round_to_format(big, "fp8_e5m2").tolist() == [448, float("inf"), float("inf"), float("-inf")]
    assert formats.round_to_format(torch.tensor([7.0, -100.0]), "fp4_e2m1").tolist() == [6, -6]
    assert formats.round_to_format(torch.tensor([65519.0, 65520.0]), "fp16").tolist() == [65504, float("inf")]


def test_special_codes():
    assert formats.quantize(torch.tensor([float("nan")]), "fp8_e4m3").item() == 0x7F
    assert formats.quantize(torch.tensor([float("-inf"), -0.0]), "fp8_e5m2").tolist() == [0xFC, 0x80]
    assert formats.quantize(torch.tensor([-0.0]), "fp4_e2m1").item() == 0x8
    fields = formats.bit_fields(0x7E, "fp8_e4m3")
    assert (fields["bits"], fields["value"], fields["unbiased_exponent"]) == ("0 1111 110", 448.0, 8)
    assert formats.bit_fields(0x01, "fp8_e4m3")["subnormal"] and formats.bit_fields(0x01, "fp8_e4m3")["value"] == 2**-9


def test_mx_scale_follows_the_spec():
    """X = 2^(floor(log2 amax) - emax): a block with max 5.0 has 2^(2-8) for E4M3, 2^(2-2) for FP4."""
    x = torch.zeros(1, 64)
    x[0, 3], x[0, 40] = 5.0, -0.75
    # 5.0 is exact in FP8; in FP4 it is the tie between 4 and 6, and goes to 4 (even mantissa).
    for fmt, expected, five in (("mxfp8_e4m3", [127 - 6, 127 - 8 - 1], 5.0), ("mxfp8_e5m2", [127 - 13, 127 - 15 - 1], 5.0),
                                ("mxfp4", [127, 127 - 2 - 1], 4.0)):
        q = formats.mx_quantize(x, fmt)
        assert q.scales.tolist() == [expected], fmt
        assert formats.block_dequantize(q)[0, 3].item() == five and formats.block_dequantize(q)[0, 40].item() == -0.75


def test_mx_all_zero_block_and_saturation():
    x = torch.zeros(2, 32)
    x[1, :] = 7.5  # amax 7.5: FP4's scale is 2^(2 - 2) = 1, and 7.5 saturates to 6
    q = formats.mx_quantize(x, "mxfp4")
    assert q.scales.tolist() == [[0], [127]]
    assert formats.block_dequantize(q)[1].unique().tolist() == [6.0] and formats.block_dequantize(q)[0].abs().sum() == 0


def test_mx_elements_are_rounded_values_of_the_scaled_block():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4)) * 10
    for fmt, elem in formats.MX_ELEMENTS.items():
        q = formats.mx_quantize(x, fmt)
        scale = torch.exp2(q.scales.double() - 127).repeat_interleave(32, dim=1)
        expected = reference.round_to_format(x.double() / scale, elem, saturate=True) * scale
        assert torch.equal(formats.block_dequantize(q), expected)


def test_nvfp4_two_level_scales():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 3
    q = formats.nvfp4_quantize(x)
    assert q.tensor_scale.dtype == torch.float32
    assert q.tensor_scale.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    block_scales = formats.decode(q.scales, "fp8_e4m3") * q.tensor_scale.double()
    block_amax = x.double().abs().reshape(4, 4, 16).amax(-1)
    # the block scale is E4M3-rounded amax / 6: within E4M3's half-ulp (1/16) of it
    assert ((block_scales * 6 / block_amax - 1).abs() <= 1 / 16 + 1e-6).all()
    err = rel_error(formats.block_dequantize(q), x)
    assert 0.02 < err < 0.2


def test_block_formats_rank_by_error_against_fp8_and_int4():
    """On Gaussian data: MXFP8 E4M3 beats E5M2, both beat 4-bit formats, NVFP4 (16-element
    blocks, E4M3 scales) beats MXFP4 (32-element blocks, power-of-two scales), and MXFP6 lies
    between MXFP4 and MXFP8 with E2M3 (more mantissa) ahead of E3M2 (more range)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    err = {f: rel_error(formats.block_dequantize(formats.mx_quantize(x, f)), x) for f in formats.MX_ELEMENTS}
    err["nvfp4"] = rel_error(formats.block_dequantize(formats.nvfp4_quantize(x)), x)
    assert err["mxfp8_e4m3"] < err["mxfp8_e5m2"] < err["nvfp4"] < err["mxfp4"]
    assert err["mxfp6_e2m3"] < err["mxfp6_e3m2"] < err["mxfp4"]  # a block needs little range: mantissa wins
    int4 = rel_error(dequantize(quantize_rtn(x, 4, 32)), x)
    assert err["mxfp8_e5m2"] < int4


def test_pack_fp4_low_nibble_first():
    codes = torch.tensor([[0x1, 0xF, 0x8, 0x2]], dtype=torch.uint8)
    assert formats.pack_fp4(codes).tolist() == [[0xF1, 0x28]]


def test_fp8_recipes_rank_on_activations_with_outlier_channels():
    x = formats.heavy_tailed_activations(256, 512, seed=7)
    err = {r: rel_error(formats.fp8_roundtrip(x, r), x) for r in formats.RECIPES}
    assert err["tile_1x128"] <= err["per_row"] <= err["per_tensor"]
    assert err["block_128x128"] <= err["per_tensor"]
    assert all(0 < e < 0.1 for e in err.values())


def test_delayed_scaling_clips_a_tensor_that_grew():
    """After steps at amax ~1, a step 10x larger saturates: its error is large, current scaling's is not."""
    scaler = formats.DelayedScaling(history=4)
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        scaler.quantize(torch.randn(64, 64, generator=gen))
    spike = torch.randn(64, 64, generator=gen) * 10
    q, s = scaler.quantize(spike)
    delayed = rel_error(q.float() * s, spike)
    assert delayed > 0.3 and delayed > 10 * rel_error(formats.fp8_roundtrip(spike, "per_tensor"), spike)
    q, s = scaler.quantize(spike)  # the history now holds the spike: back to normal
    assert rel_error(q.float() * s, spike) < 0.05


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="fmt must be one of"):
        formats.describe("fp8_e3m4")
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 255\]"):
        formats.decode(torch.tensor([256]), "fp8_e4m3")
    with pytest.raises(TypeError, match="codes must have dtype"):
        formats.decode(torch.tensor([1.0]), "fp8_e4m3")
    with pytest.raises(TypeError, match="saturate must be a bool"):
        formats.quantize(torch.ones(2), "fp16", saturate=1)
    with pytest.raises(ValueError, match="no NaN"):
        formats.quantize(torch.tensor([float("nan")]), "fp4_e2m1")
    with pytest.raises(ValueError, match="round them with quantize"):
        reference.encode(torch.tensor([0.3]), formats.E4M3)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        formats.mx_quantize(torch.ones(2, 48), "mxfp4")
    with pytest.raises(ValueError, match="finite inputs"):
        formats.nvfp4_quantize(torch.tensor([float("inf")] * 16))
    with pytest.raises(ValueError, match="fmt must be one of"):
        formats.mx_quantize(torch.ones(32), "mxfp6")
    with pytest.raises(ValueError, match="code must be an int"):
        formats.bit_fields(16, "fp4_e2m1")
    with pytest.raises(ValueError, match="recipe must be one of"):
        formats.fp8_roundtrip(torch.ones(128, 128), "per_column")
    with pytest.raises(ValueError, match="128 x 128 tiles"):
        formats.fp8_roundtrip(torch.ones(100, 128), "block_128x128")
    q = formats.mx_quantize(torch.ones(2, 64), "mxfp4")
    with pytest.raises(ValueError, match="one scale per 32"):
        formats.block_dequantize(reference.BlockScaled(q.codes, q.scales[:, :1], "mxfp4", 32))
    with pytest.raises(TypeError, match="BlockScaled"):
        formats.block_dequantize(q.codes)


def test_datasheet_rates_dense_is_half_sparse_and_hopper_has_no_fp4():
    from labkit.formats import rates
    rows = {(r["gpu"], r["format"]): r for r in rates.rate_table()}
    hopper = "H200 SXM (Hopper)"
    assert rows[hopper, "fp4"]["tensor dense"] is None
    assert all(r["tensor dense"] * 2 == r["tensor sparse"] for r in rows.values() if r["tensor sparse"] is not None)
    assert rows[hopper, "fp32"]["CUDA cores"] is not None and rows[hopper, "fp32"]["tensor sparse"] is None


def test_matmul_rates_benchmark_is_registered_for_the_chapter():
    from labkit import benchmarks
    bench = benchmarks.get("formats.matmul_rates")
    assert bench.chapter == "number-formats"
