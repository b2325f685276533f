"""The ``fused.tiles`` sweep: which launch each fused kernel should use, measured.

For each kernel, forward and backward, it times every candidate launch (:func:`candidates`)
at realistic bf16 shapes (the Qwen3 family's widths at 4K to 32K tokens, and the
norms at hidden 8192 too) and records its rate over the same unavoidable bytes the
chapter's benchmarks count (:data:`labkit.fused.bench.OPS`), beside the copy bandwidth
measured in the same run and Liger-Kernel's rate at each shape. Each candidate's outputs
and gradients are first checked against the float64 reference at the smallest token
count. The launch tables of :mod:`labkit.fused.kernels` are read off this record.

A few hundred distinct kernels (each tile and width compiles separately) would take
minutes to compile one after another, so on a GPU they are compiled first in parallel
worker processes, each launching its share once on a few rows: Triton's on-disk cache then
hands the timing loop every kernel ready made. The timing loop has a time budget; what it
did not reach is listed in the record's config.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement
from ..models import DecoderConfig
from . import bench, kernels
from .kernels import FlatTile, NormBackwardTile, RowTile

DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
TOKENS = backend.pick(cpu=(37,), gpu=(4096, 8192, 16384, 32768))
# Hidden 8192 is no Qwen3 width (they stop at 5120); it stands for the 70B class.
WIDE = dataclasses.replace(bench.QWEN3["Qwen3-32B"], hidden_size=8192)
# (label, layer shapes) per op: one per distinct width the op sees.
SHAPES = backend.pick(
    cpu={op: [("tiny", bench.TINY_SHAPE)] for op in bench.OPS},
    gpu={"rms_norm": [(m, bench.QWEN3[m]) for m in ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B",
                                                    "Qwen3-14B")] + [("hidden 8192", WIDE)],
         "rope": [(m, bench.QWEN3[m]) for m in ("Qwen3-0.6B", "Qwen3-4B", "Qwen3-14B", "Qwen3-32B")],
         "swiglu": [(m, bench.QWEN3[m]) for m in ("Qwen3-0.6B", "Qwen3-4B", "Qwen3-8B", "Qwen3-32B")]})
SHAPES = {**SHAPES, "add_rms_norm": SHAPES["rms_norm"]}
PROGRAMS_PER_SM = backend.pick(cpu=(1, 3), gpu=(1, 2, 4, 8, 16, 32, 64))
# Seconds from the sweep's start (compiling included) after which it stops timing tiles, and
# the least left for one torch.compile peer (a compile of forward and backward).
TIME_BUDGET_S = backend.pick(cpu=600.0, gpu=220.0)
COMPILE_PEER_S = 45.0
# Ten timed calls a candidate (each behind an L2 flush): enough for a median that ranks tiles.
REPS = backend.pick(cpu=1, gpu=10)
TARGET_MS = backend.pick(cpu=1.0, gpu=3.0)  # for the peers, timed as the chapter's benchmarks time them
WARP = 32
# The fields that tell one candidate launch from another, in the record's rows (``prefetch``
# and ``dw_atomic`` are absent from rows recorded before the norm backward had them).
TILE_FIELDS = ("block_rows", "block", "num_warps", "programs_per_sm", "num_stages", "prefetch", "dw_atomic")


def _row_tiles(row_values: int, per_thread: tuple[int, ...], max_tile: int) -> list[RowTile]:
    """Tiles of 1-32 rows of ``row_values`` (the power-of-two row) at ``per_thread`` values a thread."""
    return [RowTile(rows, warps) for rows in (1, 2, 4, 8, 16, 32) for warps in (1, 2, 4, 8, 16, 32)
            if rows * row_values <= max_tile and rows * row_values // (WARP * warps) in per_thread]


def candidates(op: str, direction: str, cfg: DecoderConfig) -> list:
    """The launches the sweep tries for ``op``'s ``direction`` at ``cfg``'s width."""
    if not backend.on_gpu():
        return {"norm forward": [RowTile(1, 4), RowTile(4, 4)],
                "norm backward": [NormBackwardTile(4, 4, p, s, f) for p in PROGRAMS_PER_SM for s in (1, 2)
                                  for f in (False, True)],
                "rope": [RowTile(4, 4), RowTile(16, 4)],
                "swiglu": [FlatTile(64, 2), FlatTile(256, 4)]}[_family(op, direction)]
    family = _family(op, direction)
    if family == "norm forward":
        return _row_tiles(_pow2(cfg.hidden_size), (4, 8, 16, 32), 32768)
    if family == "norm backward":
        # The backward holds dy, x and the dw sum for each value: at most 16 values a thread.
        return [NormBackwardTile(t.block_rows, t.num_warps, programs, stages, prefetch)
                for t in _row_tiles(_pow2(cfg.hidden_size), (4, 8, 16), 16384)
                for stages in (1, 2) for prefetch in (False, True) for programs in PROGRAMS_PER_SM]
    if family == "rope":
        return [RowTile(rows, warps) for rows in (4, 8, 16, 32, 64) for warps in (1, 2, 4, 8)]
    return [FlatTile(block, warps) for block in (1024, 2048, 4096, 8192, 16384) for warps in (2, 4, 8, 16)
            if 4 <= block // (WARP * warps) <= 32]


def _family(op: str, direction: str) -> str:
    return f"norm {direction}" if op.endswith("rms_norm") else op


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---- each op's kernels called directly, with a given tile --------------------------------

@dataclass(frozen=True)
class Launches:
    """``forward(t, tile)`` returns the outputs; ``saved(t)`` runs the default forward once
    for what the backward reads; ``backward(t, saved, cotangents, tile)`` returns the
    gradients of ``t``'s leaves, in ``t``'s order."""

    forward: Callable
    saved: Callable
    backward: Callable


def _norm_saved(t):
    return kernels.rms_norm_forward(t["x"].detach(), t["weight"].detach(), bench.EPS)[2]


def _add_norm_saved(t):
    _, total, rstd = kernels.rms_norm_forward(t["x"].detach(), t["weight"].detach(), bench.EPS,
                                              residual=t["residual"].detach())
    return total, rstd


def _add_norm_backward(t, saved, cot, tile):
    total, rstd = saved
    dsum, dw = kernels.rms_norm_backward(cot[0], total, t["weight"].detach(), rstd, dresidual=cot[1], tile=tile)
    return dsum, dw, dsum  # leaves: x, weight, residual


def _rope_forward(t, tile):
    q, k = t["q"].detach(), t["k"].detach()
    kernels.rope(q, k, t["cos"], t["sin"], q_dst=q, k_dst=k, tile=tile)
    return q, k


def _rope_backward(t, saved, cot, tile):
    dq, dk = torch.empty_like(cot[0]), torch.empty_like(cot[1])
    kernels.rope(cot[0], cot[1], t["cos"], t["sin"], q_dst=dq, k_dst=dk, inverse=True, tile=tile)
    return dq, dk


LAUNCHES = {
    "rms_norm": Launches(
        forward=lambda t, tile: kernels.rms_norm_forward(t["x"].detach(), t["weight"].detach(), bench.EPS,
                                                         tile=tile)[:1],
        saved=_norm_saved,
        backward=lambda t, rstd, cot, tile: kernels.rms_norm_backward(
            cot[0], t["x"].detach(), t["weight"].detach(), rstd, tile=tile)),
    "add_rms_norm": Launches(
        forward=lambda t, tile: kernels.rms_norm_forward(t["x"].detach(), t["weight"].detach(), bench.EPS,
                                                         residual=t["residual"].detach(), tile=tile)[:2],
        saved=_add_norm_saved, backward=_add_norm_backward),
    "rope": Launches(forward=_rope_forward, saved=lambda t: None, backward=_rope_backward),
    "swiglu": Launches(
        forward=lambda t, tile: (kernels.swiglu_forward(t["gate"].detach(), t["up"].detach(), tile=tile),),
        saved=lambda t: None,
        backward=lambda t, saved, cot, tile: kernels.swiglu_backward(cot[0], t["gate"].detach(),
                                                                     t["up"].detach(), tile=tile)),
}


def _cotangents(outputs) -> list[torch.Tensor]:
    return [check.randn(*o.shape, dtype=o.dtype, device=o.device, seed=20 + i) for i, o in enumerate(outputs)]


def _expected(op: bench.Op, t: dict[str, torch.Tensor], cotangents) -> tuple[tuple, tuple]:
    """The float64 reference's outputs and its gradients for ``cotangents``."""
    exact = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in t.items()}
    outs = op.call(op.reference, exact)
    grads = torch.autograd.grad(outs, [v for v in exact.values() if v.requires_grad],
                                [c.double() for c in cotangents])
    return tuple(o.detach() for o in outs), grads


