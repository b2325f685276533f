"""Hidden tests of native-custom-op: float64 references at odd shapes in three dtypes, the
fake kernel in every dtype, torch.library.opcheck, and torch.compile with fullgraph=True."""

import torch

from labkit import check

DTYPES = (torch.float64, torch.float32, torch.bfloat16)
SHAPES = ((1, 7), (37, 80), (3, 5, 33))


def swiglu64(gate, up):
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def test_forward_matches_float64(submission):
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            gate = check.randn(*shape, dtype=dtype, seed=10 * i + j, scale=3.0)
            up = check.randn(*shape, dtype=dtype, seed=100 + 10 * i + j)
            out = submission.call("swiglu", gate, up)
            assert isinstance(out, torch.Tensor) and out.dtype == dtype, \
                f"forward in {dtype}: expected a {dtype} tensor, got {getattr(out, 'dtype', type(out).__name__)}"
            submission.expect_close(out, swiglu64(gate, up), dtype=dtype, name=f"swiglu {dtype} {shape}")


def test_forward_leaves_its_inputs_alone(submission):
    gate, up = check.randn(9, 31, seed=1), check.randn(9, 31, seed=2)
    out, left = submission.call_with_args("swiglu", gate, up)
    assert torch.equal(left[0], gate) and torch.equal(left[1], up), \
        "forward changed an input: the schema (mutates_args=()) promises it does not"
    submission.expect_close(out, swiglu64(gate, up), dtype=torch.float32, name="swiglu (inputs left alone)")


def test_gradients_match_float64(submission):
    for i, dtype in enumerate(DTYPES):
        shape = SHAPES[i]
        gate = check.randn(*shape, dtype=dtype, seed=20 + i, scale=3.0)
        up = check.randn(*shape, dtype=dtype, seed=30 + i)
        grad = check.randn(*shape, dtype=dtype, seed=40 + i)
        g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
        want = torch.autograd.grad(swiglu64(g64, u64), (g64, u64), grad.double())
        got = submission.gradients("swiglu", gate, up, grad_output=grad)
        assert isinstance(got, list) and len(got) == 2, "expected gradients for gate and up"
        for g, w, name in zip(got, want, ("d gate", "d up")):
            submission.expect_close(g, w, dtype=dtype, name=f"{name} {dtype} {shape}")


def test_fake_output_in_every_dtype(submission):
    for dtype in DTYPES:
        gate, up = check.randn(5, 3, 17, dtype=dtype, seed=50), check.randn(5, 3, 17, dtype=dtype, seed=51)
        [(shape, got_dtype, strides, fake)] = submission.fake_outputs("swiglu", gate, up)
        want = ([5, 3, 17], str(dtype).replace("torch.", ""), [51, 17, 1])
        assert fake, "the op under FakeTensorMode must return a fake tensor"
        assert (shape, got_dtype, strides) == want, f"fake output for {dtype} inputs: expected {want}, got " \
                                                    f"{[shape, got_dtype, strides]}"


def test_opcheck_passes(submission):
    for dtype in (torch.float32, torch.bfloat16):
        report = submission.opcheck("swiglu", check.randn(6, 45, dtype=dtype, seed=60, scale=2.0),
                                    check.randn(6, 45, dtype=dtype, seed=61))
        failed = {test: result for test, result in report.items() if result != "SUCCESS"}
        assert report and not failed, f"torch.library.opcheck in {dtype}: " + "; ".join(
            f"{test}: {result[:300]}" for test, result in failed.items())


def test_compiles_with_fullgraph(submission):
    gate, up = check.randn(7, 29, seed=70), check.randn(7, 29, seed=71)
    out = submission.call_fullgraph("swiglu", gate, up)
    submission.expect_close(out, swiglu64(gate, up), dtype=torch.float32,
                            name="swiglu under torch.compile(fullgraph=True)")
