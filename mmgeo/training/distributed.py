"""Cross-rank gathering for contrastive training (open_clip's ``--gather-with-grad``).

Every rank encodes its own slice of the global batch; the loss needs every caption against every image,
so features are all-gathered *with gradients*: the backward of the gather sums, over ranks, the gradient
each rank computed for the features this rank owns (an all-reduce with SUM, then this rank's slice). With
DDP / FSDP averaging parameter gradients over W ranks, this reproduces the single-process gradient on the
concatenated batch exactly (docs/design.md §7; proof in ``mmgeo.training.losses.contrastive_loss``).

Token and patch tensors are right-padded to the longest sequence over all ranks before gathering (the
masks mark padding), so ranks may tokenize to different lengths. Local batch sizes must be equal
(``drop_last`` data order); a mismatch raises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmgeo.models.embedding import Embedding


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return all_gather_no_grad(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # (W·B, ...) this rank's dLoss_r/d(all features)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # Σ_r dLoss_r/d(all features)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) on each rank -> (W·B, ...) in rank order; each rank's part gets Σ over ranks of its gradient."""
    return _GatherWithGrad.apply(x)


def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) on each rank -> (W·B, ...) in rank order, no autograd (masks, indices)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def global_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], device=device, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def check_equal_batches(n: int, device: torch.device) -> None:
    sizes = all_gather_no_grad(torch.tensor([n], device=device, dtype=torch.long)).tolist()
    if len(set(sizes)) != 1:
        raise ValueError(f"local batch sizes differ across ranks {sizes}: the cross-rank contrastive loss needs "
                         "equal slices; drop the last incomplete global batch (mmgeo.data.ResumableBatchSampler)")


def _pad_tokens(x: torch.Tensor | None, length: int, token_dim: int) -> torch.Tensor | None:
    if x is None or x.shape[token_dim] == length:
        return x
    pad = [0, 0] * (x.dim() - 1 - token_dim) + [0, length - x.shape[token_dim]]
    return F.pad(x, pad)  # zeros; for the bool mask that is False = padding


def gather_embedding(e: Embedding) -> Embedding:
    """An Embedding of the local batch -> the global batch (all ranks, rank order), with gradients.

    pooled (B, d) -> (W·B, d); attn (B, H, L, d_a) / value (B, H, L, d_e) / mask (B, L) are first padded
    to the longest L over all ranks.
    """
    pooled = all_gather_with_grad(e.pooled)  # (W·B, d_g)
    if e.attn is None:
        return Embedding(pooled)
    L = global_max(e.attn.shape[2], e.attn.device)
    return Embedding(pooled,
                     all_gather_with_grad(_pad_tokens(e.attn, L, 2)),  # (W·B, H, L, d_a)
                     all_gather_with_grad(_pad_tokens(e.value, L, 2)),  # (W·B, H, L, d_e)
                     all_gather_no_grad(_pad_tokens(e.mask, L, 1)))  # (W·B, L)


def gather_ragged(e: Embedding) -> Embedding:
    """Like ``gather_embedding`` for a local batch whose size differs across ranks (e.g. caption hard
    negatives): rows are padded to the largest local count, gathered, and the padding rows dropped again.
    Padding rows carry one "real" token so that they are valid inputs until they are dropped."""
    n = len(e)
    N = global_max(n, e.pooled.device)
    valid = torch.arange(N, device=e.pooled.device) < n  # (N,)
    rows = lambda x: None if x is None else F.pad(x, [0, 0] * (x.dim() - 1) + [0, N - n])  # noqa: E731
    mask = rows(e.mask)
    if mask is not None and N > n:
        mask[n:, 0] = True
    padded = Embedding(rows(e.pooled), rows(e.attn), rows(e.value), mask)
    return gather_embedding(padded)[all_gather_no_grad(valid)]  # (Σ_r n_r, ...) in rank order


def all_reduce_any(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is True on any rank (so all ranks take the same branch)."""
    if rank_and_world()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