def _fresh(t):
    return {k: v.detach().clone() for k, v in t.items()}


# ---- compiling ahead, in parallel --------------------------------------------------------

def compile_once(job: tuple[str, str, DecoderConfig, object]) -> str | None:
    """Launch one (op, direction, shape, tile) on a few rows, which compiles it; the error, if any."""
    op_name, direction, cfg, tile = job
    try:
        op, launches = bench.OPS[op_name], LAUNCHES[op_name]
        t = op.inputs(cfg, 16, DTYPE)
        if direction == "forward":
            launches.forward(_fresh(t), tile)
        else:
            outs = launches.forward(_fresh(t), None)
            launches.backward(t, launches.saved(t), _cotangents(outs), tile)
        return None
    except Exception as e:  # reported by the sweep, which then compiles (and fails) in the loop
        return f"{op_name} {direction} {tile}: {type(e).__name__}: {e}"[:300]


def precompile(jobs: list, workers: int, timeout_s: float = 150.0) -> list[str]:
    """Compile ``jobs`` in ``workers`` processes (spawned: CUDA does not survive a fork); the
    errors. Whatever is not compiled within ``timeout_s`` compiles later, in the timing loop."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        return [e for e in pool.map(compile_once, jobs, chunksize=4, timeout=timeout_s) if e]
    except Exception as e:  # a timeout or a dead worker: the sweep goes on without the rest
        return [f"precompile stopped: {type(e).__name__}: {e}"]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# ---- the sweep ---------------------------------------------------------------------------

def _rate(op: bench.Op, direction: str, t, fn: Callable) -> float:
    nbytes = op.fwd_bytes(t) if direction == "forward" else op.bwd_bytes(t)
    return timing.bandwidth_tbps(nbytes, timing.measure(fn, warmup=3, reps=REPS))


def _tile_fields(tile) -> dict:
    fields = {"block_rows": None, "num_warps": None, "programs_per_sm": None, "num_stages": None,
              "prefetch": None, "dw_atomic": None, "block": None}
    return {**fields, **dataclasses.asdict(tile)} if tile is not None else fields


def _sweep_shape(op_name: str, label: str, cfg: DecoderConfig, copy: float, liger, deadline: float,
                 rows: list, failures: list, choose: Callable = candidates,
                 directions: tuple[str, ...] = ("forward", "backward"), with_copy: bool = True,
                 token_counts: tuple[int, ...] = TOKENS, checked_launches: int = 1) -> bool:
    """Time every candidate (``choose(op_name, direction, cfg)``) in ``directions``, a copy of
    the same size (``with_copy``) and Liger (unless ``None``) at each of ``token_counts`` for
    one shape; False once past the deadline. Each candidate is first checked against float64
    at the smallest token count, on ``checked_launches`` launches issued back to back."""
    op, launches = bench.OPS[op_name], LAUNCHES[op_name]
    rejected: set = set()
    for i, tokens in enumerate(token_counts):
        t = op.inputs(cfg, tokens, DTYPE)
        outs = launches.forward(_fresh(t), None)
        cot = _cotangents(outs)
        saved = launches.saved(t)
        want = _expected(op, t, cot) if i == 0 else None
        timed = _fresh(t)  # RoPE's forward rotates its inputs in place: time it on a copy
        base = {"op": op_name, "shape": label, "width": bench._width(op, cfg), "tokens": tokens}
        for direction in directions:
            for tile in choose(op_name, direction, cfg):
                if time.monotonic() > deadline:
                    return False
                if (direction, tile) in rejected:
                    continue
                try:
                    if want is not None:  # checked once per tile, at the smallest token count
                        runs = [launches.forward(_fresh(t), tile) if direction == "forward"
                                else launches.backward(t, saved, cot, tile) for _ in range(checked_launches)]
                        for launch, got in enumerate(runs):
                            for j, (g, w) in enumerate(zip(got, want[0] if direction == "forward" else want[1])):
                                check.assert_close(g, w, dtype=DTYPE,
                                                   name=f"{op_name} {direction} {j} {tile} launch {launch}")
                        del runs
                    if direction == "forward":
                        fn = lambda tile=tile: launches.forward(timed, tile)  # noqa: E731
                    else:
                        fn = lambda tile=tile: launches.backward(t, saved, cot, tile)  # noqa: E731
                    rate = _rate(op, direction, t, fn)
                except Exception as e:  # a tile that fails is recorded and not tried again
                    rejected.add((direction, tile))
                    failures.append(f"{op_name} {label} {direction} {tile}: {type(e).__name__}: {e}"[:500])
                    continue
                rows.append({**base, "direction": direction, "impl": "ours", **_tile_fields(tile),
                             "tbps": rate, "of_copy": rate / copy})
        # The copy ceiling is measured on 2 GiB; a copy of this op's first input shows what
        # a launch of this size reaches (its fixed start and tail cost weigh more on small ones).
        first = next(iter(t.values())).detach()
        if with_copy:
            rate = ceilings.copy_bandwidth_at_tbps(2 * first.numel() * first.element_size())
            for direction in directions:
                rows.append({**base, "direction": direction, "impl": "copy of the first input",
                             **_tile_fields(None), "tbps": rate, "of_copy": rate / copy})
        if liger is not None:
            try:
                fwd, bwd = bench._rates(op, liger, t, TARGET_MS)
                for direction, rate in (("forward", fwd), ("backward", bwd)):
                    rows.append({**base, "direction": direction, "impl": "liger", **_tile_fields(None),
                                 "tbps": rate, "of_copy": rate / copy})
            except Exception as e:
                failures.append(f"liger {op_name} {label} x {tokens}: {type(e).__name__}: {e}"[:300])
        del t, timed, outs, cot, saved
    return True


def _compile_peer(op_name: str, copy: float, rows: list, failures: list) -> None:
    """torch.compile's rate at the chapter's first shape, as the chapter's benchmark runs it."""
    op = bench.OPS[op_name]
    model, tokens = op.gpu_shapes[0]
    cfg = bench.QWEN3[model]
    t = op.inputs(cfg, tokens, DTYPE)
    started = time.monotonic()
    try:
        with bench.no_donated_buffers():
            fn = bench._compiled(op.reference, op.compile_mode)
            bench._check("torch.compile", op, fn, t, DTYPE)  # compiles forward and backward
            compiled_s = time.monotonic() - started
            fwd, bwd = bench._rates(op, fn, t, TARGET_MS)
    except Exception as e:
        failures.append(f"torch.compile {op_name}: {type(e).__name__}: {e}"[:400])
        return
    for direction, rate in (("forward", fwd), ("backward", bwd)):
        rows.append({"op": op_name, "shape": model, "width": bench._width(op, cfg), "tokens": tokens,
                     "direction": direction, "impl": "torch.compile", **_tile_fields(None),
                     "tbps": rate, "of_copy": rate / copy, "compile_seconds": compiled_s})


