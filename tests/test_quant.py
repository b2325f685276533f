"""labkit.quant: formats bit by bit, methods against their objectives, kernels against float64."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter before triton)
from labkit import backend, check, quant, sass
import triton  # noqa: E402  (after labkit, which chooses the interpreter)
from labkit.quant import corpus, kernels, make_checkpoint, model as qmodel, reference as R

DEV = backend.device()


def _weight(n, k, seed=1, dtype=torch.float32):
    return check.randn(n, k, dtype=dtype, device=DEV, seed=seed)


# ---- formats ---------------------------------------------------------------------------

def test_pack_int4_nibble_order():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8, device=DEV)
    packed = quant.pack_int4(codes)
    assert packed.tolist() == [[1 | 2 << 4, 15]]  # element 2j low nibble, 2j+1 high
    assert torch.equal(quant.unpack_int4(packed), codes)


def test_pack_unpack_roundtrip_random():
    codes = torch.randint(0, 16, (7, 64), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(codes)), codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_half_step(bits, symmetric):
    w = _weight(9, 96)
    qw = quant.quantize(w, bits, 32, symmetric=symmetric)
    err = (quant.dequantize(qw) - w).abs().reshape(9, 3, 32)
    half_step = qw.scales.float()[..., None] / 2
    assert (err <= half_step * (1 + 1e-5) + 1e-7).all()
    codes = quant.codes_of(qw)
    assert int(codes.max()) <= 2**bits - 1


def test_symmetric_maps_group_max_to_top_code():
    w = _weight(5, 64)
    qw = quant.quantize(w, 4, 32)
    amax = w.reshape(5, 2, 32).abs().amax(-1)
    assert torch.allclose(qw.scales, amax / 7)


def test_asymmetric_stores_zeros_and_is_finer_on_shifted_weights():
    w = _weight(8, 128) + 3.0  # all positive: symmetric wastes half its codes
    sym = (quant.dequantize(quant.quantize(w, 4, 32)) - w).abs().mean()
    asym_qw = quant.quantize(w, 4, 32, symmetric=False)
    asym = (quant.dequantize(asym_qw) - w).abs().mean()
    assert asym_qw.zeros is not None and asym < sym


def test_smaller_groups_reduce_error_with_an_outlier():
    w = _weight(16, 256)
    w[:, 5] *= 50  # one outlier input channel
    errs = [(quant.dequantize(quant.quantize(w, 4, g)) - w).abs().mean().item() for g in (256, 128, 32)]
    assert errs[0] > errs[1] > errs[2]


def test_all_zero_group_is_exact():
    w = torch.zeros(3, 64, device=DEV)
    assert torch.equal(quant.dequantize(quant.quantize(w, 4, 32)), w)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [None, 32])
def test_fp8_roundtrip_relative_error(fmt, block):
    w = _weight(64, 96)
    q, s = quant.quantize_fp8(w, fmt, block)
    assert q.dtype == R.FP8_FORMATS[fmt]
    mantissa = {"e4m3": 3, "e5m2": 2}[fmt]
    # Round to nearest: relative error at most half an ulp for normal numbers.
    assert check.rel_error(quant.dequantize_fp8(q, s), w) < 2.0 ** -(mantissa + 1)


# ---- methods ---------------------------------------------------------------------------

def _correlated_inputs(tokens, k, seed=3):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / math.sqrt(k)
    scales = torch.logspace(0, 1.5, k)
    return ((torch.randn(tokens, k, generator=gen) * scales) @ mix).to(DEV)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_beats_rtn_on_output_error(symmetric):
    w = _weight(24, 64)
    x = _correlated_inputs(512, 64)
    h = quant.hessian(x)
    ref = x.double() @ w.double().T

    def out_err(qw):
        return (x.double() @ quant.dequantize(qw).double().T - ref).pow(2).mean().item()

    rtn = out_err(R.quantize_rtn(w, 4, 32, symmetric))
    gptq = out_err(quant.gptq_quantize(w, h, 4, 32, symmetric))
    assert gptq < 0.8 * rtn


def test_gptq_with_identity_hessian_is_rtn():
    w = _weight(6, 64)
    qw = quant.gptq_quantize(w, torch.eye(64, dtype=torch.float64, device=DEV), 4, 32, damp=0.0)
    assert torch.equal(quant.codes_of(qw), quant.codes_of(R.quantize_rtn(w, 4, 32)))


def test_awq_never_worse_than_rtn():
    w = _weight(24, 64)
    x = _correlated_inputs(256, 64)
    s, alpha = quant.awq_scales(w, x, 4, 32)
    ref = x @ w.T
    rtn = (x @ quant.dequantize(R.quantize_rtn(w, 4, 32)).T - ref).pow(2).mean()
    awq = (x @ (quant.dequantize(R.quantize_rtn(w * s, 4, 32)) / s).T - ref).pow(2).mean()
    assert 0.0 <= alpha <= 1.0 and awq <= rtn * (1 + 1e-6)


# ---- kernels ---------------------------------------------------------------------------

CASES = [  # (M, N, K, group): odd N and M, per-channel, groups smaller and larger than a chunk;
    # K = 32 is a single chunk, so no K split: each program stores its own rows.
    (1, 37, 96, 32), (1, 19, 128, None), (1, 41, 192, 64), (1, 13, 32, 32),
    (3, 21, 64, 32), (5, 33, 192, 64), (17, 9, 96, None), (4, 13, 32, None),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m,n,k,group", CASES)
def test_dequant_matmul_matches_float64_of_same_codes(bits, symmetric, m, n, k, group):
    w = _weight(n, k)
    qw = quant.quantize(w, bits, group, symmetric=symmetric)
    x = check.randn(m, k, device=DEV, seed=2)
    check.assert_close(quant.dequant_matmul(x, qw), R.dequant_matmul(x, qw).float(),
                       dtype=torch.float32, name="fp32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("k", [128, 32])  # split K (fp32 atomics, then a cast) and not (cast in the kernel)
def test_dequant_matmul_half_activations(dtype, m, k):
    w = _weight(29, k)
    qw = quant.quantize(w, 4, 32, scale_dtype=dtype)
    x = check.randn(m, k, dtype=dtype, device=DEV, seed=4)
    y = quant.dequant_matmul(x, qw)
    assert y.dtype == dtype
    check.assert_close(y, R.dequant_matmul(x, qw).float(), dtype=dtype, name=str(dtype))


@pytest.mark.parametrize("code_words", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (19, 128, None), (41, 192, 64)])
def test_gemv_reads_codes_as_bytes_or_words(code_words, dtype, bits, symmetric, n, k, group):
    """Both ways of reading the codes (the autotuner picks one on a GPU), every format and input
    dtype; the word path's offset trick loses a few fp32 bits, far inside each dtype's tolerance."""
    qw = quant.quantize(_weight(n, k), bits, group, symmetric=symmetric)
    x = check.randn(1, k, dtype=dtype, device=DEV, seed=7)
    y = kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(16, code_words=code_words))
    check.assert_close(y, R.dequant_matmul(x, qw).float(), dtype=dtype, name=f"code_words={code_words}")


@pytest.mark.parametrize("code_words,prefetch,loop_stages,tma",
                         [(words, *ahead) for words in (False, True)
                          for ahead in ((True, 1, False), (False, 3, False), (False, 3, True)) if words or not ahead[2]],
                         ids=["bytes prefetch", "bytes pipelined", "words prefetch", "words pipelined", "words tma"])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, None), (8, 32)])
@pytest.mark.parametrize("k", [96, 160], ids=["3 chunks", "5 chunks"])
def test_gemv_loads_ahead_change_no_result(code_words, prefetch, loop_stages, tma, bits, group, k):
    """Every way of keeping loads in flight gives the plain loop's bits. PREFETCH loads chunk
    c + 1 while chunk c is worked on, and must load nothing past its split's last chunk: the
    interpreter splits K in two, so an odd chunk count gives one split a chunk more. TMA copies
    whole [rows, groups, words] boxes of the codes, and the 37 rows end inside the last strip's
    box, whose rows past the codes' last come back as zeros."""
    qw = quant.quantize(_weight(37, k), bits, group, symmetric=False)
    x = check.randn(1, k, dtype=torch.bfloat16, device=DEV, seed=9)
    plain = kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(16, code_words=code_words))
    ahead = kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(
        16, code_words=code_words, prefetch=prefetch, loop_stages=loop_stages, tma=tma))
    assert torch.equal(ahead, plain)
    check.assert_close(ahead, R.dequant_matmul(x, qw).float(), dtype=torch.bfloat16, name="loads ahead")


