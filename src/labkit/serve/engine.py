"""The engine loop: schedule, prepare inputs, run the model, sample, update, finish.

:class:`LLM` owns the model, the KV pool, the block manager and the scheduler.
:meth:`LLM.generate` serves a list of prompts to completion and returns one
:class:`RequestOutput` per prompt, in order. A prompt that can never be served (empty,
longer than the model's positions, too big for the pool or the step budget, invalid
sampling parameters) gets an output with its ``error`` set and no tokens; the others
are served as if it had not been there.

Each step runs the model once over every scheduled sequence, prefills and decodes
together: :class:`~labkit.serve.model_runner.ModelRunner` packs their new tokens into one
flat batch, attention reads each sequence's K and V through its block table
(:mod:`labkit.serve.attention`), and decode-only steps on a GPU replay CUDA graphs.
:meth:`LLM.step` returns what it scheduled, for timelines of a trace.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..models import Decoder
from ..validate import check_choice, check_positive_int
from .block_manager import BlockManager
from .lora import AdapterSlots, adapter_weights
from .memory_budget import profile_memory
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .prefix_cache import POLICIES, CachingBlockManager
from .sampler import SamplingParams, host_values, sample_tokens, token_logprobs
from .scheduler import ScheduledStep, Scheduler, Sequence, Status
from .swap import SwapSpace


@dataclass(frozen=True)
class RequestOutput:
    """One request's result: its generated ``tokens`` and why it stopped
    (``"stop"``, ``"length"``, ``"abort"`` or ``"error"``, with ``error`` saying what was wrong).

    A request with ``n > 1`` samples describes its first sample here and the others in
    ``more_samples`` (each a RequestOutput of the same request id). ``logprobs`` holds each
    token's log-probability as the engine sampled it, when the request asked for them."""

    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's field of the same name)
    more_samples: tuple[RequestOutput, ...] = ()
    logprobs: tuple[float, ...] = ()

    @property
    def samples(self) -> tuple[tuple[int, ...], ...]:
        """Every sample's tokens, the first one first."""
        return (self.tokens, *(s.tokens for s in self.more_samples))



