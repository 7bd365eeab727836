"""pair_score: the geometric score of every (caption, image) pair (DESIGN §2, §4).

    a_tj   = softmax_j(scale · <q_t, k_j>)       over real patches j
    s(c,i) = mean_h  mean_{real t}  Σ_j a_tj · <u_t, v_j>

Shapes and dtypes:
    q (B_t, H, T, d_a)  q_mask (B_t, T) bool, True = real token (every caption needs one)
    u (B_t, H, T, d_e)  -- used as given; the model L2-normalises it first
    k (B_i, H, S, d_a)  k_mask (B_i, S) bool, True = real patch (every image needs one)
    v (B_i, H, S, d_e)
    -> (B_t, B_i) in float32 (float64 for float64 inputs).
    Any T, S, d_a, d_e (d_a may differ from d_e). Reference: fp64 / fp32 / fp16 / bf16, any device.
    Triton kernel: fp32 / fp16 / bf16 on CUDA; fp32 / fp16 on CPU under ``TRITON_INTERPRET=1``.

``pair_score_naive`` materialises the (B_t, B_i, H, T, S) weights: it is the readable definition
and the baseline for benchmarks. ``pair_score_reference`` computes the same numbers in blocks of at
most ``chunk_elements`` attention weights, with captions sorted by length so each block is trimmed
to its longest caption; under autograd, when all blocks together would pass ``chunk_elements``, each
block is recomputed in backward (activation checkpointing), so peak memory grows with the block, not
with B_t·B_i·T·S.

The fused Triton kernels (``_pair_score_triton``, imported only when used) run FlashAttention's
online softmax (Dao et al. 2022) over patch tiles with the <u, v> GEMM fused in, forward and
backward; they never write B_t·B_i·T·S weights, only two floats per (image, head, caption, token)
for backward (FlashAttention's log-sum-exp trick). ``pair_score`` picks the path with
``MMGEO_KERNELS`` = auto | triton | reference (see ``mmgeo.kernels._common``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from mmgeo.kernels._common import use_triton

DEFAULT_CHUNK_ELEMENTS = 1 << 26  # attention weights alive at once (256 MiB in fp32)


def _check(q, q_mask, u, k, k_mask, v) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (B, H, T|S, d_a); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    (bt, h, t, da), (bi, hk, s, dak) = q.shape, k.shape
    if h != hk or da != dak:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share heads H and d_a")
    if u.shape[:3] != q.shape[:3] or v.shape[:3] != k.shape[:3] or u.shape[-1] != v.shape[-1]:
        raise ValueError(f"u {tuple(u.shape)} must be (B_t, H, T, d_e) like q {tuple(q.shape)} and "
                         f"v {tuple(v.shape)} (B_i, H, S, d_e) like k {tuple(k.shape)}, with one d_e")
    if tuple(q_mask.shape) != (bt, t) or tuple(k_mask.shape) != (bi, s):
        raise ValueError(f"masks must be q_mask (B_t, T)=({bt}, {t}) and k_mask (B_i, S)=({bi}, {s}); "
                         f"got {tuple(q_mask.shape)} and {tuple(k_mask.shape)}")
    if q_mask.dtype != torch.bool or k_mask.dtype != torch.bool:
        raise TypeError(f"masks must be bool (True = real); got {q_mask.dtype} and {k_mask.dtype}")
    if not bool(q_mask.any(1).all()) or not bool(k_mask.any(1).all()):
        raise ValueError("every caption needs at least one real token and every image one real patch")


def _block(q, q_mask, u, k, k_mask, v, scale: float) -> torch.Tensor:
    """Scores of a block of captions against a block of images: (bt, bi).

    Laid out as batched GEMMs over (head, image): logits (H, bi, bt·T, S) -> softmax -> @ v gives the
    attended values (H, bi, bt·T, d_e), whose dot product with u is Σ_j a_tj <u_t, v_j>.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    (bt, H, T, _), bi = q.shape, k.shape[0]
    Q = (q.to(acc) * scale).transpose(0, 1).reshape(H, 1, bt * T, -1)  # (H, 1, bt·T, d_a)
    U = u.to(acc).transpose(0, 1).reshape(H, 1, bt * T, -1)  # (H, 1, bt·T, d_e)
    K = k.to(acc).permute(1, 0, 3, 2)  # (H, bi, d_a, S)
    V = v.to(acc).transpose(0, 1)  # (H, bi, S, d_e)
    logits = Q @ K  # (H, bi, bt·T, S)
    if not bool(k_mask.all()):
        logits = logits.masked_fill(~k_mask[None, :, None, :], float("-inf"))
    attended = logits.softmax(dim=-1) @ V  # (H, bi, bt·T, d_e): what each token finds
    per_token = (attended * U).sum(dim=-1).view(H, bi, bt, T)  # Σ_j a_tj <u_t, v_j>
    w = q_mask.to(acc) / q_mask.sum(dim=1, keepdim=True)  # (bt, T): 1/n on real tokens
    return torch.einsum("hcbt,bt->bc", per_token, w) / H  # (bt, bi)