def test_gemv_config_takes_one_way_of_loading_ahead():
    with pytest.raises(ValueError, match="pick one"):
        kernels.gemv_config(16, code_words=True, prefetch=True, loop_stages=3)
    with pytest.raises(ValueError, match="code_words=False, loop_stages=3"):
        kernels.gemv_config(16, code_words=False, loop_stages=3, tma=True)
    with pytest.raises(ValueError, match="loop_stages > 1"):
        kernels.gemv_config(16, code_words=True, tma=True)


def test_gemv_tma_copies_the_codes_with_one_instruction_a_chunk():
    """With TMA the pipelined loop's copies of the codes are one UTMALDG a chunk (issued for the
    whole strip), in place of the threads' asynchronous copies (LDGSTS) of them; the inputs x
    stay asynchronous copies. The quantization chapter's stage 3c prints these counts."""
    plain, tma = (sass.loop_opcodes(quant.gemv_sass(4, True, loop_stages=3, tma=t, packed=True)) for t in (False, True))
    assert plain.count("UTMALDG") == 0 and tma.count("UTMALDG") == 1
    assert 0 < tma.count("LDGSTS") < plain.count("LDGSTS")


def _off_a_16_byte_boundary(codes: torch.Tensor) -> torch.Tensor:
    """A copy of ``codes`` that starts 4 bytes into a 16-byte line, as a slice may."""
    storage = torch.zeros(codes.numel() + 4, dtype=torch.uint8, device=codes.device)
    shifted = storage[4:].view(codes.shape)
    shifted.copy_(codes)
    return shifted


