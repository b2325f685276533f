"""FlashAttention in Triton: an FA1-ordered forward, the FA2 forward, and the FA2 backward.

Tensors are laid out (batch, heads, seq, head_dim) with the last dimension contiguous;
every kernel takes all four strides, so a (batch, seq, heads, dim) tensor viewed through
``.transpose(1, 2)`` works without a copy. K and V may have fewer heads than Q (grouped-
query and multi-query attention): query head ``h`` reads key/value head ``h // GROUP``.
They may also have a different length (``N_KV`` keys for ``N_Q`` queries: cross-attention,
or new queries after a cached prefix). The causal mask is then aligned to the bottom
right, as FlashAttention-2 aligns it: query ``i`` sees keys ``j <= i + N_KV - N_Q``, so the
last query sees every key; callers guarantee ``N_KV >= N_Q`` when causal, so that every
query sees at least one key.

Numerics shared by all kernels:

- Scores live in the base-2 domain. ``exp(x) = exp2(x * log2(e))``, and ``exp2`` is one
  hardware instruction (``ex2.approx``) while ``exp`` is an ``ex2`` plus a multiply; folding
  ``log2(e)`` into the softmax scale (``qk_scale``) makes the multiply free.
- Matmuls take fp16/bf16 operands and accumulate in fp32 (``tl.dot`` on tensor cores); the
  running max ``m``, running sum ``l`` and the output accumulator are fp32. fp32 operands
  go through ``tl.dot``'s default input precision, TF32 on the GPU (operands cut to a
  10-bit mantissa; Triton's interpreter multiplies them in full fp32).
- The saved logsumexp is in natural log, ``lse = m + log(l)`` per query row (the value the
  cuDNN and flash SDPA backends save too), so the backward can rebuild
  ``P = exp(S - lse)`` without a second pass over the keys.

On Hopper the forward's unmasked key loop may also run FlashAttention-3's order, each tile's
softmax under the previous tile's ``p v`` product (``OVERLAP_QK``,
:func:`_fwd_kv_loop_overlapped`); the autotuner times both orders.

Masks cost instructions, so each loop is split into stages: tiles that are entirely
visible and inside the sequence run without any mask; only the tiles on the causal
diagonal and the ragged last tile (when ``seq`` is not a multiple of the block) run the
masked body. That split is also where causal attention saves its half: tiles above the
diagonal are outside every loop's bounds and never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend

LOG2_E = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * LOG2_E)
LN_2 = 0.6931471805599453


def _configs(entries, keys, **fixed):
    """``triton.Config`` objects from ``(block sizes..., num_warps, num_stages)`` tuples, each
    with the ``fixed`` meta-parameters too."""
    return [
        triton.Config(dict(zip(keys, e[:-2])) | fixed, num_warps=e[-2], num_stages=e[-1]) for e in entries
    ]


def _autotune(key, sixteen_bit, fp32):
    """``triton.autotune`` over both candidate lists, pruned per call to the one for Q's dtype.

    fp32 operands take twice the shared memory of fp16/bf16 ones, so they get tiles of
    their own, and the 16-bit search stays exactly the tuned one. ``fp32=None`` (the
    interpreter's single config) uses one list for every dtype.
    """
    if fp32 is None:
        return triton.autotune(configs=sixteen_bit, key=key)

    def for_q_dtype(configs, named_args, **kwargs):
        return fp32 if named_args["Q"].dtype == torch.float32 else sixteen_bit

    return triton.autotune(configs=sixteen_bit + fp32, key=key,
                           prune_configs_by={"early_config_prune": for_q_dtype})


# Autotuning candidates, (BLOCK_M, BLOCK_N, num_warps, num_stages). On the GPU: the
# winners of a sweep of 8-11 candidates per kernel on an H200 (bf16, d = 64 and 128, causal
# and not, seq 1024 and 4096; not recorded), around what Triton's fused-attention tutorial uses on
# Hopper. 8 warps with BLOCK_M 128 gives each of the two warpgroups 64 rows of a wgmma;
# 4 warps at d = 128 were far slower (register pressure); 128 x 128 tiles with 4
# stages do not fit in 227 KB of shared memory at d = 128. The fp32 lists are small
# two-stage tiles that fit fp32 operands at d = 128, not tuned. Under the interpreter a
# single small config: every program runs in Python, and autotuning would run each
# candidate.
# The autotuner keys on the lengths' power-of-two buckets (it adds the tensors' dtypes), not
# on the lengths themselves. A key is tuned once, by timing every candidate (Triton's
# do_bench: 25 ms of warm-up and 100 ms of timing each), and packed SFT batches call the
# kernels once per document, dozens of distinct lengths a step: keyed on exact lengths,
# every new length cost over a second of tuning (10 candidates over the three kernels);
# bucketed, a step's documents share a handful of keys. The benchmarks' lengths are powers
# of two, for which the bucket is the length itself. For the same reason the lengths are
# not specialized on (Triton would compile every candidate twice, for lengths that are
# multiples of 16 and for the rest); they only bound loops and masks, outside the hot loop.
AUTOTUNE_KEY = ["N_Q_TUNE", "N_KV_TUNE", "HEAD_DIM", "CAUSAL"]
LENGTH_ARGS = ["N_Q", "N_KV"]


def tuning_length(n: int) -> int:
    """The autotuning bucket of a sequence length: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def autotuned_choices() -> dict[str, dict[str, str]]:
    """What each FA2 kernel's autotuner chose so far, by key (for the benchmarks' records)."""
    tuners = {"forward": fa2_forward_kernel, "backward dK/dV": backward_dkdv_kernel, "backward dQ": backward_dq_kernel}
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in tuners.items() if tuner.cache}


