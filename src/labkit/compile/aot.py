"""AOTAutograd's view of a function: the joint graph, and the forward and backward it is cut into.

AOTAutograd traces the forward *and* autograd's backward of a Dynamo graph into one joint
graph of ATen ops (inputs: the primals and the tangents, the gradients flowing in;
outputs: the forward's results and the gradients of the inputs). A *partitioner* then cuts
it in two: a forward graph, which returns its results plus the tensors the backward will
need (the *saved* activations), and a backward graph that takes those. Where to cut is a
trade: every saved tensor is memory held from the forward to the backward; every tensor
not saved must be recomputed in the backward. ``default_partition`` saves what the
backward reads; ``min_cut_rematerialization_partition`` (what Inductor uses) solves a
min-cut over the graph, weighing bytes saved against recomputation, and recomputes cheap
pointwise ops, which the backward's fused kernels then get almost for free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

PARTITIONS = ("default", "min_cut")


@dataclass(frozen=True)
class Saved:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    is_view_of_input: bool  # a transpose or view of an input: saved for free


@dataclass(frozen=True)
class ForwardBackward:
    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[Saved, ...]

    @property
    def saved_bytes(self) -> int:
        """Bytes the forward keeps for the backward (views of inputs cost nothing)."""
        return sum(s.nbytes for s in self.saved if not s.is_view_of_input)


def _is_input_view(node: fx.Node) -> bool:
    while node.op == "call_function" and node.target in (torch.ops.aten.t.default, torch.ops.aten.view.default,
                                                          torch.ops.aten.permute.default,
                                                          torch.ops.aten.transpose.int):
        node = node.args[0]
    return node.op == "placeholder"


def forward_backward(fn: Callable, *args: torch.Tensor, partition: str = "min_cut") -> ForwardBackward:
    """Run ``fn(*args)`` and its backward through AOTAutograd; the graphs it made.

    ``partition`` picks the partitioner (see the module docstring). ``fn`` must return one
    tensor or a tuple of tensors; the backward is run on the sum of each.
    """
    from functorch.compile import (aot_function, default_partition, make_boxed_func,
                                   min_cut_rematerialization_partition)

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if not args or not all(isinstance(a, torch.Tensor) for a in args) or not any(a.requires_grad for a in args):
        raise ValueError("args must be tensors, at least one with requires_grad=True")
    graphs: dict[str, fx.GraphModule] = {}
    cut = min_cut_rematerialization_partition if partition == "min_cut" else default_partition

    def keep(name: str):
        def compiler(gm: fx.GraphModule, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def partition_fn(joint: fx.GraphModule, joint_inputs, **kwargs):
        graphs["joint"] = joint
        return cut(joint, joint_inputs, **kwargs)

    compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition_fn)
    outputs = compiled(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.sum() for o in outputs).backward()
    returned = next(iter(graphs["forward"].graph.find_nodes(op="output"))).args[0]
    saved = []
    for node in returned[len(outputs):]:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            saved.append(Saved(node.name, tuple(value.shape), value.dtype, value.numel() * value.element_size(),
                               _is_input_view(node)))
    return ForwardBackward(graphs["joint"], graphs["forward"], graphs["backward"], tuple(saved))
