"""Draft-then-verify serving at batch 1: :meth:`LLM.generate`'s interface on :mod:`labkit.spec`.

:class:`SpeculativeLLM` takes the engine's prompts and :class:`~labkit.serve.SamplingParams`
and serves each request alone, ``num_speculative_tokens`` drafts per target step, with
the target's and the draft's steps replayed from CUDA graphs on a GPU
(:class:`labkit.spec.StepRunner`). Its outputs are :class:`~labkit.serve.RequestOutput`
s: greedy requests get the paged engine's tokens exactly (up to rounding ties), sampled
ones the target's distribution, seeded requests reproducibly. This is the latency
setting speculative decoding is for; the paged engine's continuous batching does not
speculate (vLLM's does, drafting for every running request and verifying them in one
batched pass). A request the engine could not serve finishes with an ``error`` as there;
so does one that asks for what this loop does not do (``top_k``, ``top_p``, ``n > 1``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from ..models import Decoder
from ..spec import SpecOutput, StepRunner, generate_speculative
from ..validate import check_positive_int
from .engine import RequestOutput, request_problem
from .sampler import SamplingParams


class SpeculativeLLM:
    """Serve requests one at a time with ``draft`` proposing ``num_speculative_tokens`` tokens for ``model``.

    >>> llm = serve.SpeculativeLLM(target, draft, num_speculative_tokens=4, max_model_len=512)
    >>> outputs = llm.generate(prompts, serve.SamplingParams(max_tokens=64))
    >>> llm.steps[0].accepted          # drafts kept at each verification of the first request
    """

    def __init__(self, model: Decoder, draft: Decoder, *, num_speculative_tokens: int = 4,
                 max_model_len: int = 1024, cuda_graphs: bool | None = None) -> None:
        for name, m in (("model", model), ("draft", draft)):
            if not isinstance(m, Decoder):
                raise TypeError(f"{name} must be a labkit Decoder, got {type(m).__name__}")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) must be the model's "
                             f"({model.config.vocab_size})")
        self.k = check_positive_int(num_speculative_tokens, "num_speculative_tokens")
        self.max_model_len = check_positive_int(max_model_len, "max_model_len")
        self.model = model
        capacity = max_model_len + self.k + 1  # the last step may score k drafts past the last token kept
        self.target_runner = StepRunner(model, capacity, (1, self.k + 1), use_graph=cuda_graphs)
        self.draft_runner = StepRunner(draft, capacity, (1,), use_graph=cuda_graphs)
        self.steps: list[SpecOutput] = []  # per served request, in order: the verifications' kept counts

    def generate(self, prompts: SequenceOf[SequenceOf[int]],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion, one after another; one output per prompt, in order."""
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif not isinstance(params, (list, tuple)) or len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or a list of {len(prompts)}, got {params!r}")
        self.steps = []
        return [self._serve(request_id, prompt, p) for request_id, (prompt, p) in enumerate(zip(prompts, params))]

    def _serve(self, request_id: int, prompt: object, params: object) -> RequestOutput:
        prompt_tuple = tuple(prompt) if isinstance(prompt, (list, tuple)) else ()
        error = self._reject_reason(prompt, params)
        if error is not None:
            self.steps.append(SpecOutput(tokens=[], k=self.k))
            return RequestOutput(request_id, prompt_tuple, (), "error", error)
        device = self.model.embed.weight.device
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        out = generate_speculative(self.target_runner, self.draft_runner,
                                   torch.tensor(prompt_tuple, dtype=torch.int64, device=device), params.max_tokens,
                                   k=self.k, temperature=0.0 if params.greedy else params.temperature,
                                   generator=generator, stop_token_ids=params.stop_token_ids)
        self.steps.append(out)
        stopped = bool(out.tokens) and out.tokens[-1] in params.stop_token_ids
        return RequestOutput(request_id, prompt_tuple, tuple(out.tokens), "stop" if stopped else "length")

    def _reject_reason(self, prompt: object, params: object) -> str | None:
        """Why this request cannot be served here, or ``None``."""
        problem = request_problem(prompt, params, self.model.config.vocab_size, self.max_model_len)
        if problem is not None:
            return problem
        if params.top_k or params.top_p < 1 or params.n > 1:
            return (f"speculative serving samples from the full distribution, one sample per request: "
                    f"top_k={params.top_k}, top_p={params.top_p}, n={params.n} are not supported")
        return None
