"""labkit.compile: graph-break inspection, Inductor's output read back, piecewise compilation."""

import dataclasses

import pytest
import torch

import labkit
from labkit import models
from labkit.compile import aot, dynamo, inductor, piecewise
from labkit.compile import bench as compile_bench
from labkit.compile.piecewise import CompiledModelRunner, split_at


def _one_layer():
    return dataclasses.replace(models.TINY, num_layers=1)


# -- Dynamo ----------------------------------------------------------------------------

def _three_breaks(x):
    y = x.sin()
    print("", end="")
    if y.sum() > 0:
        y = y + 1
    return y * y.max().item()


def _no_break(x):
    y = x.sin()
    y = torch.where(y.sum() > 0, y + 1, y)
    return y * y.amax()


def test_graph_breaks_names_each_break_and_its_line():
    x = labkit.check.randn(5, 3, seed=1)
    capture = dynamo.graph_breaks(_three_breaks, x)
    assert capture.break_count == 3 and capture.graph_count >= 2
    assert [b.code.split("(")[0].split()[0] for b in capture.breaks] == ["print", "if", "return"]
    assert all(b.location.startswith("test_compile.py:") for b in capture.breaks)
    clean = dynamo.graph_breaks(_no_break, x)
    assert (clean.graph_count, clean.break_count) == (1, 0)
    assert any("TENSOR_MATCH" in g for g in clean.guards)
    torch.testing.assert_close(clean.graphs[0](x)[0], _no_break(x))


def test_graph_breaks_rejects_a_non_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        dynamo.graph_breaks(3, torch.zeros(2))


# -- AOTAutograd ---------------------------------------------------------------------------

def _swish_cos(x, w):
    h = x @ w
    return (torch.nn.functional.silu(h) * h.cos()).sum(-1)


def test_min_cut_saves_less_than_the_default_partition_and_gradients_agree():
    x = labkit.check.randn(9, 7, seed=2).requires_grad_()
    w = labkit.check.randn(7, 13, seed=3).requires_grad_()
    split = {p: aot.forward_backward(_swish_cos, x, w, partition=p) for p in aot.PARTITIONS}
    assert split["min_cut"].saved_bytes < split["default"].saved_bytes
    assert [s.name for s in split["min_cut"].saved if not s.is_view_of_input] == ["mm"]
    assert split["min_cut"].saved_bytes == 9 * 13 * 4
    # the backward graph, run on what the forward saved, gives autograd's gradients
    x.grad = w.grad = None
    _swish_cos(x, w).sum().backward()
    with torch.no_grad():
        outs = split["min_cut"].forward(x.detach(), w.detach())
        grads = split["min_cut"].backward(*outs[1:], torch.ones(9))
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], w.grad)


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.zeros(2),), {}, "requires_grad"),
    ((torch.zeros(2, requires_grad=True),), {"partition": "greedy"}, "partition must be one of"),
    ((), {}, "requires_grad"),
])
def test_forward_backward_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        aot.forward_backward(lambda t: t * 2, *args, **kwargs)


# -- Inductor's output ---------------------------------------------------------------------

CALL = """
class Runner:
    def call(self, args):
        arg0_1, = args
        buf0 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
        triton_poi_fused_add_0.run(arg0_1, buf0, 32)
        buf1 = buf0; del buf0  # reuse
        buf2 = empty_strided_cuda((4, ), (1, ), torch.float32)
        triton_red_fused_sum_1.run(buf1, buf2, 4, 8)
        buf3 = reinterpret_tensor(buf2, (2, 2), (2, 1), 0); del buf2  # reuse
        del buf1
        return (buf3, )

runner = Runner()
"""

TRITON_KERNEL = (
    "triton_per_fused_mean_0 = async_compile.triton('triton_per_fused_mean_0', '''\n"
    "@triton.jit\ndef triton_per_fused_mean_0(in_ptr0):\n    pass\n''', device_str='cuda')\n"
)