def test_gemv_tma_needs_codes_on_a_16_byte_boundary():
    """A TMA copy starts on a 16-byte boundary. Codes that start 4 bytes into one (a slice) are
    refused by an explicit TMA launch with the reason, and the autotuned launcher serves them
    without TMA: its choice is keyed on whether they could be a descriptor."""
    qw = quant.quantize(_weight(21, 128), 4, 32)
    moved = replace(qw, codes=_off_a_16_byte_boundary(qw.codes))
    assert kernels.tma_unsupported(qw.codes) is None
    assert "16-byte boundary" in kernels.tma_unsupported(moved.codes)
    assert not any(c.kwargs["TMA"] for c in kernels.gemv_launches(moved, torch.bfloat16))
    x = check.randn(1, 128, dtype=torch.bfloat16, device=DEV, seed=5)
    with pytest.raises(ValueError, match="the tma GEMV config cannot run here: a TMA copy starts"):
        kernels.dequant_matmul(x, moved, gemv_config=kernels.gemv_config(16, code_words=True, loop_stages=3, tma=True))
    assert torch.equal(kernels.dequant_matmul(x, moved), kernels.dequant_matmul(x, qw))


def test_gemv_tma_box_is_a_multiple_of_128_bytes():
    """Each pipeline stage's TMA box starts on a 128-byte boundary only if the box is a multiple of
    128 bytes: 4 rows of a 32-input INT4 chunk (64 bytes) failed with a misaligned address on an
    H100. An explicit launch of it is refused with the reason, the autotuner is never offered one,
    and 8 rows of the same chunk (128 bytes) run and match the reference."""
    assert "64 bytes" in kernels.tma_box_unsupported(4, 32, 4)
    assert kernels.tma_box_unsupported(8, 32, 4) is None and kernels.tma_box_unsupported(4, 32, 8) is None
    qw = quant.quantize(_weight(37, 96), 4, 32)
    x = check.randn(1, 96, dtype=torch.bfloat16, device=DEV, seed=7)
    assert kernels.gemv_block_k(96, 32) == 32  # on every machine: the group bounds the chunk
    with pytest.raises(ValueError, match="the tma GEMV config cannot run here: a TMA box of 4 rows"):
        kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(4, code_words=True, loop_stages=3, tma=True))
    offered = [c for c in kernels.gemv_launches(qw, x.dtype) if c.kwargs["TMA"]]
    assert all(c.kwargs["BLOCK_N"] >= 8 for c in offered) and bool(offered) == backend.on_gpu()
    check.assert_close(kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(8, code_words=True, loop_stages=3,
                                                                                     tma=True)),
                       R.dequant_matmul(x, qw), dtype=torch.bfloat16, name="TMA, 8 rows of a 32-input chunk")


def test_gemv_pipelines_its_loop_only_when_the_loop_asks():
    """The kernel's num_stages leaves the GEMV's machine code as it is (it pipelines only
    loads that feed a tl.dot); LOOP_STAGES, tl.range's num_stages, turns its loads into
    asynchronous copies (LDGSTS). The quantization chapter's stage 3c rests on this."""
    one, three = (quant.gemv_sass(4, True, num_stages=s) for s in (1, 3))
    assert one == three and "LDGSTS" not in sass.opcodes(three)
    assert "LDGSTS" in sass.opcodes(quant.gemv_sass(4, True, loop_stages=3))


