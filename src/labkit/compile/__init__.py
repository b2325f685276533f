"""torch.compile taken apart, one stage per module.

- :mod:`labkit.compile.dynamo`: what Dynamo captured (:func:`~labkit.compile.dynamo.graph_breaks`:
  graphs, graph breaks with their lines, guards).
- :mod:`labkit.compile.aot`: AOTAutograd's joint graph and the forward and backward a
  partitioner cuts it into, with what the forward saves (:func:`~labkit.compile.aot.forward_backward`).
- :mod:`labkit.compile.inductor`: the code Inductor generates, read back
  (:func:`~labkit.compile.inductor.generated_code`, :func:`~labkit.compile.inductor.captured_code`,
  :func:`~labkit.compile.inductor.buffer_plan`).
- :mod:`labkit.compile.piecewise`: vLLM's piecewise compilation of the book's model on the
  serving engine's runner (:class:`~labkit.compile.piecewise.CompiledModelRunner`).
- :mod:`labkit.compile.bench`: the chapter's benchmarks.
"""