def sweep(shapes: dict = SHAPES, token_counts: tuple[int, ...] = TOKENS, peers: bool = True) -> Measurement:
    """The ``fused.tiles`` benchmark (registered in :mod:`labkit.fused.bench`) over ``shapes``
    (``(label, layer shapes)`` per op) and ``token_counts``; ``peers``: Liger and torch.compile too."""
    started = time.monotonic()
    copy = ceilings.copy_bandwidth_tbps()
    compile_errors: list[str] = []
    if backend.on_gpu():
        jobs = [(op_name, direction, cfg, tile) for op_name in bench.OPS for _, cfg in shapes[op_name]
                for direction in ("forward", "backward")
                for tile in dict.fromkeys(  # programs per SM is a runtime value: one compile covers all
                    dataclasses.replace(c, programs_per_sm=1) if isinstance(c, NormBackwardTile) else c
                    for c in candidates(op_name, direction, cfg))]
        compile_errors = precompile(jobs, workers=max(1, min(16, (os.cpu_count() or 2) - 1)),
                                    timeout_s=TIME_BUDGET_S / 2)
    compiled_s = time.monotonic() - started
    deadline = started + TIME_BUDGET_S
    rows: list[dict] = []
    failures: list[str] = []
    skipped: list[str] = []
    # The norm backward first: it is the kernel furthest from its goal.
    for op_name in ("rms_norm", "add_rms_norm", "swiglu", "rope"):
        liger = bench._liger(bench.OPS[op_name])[0] if peers else None
        for label, cfg in shapes[op_name]:
            if not _sweep_shape(op_name, label, cfg, copy, liger, deadline, rows, failures, token_counts=token_counts):
                skipped.append(f"{op_name} {label}")
        if (peers and backend.on_gpu() and op_name.endswith("rms_norm")
                and time.monotonic() < deadline - COMPILE_PEER_S):
            _compile_peer(op_name, copy, rows, failures)
    return Measurement(
        rows=rows, metric="TB/s (the chapter's unavoidable bytes: inputs read once, outputs written once)",
        limits={"copy_tbps": copy},
        config={"dtype": str(DTYPE).replace("torch.", ""), "tokens": list(token_counts),
                "sm_count": backend.sm_count(), "compile_seconds": compiled_s, "compile_errors": compile_errors,
                "failures": failures,
                "skipped (time budget)": skipped,
                "checked": "every tile's outputs and gradients against float64 at the smallest token count"},
    )


