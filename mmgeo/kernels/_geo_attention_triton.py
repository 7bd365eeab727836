"""Triton kernels and launchers for ``geo_attention`` (docs/design.md §4). Imported lazily: it imports triton.

FlashAttention-2 (Dao 2023) with separate head dims: q, k carry d_a, v and the output d_v, each padded
to a power of two ≥ 16 in registers only. Forward: one program per (query tile, batch·head), online
softmax over key tiles, causal programs stop at their diagonal; it writes the output and the per-row
log-sum-exp (+inf on rows with no allowed key, whose output is 0). Backward, as in the FlashAttention-2
paper, two kernels without atomics: one program per key tile accumulates dk, dv over query tiles, one
per query tile accumulates dq over key tiles, both from p = exp(s - lse) and delta = rowsum(dO ∘ O).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmgeo.kernels._common import autotune_configs, dot_precision

# (BLOCK_M, BLOCK_N, num_warps, num_stages) on GPU; the interpreter runs 16 × 16 tiles.
_FWD_CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
_BWD_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 3), (32, 32, 4, 2)]


@triton.jit
def _allowed(rows, cols, b, KPM, N, M, HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the keys each query row may attend."""
    ok = (cols[None, :] < M) & (rows[:, None] < N)
    if HAS_PAD:
        pad = tl.load(KPM + b * M + cols, mask=cols < M, other=1) != 0  # True = padding
        ok = ok & ~pad[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return ok


@triton.autotune(configs=autotune_configs(_FWD_CONFIGS, "BLOCK_M", "BLOCK_N"), key=["N", "M", "DA", "DV", "CAUSAL"])
@triton.jit
def _attn_fwd_kernel(Q, K, V, KPM, O, LSE, sq_b, sq_h, sq_n, sk_b, sk_h, sk_m, sv_b, sv_h, sv_m, so_b, so_h, so_n,
                     H, N, M, DA, DV, scale,
                     HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DV: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    mb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    da, dv = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_n + da[None, :],
                mask=(rows[:, None] < N) & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
    m = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # finite: fully masked tiles give no NaN
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    end = tl.minimum(M, (mb + 1) * BLOCK_M) if CAUSAL else M  # keys past the diagonal are never attended
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_m + da[None, :],
                    mask=(cols[:, None] < M) & (da[None, :] < DA), other=0.0)  # (BLOCK_N, BLOCK_DA)
        v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_m + dv[None, :],
                    mask=(cols[:, None] < M) & (dv[None, :] < DV), other=0.0)  # (BLOCK_N, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(_allowed(rows, cols, b, KPM, N, M, HAS_PAD, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        z = z * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    empty = z == 0.0  # no allowed key: output 0, lse +inf (so backward's exp(s - lse) is 0)
    out = acc / tl.where(empty, 1.0, z)[:, None]
    tl.store(O + b * so_b + h * so_h + rows[:, None] * so_n + dv[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < N) & (dv[None, :] < DV))
    tl.store(LSE + bh * N + rows, tl.where(empty, float("inf"), m + tl.log(tl.where(empty, 1.0, z))), mask=rows < N)


