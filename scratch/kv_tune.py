"""GPU sweep of the decode-attention kernel's launch parameters, then the decode step (scratch).

Run from the repo root: PYTHONPATH=src python3 scratch/kv_tune.py   (under 2 minutes on an H200;
most of the first run is compiling the candidates, which Triton caches for the next)

Part 1, GQA 32/8 x 128, bf16, every sequence at full length, at the benchmark's problem sizes:
SDPA, our kernel with kernels.default_config (timed three ways: with the L2 flush the
benchmark uses; with no flush but rotating over 3 copies of the cache; and replayed from a
CUDA graph, which removes the host's launch cost), then our kernel with each candidate
(num_splits, BLOCK_N, num_warps, num_stages) forced. TB/s counts the bytes of K and V read.
Part 2: one decode step of the book's GPU model at context 4096, batch 4, per token:
recompute, eager KVCache + SDPA, the static step run eagerly, and the graphed step.
"""
import math
import time

T0 = time.time()

from labkit import ceilings, check, models, timing  # noqa: E402  (labkit before triton)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from labkit.kvcache import kernels  # noqa: E402

SWEEP_BUDGET_S = 80  # past this, start no new shape, so part 2 still runs
HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
# The goals' sizes first (batch >= 16 or context >= 8192), so a spent budget skips the others.
SHAPES = [(1, 16384), (16, 1024), (16, 4096), (64, 1024), (64, 4096), (4, 16384), (4, 4096)]
# (BLOCK_N, num_warps, num_stages); the first is the shipped default.
METAS = [(kernels.BLOCK_N, kernels.NUM_WARPS, kernels.NUM_STAGES),
         (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 4), (64, 8, 2), (64, 8, 3),
         (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 2, 3)]
METAS = list(dict.fromkeys(METAS))
SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
REPS = 30
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def split_candidates(batch, context, block_n):
    """Splits that give between half a program and 16 programs per SM, each with a tile."""
    pairs = batch * HKV
    return [s for s in SPLITS if SMS / 2 <= pairs * s <= 16 * SMS and s <= math.ceil(context / block_n)]


def compiled_info(fn):
    """Registers, spills and shared memory of the split kernel ``fn()`` launches."""
    jit = kernels._decode_split_kernel
    seen = {}
    original = jit.run

    def spy(*args, **kwargs):
        seen["kernel"] = original(*args, **kwargs)
        return seen["kernel"]

    jit.run = spy
    try:
        fn()
    finally:
        del jit.run
    k = seen.get("kernel")
    if k is None:
        return "?"
    return f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} smem {k.metadata.shared}"