PREFETCH_PROGRAMS_PER_SM = backend.pick(cpu=(1, 3), gpu=(1, 2, 4, 8, 16))


def prefetch_candidates(op_name: str, direction: str, cfg: DecoderConfig) -> list[NormBackwardTile]:
    """The launch table's norm-backward tile for ``cfg``'s width, walking its rows plainly and
    double-buffered, at several programs per SM, summing dw from partial rows. The table now
    sums with atomics; this sweep keeps the partial rows it was first recorded with, which
    qwen3-architecture's sections 4.7 and 4.8 read it as (fused.dw_reduction times both)."""
    tile = kernels.pick_tile(kernels.NORM_BACKWARD_TILES, cfg.hidden_size)
    return [dataclasses.replace(tile, programs_per_sm=programs, prefetch=prefetch, dw_atomic=False)
            for prefetch in (False, True) for programs in PREFETCH_PROGRAMS_PER_SM]


def prefetch_sweep(shapes: list = SHAPES["rms_norm"], token_counts: tuple[int, ...] = TOKENS) -> Measurement:
    """The ``fused.prefetch`` benchmark (registered in :mod:`labkit.fused.bench`): the norm
    backward's two walks, plain and double-buffered, at the launch table's tiles, for each
    ``(label, layer shapes)`` of ``shapes``."""
    copy = ceilings.copy_bandwidth_tbps()
    rows: list[dict] = []
    failures: list[str] = []
    deadline = time.monotonic() + TIME_BUDGET_S
    for label, cfg in shapes:
        _sweep_shape("rms_norm", label, cfg, copy, None, deadline, rows, failures, choose=prefetch_candidates,
                     directions=("backward",), with_copy=False, token_counts=token_counts)
    return Measurement(
        rows=rows, metric="TB/s (dy and x read, dx written, once)", limits={"copy_tbps": copy},
        config={"dtype": str(DTYPE).replace("torch.", ""), "tokens": list(token_counts), "sm_count": backend.sm_count(),
                "failures": failures,
                "checked": "every launch's dx and dw against float64 at the smallest token count"},
    )