@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)])
def test_gemm_loop_loads_everything_but_the_scales_ahead(bits, group):
    """In the small-batch GEMM's K loop (sm_90 code at the first of GEMM_CONFIGS, no PREFETCH)
    the codes and x arrive as asynchronous copies (LDGSTS); the only plain loads (LDG) are
    the scales', one for each of the two accumulator rows a thread holds in a 64-row wgmma
    tile (a chunk lies in one group). Read with a stride of two inputs, INT4's even and odd
    inputs were 16 more plain loads a thread (the quantization chapter's stage 4)."""
    bm, bn, warps, stages = kernels.GEMM_CONFIGS[0]
    loop = sass.loop_opcodes(quant.gemm_sass(bits, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                             group_size=group))
    assert "LDGSTS" in loop and loop.count("LDG") == 2


@pytest.mark.parametrize("bits,group", [(4, 32), (8, None)])
@pytest.mark.parametrize("m", [3, 17])
def test_gemm_prefetching_the_next_chunk_changes_no_result(bits, group, m):
    """The small-batch GEMM's PREFETCH, over several chunks in each of the interpreter's two
    K splits (K = 160: five 32-input chunks, so the splits get three and two)."""
    qw = quant.quantize(_weight(37, 160), bits, group, symmetric=False)
    x = check.randn(m, 160, dtype=torch.bfloat16, device=DEV, seed=m)
    plain = kernels.dequant_matmul(x, qw, gemm_config=kernels.gemm_config(16, 16))
    ahead = kernels.dequant_matmul(x, qw, gemm_config=kernels.gemm_config(16, 16, prefetch=True))
    assert torch.equal(ahead, plain)
    check.assert_close(ahead, R.dequant_matmul(x, qw).float(), dtype=torch.bfloat16, name="prefetch")


def test_gemm_offers_prefetch_to_int4_only():
    """INT8's codes are already pipelined by Triton; the autotuner never tries PREFETCH on them."""
    configs = [kernels.gemm_config(16, 64, prefetch=p) for p in (False, True)]
    assert kernels.prune_gemm_configs(configs, {}, BITS=4) == configs
    assert kernels.prune_gemm_configs(configs, {}, BITS=8) == configs[:1]


def test_gemv_word_codes_cover_every_position():
    """Each code position of a word (8 for INT4, 4 for INT8) holds the top code once and zeros
    elsewhere, so a wrong shift or mask for any position shows."""
    for bits in (4, 8):
        per_word = 32 // bits
        top = 2 ** bits - 1
        for position in range(per_word):
            codes = torch.zeros(per_word, 32, dtype=torch.uint8, device=DEV)
            for row in range(per_word):  # row r: code `top` at inputs r, r + per_word, ...
                codes[row, (row + position) % per_word::per_word] = top
            packed = quant.pack_int4(codes) if bits == 4 else codes
            qw = R.QuantizedWeight(packed.to(DEV), torch.ones(per_word, 1, device=DEV), None, bits, 32)
            x = torch.arange(1, 33, dtype=torch.float32, device=DEV)[None, :]
            y = kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(16, code_words=True))
            check.assert_close(y, R.dequant_matmul(x, qw).float(), dtype=torch.float32, name=f"{bits} bits")


@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)])
def test_word_codes_issue_fewer_instructions_per_weight(bits, group):
    """The sm_90 machine code of the GEMV's loop: reading codes as words drops the per-weight
    subtraction and the per-chunk reductions (the quantization chapter prints the mix)."""
    words = quant.gemv_instruction_mix(bits, True, group_size=group)
    byte_codes = quant.gemv_instruction_mix(bits, False, group_size=group)
    assert words["total"] < byte_codes["total"] and words["float"] < byte_codes["float"]


def test_packed_codes_issue_two_weights_an_instruction():
    """The bf16x2 path's sm_90 loop: its products are HFMA2/HMUL2s, one per two weights (ptxas
    also moves constants with HFMA2, hence at least), its fp32 FMAs one per word, not per
    weight; and it issues fewer instructions per weight than the word path at every strip the
    autotuner tries."""
    for block_n, warps in kernels.GEMV_STRIPS:
        packed = quant.gemv_instruction_mix(4, True, block_n=block_n, num_warps=warps, packed=True)
        words = quant.gemv_instruction_mix(4, True, block_n=block_n, num_warps=warps)
        assert packed["total"] < words["total"], (block_n, warps, packed["total"], words["total"])
        assert packed.get("HFMA2", 0) + packed.get("HMUL2", 0) >= 0.5, (block_n, warps, packed)
        assert packed.get("FFMA", 0) <= 1 / 8, (block_n, warps, packed)