def test_buffer_plan_reads_allocs_reuses_and_frees():
    code = inductor.call_function(CALL)
    assert code.startswith("def call(self, args):") and "runner = Runner()" not in code
    plan = [(e.action, e.buffer, e.detail) for e in inductor.buffer_plan(code)]
    assert plan == [("alloc", "buf0", "4, 8"), ("reuse", "buf1", "buf0"), ("alloc", "buf2", "4, "),
                    ("reuse", "buf3", "buf2"), ("free", "buf1", "")]


def test_parse_wrapper_finds_triton_kernels():
    out = inductor.parse_wrapper([TRITON_KERNEL + CALL])
    assert out.language == "triton" and list(out.kernels) == ["triton_per_fused_mean_0"]
    assert out.kernels["triton_per_fused_mean_0"].startswith("@triton.jit")
    assert out.kernel_kinds() == {"persistent_reduction": 1}
    assert inductor.kernel_kind("triton_red_fused_sum_1") == "reduction"
    assert inductor.kernel_kind("cpp_fused_add_0") == "cpp"


@pytest.mark.parametrize("bad", [[], "code", [3]])
def test_parse_wrapper_rejects_what_is_not_a_list_of_sources(bad):
    with pytest.raises(ValueError, match="non-empty list"):
        inductor.parse_wrapper(bad)


def test_call_function_and_buffer_plan_reject_bad_code():
    with pytest.raises(ValueError, match="no 'def call"):
        inductor.call_function("x = 1\n")
    with pytest.raises(TypeError, match="call_code must be a str"):
        inductor.buffer_plan(None)


