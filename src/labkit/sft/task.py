"""SFT data the project makes: multi-turn addition chats from the GRPO chapter's task.

A conversation asks one to ``max_turns`` sums of :class:`labkit.grpo.task.AdditionTask`
(``"07+45="``) and the assistant answers each with its digits. The number of turns
varies, so documents vary in length and packing has something to pack. Held-out pairs
never appear in training conversations; :func:`held_out_accuracy` asks them one per
conversation and checks the greedy answer exactly.
"""

from __future__ import annotations

import torch

from ..grpo.task import AdditionTask
from ..models import Decoder, generate_greedy
from ..validate import check_positive_int
from .data import ChatTemplate, Document


def template_for(task: AdditionTask) -> ChatTemplate:
    return ChatTemplate(base_vocab=task.vocab_size)


def task_names(task: AdditionTask) -> dict[int, str]:
    return {**{d: str(d) for d in range(10)}, task.PLUS: "+", task.EQUALS: "="}


def addition_chats(task: AdditionTask, n: int, generator: torch.Generator, *, max_turns: int = 4,
                   split: str = "train") -> list[Document]:
    """``n`` conversations of 1..``max_turns`` additions each, rendered by the book's template."""
    check_positive_int(n, "n")
    check_positive_int(max_turns, "max_turns")
    template = template_for(task)
    turns = torch.randint(1, max_turns + 1, (n,), generator=generator).tolist()
    pairs = task.sample_pairs(sum(turns), split, generator)
    prompts, answers = task.prompts(pairs).tolist(), task.answers(pairs)
    chats, at = [], 0
    for k in turns:
        conversation = []
        for i in range(at, at + k):
            conversation += [("user", prompts[i]), ("assistant", answers[i][:-1])]  # the template's end replaces eos
        chats.append(template.render(conversation))
        at += k
    return chats


@torch.no_grad()
def held_out_accuracy(model: Decoder, task: AdditionTask, n: int = 200, seed: int = 1234) -> float:
    """Fraction of ``n`` held-out sums answered exactly (digits, then ``<|end|>``), greedily."""
    template = template_for(task)
    pairs = task.sample_pairs(n, "held_out", torch.Generator().manual_seed(seed))
    prompts = torch.stack([template.prompt(p) for p in task.prompts(pairs).tolist()])
    device = model.embed.weight.device
    out = generate_greedy(model, prompts.to(device), task.max_answer_tokens, cache="recompute").tokens.cpu()
    correct = 0
    for row, answer in zip(out.tolist(), task.answers(pairs)):
        expected = answer[:-1] + [template.end]
        correct += row[:len(expected)] == expected
    return correct / n
