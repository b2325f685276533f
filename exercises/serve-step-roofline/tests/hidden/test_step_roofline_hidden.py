"""Hidden tests of serve-step-roofline: a reference that counts token by token on random
models and steps, chunked prefills that add up, weights read once, and the roof on random steps."""

import random

from labkit.grade.harness import public_module

expect_cost = public_module(__file__, "test_step_roofline.py").expect_cost


def random_model(rng):
    heads_per_kv = rng.choice([1, 2, 4])
    kv_heads = rng.randint(1, 4)
    return dict(hidden=rng.randint(8, 96), layers=rng.randint(1, 6), heads=kv_heads * heads_per_kv, kv_heads=kv_heads,
                head_dim=2 * rng.randint(1, 32), intermediate=rng.randint(8, 256), vocab=rng.randint(16, 500))


def reference_cost(model, batch, new_tokens, context, bytes_per_element=2):
    """Count from the definitions, one weight matrix and one query at a time."""
    h, d = model["hidden"], model["head_dim"]
    matrices = [h * model["heads"] * d, h * model["kv_heads"] * d, h * model["kv_heads"] * d, model["heads"] * d * h,
                h * model["intermediate"], h * model["intermediate"], model["intermediate"] * h]
    flops = 0
    for _ in range(batch):
        for t in range(new_tokens):
            flops += sum(2 * m for m in matrices) * model["layers"]
            visible = context + t + 1
            flops += 4 * model["heads"] * d * visible * model["layers"]
        flops += 2 * model["vocab"] * h
    kv = 2 * model["layers"] * model["kv_heads"] * d
    elements = sum(matrices) * model["layers"] + model["vocab"] * h + kv * batch * (context + new_tokens)
    return flops, elements * bytes_per_element


def test_random_models_match_the_definition(submission):
    """Two hundred random models and steps (prefills, chunks, decodes, 1- and 4-byte elements)."""
    rng = random.Random(11)
    for case in range(200):
        model = random_model(rng)
        shape = dict(batch=rng.randint(1, 9), new_tokens=rng.choice([1, rng.randint(1, 40)]), context=rng.randint(0, 300),
                     bytes_per_element=rng.choice([1, 2, 4]))
        got = submission.call("step_cost", *model.values(), **shape)
        want = reference_cost(model, shape["batch"], shape["new_tokens"], shape["context"], shape["bytes_per_element"])
        assert tuple(float(v) for v in got) == tuple(float(v) for v in want), \
            f"case {case}, model {model}, step {shape}: expected {want}, got {tuple(got)}"


def test_chunked_prefill_adds_up(submission):
    """A prompt prefilled in two chunks does the one-step prefill's FLOPs plus one more LM head."""
    rng = random.Random(5)
    for _ in range(30):
        model = random_model(rng)
        first, second = rng.randint(1, 50), rng.randint(1, 50)
        whole = submission.call("step_cost", *model.values(), batch=1, new_tokens=first + second, context=0)[0]
        a = submission.call("step_cost", *model.values(), batch=1, new_tokens=first, context=0)[0]
        b = submission.call("step_cost", *model.values(), batch=1, new_tokens=second, context=first)[0]
        assert a + b == whole + 2 * model["vocab"] * model["hidden"], \
            f"model {model}, chunks {first} + {second}: {a} + {b} FLOPs against {whole} in one step"


def test_weights_are_read_once_whatever_the_batch(submission):
    """Doubling a decode batch doubles the cache bytes, never the weights'."""
    model = dict(hidden=64, layers=3, heads=8, kv_heads=2, head_dim=16, intermediate=160, vocab=300)
    one = submission.call("step_cost", *model.values(), batch=4, new_tokens=1, context=100)[1]
    two = submission.call("step_cost", *model.values(), batch=8, new_tokens=1, context=100)[1]
    kv = 2 * 3 * 2 * 16 * 2 * 4 * 101  # 4 more sequences' K and V, 101 positions each, 2 bytes
    assert two - one == kv, f"batch 4 -> 8 added {two - one} bytes; 4 more caches are {kv}, the weights are read once"


def test_the_roof_on_random_steps(submission):
    """bound() agrees with the two times on random counts and rates."""
    rng = random.Random(3)
    for _ in range(100):
        flops, moved = rng.uniform(1e6, 1e15), rng.uniform(1e6, 1e12)
        tflops, tbps = rng.uniform(10, 2000), rng.uniform(0.5, 8)
        want = "compute" if flops / (tflops * 1e12) >= moved / (tbps * 1e12) else "memory"
        got = submission.call("bound", flops, moved, tflops, tbps)
        assert got == want, f"{flops:.3g} FLOPs, {moved:.3g} bytes at {tflops:.0f} TFLOP/s, {tbps:.2f} TB/s: {got}"
