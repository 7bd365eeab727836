"""Muon for the weights of linear and convolution layers, AdamW for every other parameter, as one optimizer.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") replaces a weight matrix's
momentum by its nearest semi-orthogonal matrix (five Newton–Schulz iterations) before the step. Each update is
scaled by 0.2·sqrt(max(rows, cols)) so its RMS matches AdamW's (Liu et al. 2025, "Muon is Scalable for LLM
Training"), so the learning rate and decoupled weight decay mean what they mean for AdamW. A convolution's weight
(out, in, kh, kw) is orthogonalised as the (out, in·kh·kw) matrix. Embeddings, the class token, position
embeddings, biases, norms and temperatures take AdamW. One optimizer (one state dict, one set of param groups) so
the learning-rate schedule, gradient clipping and checkpoints treat it as they treat AdamW.
"""
from __future__ import annotations

import math

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton–Schulz coefficients of the Muon paper


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """(m, n) -> (m, n): U·Vᵀ of g = U·S·Vᵀ, approximately: five iterations bring the singular values that are at
    least ~1/300 of g's Frobenius norm into ~[0.6, 1.2] (smaller ones stay under 0.6; Jordan et al. 2024)."""
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + eps)  # spectral norm <= 1
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T  # iterate on the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.T  # (min, min)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a·x + (b·G + c·G²)·x
    return x.T if tall else x


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters Muon takes: the weights of nn.Linear and nn.Conv1d/2d/3d layers."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return {id(m.weight) for m in model.modules() if isinstance(m, kinds) and m.weight is not None}


class MuonAdamW(torch.optim.Optimizer):
    """Param groups with ``muon: True`` take Muon (momentum, Nesterov), the others AdamW.

    Every group has ``lr`` and ``weight_decay`` (decoupled, as AdamW's); Muon groups ``momentum``, AdamW groups
    ``betas`` and ``eps``. A parameter whose ``grad`` is None is left untouched (no update, no decay, state kept).
    """

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.98),
                 momentum: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0, ns_steps: int = 5):
        for g in groups:
            if g.get("muon") and any(p.dim() < 2 for p in g["params"]):
                raise ValueError("MuonAdamW: a Muon group holds a parameter with fewer than 2 dimensions")
        defaults = dict(lr=lr, betas=betas, momentum=momentum, eps=eps, weight_decay=weight_decay,
                        ns_steps=ns_steps, muon=False)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, beta = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - beta)
        g = p.grad.lerp(buf, beta)  # Nesterov
        update = orthogonalize(g.reshape(len(g), -1), group["ns_steps"]).view_as(p)  # (out, in·k…) for a conv
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(len(g), g[0].numel())))

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        (b1, b2), t = group["betas"], state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(p.grad, 1 - b1)
        v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
        p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
