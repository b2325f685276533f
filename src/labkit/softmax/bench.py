"""Benchmarks of chapter ``triton-softmax``: our softmax against torch, torch.compile,
Liger-Kernel and the copy limit.

Bandwidth counts the bytes a softmax cannot avoid: one read and one write of the matrix.
A kernel that reads twice (the online one, torch's own) is charged for that in time, not
credited for it in bytes, so every implementation is on one scale and the copy
bandwidth measured in the same run is its ceiling. Each implementation's output is
checked against the float64 reference before it is timed.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import torch
import triton

from .. import backend, ceilings, check, profiling, timing
from ..benchmarks import Measurement, benchmark
from ..memory.occupancy import compiled_registers, occupancy
from ..results import Goal
from ..validate import dtype_name
from . import kernels, plan_for, softmax
from .kernels import MAX_FUSED_COLS, MIN_TILE_BYTES, VARIANTS
from .reference import softmax_reference

CHAPTER = "triton-softmax"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("torch", "torch.compile", "liger")
CHECK_ROWS = 64  # rows checked at each end of the matrix: each row is its own program


def _torch_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _compiled_softmax() -> Callable[[torch.Tensor], torch.Tensor]:
    # A fresh compile per shape and dtype, specialised to it (dynamic=False), as a model
    # with fixed shapes would get; the reset keeps dynamo's recompile limit out of the way.
    torch._dynamo.reset()
    return torch.compile(_torch_softmax, dynamic=False)


def liger_softmax() -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """Liger-Kernel's Triton softmax and its version, or ``None`` and why it is absent.

    Imported here, lazily and on a GPU only: Liger is a peer to measure against, not a
    dependency of the book.
    """
    if not backend.on_gpu():
        return None, "not run: Liger-Kernel is measured on a GPU only"
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError as e:
        return None, f"missing: {e}"
    return LigerSoftmaxFunction.apply, f"liger-kernel {importlib.metadata.version('liger-kernel')}"


def _peers() -> tuple[dict[str, Callable[[], Callable] | None], dict[str, str]]:
    """Factories for the references (called once per shape), and a note on each."""
    liger, liger_note = liger_softmax()
    factories: dict[str, Callable[[], Callable] | None] = {"torch": lambda: _torch_softmax}
    notes = {"torch": f"torch.softmax, torch {torch.__version__}"}
    if backend.on_gpu():
        factories["torch.compile"] = _compiled_softmax
        notes["torch.compile"] = "torch.compile(torch.softmax, dynamic=False), default mode"
    else:
        factories["torch.compile"] = None
        notes["torch.compile"] = "not run: measured on a GPU only (the interpreter times nothing real)"
    factories["liger"] = (lambda: liger) if liger is not None else None
    notes["liger"] = liger_note
    return factories, notes


def _checked(name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    out = fn(x)
    n = x.shape[0]
    rows = torch.arange(n, device=x.device) if n <= 2 * CHECK_ROWS else torch.cat(
        [torch.arange(CHECK_ROWS, device=x.device), torch.arange(n - CHECK_ROWS, n, device=x.device)])
    check.assert_close(out[rows], softmax_reference(x[rows]), dtype=x.dtype,
                       name=f"{name} {tuple(x.shape)} {dtype_name(x.dtype)}")


def _tbps(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, target_ms: float) -> float:
    # Under the interpreter one timed call is plenty: its wall-clock is not performance.
    t = timing.measure(fn, (x,), target_ms=target_ms, reps=backend.pick(cpu=1, gpu=None))
    return timing.bandwidth_tbps(2 * x.numel() * x.element_size(), t)


def _measure_peers(x, factories, failures: list[str], target_ms: float) -> dict[str, float | None]:
    """TB/s of each reference on ``x``; ``None`` where it is absent or fails at this shape."""
    found: dict[str, float | None] = {}
    for name in PEERS:
        factory = factories[name]
        if factory is None:
            found[name] = None
            continue
        fn = factory()
        try:
            _checked(name, fn, x)
        except Exception as e:  # a peer that rejects a shape is recorded as such, not fatal
            failures.append(f"{name} at {tuple(x.shape)} {dtype_name(x.dtype)}: {type(e).__name__}: {e}"[:300])
            found[name] = None
            continue
        found[name] = _tbps(fn, x, target_ms)
    return found


def _ratios(ours: float, peers: dict[str, float | None], copy: float) -> dict[str, float | None]:
    r: dict[str, float | None] = {f"ours/{k}": (ours / v if v else None) for k, v in peers.items()}
    r["ours/limit"] = ours / copy
    return r


HEADLINE_GOALS = (("limit", 0.90), ("liger", 0.95), ("torch", 1.0), ("torch.compile", 1.0))


@benchmark("softmax.headline", chapter=CHAPTER,
           title="Softmax at 16384 x 8192, fp32 and bf16: ours against torch, torch.compile, "
                 "Liger-Kernel and the copy limit")
def headline() -> Measurement:
    n_rows, n_cols = backend.pick(cpu=(24, 1000), gpu=(16384, 8192))
    copy = ceilings.copy_bandwidth_tbps()
    factories, notes = _peers()
    failures: list[str] = []
    rows, goals = [], []
    for label in ("fp32", "bf16"):
        x = check.randn(n_rows, n_cols, dtype=DTYPES[label], device=backend.device(), seed=0)
        _checked("ours", softmax, x)
        ours = _tbps(softmax, x, target_ms=200.0)
        peers = _measure_peers(x, factories, failures, target_ms=200.0)
        ratios = _ratios(ours, peers, copy)
        rows.append({"dtype": label, "n_rows": n_rows, "n_cols": n_cols, "launch": str(plan_for(x)),
                     "ours": ours, **peers, "copy": copy, **ratios})
        if backend.on_gpu():  # goals are about GPU speed; interpreter timings are not
            goals += [Goal(f"ours/{ref} {label}", ratios[f"ours/{ref}"], ">=", threshold)
                      for ref, threshold in HEADLINE_GOALS if ratios[f"ours/{ref}"] is not None]
    return Measurement(
        rows=rows, metric="TB/s (one read + one write of the matrix)", limits={"copy_tbps": copy},
        goals=goals, config={"peers": notes, "peer_failures": failures,
                             "checked": f"first and last {CHECK_ROWS} rows against float64"},
    )


@benchmark("softmax.sweep", chapter=CHAPTER,
           title="Softmax bandwidth against row width, fp32 / bf16 / fp16: our three kernels "
                 "and the references")
def sweep() -> Measurement:
    elements = backend.pick(cpu=2**11, gpu=2**26)  # GPU: 256 MB of fp32, four L2s and more
    widths = backend.pick(cpu=[24, 200, 1500], gpu=[128, 1024, 8192, 32768, 65536])
    target_ms = backend.pick(cpu=200.0, gpu=40.0)
    copy = ceilings.copy_bandwidth_tbps()
    factories, notes = _peers()
    failures: list[str] = []
    rows = []
    for label, dtype in DTYPES.items():
        for n_cols in widths:
            x = check.randn(elements // n_cols, n_cols, dtype=dtype, device=backend.device(), seed=n_cols)
            auto = plan_for(x)
            fits = triton.next_power_of_2(n_cols) <= MAX_FUSED_COLS
            variants: dict[str, float | None] = {}
            for variant in VARIANTS:
                # 'row' and 'rows' need the row in registers; 'rows' with one row a
                # program is the 'row' kernel again, so it is not timed twice.
                if (variant != "online" and not fits) or (
                        variant == "rows" and plan_for(x, variant).block_rows == 1):
                    variants[variant] = None
                    continue
                fn = lambda t, v=variant: softmax(t, variant=v)  # noqa: E731
                _checked(variant, fn, x)
                variants[variant] = _tbps(fn, x, target_ms)
            ours = variants[auto.variant]
            peers = _measure_peers(x, factories, failures, target_ms)
            rows.append({"dtype": label, "n_rows": x.shape[0], "n_cols": n_cols, "auto": auto.variant,
                         "ours": ours, **{f"ours_{v}": t for v, t in variants.items()},
                         **peers, "copy": copy, **_ratios(ours, peers, copy)})
    return Measurement(
        rows=rows, metric="TB/s (one read + one write of the matrix)", limits={"copy_tbps": copy},
        config={"elements": elements, "peers": notes, "peer_failures": failures,
                "ours": "variant 'auto'; ours_row / ours_rows / ours_online force one kernel"},
    )


def _residency(p, x: torch.Tensor) -> dict:
    """Registers, spills, shared memory and programs per SM of plan ``p``'s compiled kernel (GPU only)."""
    if not backend.on_gpu():
        return {}
    k = kernels.compiled(p, x, torch.empty_like(x))
    n_regs, n_spills = compiled_registers(k)
    shared = int(k.metadata.shared)
    occ = occupancy(n_regs, p.num_warps, shared)
    return {"registers_per_thread": n_regs, "spilled_registers": n_spills, "shared_bytes": shared,
            "programs_per_sm": occ.blocks_per_sm, "limited_by": occ.limited_by}