def test_packed_gemv_says_where_it_cannot_run():
    with pytest.raises(ValueError, match="code_words=True"):
        kernels.gemv_config(16, code_words=False, packed=True)
    with pytest.raises(ValueError, match="bits=4 and code_words=True"):
        quant.gemv_sass(8, True, packed=True)
    qw = quant.quantize(_weight(16, 64), 8, 32)
    x = check.randn(1, 64, dtype=torch.bfloat16, device=DEV, seed=3)
    with pytest.raises(ValueError, match="CUDA GPU" if not backend.on_gpu() else "4-bit codes"):
        kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(16, code_words=True, packed=True))
    if backend.on_gpu():
        qw4 = quant.quantize(_weight(16, 64), 4, 32)
        with pytest.raises(ValueError, match="x must be bfloat16"):
            kernels.dequant_matmul(x.half(), qw4, gemv_config=kernels.gemv_config(16, code_words=True, packed=True))


def test_gemv_launches_are_the_autotuners_candidates_where_they_apply():
    for bits, dtype in ((4, torch.bfloat16), (8, torch.bfloat16), (4, torch.float16)):
        launches = kernels.gemv_launches(quant.quantize(_weight(16, 128), bits, 32), dtype)  # fresh codes: aligned
        assert launches and all(c in kernels._gemv.configs for c in launches)
        packed = [c for c in launches if c.kwargs["PACKED"]]
        assert bool(packed) == (kernels.packed_unsupported(bits, dtype) is None)
        # TMA is among the GPU's candidates; the interpreter's one launch is the plain word read
        assert any(c.kwargs["TMA"] for c in launches) == backend.on_gpu()


def test_gemv_autotuner_prunes_and_launches_where_it_has_several_candidates(monkeypatch):
    """The GPU's path through Triton's autotuner, on any machine: a tuner over several of the
    GEMV's launches, with the same key and pruner, and its benchmark replaced by a ranking (the
    interpreter has no GPU timer). The launcher passes its arguments by name, which the
    autotuner hands the pruner apart from the kernel's positional ones; the pruner must find
    them there (a lookup in the positional ones alone failed every autotuned GPU launch). It
    offers the benchmark the launches that can run here (bf16x2 only on a GPU, TMA only where the
    codes are aligned and the strip's box fits), and the winner's result is the reference's."""
    configs = [kernels.gemv_config(16, code_words=True), kernels.gemv_config(8, code_words=True, packed=True),
               kernels.gemv_config(16, code_words=True, loop_stages=3, tma=True),
               kernels.gemv_config(4, code_words=True, loop_stages=3, tma=True)]
    benched = []

    def rank(*args, config, **meta):  # the TMA launch "wins" wherever it is offered
        benched.append(config)
        return [0.5 if config.kwargs["TMA"] else 1.0] * 3

    qw = quant.quantize(_weight(37, 128), 4, 32)
    x = check.randn(1, 128, dtype=torch.bfloat16, device=DEV, seed=6)
    for codes in (qw.codes, _off_a_16_byte_boundary(qw.codes)):
        tuner = triton.autotune(configs, key=kernels._GEMV_KEY, reset_to_zero=["y_ptr"],
                                prune_configs_by={"early_config_prune": kernels.prune_gemv_configs})(
                                    kernels._gemv_kernel)
        monkeypatch.setattr(tuner, "_bench", rank)
        monkeypatch.setattr(kernels, "_gemv", tuner)
        benched.clear()
        w = replace(qw, codes=codes)
        y = kernels.dequant_matmul(x, w)
        aligned = kernels.tma_unsupported(codes) is None
        assert aligned == (codes is qw.codes)
        packed_ok = kernels.packed_unsupported(4, x.dtype) is None  # on a GPU; the interpreter cannot run PTX
        block_k = kernels.gemv_block_k(128, 32)  # 32 inputs under the interpreter: 4 rows' box is 64 bytes
        runnable = [c for c in configs if (packed_ok or not c.kwargs["PACKED"]) and (not c.kwargs["TMA"] or aligned
                    and kernels.tma_box_unsupported(c.kwargs["BLOCK_N"], block_k, 4) is None)]
        assert benched == runnable or (len(runnable) == 1 and not benched)  # newer Tritons time no lone launch
        assert kernels.gemv_autotuned(w).kwargs["TMA"] == aligned
        check.assert_close(y, R.dequant_matmul(x, w), dtype=torch.bfloat16,
                           name=f"autotuned, codes at byte {codes.data_ptr() % 16}")