def pair_score_naive(q, q_mask, u, k, k_mask, v, scale: float | None = None) -> torch.Tensor:
    """The definition in one block: allocates (B_t, B_i, H, T, S) weights. For tests and benchmarks."""
    _check(q, q_mask, u, k, k_mask, v)
    return _block(q, q_mask, u, k, k_mask, v, scale or q.shape[-1] ** -0.5)


def pair_score_reference(q, q_mask, u, k, k_mask, v, scale: float | None = None,
                         chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, text_block: int = 16) -> torch.Tensor:
    """Blocked plain-PyTorch pair score; at most ``chunk_elements`` attention weights alive at once.

    Captions are sorted by length and taken ``text_block`` at a time, each block trimmed to its
    longest caption; images are split so a block holds at most ``chunk_elements`` weights. Under
    autograd, blocks are recomputed in backward only when all of them together would pass the bound.
    """
    _check(q, q_mask, u, k, k_mask, v)
    scale = scale or q.shape[-1] ** -0.5
    (bt, h, _, _), (bi, _, s, _) = q.shape, k.shape
    lengths = q_mask.sum(dim=1)  # (B_t,)
    order = torch.argsort(lengths, stable=True)  # short captions first: blocks trim their padding
    sorted_len = lengths[order].tolist()
    blocks = [(a, min(a + text_block, bt)) for a in range(0, bt, text_block)]
    widths = [max(sorted_len[a:b]) for a, b in blocks]  # longest caption of each block
    total = sum((b - a) * t for (a, b), t in zip(blocks, widths)) * h * s * bi
    recompute = total > chunk_elements and torch.is_grad_enabled() and any(x.requires_grad for x in (q, u, k, v))
    rows = []
    for (a, b), t in zip(blocks, widths):
        idx = order[a:b]
        qb, mb, ub = q[idx, :, :t], q_mask[idx, :t], u[idx, :, :t]
        ci = max(1, min(bi, chunk_elements // ((b - a) * h * t * s)))  # images per block
        cols = []
        for c in range(0, bi, ci):
            args = (qb, mb, ub, k[c:c + ci], k_mask[c:c + ci], v[c:c + ci], scale)
            cols.append(checkpoint(_block, *args, use_reentrant=False) if recompute else _block(*args))
        rows.append(torch.cat(cols, dim=1))
    out = torch.cat(rows, dim=0)  # (B_t, B_i) in length order
    return out[torch.argsort(order)]


# Triton kernels and their launchers: mmgeo/kernels/_pair_score_triton.py (imports triton; loaded lazily).


class _PairScoreTriton(torch.autograd.Function):
    """Fused forward; backward recomputes the weights from the saved log-sum-exp (FlashAttention-style)."""

    @staticmethod
    def forward(ctx, q, q_mask, u, k, k_mask, v, scale):
        from mmgeo.kernels._pair_score_triton import pair_score_fwd

        store = any(ctx.needs_input_grad[i] for i in (0, 2, 3, 5))
        out, lse, o = pair_score_fwd(q, q_mask, u, k, k_mask, v, scale, store_stats=store)
        if store:
            ctx.save_for_backward(q, q_mask, u, k, k_mask, v, lse, o)
        ctx.scale = scale
        return out  # (B_t, B_i) fp32

    @staticmethod
    def backward(ctx, grad):
        from mmgeo.kernels._pair_score_triton import pair_score_bwd

        q, q_mask, u, k, k_mask, v, lse, o = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, du, dk, dv = pair_score_bwd(grad, q, q_mask, u, k, k_mask, v, lse, o, ctx.scale,
                                        text=need[0] or need[2], image=need[3] or need[5])
        return dq, None, du, dk, None, dv, None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def pair_score(q, q_mask, u, k, k_mask, v, scale: float | None = None,
               chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Public entry point: geometric score (B_t, B_i), differentiable in q, u, k and v.

    Runs the fused Triton kernel or the chunked reference as ``MMGEO_KERNELS`` says (default auto:
    Triton for CUDA tensors in fp32 / fp16 / bf16 when triton imports). ``chunk_elements`` bounds the
    reference's blocks only.
    """
    if not use_triton("pair_score", q, u, k, v):
        return pair_score_reference(q, q_mask, u, k, k_mask, v, scale=scale, chunk_elements=chunk_elements)
    _check(q, q_mask, u, k, k_mask, v)
    if len({x.device for x in (q, q_mask, u, k, k_mask, v)}) > 1:
        raise ValueError(f"all inputs must be on one device; got q, q_mask, u, k, k_mask, v on "
                         f"{[str(x.device) for x in (q, q_mask, u, k, k_mask, v)]}: move them first")
    dtype = torch.promote_types(torch.promote_types(q.dtype, u.dtype), torch.promote_types(k.dtype, v.dtype))
    q, u, k, v = (_last_dim_contiguous(x.to(dtype)) for x in (q, u, k, v))  # one dtype (mixed under autocast)
    return _PairScoreTriton.apply(q, q_mask, u, k, k_mask, v, float(scale or q.shape[-1] ** -0.5))
