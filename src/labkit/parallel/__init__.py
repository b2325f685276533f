"""Parallelism strategies from scratch: tensor, sequence, pipeline and context parallelism, and the planner.

>>> from labkit.collectives import launch
>>> from labkit.parallel import programs
>>> launch.run(programs.tensor_parallel_step, 2, args=(config, rows, seq, False))

- :mod:`~labkit.parallel.tensor_parallel`: Megatron's column- and row-parallel linears,
  the book's decoder with its blocks split over ranks (two all-reduces per block forward);
- :mod:`~labkit.parallel.sequence_parallel`: the regions between them split along the
  sequence (reduce-scatter and all-gather instead of all-reduce);
- :mod:`~labkit.parallel.schedules`: GPipe, 1F1B and interleaved 1F1B as data, and a
  simulator that turns them into timelines; :mod:`~labkit.parallel.pipeline` runs them;
- :mod:`~labkit.parallel.ring_attention`: context parallelism;
- :mod:`~labkit.parallel.planner`: what each strategy moves and holds, and the calculator
  that picks a configuration for a cluster;
- :mod:`~labkit.parallel.comm`: the logged collectives all of them call;
- :mod:`~labkit.parallel.programs` (what each rank runs), :mod:`~labkit.parallel.verify`
  (the checks against one process and against torch's own TP and 1F1B), and
  :mod:`~labkit.parallel.bench` (the chapter's benchmark, ``parallel.strategies``).
"""

from .comm import CommLog, logging_to
from .pipeline import PipelineStage, run_schedule, sync_tied_embedding
from .ring_attention import ring_attention, token_positions
from .schedules import (Action, Timeline, bubble_fraction_formula, check_schedule, gpipe, in_flight,
                        interleaved_one_f_one_b, make_schedule, one_f_one_b, simulate)
from .sequence_parallel import gather_sequence, reduce_scatter_sequence, sequence_slice
from .tensor_parallel import TensorParallelDecoder, copy_to_tensor_parallel, reduce_from_tensor_parallel

__all__ = [
    "Action", "CommLog", "PipelineStage", "TensorParallelDecoder", "Timeline", "bubble_fraction_formula",
    "check_schedule", "copy_to_tensor_parallel", "gather_sequence", "gpipe", "in_flight", "interleaved_one_f_one_b",
    "logging_to", "make_schedule", "one_f_one_b", "reduce_from_tensor_parallel", "reduce_scatter_sequence",
    "ring_attention", "run_schedule", "sequence_slice", "simulate", "sync_tied_embedding", "token_positions",
]