def _sweep_inputs(elements: int, widths: list[int]):
    """(dtype label, columns, x) for the sweeps: fp32 then bf16, each width at about ``elements`` values."""
    for label in ("fp32", "bf16"):
        for n_cols in widths:
            yield label, n_cols, check.randn(elements // n_cols, n_cols, dtype=DTYPES[label],
                                             device=backend.device(), seed=n_cols)


@benchmark("softmax.warps", chapter=CHAPTER,
           title="The one-row kernel by num_warps at 8192 and 32768 columns: bandwidth, registers, "
                 "programs per SM")
def warps() -> Measurement:
    elements = backend.pick(cpu=2**11, gpu=2**26)
    widths = backend.pick(cpu=[256, 1024], gpu=[8192, 32768])
    warp_choices = backend.pick(cpu=[4, 8], gpu=[4, 8, 16, 32])
    target_ms = backend.pick(cpu=200.0, gpu=40.0)
    copy = ceilings.copy_bandwidth_tbps()
    rows = []
    for label, n_cols, x in _sweep_inputs(elements, widths):
        default_warps = plan_for(x, "row").num_warps
        for nw in warp_choices:
            fn = lambda t, nw=nw: softmax(t, variant="row", num_warps=nw)  # noqa: E731
            _checked(f"row, {nw} warps", fn, x)
            ours = _tbps(fn, x, target_ms)
            p = plan_for(x, "row", num_warps=nw)
            rows.append({"dtype": label, "n_rows": x.shape[0], "n_cols": n_cols, "num_warps": nw,
                         "values_per_thread": p.block_cols // (32 * nw), "default": nw == default_warps,
                         "ours": ours, "ours/limit": ours / copy, **_residency(p, x)})
    return Measurement(
        rows=rows, metric="TB/s (one read + one write of the matrix)", limits={"copy_tbps": copy},
        config={"elements": elements, "kernel": "softmax_row_kernel (variant 'row')",
                "programs_per_sm": "labkit.memory.occupancy: registers, warp and block slots, shared memory"},
    )