@dataclass(frozen=True)
class StepTiming:
    """Where the host's time went in one :meth:`LLM.step`, in seconds of wall clock. ``wait`` is
    the time blocked until the applied step's tokens were on the host: with the update after
    each step, for the GPU to run the step just queued; with asynchronous scheduling, for the
    step before it."""

    schedule: float  # the scheduler's decisions
    launch: float    # queueing the step: inputs + placeholders + forward + sample below
    wait: float      # blocked until the applied step's sampled tokens arrived
    apply: float     # putting them in place, retiring finished sequences
    # launch, in four parts: where a launch that grows spends the time
    inputs: float = 0.0   # block copies, packing the inputs on the host, their copies to the device
    placeholders: float = 0.0  # asynchronous scheduling: the step in flight's tokens put in place, on the device
    forward: float = 0.0  # the forward queued: a graph staged and replayed, or the model run eagerly
    sample: float = 0.0   # the step's bookkeeping, sampling, the tokens' copy back and its event

    @property
    def total(self) -> float:
        return self.schedule + self.launch + self.wait + self.apply


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens have not been applied yet."""

    samplers: list[Sequence]             # the sequences that sampled, in the order of the tokens
    tokens: torch.Tensor                 # [len(samplers)] int64, on the device
    host_tokens: torch.Tensor            # their copy on the host (pinned), complete once `ready` is
    host_logprobs: torch.Tensor | None   # likewise for their log-probabilities, when asked for
    ready: torch.cuda.Event | None       # recorded after the copies (None on a CPU: already complete)

    def __post_init__(self) -> None:
        if self.ready is not None:
            self.ready.record()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host, queued behind the work that computes it (pinned memory: the
    host does not wait for it here)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def request_problem(prompt: object, params: object, vocab_size: int, max_model_len: int) -> str | None:
    """What makes a request unservable by any engine of ``max_model_len`` positions over a
    vocabulary of ``vocab_size``, or ``None``: the checks every engine front end makes."""
    if not isinstance(params, SamplingParams):
        return f"params must be a SamplingParams, got {type(params).__name__}"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return f"prompt must be a non-empty list of token ids, got {prompt!r}"
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        return f"prompt token ids must be ints in [0, {vocab_size}), got {list(prompt)!r}"
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        return (f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds the engine's {max_model_len} positions (max_model_len)")
    return None

class LLM:
    """A paged inference engine over a :class:`labkit.models.Decoder`: continuous batching,
    one packed forward per step.

    ``num_blocks`` blocks of ``block_size`` tokens make the KV pool; each step runs at most
    ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens. ``chunked_prefill``
    splits prompts longer than a step's room into chunks (see :mod:`~labkit.serve.scheduler`).
    ``cuda_graphs`` (default: on a GPU) replays decode steps from CUDA graphs, and steps
    with a prefill from piecewise graphs (see :mod:`~labkit.serve.model_runner`). On a GPU ``num_blocks`` may be left out: a
    profiling run then sizes the pool to ``gpu_memory_utilization`` of the device's memory
    (see :mod:`~labkit.serve.memory_budget`; the result is ``memory_budget``).
    ``max_model_len`` (default: the model's positions) bounds prompt plus output tokens, and
    with it the width of the block tables a CUDA graph is captured with.
    ``preemption`` is ``"recompute"`` or ``"swap"``; swap copies a preempted sequence's
    blocks to ``num_swap_blocks`` CPU blocks (:class:`~labkit.serve.swap.SwapSpace`).
    ``prefix_caching`` (``None``, ``"radix"`` or ``"hash"``) keeps finished requests' full KV
    blocks for later prompts with the same prefix (see :mod:`~labkit.serve.prefix_cache`).
    ``attention`` is ``"triton"`` (the paged kernels) or ``"torch"`` (their plain-torch
    definitions, a loop over sequences: on a CPU far faster than the Triton interpreter).

    ``max_loras`` (0: none) adapter slots of rank up to ``max_lora_rank`` let each request name
    its own LoRA adapter (:meth:`add_lora`, ``add_request(..., lora=name)``): the model's
    linear layers take the adapters' buffers (:mod:`~labkit.serve.lora`), and every step adds
    each token's adapter after the shared base matmuls (Punica's BGMV and SGMV).

    ``async_scheduling`` (vLLM's ``--async-scheduling``) lets each :meth:`step` queue the next
    model step on the device before it reads back the previous step's tokens: a decode's
    input token may then still be on the device (the runner takes it from there), and a
    sequence that stops spends one extra step whose token is dropped.

    A fused model (``model.fused``) gets its projections stacked at construction, as vLLM
    loads a model (:meth:`~labkit.models.Decoder.fuse_projections`): one matmul for q, k and
    v, one for gate and up, and one kernel for the q/k norms, the rotation and the cache
    stores. The weights' values and the model's parameters stay as they were.
    """

    def __init__(self, model: Decoder, *, num_blocks: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 chunked_prefill: bool = False, cuda_graphs: bool | None = None,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 preemption: str = "recompute", num_swap_blocks: int = 0,
                 prefix_caching: str | None = None, attention: str = "triton",
                 async_scheduling: bool = False, max_loras: int = 0, max_lora_rank: int = 16) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
        self.model = model
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
            raise ValueError(f"max_loras must be an int >= 0 (0: no adapters), got {max_loras!r}")
        if max_loras and prefix_caching is not None:
            raise ValueError("prefix caching with adapters is not supported: a prompt's K and V depend on its "
                             "adapter, so cached blocks would need the adapter in their key (as vLLM's hashes have)")
        # Before any graph is captured: the graphs read the adapters' buffers and the stacked weights.
        self.adapters = AdapterSlots(model, max_loras, max_lora_rank) if max_loras else None
        if model.fused and self.adapters is None:
            model.fuse_projections()
        w = model.embed.weight
        positions = model.config.max_position_embeddings
        self.max_model_len = positions if max_model_len is None else check_positive_int(max_model_len, "max_model_len")
        if self.max_model_len > positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {positions} positions")
        self.memory_budget = None
        if num_blocks is None:
            if w.device.type != "cuda":
                raise ValueError(f"num_blocks is required on {w.device}: only a GPU's memory is budgeted")
            self.memory_budget = profile_memory(model, gpu_memory_utilization=gpu_memory_utilization,
                                                block_size=block_size, max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=max_num_batched_tokens)
            num_blocks = self.memory_budget.num_blocks - 1  # the pool's pad block is one of the budget's
        if prefix_caching is None:
            self.blocks = BlockManager(num_blocks, block_size)
        else:
            check_choice(prefix_caching, "prefix_caching", POLICIES)
            self.blocks = CachingBlockManager(num_blocks, block_size, prefix_caching)
        self.prefix_cache = self.blocks.cache if prefix_caching is not None else None
        # One block more than the manager hands out: padded rows of a CUDA graph write there.
        self.kv = PagedKVCache(model.config, num_blocks + 1, block_size, dtype=w.dtype, device=w.device)
        self.runner = ModelRunner(model, self.kv, pad_block=num_blocks, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, cuda_graphs=cuda_graphs, attention=attention,
                                  max_num_batched_tokens=max_num_batched_tokens if attention == "triton" else None,
                                  adapters=self.adapters)
        if self.runner.cuda_graphs:
            self.runner.capture()  # at start-up, as vLLM does: no request's latency includes it
        self.swap = SwapSpace(self.kv, num_swap_blocks) if preemption == "swap" else None
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   chunked_prefill=chunked_prefill, preemption=preemption,
                                   swap_blocks=self.swap.blocks if self.swap else None,
                                   prefix_cache=self.prefix_cache)
        self._in_flight: _Launched | None = None  # with async_scheduling: the step whose tokens are on their way
        self.last_step_timing: StepTiming | None = None  # the host's phases in the last step()
        self._wait_s = 0.0  # the last _apply's time blocked on the device
        self._launch_parts = (0.0, 0.0, 0.0)  # the last _launch's seconds on inputs, placeholders and the forward
        self.async_scheduling = async_scheduling
        self._ids = itertools.count()
        self._finished: dict[int, RequestOutput] = {}
        self._live: dict[int, list[Sequence]] = {}   # request id -> its samples' sequences, the first first
        self._request_of: dict[int, int] = {}         # sequence id -> request id (they differ for samples > 0)
        self._finish_reasons: dict[int, str] = {}     # sequence id -> why it stopped

    @property
    def async_scheduling(self) -> bool:
        """Whether :meth:`step` queues the next step before applying the previous one's tokens.
        Switching it off applies the step in flight."""
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"async_scheduling must be a bool, got {type(value).__name__}")
        if not value:
            self._apply(self._in_flight)
            self._in_flight = None
        self._async_scheduling = value

    def add_lora(self, name: str, adapter: nn.Module | dict) -> None:
        """Load adapter ``name`` into a free slot: a model adapted with :func:`labkit.lora.add_lora`
        (its adapters are copied; it may be freed afterwards), or
        :func:`~labkit.serve.lora.adapter_weights`' dict. Requests then name it (``lora=``)."""
        if self.adapters is None:
            raise ValueError("this engine serves no adapters: construct it with max_loras > 0")
        self.adapters.load(name, adapter if isinstance(adapter, dict) else adapter_weights(adapter))

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``; no queued or running request may still use it."""
        if self.adapters is None or name not in self.adapters.slot_of:
            raise KeyError(f"no adapter named {name!r} is loaded")
        slot = self.adapters.slot_of[name]
        if any(seq.lora_slot == slot for samples in self._live.values() for seq in samples):
            raise ValueError(f"adapter {name!r} is in use by a queued or running request")
        self.adapters.remove(name)

    def add_request(self, prompt: SequenceOf[int], params: SamplingParams | dict | None = None, *,
                    lora: str | None = None) -> int:
        """Queue ``prompt``; its request id. ``params`` is a :class:`SamplingParams` or the dict
        of its fields; ``lora`` names a loaded adapter (:meth:`add_lora`; ``None``: the base
        model). A request that can never be served finishes at once with an error
        (see :meth:`output`) instead of raising, so the other requests of a batch go on."""
        request_id = next(self._ids)
        prompt_tuple = tuple(prompt) if isinstance(prompt, (list, tuple)) else ()
        error = None
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except (TypeError, ValueError) as exc:
                error = f"invalid sampling parameters: {exc}"
        error = error or self._reject_reason(prompt, params) or self._lora_problem(lora)
        if error is not None:
            self._finished[request_id] = RequestOutput(request_id, prompt_tuple, (), "error", error)
            return request_id
        seq = Sequence(request_id, list(prompt), params, self._generator(params, 0),
                       lora_slot=-1 if lora is None else self.adapters.slot_of[lora])
        self._live[request_id] = [seq]
        self._request_of[request_id] = request_id
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: int) -> None:
        """Stop a queued or running request (all its samples) now; it finishes with reason ``"abort"``."""
        if request_id not in self._live:
            raise KeyError(f"request {request_id} is not queued or running")
        for seq in list(self._live[request_id]):
            if seq.status is not Status.FINISHED:
                self._retire(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def output(self, request_id: int) -> RequestOutput:
        """The result of a finished request."""
        if request_id not in self._finished:
            raise KeyError(f"request {request_id} has not finished")
        return self._finished[request_id]

    def take_output(self, request_id: int) -> RequestOutput:
        """The result of a finished request, forgotten by the engine (a server's way to not accumulate them)."""
        out = self.output(request_id)
        del self._finished[request_id]
        return out

    def progress(self, request_id: int) -> tuple[tuple[tuple[int, ...], ...], RequestOutput | None]:
        """Every sample's tokens so far, and the output once the request has finished (else ``None``):
        what a streaming server sends after each step."""
        if request_id in self._finished:
            out = self._finished[request_id]
            return out.samples, out
        if request_id not in self._live:
            raise KeyError(f"no request {request_id}")
        return tuple(tuple(seq.output[:len(seq.output) - seq.num_pending]) for seq in self._live[request_id]), None

    @torch.no_grad()
    def step(self) -> ScheduledStep:
        """One iteration: schedule, prepare the packed inputs, run the model once, sample, update.
        Returns what it scheduled.

        With ``async_scheduling`` the update trails by one step: this call schedules and
        queues step ``k`` (its inputs, forward and sampling) on the device, and only then
        waits for step ``k - 1``'s tokens and applies them, so the host's work for step ``k``
        overlaps the device's work for step ``k - 1``. ``last_step_timing`` then says where the
        host's time went (:class:`StepTiming`)."""
        started = time.perf_counter()
        step = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self._launch_parts = (0.0, 0.0, 0.0)  # (a step with nothing to launch leaves them so)
        launched = self._launch(step)
        queued = time.perf_counter()
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        self._apply(launched)
        inputs, placeholders, forward = self._launch_parts
        self.last_step_timing = StepTiming(scheduled - started, queued - scheduled, self._wait_s,
                                           time.perf_counter() - queued - self._wait_s,
                                           inputs=inputs, placeholders=placeholders, forward=forward,
                                           sample=queued - scheduled - inputs - placeholders - forward)
        return step

    def _launch(self, step: ScheduledStep) -> _Launched | None:
        """Queue a scheduled step on the device: block copies, the forward pass, the sampling
        of every sequence whose tokens are then all cached, and the copy of the sampled tokens
        to the host. Each sampling sequence gets a placeholder token (``-1 - i``: token ``i`` of
        this step) until :meth:`_apply` reads the real ones back. Nothing waits for the device.
        Notes where its time went in ``_launch_parts`` (inputs, placeholders, forward; the rest is
        sampling)."""
        launching = time.perf_counter()
        if self.swap is not None:
            self.swap.swap_out(self.kv, step.swap_out)  # first: other sequences may reuse these blocks now
            self.swap.swap_in(self.kv, step.swap_in)
        for source, destination in step.copies:
            self.kv.copy_block(source, destination)
        seqs = step.prefills + step.decodes
        if not seqs:
            self._launch_parts = (time.perf_counter() - launching, 0.0, 0.0)  # block copies only
            return None
        # Inputs that are still placeholders come from the step in flight, on the device.
        pending = self._in_flight.tokens if any(seq.num_pending for seq in seqs) else None
        executing = time.perf_counter()
        logits = self.runner.execute(seqs, pending_tokens=pending)
        inputs = executing - launching + self.runner.last_prepare_s
        placeholders = self.runner.last_placeholders_s
        self._launch_parts = (inputs, placeholders, time.perf_counter() - launching - inputs - placeholders)
        done = []  # (logits row, sequence) for every sequence whose tokens are now all cached
        for row, seq in enumerate(seqs):
            seq.num_cached += seq.num_new
            if self.prefix_cache is not None and row < len(step.prefills):
                # vLLM caches each full block once computed: a request admitted while this one
                # still runs shares its prompt (SGLang caches unfinished requests likewise).
                self.prefix_cache.insert(seq.tokens[:seq.num_cached], seq.block_table)
            if seq.num_cached == seq.num_tokens:
                done.append((row, seq))
                if seq.params.n > 1 and len(self._live[self._request_of[seq.request_id]]) == 1:
                    done += [(row, child) for child in self._fork(seq)]
        if not done:
            return None  # chunks of prefills only
        rows = [row for row, _ in done]
        if rows != list(range(logits.shape[0])):  # (a decode step samples every row, in order: no gather)
            logits = logits[host_values(rows, torch.int64, logits.device)]
        params = [seq.params for _, seq in done]
        tokens = sample_tokens(logits, params, [seq.generator for _, seq in done])
        logprobs = token_logprobs(logits, params, tokens) if any(p.logprobs for p in params) else None
        samplers = [seq for _, seq in done]
        for index, seq in enumerate(samplers):
            seq.output.append(-1 - index)
            seq.num_pending += 1
        return _Launched(samplers, tokens, _to_host(tokens), None if logprobs is None else _to_host(logprobs),
                         torch.cuda.Event() if tokens.is_cuda else None)

    def _apply(self, launched: _Launched | None) -> None:
        """Wait for a launched step's tokens, put each in place of its placeholder, and retire
        the sequences that stopped or reached their length. A sequence that finished while the
        token was in flight (a stop token the step before, or an abort) drops it."""
        self._wait_s = 0.0
        if launched is None:
            return
        if launched.ready is not None:
            waiting = time.perf_counter()
            launched.ready.synchronize()
            self._wait_s = time.perf_counter() - waiting
        tokens = launched.host_tokens.tolist()
        logprobs = launched.host_logprobs.tolist() if launched.host_logprobs is not None else None
        for index, seq in enumerate(launched.samplers):
            if seq.status is Status.FINISHED:
                continue
            position = len(seq.output) - seq.num_pending  # the oldest placeholder is this step's
            token = seq.output[position] = tokens[index]
            seq.num_pending -= 1
            if logprobs is not None and seq.params.logprobs:
                seq.output_logprobs.append(logprobs[index])
            if token in seq.params.stop_token_ids:
                self._retire(seq, "stop")
            elif position + 1 == seq.params.max_tokens:
                self._retire(seq, "length")

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of ``seq``'s request, its prompt just prefilled: each shares every KV block
        of ``seq`` (copy-on-write) and runs beside it from now on, drawing from its own generator."""
        request_id = self._request_of[seq.request_id]
        children = []
        for index in range(1, seq.params.n):
            child = Sequence(next(self._ids), list(seq.prompt), seq.params, self._generator(seq.params, index),
                             block_table=self.blocks.fork(seq.block_table), num_cached=seq.num_cached,
                             status=Status.RUNNING, lora_slot=seq.lora_slot)
            self._request_of[child.request_id] = request_id
            self._live[request_id].append(child)
            self.scheduler.running.append(child)
            children.append(child)
        return children

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample ``index``'s generator: seeded by ``seed + index`` (vLLM's children's seeds), or none."""
        if params.greedy or params.seed is None:
            return None
        return torch.Generator(device=self.model.embed.weight.device).manual_seed(params.seed + index)

    def generate(self, prompts: SequenceOf[SequenceOf[int]],
                 params: SamplingParams | dict | SequenceOf[SamplingParams | dict] | None = None, *,
                 lora: str | SequenceOf[str | None] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion; one output per prompt, in order.

        ``params`` is one :class:`SamplingParams` (or dict) for all prompts or a list, one per prompt;
        ``lora`` likewise one adapter name (or ``None``) for all or a list.
        """
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if params is None or isinstance(params, (SamplingParams, dict)):
            params = [params] * len(prompts)
        elif not isinstance(params, (list, tuple)) or len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or a list of {len(prompts)}, got {params!r}")
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        elif not isinstance(lora, (list, tuple)) or len(lora) != len(prompts):
            raise ValueError(f"lora must be one adapter name or a list of {len(prompts)}, got {lora!r}")
        ids = [self.add_request(p, sp, lora=name) for p, sp, name in zip(prompts, params, lora)]
        while self.has_unfinished():
            self.step()
        return [self.take_output(i) for i in ids]

    def _lora_problem(self, lora: object) -> str | None:
        """Why a request cannot use adapter ``lora``, or ``None``."""
        if lora is None:
            return None
        if self.adapters is None:
            return f"adapter {lora!r} requested, but this engine serves no adapters (max_loras=0)"
        if lora not in self.adapters.slot_of:
            return f"no adapter named {lora!r} is loaded (loaded: {sorted(self.adapters.slot_of)})"
        return None

    def _reject_reason(self, prompt: object, params: object) -> str | None:
        """Why a request can never be served, or ``None``."""
        problem = request_problem(prompt, params, self.model.config.vocab_size, self.max_model_len)
        if problem is not None:
            return problem
        total = len(prompt) + params.max_tokens
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            return (f"{total} tokens need {self.blocks.blocks_needed(total)} blocks of {self.blocks.block_size}; "
                    f"the pool has {self.blocks.num_blocks}, so this request can never fit")
        if params.n > self.scheduler.max_num_seqs:
            return f"n={params.n} samples exceed max_num_seqs {self.scheduler.max_num_seqs}: they run side by side"
        if total > self.scheduler.max_num_batched_tokens and not self.scheduler.chunked_prefill:
            return (f"{total} tokens exceed max_num_batched_tokens {self.scheduler.max_num_batched_tokens}: "
                    f"a prefill after preemption could never be scheduled")
        return None

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Finish one sequence; its request finishes with its last sample."""
        if seq.num_pending:  # tokens sampled after the one it stopped on (asynchronous scheduling)
            del seq.output[len(seq.output) - seq.num_pending:]
            seq.num_pending = 0
        self.scheduler.finish(seq)
        self._finish_reasons[seq.request_id] = reason
        request_id = self._request_of[seq.request_id]
        samples = self._live[request_id]
        if any(s.status is not Status.FINISHED for s in samples):
            return
        outputs = [RequestOutput(request_id, tuple(s.prompt), tuple(s.output), self._finish_reasons.pop(s.request_id),
                                 None, s.num_preemptions, s.num_prefix_hit, logprobs=tuple(s.output_logprobs))
                   for s in samples]
        for s in samples:
            del self._request_of[s.request_id]
        del self._live[request_id]
        self._finished[request_id] = replace(outputs[0], more_samples=tuple(outputs[1:]))