# Every width of the norm sweep, so every tile of the launch table (the 32-warp one too).
DW_REDUCTION_SHAPES = SHAPES["rms_norm"]
# The atomic sum's order changes from launch to launch: each candidate's result is checked
# on this many launches issued back to back, not on one.
DW_REDUCTION_CHECKED_LAUNCHES = backend.pick(cpu=2, gpu=8)


def dw_reduction_candidates(op_name: str, direction: str, cfg: DecoderConfig) -> list[NormBackwardTile]:
    """The launch table's norm-backward tile for ``cfg``'s width, with each walk and each of
    the two ``dw`` reductions (partial rows summed by torch, or atomics in the kernel), at
    several programs per SM."""
    tile = kernels.pick_tile(kernels.NORM_BACKWARD_TILES, cfg.hidden_size)
    return [dataclasses.replace(tile, programs_per_sm=programs, prefetch=prefetch, dw_atomic=atomic)
            for atomic in (False, True) for prefetch in (False, True) for programs in PREFETCH_PROGRAMS_PER_SM]


def dw_reduction_sweep(shapes: list = DW_REDUCTION_SHAPES, token_counts: tuple[int, ...] = TOKENS) -> Measurement:
    """The ``fused.dw_reduction`` benchmark (registered in :mod:`labkit.fused.bench`): the norm
    backward with its ``dw`` summed from partial rows by torch (three launches) or by atomics
    in the kernel (one), each walk, at the launch table's tiles, for each ``(label, layer
    shapes)`` of ``shapes``."""
    copy = ceilings.copy_bandwidth_tbps()
    rows: list[dict] = []
    failures: list[str] = []
    deadline = time.monotonic() + TIME_BUDGET_S
    skipped = [label for label, cfg in shapes
               if not _sweep_shape("rms_norm", label, cfg, copy, None, deadline, rows, failures,
                                   choose=dw_reduction_candidates, directions=("backward",), with_copy=False,
                                   token_counts=token_counts, checked_launches=DW_REDUCTION_CHECKED_LAUNCHES)]
    return Measurement(
        rows=rows, metric="TB/s (dy and x read, dx written, once)", limits={"copy_tbps": copy},
        config={"dtype": str(DTYPE).replace("torch.", ""), "tokens": list(token_counts), "sm_count": backend.sm_count(),
                "failures": failures, "skipped (time budget)": skipped,
                "checked": f"each launch's dx and dw against float64 at the smallest token count, on "
                           f"{DW_REDUCTION_CHECKED_LAUNCHES} launches issued back to back",
                # records before this field were made without the barrier (a race at the 32-warp tile)
                "atomic_row_reset": "by the last program, after a barrier: every thread has read the sum"},
    )