def graphed(fn):
    """``fn`` captured in a CUDA graph: what a replay costs with no host work per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def part1(copy_tbps):
    print(f"copy limit {copy_tbps:.3f} TB/s (read + write); {SMS} SMs")
    failed = {}
    infos = {}
    best = {}  # (shape, meta) -> (ms, splits)
    summary = []
    for batch, context in SHAPES:
        if time.time() - T0 > SWEEP_BUDGET_S:
            print(f"budget of {SWEEP_BUDGET_S} s spent: skipping B={batch} L={context}")
            continue
        q = check.randn(batch, HQ, D, dtype=DT, device="cuda", seed=1)
        copies = [(check.randn(batch, HKV, context, D, dtype=DT, device="cuda", seed=2 + 2 * i),
                   check.randn(batch, HKV, context, D, dtype=DT, device="cuda", seed=3 + 2 * i)) for i in range(3)]
        k, v = copies[0]
        lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        cache_bytes = k.nbytes + v.nbytes
        ref = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0].float()

        def tbps(ms):
            return cache_bytes / (ms * 1e-3) / 1e12

        def sdpa(k=k, v=v):
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

        def ours(config, k=k, v=v):
            return kernels.split_kv_decode(q, k, v, lengths, D**-0.5, config)

        heur = kernels.default_config(batch, HKV, context)
        t_sdpa = timing.measure(sdpa, reps=REPS).median_ms
        t_sdpa_rot = timing.measure(sdpa, *copies, reps=REPS, flush_l2=False).median_ms
        print(f"\n== B={batch} L={context}: {cache_bytes / 1e6:.1f} MB of K+V, {batch * HKV} (seq, kv head) pairs "
              f"[{time.time() - T0:.0f} s]")
        print(f"   SDPA                      {t_sdpa:8.4f} ms {tbps(t_sdpa):5.2f} TB/s | no flush, rotating: "
              f"{t_sdpa_rot:8.4f} ms {tbps(t_sdpa_rot):5.2f} TB/s")
        row = {"shape": (batch, context), "bytes": cache_bytes, "sdpa": t_sdpa, "sdpa_rot": t_sdpa_rot}
        try:
            check.assert_close(ours(heur), ref, dtype=DT, name=str(heur))
            t_h = timing.measure(lambda: ours(heur), reps=REPS).median_ms
            t_rot = timing.measure(lambda k, v: ours(heur, k, v), *copies, reps=REPS, flush_l2=False).median_ms
            t_graph = timing.measure(graphed(lambda: ours(heur)), reps=REPS).median_ms
            print(f"   ours {heur.num_splits:>3} N{heur.block_n} w{heur.num_warps} s{heur.num_stages} (heuristic) "
                  f"{t_h:8.4f} ms {tbps(t_h):5.2f} TB/s ({tbps(t_h) / copy_tbps:.2f} of copy, {t_sdpa / t_h:.2f}x SDPA)"
                  f" | rotating {t_rot:.4f} ms {tbps(t_rot):5.2f} TB/s ({t_sdpa_rot / t_rot:.2f}x SDPA)"
                  f" | graph replay {t_graph:.4f} ms {tbps(t_graph):5.2f} TB/s")
            row.update(heur=t_h, heur_rot=t_rot, heur_graph=t_graph, heur_cfg=heur)
        except Exception as e:  # noqa: BLE001  (report and carry on)
            print(f"   heuristic {heur} FAILED: {type(e).__name__}: {str(e)[:200]}")
        results = []
        for meta in METAS:
            if meta in failed:
                continue
            for splits in split_candidates(batch, context, meta[0]):
                config = kernels.DecodeConfig(splits, *meta)
                try:
                    if (meta, splits == 1) not in infos:
                        check.assert_close(ours(config), ref, dtype=DT, name=str(config))
                        infos[(meta, splits == 1)] = compiled_info(lambda: ours(config))
                    t = timing.measure(lambda: ours(config), reps=REPS).median_ms
                    results.append((t, splits, meta))
                    prev = best.get(((batch, context), meta))
                    if prev is None or t < prev[0]:
                        best[((batch, context), meta)] = (t, splits)
                except Exception as e:  # noqa: BLE001
                    failed[meta] = f"{type(e).__name__}: {str(e)[:160]}"
                    print(f"   N{meta[0]} w{meta[1]} s{meta[2]} FAILED, skipped from now on: {failed[meta]}")
                    break
        results.sort()
        print("   fastest forced configs:   splits N   w s      ms    TB/s /copy /sdpa progs/SM")
        for t, splits, meta in results[:8]:
            print(f"   {'':<24}{splits:>6} {meta[0]:>3} {meta[1]:>2} {meta[2]:>1} {t:8.4f} {tbps(t):6.2f} "
                  f"{tbps(t) / copy_tbps:5.2f} {t_sdpa / t:5.2f} {batch * HKV * splits / SMS:7.2f}")
        if results:
            row["best"] = results[0]
        summary.append(row)
        del copies, k, v
        torch.cuda.empty_cache()

    print("\n== compiled split kernels (tile, warps, stages; FINAL = the one-split variant)")
    for (meta, final), info in sorted(infos.items()):
        print(f"   N{meta[0]:<3} w{meta[1]} s{meta[2]} {'FINAL' if final else 'split'}: {info}")
    print("\n== per tile config: geometric mean over shapes of (its best time / the best time), and its best splits")
    shapes = [r["shape"] for r in summary if "best" in r]
    for meta in METAS:
        ratios, picks = [], []
        for shape in shapes:
            got = best.get((shape, meta))
            overall = next(r["best"][0] for r in summary if r["shape"] == shape)
            if got:
                ratios.append(got[0] / overall)
                picks.append(f"{shape[0]}x{shape[1]}:S{got[1]}")
        if ratios:
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            print(f"   N{meta[0]:<3} w{meta[1]} s{meta[2]}  {gm:5.3f} (worst {max(ratios):.3f})  {' '.join(picks)}")
    print("\n== summary: goal rows are batch >= 16 or context >= 8192; goals 0.75 of copy and > 1x SDPA")
    print("   B     L  | SDPA TB/s | heuristic TB/s /copy /sdpa | rotating /copy /sdpa | graph TB/s | best forced")
    for r in summary:
        batch, context = r["shape"]

        def t2b(ms, r=r):
            return r["bytes"] / (ms * 1e-3) / 1e12

        line = f"   {batch:<3}{context:>6} | {t2b(r['sdpa']):9.2f} |"
        if "heur" in r:
            line += (f" {t2b(r['heur']):14.2f} {t2b(r['heur']) / copy_tbps:5.2f} {r['sdpa'] / r['heur']:5.2f} |"
                     f" {t2b(r['heur_rot']) / copy_tbps:14.2f} {r['sdpa_rot'] / r['heur_rot']:5.2f} |"
                     f" {t2b(r['heur_graph']):10.2f} |")
        if "best" in r:
            t, splits, meta = r["best"]
            line += f" S{splits} N{meta[0]} w{meta[1]} s{meta[2]} {t2b(t):.2f} TB/s ({r['sdpa'] / t:.2f}x SDPA)"
        print(line)


@torch.no_grad()
def part2(copy_tbps):
    batch, context = 4, 4096
    config = models.BOOK_GPU
    model = models.Decoder(config, dtype=DT, device="cuda")
    ids = torch.randint(0, config.vocab_size, (batch, context + 1), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    prompt, token = ids[:, :context], ids[:, context:]
    cache = model.new_cache(batch, context + 1)
    model(prompt, cache)
    eager_static = models.GraphedDecoder(model, batch, context + 1, use_graph=False)
    eager_static.prefill(prompt)
    runner = models.GraphedDecoder(model, batch, context + 1)
    runner.prefill(prompt)

    def cached():
        model(token, cache, last_only=True)
        cache.truncate(context)

    def static_eager():
        eager_static.step(token)
        eager_static.cache.truncate(context)

    def graph_step():
        runner.step(token)
        runner.cache.truncate(context)

    def recompute():
        model(ids, last_only=True)

    full = model(ids, last_only=True)[:, -1].float()
    want = runner.step(token).float()
    runner.cache.truncate(context)
    print(f"\n== decode step, book GPU model (8 layers of Qwen3-4B), bf16, batch {batch}, context {context}")
    print(f"   graphed vs recomputed logits: {check.rel_error(want, full):.2e} relative error")
    weights = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    kv = config.kv_bytes_per_token(2) * batch * context
    print(f"   bytes per step: weights {weights / 1e9:.2f} GB + cache {kv / 1e9:.2f} GB -> "
          f"{(weights + kv) / (copy_tbps * 1e12) * 1e3:.3f} ms at the copy bandwidth")
    times = {}
    for name, fn, reps in (("recompute", recompute, 5), ("eager KVCache + SDPA", cached, 20),
                           ("static step, eager (our kernel)", static_eager, 20),
                           ("static step, CUDA graph (our kernel)", graph_step, 50)):
        try:
            times[name] = timing.measure(fn, reps=reps, warmup=2).median_ms
        except Exception as e:  # noqa: BLE001
            print(f"   {name} FAILED: {type(e).__name__}: {str(e)[:200]}")
    base = times.get("recompute")
    for name, ms in times.items():
        vs = f"  {base / ms:6.2f}x recompute" if base else ""
        print(f"   {name:<38} {ms:8.3f} ms/step {ms / batch:8.4f} ms/token{vs}")


def main():
    copy_tbps = ceilings.copy_bandwidth_tbps()
    try:
        part1(copy_tbps)
    except Exception as e:  # noqa: BLE001
        print(f"part 1 FAILED: {type(e).__name__}: {e}")
    try:
        part2(copy_tbps)
    except Exception as e:  # noqa: BLE001
        print(f"part 2 FAILED: {type(e).__name__}: {e}")
    print(f"\ntotal wall time {time.time() - T0:.1f} s")


if __name__ == "__main__":
    main()