BLOCKS = ("BLOCK_M", "BLOCK_N")
FWD_GPU = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
FWD_FP32_GPU = [(64, 32, 4, 2), (64, 64, 4, 2)]
# dK/dV: a program holds BLOCK_N keys and walks the queries BLOCK_M at a time. Its two fp32
# accumulators (dK, dV: BLOCK_N x HEAD_DIM each) stay live across the whole query loop, and
# at head_dim 128 with causal masking all three tiles here spill registers to local memory
# when compiled for sm_90 (read in their SASS, Triton 3.6 and 3.9). Two tiles that spill
# nothing there, 64x64 and 32x128 on 8 warps, were candidates in the H200 run of
# attention.backward at e1bf01d, and the autotuner chose neither at any shape: the spilling
# tiles ran faster.
DKDV_GPU = [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)]
DKDV_FP32_GPU = [(16, 32, 4, 2), (32, 64, 4, 2)]
# dQ: a program holds BLOCK_M queries and walks the keys BLOCK_N at a time.
DQ_GPU = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)]
DQ_FP32_GPU = [(64, 32, 4, 2), (64, 64, 4, 2)]
# The forward's 16-bit tiles are also timed with the unmasked key loop overlapped
# (OVERLAP_QK, added after the sweep above: _fwd_kv_loop_overlapped). All but 128 x 128: at
# head_dim 128 its deeper pipeline needs more shared memory than an H200 program has.
FWD_OVERLAP_GPU = [t for t in FWD_GPU if t[:2] != (128, 128)]
FWD_GPU_CONFIGS = _configs(FWD_GPU, BLOCKS, OVERLAP_QK=False) + _configs(FWD_OVERLAP_GPU, BLOCKS, OVERLAP_QK=True)
FWD_CONFIGS = backend.pick(cpu=_configs([(32, 16, 4, 1)], BLOCKS, OVERLAP_QK=False), gpu=FWD_GPU_CONFIGS)
FWD_FP32_CONFIGS = backend.pick(cpu=None, gpu=_configs(FWD_FP32_GPU, BLOCKS, OVERLAP_QK=False))
BWD_DKDV_CONFIGS = _configs(backend.pick(cpu=[(16, 32, 4, 1)], gpu=DKDV_GPU), BLOCKS)
BWD_DKDV_FP32_CONFIGS = backend.pick(cpu=None, gpu=_configs(DKDV_FP32_GPU, BLOCKS))
BWD_DQ_CONFIGS = _configs(backend.pick(cpu=[(32, 16, 4, 1)], gpu=DQ_GPU), BLOCKS)
BWD_DQ_FP32_CONFIGS = backend.pick(cpu=None, gpu=_configs(DQ_FP32_GPU, BLOCKS))
# The FA1-ordered kernel is a teaching step, not tuned.
FA1_BLOCK = backend.pick(cpu=16, gpu=64)