def test_gemv_launch_names():
    def fields(**overrides):
        return {"PACKED": False, "CODE_WORDS": False, "PREFETCH": False, "LOOP_STAGES": 1, "TMA": False} | overrides

    assert kernels.gemv_code_read(fields()) == "bytes"
    assert kernels.gemv_code_read(fields(CODE_WORDS=True)) == "words"
    assert kernels.gemv_code_read(fields(CODE_WORDS=True, PACKED=True)) == "packed"
    assert kernels.gemv_loads_ahead(fields()) == "neither"
    assert kernels.gemv_loads_ahead(fields(PREFETCH=True)) == "PREFETCH"
    assert kernels.gemv_loads_ahead(fields(LOOP_STAGES=3)) == "LOOP_STAGES 3"
    assert kernels.gemv_loads_ahead(fields(CODE_WORDS=True, LOOP_STAGES=4, TMA=True)) == "TMA 4"


def test_gemv_launches_benchmark_checks_every_launch_and_marks_the_choice():
    from labkit import benchmarks, results
    from labkit.quant import bench

    rec = benchmarks.run("quant.gemv_launches", record=False)
    assert results.validate(rec.to_dict()) == []
    for key in {(r["N"], r["format"]) for r in rec.rows}:
        at = [r for r in rec.rows if (r["N"], r["format"]) == key]
        qw = quant.quantize(_weight(key[0], at[0]["K"]), *bench.FORMATS[key[1]])  # fresh codes, as the bench's
        assert len(at) == len(kernels.gemv_launches(qw, bench.DTYPE))
        assert sum(r["chosen"] for r in at) == 1  # the autotuner's choice is one of its candidates
        assert all(r["ms"] > 0 and r["ours/cublas"] == pytest.approx(r["cublas_ms"] / r["ms"]) for r in at)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_n,warps", [(4, 2), (16, 4)])
@pytest.mark.parametrize("n,k,group", [(37, 1024, 32), (301, 4096, 128), (19, 2048, None), (64, 3072, 64)])
def test_packed_gemv_matches_the_reference(symmetric, block_n, warps, n, k, group):
    """The bf16x2 GEMV (inline PTX, so GPU only), every way of loading ahead: within the bf16
    tolerance of float64, and within one bf16 unit in the last place of the model of its
    roundings (``reference.packed_gemv_rounding``: each product and 4-term sum rounded to bf16),
    element by element. That model is 0.14-0.29% from float64 at these shapes on the CPU,
    where the word path's fp32 sums are only the output's rounding away."""
    qw = quant.quantize(_weight(n, k, seed=n), 4, group, symmetric=symmetric)
    x = check.randn(1, k, dtype=torch.bfloat16, device=DEV, seed=k)
    exact = R.dequant_matmul(x, qw)
    modelled = R.packed_gemv_rounding(x, qw)
    ulp = torch.exp2(torch.floor(torch.log2(modelled.abs().clamp_min(1e-30))) - 7)
    for prefetch, stages, tma in kernels.GEMV_LOADS_AHEAD:
        packed = kernels.dequant_matmul(x, qw, gemv_config=kernels.gemv_config(
            block_n, code_words=True, num_warps=warps, prefetch=prefetch, loop_stages=stages, packed=True, tma=tma))
        check.assert_close(packed, exact, dtype=torch.bfloat16, name=f"packed {prefetch} {stages} {tma}")
        off = (packed.double() - modelled).abs() / ulp
        assert off.max() <= 1.0, f"packed {prefetch} {stages} {tma}: {off.max().item():.2f} ulp from the rounding model"


def test_packed_rounding_model_rounds_only_in_bf16():
    """The model of the bf16x2 GEMV's roundings is exact where bf16 is: integer inputs small
    enough that every product and 4-term sum is a bf16 number give float64's answer."""
    qw = quant.quantize(_weight(23, 256, seed=5), 4, 64, symmetric=False)
    weight = ((R.codes_of(qw).double() - qw.zeros.double().repeat_interleave(64, 1))
              * qw.scales.double().repeat_interleave(64, 1))  # in float64: dequantize() rounds to fp32
    x = torch.randint(-4, 5, (1, 256), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEV)
    assert check.rel_error(R.packed_gemv_rounding(x, qw), x.double() @ weight.T) < 1e-14
    y = check.randn(1, 256, dtype=torch.bfloat16, device=DEV, seed=6)
    assert check.rel_error(R.packed_gemv_rounding(y, qw), y.double() @ weight.T) > 1e-4