def test_generated_code_compiles_fuses_and_matches_eager():
    def norm_silu(x):
        return torch.nn.functional.silu(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    x = labkit.check.randn(3, 37, seed=4)
    out, code = inductor.generated_code(norm_silu, x)
    torch.testing.assert_close(out, norm_silu(x))
    assert code.language == ("triton" if labkit.on_gpu() else "c++")
    assert len(code.kernels) == 1 and "silu" in next(iter(code.kernels))  # one fused kernel
    assert code.call_code.startswith("def call(")
    with pytest.raises(TypeError, match="fn must be callable"):
        inductor.generated_code("norm_silu", x)
    # compiling it again generates code again (Dynamo's cache is keyed by code object)
    assert list(inductor.generated_code(norm_silu, x)[1].kernels) == list(code.kernels)


# -- piecewise -----------------------------------------------------------------------------

def test_split_at_isolates_each_split_node():
    def f(x):
        y = x.sin()
        z = torch.relu(y)
        return z.cos() + 1

    gm = torch.fx.symbolic_trace(f)
    split = split_at(gm, lambda n: n.op == "call_function" and n.target is torch.relu)
    subs = [getattr(split, n.target) for n in split.graph.find_nodes(op="call_module")]
    calls = [[n.target for n in s.graph.nodes if n.op == "call_function"] for s in subs]
    assert len(subs) == 3 and calls[1] == [torch.relu]
    x = labkit.check.randn(4, seed=5)
    torch.testing.assert_close(split(x), f(x))
    with pytest.raises(TypeError, match="GraphModule"):
        split_at(f)


def test_compiled_runner_rejects_bad_sizes():
    _, kv, _, runner = compile_bench.decode_setup(_one_layer(), max_batch=4, context=8, dtype=torch.float32,
                                                  device="cpu", cuda_graphs=False, sizes=(2, 4))
    common = dict(pad_block=runner.pad_block, max_num_seqs=4)
    with pytest.raises(ValueError, match="must not exceed max_num_seqs"):
        CompiledModelRunner(runner.model, kv, sizes=(2, 8), **common)
    with pytest.raises(ValueError, match="at least 2"):
        CompiledModelRunner(runner.model, kv, sizes=(1,), **common)
    with pytest.raises(ValueError, match="size must be positive"):
        CompiledModelRunner(runner.model, kv, sizes=(0, 2), **common)
    with pytest.raises(ValueError, match="compiled sizes"):
        runner.run_size(3)
    assert [runner.padded_size(b) for b in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    assert piecewise.drop_all_guards(["a", "b"]) == [False, False]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_piecewise_follows_eager_over_advancing_steps(device):
    """Compiled pieces (on CUDA replayed from their graphs) step after step, with new
    positions, lengths and padded sizes, give eager's logits: stale static inputs, a wrong
    copy or a wrong size's code would show."""
    on_cuda = device == "cuda"
    config = models.TINY if on_cuda else _one_layer()
    _, kv, seqs, runner = compile_bench.decode_setup(config, max_batch=4, context=24, dtype=torch.float32,
                                                     device=device, cuda_graphs=on_cuda,
                                                     sizes=None if on_cuda else (2, 4))
    runner.compile()
    for batch in (3, 1, 4, 2) if on_cuda else (3, 1):
        steps = seqs[:batch]
        for seq in steps:
            seq.output.clear()
            seq.num_cached = len(seq.prompt) - 1
        for step in range(4):
            compiled = runner.execute(steps).clone()
            # eager over the same state (it rewrites the same slots with the same tokens' K/V)
            eager = runner.forward(runner.prepare(steps))
            labkit.check.assert_close(compiled, eager, dtype=torch.float32, name=f"batch {batch}, step {step}")
            for seq, token in zip(steps, compiled.argmax(-1).tolist()):
                seq.output.append(token)
                seq.num_cached += 1
    assert all(p.graphs if on_cuda else p.compiled for p in runner.backend.pieces)


# -- the grader's way through Dynamo (labkit.grade.tracing), which exercise compile-graph-breaks uses --

def _graph_breaks_exercise():
    from labkit.grade import exercise, notebook

    ex = exercise.load("compile-graph-breaks")
    return ex, notebook.submission_source(notebook.read(ex.notebook))


def test_a_submission_that_replaces_explain_still_shows_its_breaks():
    """A submission that swaps torch._dynamo.explain (and torch.compile) for fakes reporting one
    clean graph is measured by the functions the grader took before loading it."""
    from labkit.grade import runner

    ex, solution = _graph_breaks_exercise()
    forged = solution + '''
import types
def _clean(fn):
    return lambda *a, **k: types.SimpleNamespace(graph_count=1, graph_break_count=0, break_reasons=[])
torch._dynamo.explain = _clean
torch.compile = lambda fn, **kw: fn
def scaled_projection(x, w, threshold):
    h = x @ w
    if h.sum() < 0:
        h = -h
    return torch.where(h.abs() >= threshold * h.abs().max().item(), h / h.abs().max(), 0.0)
'''
    report = runner.grade(ex, forged, hidden=False)
    assert report.score == 0, report.results["tests"]
    assert any("break" in t["output"] for t in report.results["tests"])


def _sign_fixed_clean(x):
    return torch.where(x.sum() > 0, x, -x)


def _sign_fixed_broken(x):
    return x if x.sum() > 0 else -x


def test_in_process_explain_and_fullgraph():
    """check()'s in-process submission answers explain and fullgraph calls as the sandbox does."""
    from labkit.grade.harness import InProcessSubmission, SubmissionFailed

    sub = InProcessSubmission({"clean": _sign_fixed_clean, "broken": _sign_fixed_broken})
    x = torch.randn(3, 4)
    assert sub.explain("clean", x) == {"graph_count": 1, "graph_break_count": 0, "break_reasons": []}
    # explain counts a break by the graphs it leaves (none after a branch that returns x
    # untouched), while break_reasons lists every break: check that, whatever the sign
    for sign in (1.0, -1.0):
        report = sub.explain("broken", sign * x.abs())
        assert len(report["break_reasons"]) == 1 and "jump" in report["break_reasons"][0], report
    torch.testing.assert_close(sub.call_fullgraph("clean", x), torch.where(x.sum() > 0, x, -x))
    with pytest.raises(SubmissionFailed):
        sub.call_fullgraph("broken", x)


def test_through_rejects_an_unknown_mode():
    from labkit.grade import tracing

    with pytest.raises(ValueError, match="mode must be one of"):
        tracing.through(lambda x: x, "inductor")