# ----------------------------------------------------------------------------------------
# Stage 1: FlashAttention-1 ordering.
# ----------------------------------------------------------------------------------------


@triton.jit
def fa1_forward_kernel(
    Q, K, V, O, M, L,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H, GROUP, N_CTX, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Algorithm 1 of FlashAttention (2022): outer loop over K/V tiles, inner over Q tiles.

    One program per (batch, head). K_j and V_j are loaded once and stay on chip; for each
    Q tile the running statistics ``m``, ``l`` and the *normalized* output ``O`` are read
    from HBM, updated, and written back. ``O``, ``M`` and ``L`` are fp32 buffers of
    (batch * heads, seq, ...) filled by the launcher with 0, -inf and 0.
    """
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    o_base = O + bh.to(tl.int64) * N_CTX * HEAD_DIM
    ml_base = bh.to(tl.int64) * N_CTX
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(0, N_CTX, BLOCK):
        offs_n = start_n + tl.arange(0, BLOCK)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=offs_n[:, None] < N_CTX, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=offs_n[:, None] < N_CTX, other=0.0)
        # Causal: query tiles wholly above this key tile see none of it; skip them.
        first_m = (start_n // BLOCK) * BLOCK if CAUSAL else 0
        for start_m in range(first_m, N_CTX, BLOCK):
            offs_m = start_m + tl.arange(0, BLOCK)
            row_ok = offs_m < N_CTX
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            visible = offs_n[None, :] < N_CTX
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(visible, s, float("-inf"))
            # Read the state this Q tile left after the previous K/V tile.
            o_ptrs = o_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            m_old = tl.load(M + ml_base + offs_m, mask=row_ok, other=0.0)
            l_old = tl.load(L + ml_base + offs_m, mask=row_ok, other=0.0)
            o_old = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            # The paper forms exp(S - rowmax(S_tile)) and then rescales it by
            # exp(rowmax - m_new); shifting by m_new at once is the same number, and stays
            # finite for a causal row that sees none of this tile's keys (m_old is finite
            # there: every row saw key 0 in the first tile).
            m_new = tl.maximum(m_old, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            w_old = tl.math.exp2(m_old - m_new)  # 0 on the first tile, where m_old = -inf
            l_new = w_old * l_old + tl.sum(p, 1)
            pv = tl.dot(p.to(v.dtype), v)
            o_new = (w_old[:, None] * l_old[:, None] * o_old + pv) / l_new[:, None]
            tl.store(o_ptrs, o_new, mask=row_ok[:, None])
            tl.store(M + ml_base + offs_m, m_new, mask=row_ok)
            tl.store(L + ml_base + offs_m, l_new, mask=row_ok)
        # The next K/V tile reads what this one wrote, from other threads' registers.
        tl.debug_barrier()


def forward_fa1(q, k, v, causal: bool, scale: float):
    """FA1-ordered forward: returns ``(o, lse)``; inputs as :func:`forward` takes them,
    with as many keys as queries (the teaching step handles self-attention only)."""
    B, H, N, D = q.shape
    group = H // k.shape[1]
    o32 = torch.zeros((B * H, N, D), device=q.device, dtype=torch.float32)
    m = torch.full((B * H, N), float("-inf"), device=q.device, dtype=torch.float32)
    l = torch.zeros((B * H, N), device=q.device, dtype=torch.float32)
    fa1_forward_kernel[(B * H,)](
        q, k, v, o32, m, l,
        *q.stride(), *k.stride(), *v.stride(),
        H, group, N, scale * LOG2_E,
        HEAD_DIM=D, BLOCK=FA1_BLOCK, CAUSAL=causal, num_warps=4, num_stages=2,
    )
    lse = (m + torch.log2(l)) * LN_2
    return o32.view(B, H, N, D).to(q.dtype), lse.view(B, H, N)


# ----------------------------------------------------------------------------------------
# Stage 2: FlashAttention-2 forward.
# ----------------------------------------------------------------------------------------


@triton.jit
def _kv_stages(start_m, N_Q, N_KV, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):
    """Where a Q tile's key loop switches to the masked body, and where it ends.

    Keys ``[0, mask_lo)`` are all visible and in range: causal, the whole key tiles that
    even the tile's first query sees (keys up to ``start_m + N_KV - N_Q``); otherwise
    every full tile. ``[mask_lo, hi)`` needs the mask: the diagonal tiles, or the ragged
    tail. Keys from ``hi`` on lie above the diagonal and are skipped.
    """
    full_tiles_end = (N_KV // BLOCK_N) * BLOCK_N
    if CAUSAL:
        shift = N_KV - N_Q
        mask_lo = tl.minimum(((start_m + shift + 1) // BLOCK_N) * BLOCK_N, full_tiles_end)
        hi = tl.minimum(start_m + BLOCK_M + shift, N_KV)
    else:
        mask_lo = full_tiles_end
        hi = N_KV
    return mask_lo, hi


@triton.jit
def _load_kv_tile(base, stride_n, stride_d, start_n, N_KV, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr):
    """Keys (or values) ``[start_n, start_n + BLOCK_N)`` of one head, masked where the tile
    may run past ``N_KV``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    ptrs = base + offs_n[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :] * stride_d
    if MASKED:
        return tl.load(ptrs, mask=offs_n[:, None] < N_KV, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _tile_softmax(s, m_i, l_i, start_n, offs_m, N_Q, N_KV, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """One key tile's share of the online softmax, from its raw scores ``s = q k^T`` (keys
    ``[start_n, start_n + BLOCK_N)``): the unnormalized probabilities ``p``, the factor
    ``alpha`` that rescales what was accumulated under the old running max, and the new
    running sum and max.

    ``MASKED=False`` is the hot loop: every key is in range and visible, so there is no
    mask at all, and scale and max-subtraction fuse into one FMA per score.
    """
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = offs_n[None, :] < N_KV
        if CAUSAL:
            visible = visible & (offs_m[:, None] + (N_KV - N_Q) >= offs_n[None, :])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0 commutes with max
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _accumulate_pv(acc, alpha, p, v_base, stride_vn, stride_vd, start_n, N_KV, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """``acc * alpha + p v`` for one key tile. Not divided by the running sum: FA2 defers the
    division to the epilogue, one divide per row instead of one per tile."""
    acc = acc * alpha[:, None]
    v = _load_kv_tile(v_base, stride_vn, stride_vd, start_n, N_KV, HEAD_DIM, BLOCK_N, MASKED)
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, N_Q, N_KV, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into one Q tile's running ``(acc, l, m)``, one after another:
    each tile's ``q k^T``, its softmax, then its ``p v``."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_kv_tile(k_base, stride_kn, stride_kd, start_n, N_KV, HEAD_DIM, BLOCK_N, MASKED)
        s = tl.dot(q, tl.trans(k))
        p, alpha, l_i, m_i = _tile_softmax(s, m_i, l_i, start_n, offs_m, N_Q, N_KV, qk_scale, BLOCK_N, MASKED,
                                           CAUSAL)
        acc = _accumulate_pv(acc, alpha, p, v_base, stride_vn, stride_vd, start_n, N_KV, HEAD_DIM, BLOCK_N, MASKED)
    return acc, l_i, m_i


@triton.jit
def _fwd_kv_loop_overlapped(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, N_Q, N_KV, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """:func:`_fwd_kv_loop` over unmasked tiles, each tile's ``p v`` deferred by one tile:
    iteration ``j`` issues tile ``j``'s ``q k^T``, then tile ``j - 1``'s ``p v``, and only
    then runs tile ``j``'s softmax, while that ``p v`` is still in flight.

    On Hopper ``tl.dot`` is an asynchronous ``wgmma``, waited for where its result is first
    used. In the plain loop the softmax needs the scores at once and the next scores need
    nothing from it, so the tensor cores idle during the exponentials. This is
    FlashAttention-3's intra-warpgroup order: the exponentials of one tile run under the
    ``p v`` product of the tile before.

    The first iteration's ``p v`` is a no-op (``p = 0``, ``alpha = 1``, over the first tile's
    values) and the last tile's runs after the loop, its values loaded with a mask (with no
    unmasked tile at all it is a no-op again). A branch around the loop for the case of no
    tile would be simpler, but with it ``ptxas`` serializes every ``wgmma`` of the kernel
    (its C7515: an instruction other than a ``wgmma`` writes a ``wgmma``'s accumulator while
    it is in flight), a wait after each.
    """
    p = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    alpha = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # p and alpha are tile start_n - BLOCK_N's (the no-op at lo)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_kv_tile(k_base, stride_kn, stride_kd, start_n, N_KV, HEAD_DIM, BLOCK_N, False)
        s = tl.dot(q, tl.trans(k))
        acc = _accumulate_pv(acc, alpha, p, v_base, stride_vn, stride_vd, tl.maximum(start_n - BLOCK_N, lo), N_KV,
                             HEAD_DIM, BLOCK_N, False)
        p, alpha, l_i, m_i = _tile_softmax(s, m_i, l_i, start_n, offs_m, N_Q, N_KV, qk_scale, BLOCK_N, False, CAUSAL)
    acc = _accumulate_pv(acc, alpha, p, v_base, stride_vn, stride_vd, tl.maximum(hi - BLOCK_N, lo), N_KV, HEAD_DIM,
                         BLOCK_N, True)
    return acc, l_i, m_i


@_autotune(AUTOTUNE_KEY, FWD_CONFIGS, FWD_FP32_CONFIGS)
@triton.jit(do_not_specialize=LENGTH_ARGS)
def fa2_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, N_KV, N_Q_TUNE, N_KV_TUNE, qk_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    OVERLAP_QK: tl.constexpr,  # the unmasked stage overlaps each tile's softmax with the next Q K^T
):
    """One program per (Q tile, batch * head): the Q tile stays on chip, K/V stream past.

    Grid ``(cdiv(seq, BLOCK_M), batch * heads)``: FA2 parallelizes over the sequence as
    well as batch and heads, so even batch 1 with few heads fills 132 SMs.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the causal split lands on tile edges
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP  # GQA/MQA: GROUP query heads share one K/V head
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    mask_lo, hi = _kv_stages(start_m, N_Q, N_KV, BLOCK_M, BLOCK_N, CAUSAL)
    if OVERLAP_QK:
        acc, l_i, m_i = _fwd_kv_loop_overlapped(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd,
                                                stride_vn, stride_vd, offs_m, 0, mask_lo, N_Q, N_KV, qk_scale,
                                                HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL)
    else:
        acc, l_i, m_i = _fwd_kv_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd,
                                     stride_vn, stride_vd, offs_m, 0, mask_lo, N_Q, N_KV, qk_scale,
                                     HEAD_DIM, BLOCK_N, False, CAUSAL)
    # Masked stage: the diagonal tiles (causal) and the ragged tail. Tiles past `hi` are
    # above the diagonal: skipped, never loaded.
    acc, l_i, m_i = _fwd_kv_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd,
                                 stride_vn, stride_vd, offs_m, mask_lo, hi, N_Q, N_KV, qk_scale,
                                 HEAD_DIM, BLOCK_N, True, CAUSAL)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural log
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def forward(q, k, v, causal: bool, scale: float, out=None, cfg: triton.Config | None = None):
    """FA2 forward: ``o`` (like ``q``) and the fp32 logsumexp ``lse`` of shape (B, H, N_Q).

    Expects 4-D inputs already validated (see :func:`labkit.attention.forward`).
    ``out=(o, lse)`` writes into given buffers (``lse`` contiguous; those shapes and dtypes).
    ``cfg`` (``BLOCK_M``, ``BLOCK_N``, ``OVERLAP_QK``, warps and stages, as :data:`FWD_GPU_CONFIGS`
    holds them) runs that launch instead of the autotuner's choice.
    """
    B, H, N_Q, D = q.shape
    if out is None:
        out = (torch.empty_like(q), torch.empty((B, H, N_Q), device=q.device, dtype=torch.float32))
    o, lse = out

    def grid(meta):
        return (triton.cdiv(N_Q, meta["BLOCK_M"]), B * H)

    kernel, meta = (fa2_forward_kernel, {}) if cfg is None else (fa2_forward_kernel.fn, cfg.all_kwargs())
    kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, H // k.shape[1], N_Q, k.shape[2], tuning_length(N_Q), tuning_length(k.shape[2]), scale * LOG2_E,
        HEAD_DIM=D, CAUSAL=causal, **meta,
    )
    return o, lse


# ----------------------------------------------------------------------------------------
# Stage 3: the backward, recomputing P from the saved logsumexp.
# ----------------------------------------------------------------------------------------


@triton.jit
def backward_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_db, stride_dh, stride_dn, stride_dd,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """``D_i = sum_d dO_id * O_id``: the row term of the softmax gradient, once per row."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N_Q
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, mask=row_ok, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
                 + offs_m[:, None] * stride_dn + offs_d[None, :] * stride_dd, mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _dkdv_q_loop(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_dn, stride_dd,
    offs_n, lo, hi, N_Q, N_KV, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Accumulate one K/V tile's ``dK, dV`` over query tiles ``[lo, hi)``.

    Works on transposed tiles (keys down, queries across) so that ``dV += P^T dO`` and
    ``dK += dS^T Q`` are plain ``tl.dot``s of what is already in registers.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
        do_ptrs = do_base + offs_m[:, None] * stride_dn + offs_d[None, :] * stride_dd
        if MASKED:
            row_ok = offs_m < N_Q
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        lse2 = lse2 * 1.4426950408889634  # natural log -> base 2, like the scores
        s_t = tl.dot(k, tl.trans(q))  # (BLOCK_N keys, BLOCK_M queries)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])  # P recomputed, already normalized
        if MASKED:
            visible = offs_m[None, :] < N_Q
            if CAUSAL:
                visible = visible & (offs_m[None, :] + (N_KV - N_Q) >= offs_n[:, None])
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@_autotune(AUTOTUNE_KEY, BWD_DKDV_CONFIGS, BWD_DKDV_FP32_CONFIGS)
@triton.jit(do_not_specialize=LENGTH_ARGS)
def backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, GROUP, N_Q, N_KV, N_Q_TUNE, N_KV_TUNE, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (K/V tile, batch * kv_head): dK and dV for those keys.

    A K/V head serves GROUP query heads, so its gradient sums over all of them: the
    program walks every query head of its group, and no two programs write the same rows
    (no atomics). dK and dV share layout with K and V, contiguous.
    """
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    H_KV = H // GROUP
    b = bkv // H_KV
    kvh = bkv % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < N_KV
    k = tl.load(K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=key_ok, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    full_m = (N_Q // BLOCK_M) * BLOCK_M  # query tiles below this need no bounds mask
    if CAUSAL:
        # Query m sees key n iff m + shift >= n. Queries before start_n - shift see none
        # of these keys; from free_lo on, a whole query tile sees every key of this tile
        # (the last is start_n + BLOCK_N - 1); the tiles between are the diagonal band,
        # masked. Both bounds rounded to query tiles: down for diag_lo, up for free_lo.
        shift = N_KV - N_Q
        diag_lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        free_lo = ((tl.maximum(start_n + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        diag_hi = tl.minimum(free_lo, N_Q)
    else:
        diag_lo = 0
        diag_hi = 0
        free_lo = 0
    tail_lo = tl.maximum(free_lo, full_m)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        lse_base = LSE + (b * H + h).to(tl.int64) * N_Q
        delta_base = DELTA + (b * H + h).to(tl.int64) * N_Q
        dk, dv = _dkdv_q_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                              stride_qn, stride_qd, stride_don, stride_dod, offs_n,
                              diag_lo, diag_hi, N_Q, N_KV, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL)
        dk, dv = _dkdv_q_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                              stride_qn, stride_qd, stride_don, stride_dod, offs_n,
                              free_lo, full_m, N_Q, N_KV, qk_scale, HEAD_DIM, BLOCK_M, False, CAUSAL)
        dk, dv = _dkdv_q_loop(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                              stride_qn, stride_qd, stride_don, stride_dod, offs_n,
                              tail_lo, N_Q, N_Q, N_KV, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL)
    out = (bkv.to(tl.int64) * N_KV + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_kv_loop(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, N_Q, N_KV, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Accumulate one Q tile's ``dQ`` over key tiles ``[lo, hi)``."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_KV, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_KV, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            visible = offs_n[None, :] < N_KV
            if CAUSAL:
                visible = visible & (offs_m[:, None] + (N_KV - N_Q) >= offs_n[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@_autotune(AUTOTUNE_KEY, BWD_DQ_CONFIGS, BWD_DQ_FP32_CONFIGS)
@triton.jit(do_not_specialize=LENGTH_ARGS)
def backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, GROUP, N_Q, N_KV, N_Q_TUNE, N_KV_TUNE, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (Q tile, batch * head): dQ = scale * dS K, walking the keys.

    Same loop structure as the forward; recomputes S and P instead of reading them, which
    costs one extra Q K^T matmul and saves reading an (N, N) matrix.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    mask_lo, hi = _kv_stages(start_m, N_Q, N_KV, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_kv_loop(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                     stride_vd, offs_m, 0, mask_lo, N_Q, N_KV, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL)
    dq = _dq_kv_loop(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                     stride_vd, offs_m, mask_lo, hi, N_Q, N_KV, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL)
    out = (bh.to(tl.int64) * N_Q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


PREPROCESS_BLOCK = backend.pick(cpu=32, gpu=128)


def backward(q, k, v, o, lse, do, causal: bool, scale: float, out=None):
    """``(dq, dk, dv)`` from the forward's inputs, output and logsumexp, and ``dO``.

    Three launches: ``D = rowsum(dO * O)``; dK and dV (one program per K/V tile); dQ (one
    program per Q tile). The gradients come back contiguous, shaped like q, k, v, or in
    the contiguous buffers ``out=(dq, dk, dv)``. Expects 4-D inputs already validated
    (see :func:`labkit.attention.backward`).
    """
    B, H, N_Q, D = q.shape
    h_kv, N_KV = k.shape[1], k.shape[2]
    delta = torch.empty((B, H, N_Q), device=q.device, dtype=torch.float32)
    backward_preprocess_kernel[(triton.cdiv(N_Q, PREPROCESS_BLOCK), B * H)](
        o, do, delta, *o.stride(), *do.stride(), H, N_Q,
        HEAD_DIM=D, BLOCK_M=PREPROCESS_BLOCK,
    )
    if out is None:
        out = tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    dq, dk, dv = out
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(),
              H, H // h_kv, N_Q, N_KV, tuning_length(N_Q), tuning_length(N_KV), scale * LOG2_E, scale)
    backward_dkdv_kernel[lambda meta: (triton.cdiv(N_KV, meta["BLOCK_N"]), B * h_kv)](
        q, k, v, do, lse, delta, dk, dv, *common, HEAD_DIM=D, CAUSAL=causal,
    )
    backward_dq_kernel[lambda meta: (triton.cdiv(N_Q, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, *common, HEAD_DIM=D, CAUSAL=causal,
    )
    return dq, dk, dv