def test_gemv_instruction_mix_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quant.gemv_instruction_mix(3, True)
    with pytest.raises(ValueError, match="group_size"):
        quant.gemv_instruction_mix(4, True, group_size=48)


def test_codes_must_be_word_aligned():
    qw = quant.quantize(_weight(4, 64), 8, 32)
    shifted = torch.empty(4 * 64 + 1, dtype=torch.uint8, device=DEV)[1:].view(4, 64)
    shifted.copy_(qw.codes)
    with pytest.raises(ValueError, match="4-byte boundary"):
        quant.dequant_matmul(check.randn(1, 64, device=DEV, seed=1), replace(qw, codes=shifted))


@pytest.mark.parametrize("bits,expected", [(8, 0.02), (4, 0.3)])
def test_dequant_matmul_close_to_unquantized(bits, expected):
    """Against the float weights, the error is the format's, not the kernel's."""
    w = _weight(40, 128)
    x = check.randn(2, 128, device=DEV, seed=5)
    y = quant.dequant_matmul(x, quant.quantize(w, bits, 32))
    err = check.rel_error(y, x.double() @ w.double().T)
    assert err < expected


@pytest.mark.parametrize("m", [1, 4])
def test_every_output_written(monkeypatch, m):
    """Kernels that store their rows directly get a NaN-poisoned output: none may stay NaN."""
    real = kernels._output

    def poisoned_output(m_, n_, x_, split):
        y = real(m_, n_, x_, split)
        assert split == 1  # K = 32 is one chunk: no split-K, no zero-filled buffer
        return check.poison(y)

    monkeypatch.setattr(kernels, "_output", poisoned_output)
    qw = quant.quantize(_weight(23, 32), 4, 32)
    x = check.randn(m, 32, device=DEV, seed=6)
    check.assert_close(quant.dequant_matmul(x, qw), R.dequant_matmul(x, qw).float(), dtype=torch.float32,
                       name="poisoned output")


# ---- errors ----------------------------------------------------------------------------

def test_group_must_divide_k():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quant.quantize(_weight(4, 96), 4, 64)


def test_group_must_be_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(_weight(4, 96), 4, 48)


def test_bad_bits_and_types():
    with pytest.raises(ValueError, match="bits"):
        quant.quantize(_weight(4, 64), 3, 32)
    with pytest.raises(TypeError, match="w must be"):
        quant.quantize([[1.0]], 4, 32)
    with pytest.raises(TypeError, match="dtype"):
        quant.quantize(torch.ones(4, 64, dtype=torch.int32, device=DEV), 4, 32)
    with pytest.raises(TypeError, match="symmetric"):
        quant.quantize(_weight(4, 64), 4, 32, symmetric=1)


