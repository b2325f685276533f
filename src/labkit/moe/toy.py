"""A toy MoE trained on clustered data, to watch routers balance or collapse.

Tokens come from ``clusters`` Gaussian blobs; each blob has its own linear target map, so
the ideal layer sends each blob to its own expert. Experts are single linear maps, small
enough to evaluate all of them for every token (the dense evaluation keeps the toy exact
and differentiable). Three routers are compared: softmax top-k with no balancing,
with Switch's auxiliary loss, and DeepSeek-V3's sigmoid router with a bias and no loss.
"""

from __future__ import annotations

import torch

from ..validate import check_choice, check_positive_int
from .router import expert_counts, load_balancing_loss, sigmoid_topk_with_bias, softmax_topk, update_bias

MODES = ("no balancing", "aux loss", "aux-loss-free bias")


class ClusteredTask:
    """``clusters`` Gaussian blobs in ``hidden`` dims, each with its own linear target map."""

    def __init__(self, hidden: int, clusters: int, gen: torch.Generator):
        self.centers = 2.0 * torch.randn(clusters, hidden, generator=gen)
        self.maps = torch.randn(clusters, hidden, hidden, generator=gen) / hidden**0.5

    def sample(self, num: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        which = torch.randint(0, self.centers.shape[0], (num,), generator=gen)
        x = self.centers[which] + 0.5 * torch.randn(num, self.centers.shape[1], generator=gen)
        return x, torch.einsum("tij,tj->ti", self.maps[which], x)


def train_toy_router(
    mode: str, *, steps: int = 120, num_experts: int = 8, top_k: int = 2, clusters: int = 8,
    hidden: int = 16, batch: int = 256, seed: int = 0, aux_weight: float = 0.05,
    bias_rate: float = 0.01, record_every: int = 10, lr: float = 0.02,
) -> dict:
    """Train router and experts with Adam; every ``record_every`` steps record the expert loads.

    Returns ``{"steps": [...], "counts": [[E ints], ...], "task_loss": [...]}``: the loads
    are counted on a fixed evaluation batch, so the frames differ only by training.
    """
    check_choice(mode, "mode", MODES)
    for value, name in ((steps, "steps"), (num_experts, "num_experts"), (top_k, "top_k"),
                        (batch, "batch"), (record_every, "record_every")):
        check_positive_int(value, name)
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    router = (0.01 * torch.randn(num_experts, hidden, generator=gen)).requires_grad_()
    experts = (torch.randn(num_experts, hidden, hidden, generator=gen) / hidden**0.5).requires_grad_()
    bias = torch.zeros(num_experts)
    opt = torch.optim.Adam([router, experts], lr=lr)
    task = ClusteredTask(hidden, clusters, gen)
    eval_x, _ = task.sample(512, torch.Generator().manual_seed(seed + 2))

    def route(x):
        logits = x @ router.t()
        if mode == "aux-loss-free bias":
            return sigmoid_topk_with_bias(logits, bias, top_k)
        return softmax_topk(logits, top_k)

    history: dict = {"steps": [], "counts": [], "task_loss": []}
    for step in range(steps + 1):
        if step % record_every == 0:
            with torch.no_grad():
                history["steps"].append(step)
                history["counts"].append(expert_counts(route(eval_x).expert_ids, num_experts).tolist())
        if step == steps:
            break
        x, y = task.sample(batch, data_gen)
        routing = route(x)
        every_expert = torch.einsum("eij,tj->tei", experts, x)  # [T, E, H]
        chosen = torch.gather(every_expert, 1, routing.expert_ids[:, :, None].expand(-1, -1, hidden))
        out = (routing.weights[:, :, None] * chosen).sum(1)
        task_loss = torch.nn.functional.mse_loss(out, y)
        loss = task_loss + (aux_weight * load_balancing_loss(routing) if mode == "aux loss" else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mode == "aux-loss-free bias":
            bias = update_bias(bias, routing.expert_ids, bias_rate)
        history["task_loss"].append(task_loss.item())
    return history