def best(rec, op: str, direction: str) -> dict[str, dict]:
    """Per width: the candidate whose slowest token count is fastest, among those measured at
    every token count of the record ``rec`` (a ``fused.tiles`` record); its rows' fields, with
    ``tokens`` and ``tbps`` as lists over the token counts."""
    by_tile: dict[tuple, dict] = {}
    for r in rec.rows:
        if r["op"] != op or r["direction"] != direction or r["impl"] != "ours":
            continue
        key = (r["width"], *(r.get(f) for f in TILE_FIELDS))
        entry = by_tile.setdefault(key, {**r, "tokens": [], "tbps": []})
        entry["tokens"].append(r["tokens"])
        entry["tbps"].append(r["tbps"])
    winners: dict[str, dict] = {}
    for entry in by_tile.values():
        if len(entry["tbps"]) < len(rec.config["tokens"]):
            continue
        current = winners.get(entry["width"])
        if current is None or min(entry["tbps"]) > min(current["tbps"]):
            winners[entry["width"]] = entry
    return winners


def summary(rec) -> str:
    """The sweep in a few lines: per op, direction and width, the best tile and its share of
    the copy bandwidth at each token count, and Liger's and torch.compile's beside it."""
    lines = [f"copy bandwidth {rec.limits['copy_tbps']:.3f} TB/s; config: "
             f"{ {k: v for k, v in rec.config.items() if k != 'checked'} }"]
    for op in bench.OPS:
        for direction in ("forward", "backward"):
            for width, w in best(rec, op, direction).items():
                tile = {k: w.get(k) for k in TILE_FIELDS if w.get(k) is not None}
                peers = {(r["impl"], r["tokens"]): r["tbps"] for r in rec.rows
                         if (r["op"], r["direction"], r["width"]) == (op, direction, width) and r["impl"] != "ours"}
                cells = [f"{n}: {v / rec.limits['copy_tbps']:.3f}"
                         + "".join(f" {impl} {peers[impl, n] / rec.limits['copy_tbps']:.3f}"
                                   for impl in ("liger", "torch.compile", "copy of the first input")
                                   if (impl, n) in peers)
                         for n, v in zip(w["tokens"], w["tbps"])]
                lines.append(f"{op:13s} {direction:8s} {width:26s} {tile}  of copy by tokens: {'; '.join(cells)}")
    return "\n".join(lines)


if __name__ == "__main__":
    from .. import benchmarks

    print(backend.describe())
    print(summary(benchmarks.run("fused.tiles", record=backend.on_gpu())))