def test_dequant_matmul_rejects_bad_inputs():
    qw = quant.quantize(_weight(8, 64), 4, 32)
    with pytest.raises(ValueError, match="K = 32 inputs"):
        quant.dequant_matmul(torch.ones(1, 32, device=DEV), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        quant.dequant_matmul(torch.ones(1, 64, device=DEV), torch.ones(8, 64, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        quant.dequant_matmul(torch.ones(64, 2, device=DEV).t(), qw)
    bad = R.QuantizedWeight(qw.codes, qw.scales[:, :1].contiguous(), None, 4, 32)
    with pytest.raises(ValueError, match="scales must be"):
        quant.dequant_matmul(torch.ones(1, 64, device=DEV), bad)


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="even number"):
        quant.pack_int4(torch.zeros(2, 3, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        quant.pack_int4(torch.full((2, 4), 16, dtype=torch.uint8, device=DEV))
    with pytest.raises(TypeError, match="dtype"):
        quant.pack_int4(torch.zeros(2, 4, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="dtype"):
        quant.unpack_int4(torch.zeros(2, 4, device=DEV))


def test_fp8_rejects_bad_format_and_block():
    with pytest.raises(ValueError, match="fmt"):
        quant.quantize_fp8(_weight(32, 32), "e3m4")
    with pytest.raises(ValueError, match="must divide"):
        quant.quantize_fp8(_weight(32, 48), block=32)


def test_dequantize_fp8_rejects_bad_inputs():
    q, s = quant.quantize_fp8(_weight(64, 64), block=32)
    with pytest.raises(TypeError, match="q must have dtype"):
        quant.dequantize_fp8(q.float(), s)
    with pytest.raises(ValueError, match="one value per tile"):
        quant.dequantize_fp8(q, s[:, :1].repeat(1, 3))
    with pytest.raises(TypeError, match="scale must have dtype"):
        quant.dequantize_fp8(q, s.double())


def test_dequantize_and_awq_reject_bad_inputs():
    with pytest.raises(TypeError, match="QuantizedWeight"):
        quant.dequantize(torch.ones(4, 4, device=DEV))
    with pytest.raises(ValueError, match="features"):
        quant.awq_scales(_weight(4, 64), torch.ones(8, 32, device=DEV), 4, 32)
    with pytest.raises(TypeError, match="dtype"):
        quant.hessian(torch.ones(4, 4, dtype=torch.int64, device=DEV))


def test_gptq_rejects_wrong_hessian():
    with pytest.raises(ValueError, match="h must be"):
        quant.gptq_quantize(_weight(4, 64), torch.eye(32, device=DEV), 4, 32)


def test_fp8_linear_explains_when_unsupported():
    ok, why = quant.fp8_supported()
    if ok:
        pytest.skip("FP8 is supported here")
    one = torch.tensor(1.0, device=DEV)
    with pytest.raises(RuntimeError, match="8.9"):
        quant.fp8_linear(torch.ones(16, 16, device=DEV), torch.ones(16, 16, device=DEV), one)
    with pytest.raises(RuntimeError, match="8.9"):
        quant.fp8_matmul(torch.ones(16, 16, device=DEV), one, torch.ones(16, 16, device=DEV), one)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 48])
def test_fp8_linear_is_quantize_then_fp8_matmul(m):
    """fp8_linear = per-tensor E4M3 quantization of x, then the FP8 matmul; both checked
    against the float64 product of the same dequantized operands."""
    if not quant.fp8_supported()[0]:
        pytest.skip(quant.fp8_supported()[1])
    x = check.randn(m, 96, dtype=torch.bfloat16, device="cuda", seed=1)
    w8, ws = quant.quantize_fp8(check.randn(80, 96, device="cuda", seed=2, scale=0.02), "e4m3")
    x8, xs = quant.quantize_fp8(x, "e4m3")
    expected = quant.dequantize_fp8(x8, xs).double() @ quant.dequantize_fp8(w8, ws).double().T
    check.assert_close(quant.fp8_matmul(x8, xs, w8, ws), expected, dtype=torch.bfloat16, name="fp8_matmul")
    check.assert_close(quant.fp8_linear(x, w8, ws), expected, dtype=torch.bfloat16, name="fp8_linear")
    with pytest.raises(ValueError, match="multiples of 16"):
        quant.fp8_matmul(x8[:, :90].contiguous(), xs, w8[:, :90].contiguous(), ws)
    with pytest.raises(TypeError, match="x_fp8 must have dtype"):
        quant.fp8_matmul(x, xs, w8, ws)


# ---- the trained model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained():
    return make_checkpoint.load_checkpoint()


def test_checkpoint_records_its_settings(trained):
    saved = torch.load(make_checkpoint.CHECKPOINT, weights_only=True)
    assert saved["settings"] == make_checkpoint.SETTINGS
    assert saved["config"]["vocab_size"] == 256


def test_trained_model_int8_is_free_and_gptq_beats_rtn_at_int4(trained):
    tokens = corpus.heldout_tokens(8 * 256 + 1)
    calibration = corpus.load_bytes(corpus.split_files()[0])[:8 * 256].reshape(8, 256)
    ppl = qmodel.perplexity(trained, tokens)
    assert ppl < 256 / 8  # far better than a uniform guess over bytes

    def quantized(bits, group, method):
        model, stats = qmodel.quantize_model(trained, bits, group, method, calibration)
        return qmodel.perplexity(model, tokens), stats

    int8, int8_stats = quantized(8, None, "rtn")
    rtn, rtn_stats = quantized(4, 128, "rtn")
    gptq, _ = quantized(4, 128, "gptq")
    assert abs(int8 - ppl) / ppl < 1e-3
    assert rtn > ppl and gptq < rtn
    assert 0 < int8_stats["mean_abs_error"] < rtn_stats["mean_abs_error"] <= rtn_stats["max_abs_error"]


def test_quantize_model_needs_calibration(trained):
    with pytest.raises(ValueError, match="calibration"):
        qmodel.quantize_model(trained, 4, 32, method="gptq")
    with pytest.raises(ValueError, match="method"):
        qmodel.quantize_model(trained, 4, 32, method="magic")


def test_perplexity_rejects_short_text(trained):
    with pytest.raises(ValueError, match="at least"):
        qmodel.perplexity(trained, torch.zeros(10, dtype=torch.long, device=DEV), seq_len=256)
