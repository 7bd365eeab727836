"""geo_attention: flash-style attention whose query/key dim d_a may differ from d_v (docs/design.md §3, §4).

    out_i = Σ_j softmax_j(scale · <q_i, k_j>) v_j       over the keys j that row i may attend

Shapes and dtypes:
    q (B, H, N, d_a)  k (B, H, M, d_a)  v (B, H, M, d_v)  -> (B, H, N, d_v) in the dtype of q
    key_padding_mask (B, M) bool, True = padding (PyTorch's convention), or None
    causal: row i attends keys j <= i, aligned top-left like ``scaled_dot_product_attention(is_causal=True)``
    scale: default 1 / sqrt(d_a)
    Reference: fp64 / fp32 / fp16 / bf16, any device (computes in fp32 or better).
    Triton kernel: fp32 / fp16 / bf16 on CUDA; fp32 / fp16 on CPU under ``TRITON_INTERPRET=1``.

Fully masked rows (every key padded, or causal with its only allowed keys padded) return 0 and pass no
gradient, in both implementations; PyTorch's SDPA returns NaN there.

The Triton kernels (``_geo_attention_triton``, imported only when used) follow FlashAttention-2
(Dao 2023): online softmax forward saving the row log-sum-exp, and a backward that recomputes the
weights. ``geo_attention`` picks the path with ``MMGEO_KERNELS`` = auto | triton | reference.

Self-check (``auto`` only): the first call per class — dtype, device and the compiled forward variant
(d_a, d_v padded to powers of two as the kernel pads them; causal; padding mask or not) — runs the Triton
forward on 2 × min(H, 2) heads of the call's N, M (each at most 1024), d_a, d_v next to
``geo_attention_reference``; on a mismatch or an exception it warns once and that class runs the
reference from then on. ``MMGEO_KERNELS=triton`` skips the check: failures raise.
"""

from __future__ import annotations

import torch

from mmgeo.kernels._common import MAX_GRID_Y, kernel_backend, next_power_of_2, self_checked, use_triton
from mmgeo.kernels.scale import attention_scale


def _check(q, k, v, key_padding_mask) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, N|M, d); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}: reshape to (batch, heads, length, dim)")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share (B, H) and d_a")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must be (B, H, M, d_v) with (B, H, M) of k {tuple(k.shape)}")
    if key_padding_mask is not None:
        b, m = k.shape[0], k.shape[2]
        if tuple(key_padding_mask.shape) != (b, m):
            raise ValueError(f"key_padding_mask must be (B, M)=({b}, {m}); got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padding); got {key_padding_mask.dtype}")


def geo_attention_reference(q, k, v, key_padding_mask=None, causal: bool = False,
                            scale: float | None = None) -> torch.Tensor:
    """Plain-PyTorch attention with the (B, H, N, M) weights in memory; fully masked rows give 0."""
    _check(q, k, v, key_padding_mask)
    scale = attention_scale(q.shape[-1], scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    n, m = q.shape[2], k.shape[2]
    logits = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale  # (B, H, N, M)
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()  # j <= i, top-left aligned
    allowed = allowed[None, None]  # (1, 1, N, M)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]  # (B, 1, N, M)
    live = allowed.any(dim=-1, keepdim=True)  # rows with at least one key
    logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(~live, 0.0)  # no NaN on empty rows
    weights = logits.softmax(dim=-1) * live
    return (weights @ v.to(acc)).to(q.dtype)  # (B, H, N, d_v)


# Triton kernels and their launchers: mmgeo/kernels/_geo_attention_triton.py (imports triton; loaded lazily).


class _GeoAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 forward saving the log-sum-exp; backward recomputes the weights tile by tile."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, causal, scale):
        from mmgeo.kernels._geo_attention_triton import geo_attention_fwd

        o, lse = geo_attention_fwd(q, k, v, key_padding_mask, causal, scale)
        ctx.save_for_backward(q, k, v, key_padding_mask, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        from mmgeo.kernels._geo_attention_triton import geo_attention_bwd

        q, k, v, key_padding_mask, o, lse = ctx.saved_tensors
        dq, dk, dv = geo_attention_bwd(do, q, k, v, key_padding_mask, ctx.causal, ctx.scale, o, lse)
        return dq, dk, dv, None, None, None


def _self_check(H: int, N: int, M: int, d_a: int, d_v: int, padded: bool, causal: bool, dtype, device,
                scale: float) -> bool:
    """``MMGEO_KERNELS=auto``: whether the Triton forward passed its check for this class (``_common.self_checked``)."""
    variant = (max(16, next_power_of_2(d_a)), max(16, next_power_of_2(d_v)), causal, padded)

    def probe():
        from mmgeo.kernels._geo_attention_triton import geo_attention_fwd

        g, h, n, m = torch.Generator().manual_seed(0), min(H, 2), min(N, 1024), min(M, 1024)
        mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
        q, k, v = mk(2, h, n, d_a), mk(2, h, m, d_a), mk(2, h, m, d_v)
        kpm = None
        if padded:
            kpm = torch.rand(2, m, generator=g) < 0.25  # (2, m) True = padding, anywhere
            kpm[:, 0] = False
            kpm = kpm.to(device)
        got = geo_attention_fwd(q, k, v, kpm, causal, scale)[0]  # (2, h, n, d_v)
        return got, geo_attention_reference(q, k, v, kpm, causal=causal, scale=scale)

    return self_checked("geo_attention", dtype, device, variant, probe)


def geo_attention(q, k, v, key_padding_mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Public entry point: attention (B, H, N, d_v), differentiable in q, k and v.

    Runs the Triton kernel or the reference as ``MMGEO_KERNELS`` says (default auto: Triton for CUDA
    tensors in fp32 / fp16 / bf16 when triton imports, once its self-check passed).
    """
    _check(q, k, v, key_padding_mask)
    if not use_triton("geo_attention", q, k, v):
        return geo_attention_reference(q, k, v, key_padding_mask, causal=causal, scale=scale)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)  # e.g. mixed under autocast
    scale = attention_scale(q.shape[-1], scale)
    if kernel_backend() == "auto" and not _self_check(q.shape[1], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1],
                                                      key_padding_mask is not None, bool(causal), dtype, q.device,
                                                      scale):
        return geo_attention_reference(q, k, v, key_padding_mask, causal=causal, scale=scale)
    q, k, v = (x.to(dtype) if x.stride(-1) == 1 else x.to(dtype).contiguous() for x in (q, k, v))
    per_launch = max(1, MAX_GRID_Y // q.shape[1])  # the kernels put B·H on a CUDA grid axis of at most 65,535
    if q.shape[0] <= per_launch:
        return _GeoAttentionTriton.apply(q, k, v, key_padding_mask, bool(causal), scale)
    parts = []
    for b in range(0, q.shape[0], per_launch):
        part = slice(b, b + per_launch)
        mask = None if key_padding_mask is None else key_padding_mask[part]
        parts.append(_GeoAttentionTriton.apply(q[part], k[part], v[part], mask, bool(causal), scale))
    return torch.cat(parts)