@benchmark("softmax.tiles", chapter=CHAPTER,
           title="The several-rows kernel by tile size at 128 and 512 columns")
def tiles() -> Measurement:
    elements = backend.pick(cpu=2**11, gpu=2**26)
    widths = backend.pick(cpu=[24, 100], gpu=[128, 512])
    tile_bytes_choices = backend.pick(cpu=[256, 1024], gpu=[2**k for k in range(9, 16)])  # 512 B .. 32 KiB
    target_ms = backend.pick(cpu=200.0, gpu=40.0)
    copy = ceilings.copy_bandwidth_tbps()
    rows = []
    for label, n_cols, x in _sweep_inputs(elements, widths):
        row_bytes = triton.next_power_of_2(n_cols) * x.element_size()
        default_rows = plan_for(x, "rows").block_rows
        for tile_bytes in tile_bytes_choices:
            block_rows = tile_bytes // row_bytes
            if block_rows < 1:
                continue
            fn = lambda t, b=block_rows: softmax(t, variant="rows", block_rows=b)  # noqa: E731
            _checked(f"rows, {block_rows} a tile", fn, x)
            ours = _tbps(fn, x, target_ms)
            p = plan_for(x, "rows", block_rows=block_rows)
            rows.append({"dtype": label, "n_rows": x.shape[0], "n_cols": n_cols, "block_rows": block_rows,
                         "tile_bytes": block_rows * row_bytes, "num_warps": p.num_warps, "programs": p.grid,
                         "default": block_rows == default_rows, "ours": ours, "ours/limit": ours / copy})
    return Measurement(
        rows=rows, metric="TB/s (one read + one write of the matrix)", limits={"copy_tbps": copy},
        config={"elements": elements, "kernel": "softmax_rows_kernel (variant 'rows'), num_warps by num_warps_for",
                "min_tile_bytes": MIN_TILE_BYTES},
    )


def kernel_name(profiler_key: str) -> str:
    """The kernel's own name in a profiler key: 'void ns::softmax_warp_forward<float, ...>(...)' ->
    'softmax_warp_forward'."""
    head = profiler_key.replace("(anonymous namespace)", "").split("<")[0].split("(")[0].strip()
    return head.split()[-1].split("::")[-1] if head else profiler_key


@benchmark("softmax.torch_kernels", chapter=CHAPTER,
           title="What torch.softmax and torch.compile launch, by row width and dtype (torch.profiler)")
def torch_kernels() -> Measurement:
    elements = backend.pick(cpu=2**11, gpu=2**26)
    widths = backend.pick(cpu=[24, 1500], gpu=[128, 1024, 8192, 32768, 65536])
    calls = 3
    factories, notes = _peers()
    rows = []
    # fp16 takes bf16's paths; each shape costs torch.compile a compile
    for label, n_cols, x in _sweep_inputs(elements, widths):
        for impl in ("torch", "torch.compile"):
            if factories[impl] is None:
                continue
            fn = factories[impl]()
            fn(x)  # compiled and warm before the profile
            kernels = profiling.kernels_run(lambda fn=fn: fn(x), calls)
            # the interpreter's run has no kernels: its ATen ops name what ran, with no GPU time
            device_us = sum(k.us for k in kernels) / calls if backend.on_gpu() else None
            rows.append({"dtype": label, "n_rows": x.shape[0], "n_cols": n_cols, "impl": impl,
                         "kernels": "; ".join(sorted({kernel_name(k.name) for k in kernels})),
                         "launches_per_call": sum(k.launches for k in kernels) / calls, "kernel_us": device_us,
                         "tbps": (2 * x.numel() * x.element_size() / device_us / 1e6) if device_us else None})
    return Measurement(
        rows=rows, metric="kernel names and GPU time per call, from torch.profiler", limits={},
        config={"elements": elements, "calls_profiled": calls, "peers": notes,
                "inductor_online_softmax": bool(torch._inductor.config.online_softmax)},
    )