@triton.autotune(configs=autotune_configs(_BWD_CONFIGS, "BLOCK_M", "BLOCK_N"), key=["N", "M", "DA", "DV", "CAUSAL"])
@triton.jit
def _attn_bwd_kv_kernel(Q, K, V, KPM, DO, LSE, DELTA, DK, DV_,
                        sq_b, sq_h, sq_n, sk_b, sk_h, sk_m, sv_b, sv_h, sv_m, sd_b, sd_h, sd_n,
                        H, N, M, DA, DV, scale,
                        HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DV: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    nb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    da, dv = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_m + da[None, :],
                mask=(cols[:, None] < M) & (da[None, :] < DA), other=0.0)  # (BLOCK_N, BLOCK_DA)
    v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_m + dv[None, :],
                mask=(cols[:, None] < M) & (dv[None, :] < DV), other=0.0)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DA], dtype=tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    start = (nb * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0  # rows above the diagonal never see these keys
    for m0 in range(start, N, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_n + da[None, :],
                    mask=(rows[:, None] < N) & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
        do = tl.load(DO + b * sd_b + h * sd_h + rows[:, None] * sd_n + dv[None, :],
                     mask=(rows[:, None] < N) & (dv[None, :] < DV), other=0.0)  # (BLOCK_M, BLOCK_DV)
        lse = tl.load(LSE + bh * N + rows, mask=rows < N, other=float("inf"))
        delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(_allowed(rows, cols, b, KPM, N, M, HAS_PAD, CAUSAL), s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dvacc += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    # DK (B, H, M, DA), DV_ (B, H, M, DV): contiguous, input dtype
    tl.store(DK + (bh * M + cols[:, None]) * DA + da[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=(cols[:, None] < M) & (da[None, :] < DA))
    tl.store(DV_ + (bh * M + cols[:, None]) * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=(cols[:, None] < M) & (dv[None, :] < DV))


@triton.autotune(configs=autotune_configs(_BWD_CONFIGS, "BLOCK_M", "BLOCK_N"), key=["N", "M", "DA", "DV", "CAUSAL"])
@triton.jit
def _attn_bwd_q_kernel(Q, K, V, KPM, DO, LSE, DELTA, DQ,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_m, sv_b, sv_h, sv_m, sd_b, sd_h, sd_n,
                       H, N, M, DA, DV, scale,
                       HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DV: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    mb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    da, dv = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_n + da[None, :],
                mask=(rows[:, None] < N) & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
    do = tl.load(DO + b * sd_b + h * sd_h + rows[:, None] * sd_n + dv[None, :],
                 mask=(rows[:, None] < N) & (dv[None, :] < DV), other=0.0)  # (BLOCK_M, BLOCK_DV)
    lse = tl.load(LSE + bh * N + rows, mask=rows < N, other=float("inf"))
    delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_DA], dtype=tl.float32)
    end = tl.minimum(M, (mb + 1) * BLOCK_M) if CAUSAL else M
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_m + da[None, :],
                    mask=(cols[:, None] < M) & (da[None, :] < DA), other=0.0)  # (BLOCK_N, BLOCK_DA)
        v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_m + dv[None, :],
                    mask=(cols[:, None] < M) & (dv[None, :] < DV), other=0.0)  # (BLOCK_N, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(_allowed(rows, cols, b, KPM, N, M, HAS_PAD, CAUSAL), s, float("-inf"))
        p = tl.exp(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + (bh * N + rows[:, None]) * DA + da[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < N) & (da[None, :] < DA))


# ---------------------------------------------------------------------------------------------- launchers


def _strides(*xs: torch.Tensor) -> list[int]:
    return [st for x in xs for st in x.stride()[:3]]


def _common_args(q, k, v, key_padding_mask, causal: bool) -> tuple[torch.Tensor, dict]:
    kpm = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else q.new_empty(1)
    return kpm, dict(HAS_PAD=key_padding_mask is not None, CAUSAL=causal,
                     BLOCK_DA=max(16, triton.next_power_of_2(q.shape[-1])),
                     BLOCK_DV=max(16, triton.next_power_of_2(v.shape[-1])), PRECISION=dot_precision(q.dtype))


def geo_attention_fwd(q, k, v, key_padding_mask, causal: bool, scale: float):
    """Output (B, H, N, d_v) in the input dtype and the row log-sum-exp (B, H, N) fp32."""
    (B, H, N, DA), M, DV = q.shape, k.shape[2], v.shape[-1]
    o = torch.empty(B, H, N, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    kpm, c = _common_args(q, k, v, key_padding_mask, causal)
    _attn_fwd_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)](
        q, k, v, kpm, o, lse, *_strides(q, k, v, o), H, N, M, DA, DV, scale, **c)
    return o, lse


def geo_attention_bwd(do, q, k, v, key_padding_mask, causal: bool, scale: float, o, lse):
    """(dq, dk, dv) in the input dtype."""
    (B, H, N, DA), M, DV = q.shape, k.shape[2], v.shape[-1]
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()  # (B, H, N): rowsum(dO ∘ O)
    kpm, c = _common_args(q, k, v, key_padding_mask, causal)
    dq, dk, dv = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)
    args = (*_strides(q, k, v, do), H, N, M, DA, DV, scale)
    _attn_bwd_kv_kernel[lambda meta: (triton.cdiv(M, meta["BLOCK_N"]), B * H)](
        q, k, v, kpm, do, lse, delta, dk, dv, *args, **c)
    _attn_bwd_q_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)](
        q, k, v, kpm, do, lse, delta, dq, *args, **c)
    return dq, dk, dv
