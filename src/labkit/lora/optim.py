"""AdamW with its moments kept off the GPU and paged in per parameter: QLoRA's paged optimizer, by hand.

bitsandbytes' paged optimizers allocate Adam's two moments in CUDA unified memory: the
driver evicts their pages to CPU memory when the GPU runs short and faults them back when
the optimizer step touches them. :class:`PagedAdamW` does the same movement explicitly and
always: each parameter's moments live on ``state_device`` (pinned CPU memory when the
parameters are on a GPU), are copied in for that parameter's update, and copied back, so
the device holds one parameter's moments at a time instead of all of them. The update is
``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments), in fp32 moments
whatever the parameter's dtype.

What it cannot show on a CPU-only machine is the point of paging, device memory saved:
there both memories are one. The tests check that its updates are AdamW's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PagedAdamW(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` and ``exp_avg_sq`` live on ``state_device`` between steps."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 state_device: torch.device | str = "cpu") -> None:
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_device = torch.device(state_device)

    def _new_moment(self, p: torch.Tensor) -> torch.Tensor:
        pinned = self.state_device.type == "cpu" and p.device.type == "cuda"
        return torch.zeros(p.shape, dtype=torch.float32, device=self.state_device, pin_memory=pinned)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = self._new_moment(p)
                    state["exp_avg_sq"] = self._new_moment(p)
                state["step"] += 1
                # page in: this parameter's moments, to where the parameter is
                m = state["exp_avg"].to(p.device, non_blocking=True)
                v = state["exp_avg_sq"].to(p.device, non_blocking=True)
                grad = p.grad.float()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denom = (v / bias2).sqrt_().add_(group["eps"])
                p.add_((m / denom * (-group["lr"] / bias1)).to(p.dtype))
                # page out: the moments go back; the device keeps nothing of them
                state["exp_avg"].copy_(m, non_blocking=True)
                state["exp_avg_sq"].copy_(v, non_blocking=True)
        if self.state_device.type == "cpu" and any(p.device.type == "cuda" for g in self.param_groups
                                                   for p in g["params"]):
            torch.cuda.synchronize()  # the copies back must land before the host reuses the buffers
        return loss
