"""Triton kernels and launchers for ``pair_score`` (docs/design.md §4). Imported lazily: it imports triton.

Rows. A program owns BLOCK_M query rows = BC captions × TT token slots (TT = next power of two of T,
capped at BLOCK_M; longer captions take several token chunks), so one k/v tile loaded from an image
is used against BLOCK_M tokens, as the reference's batched GEMM does with its bt·T rows.

Forward (one program per caption block × image, heads and token chunks looped inside): FlashAttention's
online softmax (Dao et al. 2022) over S tiles, with the second GEMM replaced by the <u, v> product
that is reduced on the fly:  m_t = max_j l_tj,  Z_t = Σ_j e^{l_tj - m_t},  A_t = Σ_j e^{l_tj - m_t} <u_t, v_j>,
o_t = A_t / Z_t. Scores are reduced per caption in registers; nothing of size T×S reaches memory.
With autograd on, it also writes lse_t = m_t + log Z_t and o_t per (image, head, caption, token),
FlashAttention's LSE trick: B_i·H·B_t·T floats each.

Backward (two kernels, no atomics, deterministic), with g_t = dL/ds(c,i) · w_t / H and p recomputed
from lse:
    caption side  (program per row block × head × image split, images looped inside):
        du_t += Σ_j g_t p_tj v_j,   dq_t += scale Σ_j g_t p_tj (sim_tj - o_t) k_j
    image side    (program per patch tile × image × head, caption row blocks looped inside):
        dv_j += Σ_t g_t p_tj u_t,   dk_j += scale Σ_t g_t p_tj (sim_tj - o_t) q_t
Image splits of the caption-side kernel write partial sums to their own slice, summed afterwards.
The upstream gradient is divided by its max |.| before entering the kernels (and multiplied back
after), so that g·p stays in [-1, 1] and does not underflow when cast to fp16 for the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmgeo.kernels._common import autotune_configs, dot_precision, num_sms

# (BLOCK_M, BLOCK_S, num_warps, num_stages) on GPU; the interpreter runs 16 × 16 tiles.
_FWD_CONFIGS = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3)]
_BWD_Q_CONFIGS = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 2)]
_BWD_K_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)]


@triton.jit
def _rows(rb, n_tc, B_t, T, T_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block rb -> caption and token of each of its BLOCK_M rows, and which rows are real slots."""
    BC: tl.constexpr = (BLOCK_M + T_P - 1) // T_P  # captions per block (1 when T_P > BLOCK_M)
    TT: tl.constexpr = BLOCK_M // BC  # token slots per caption per chunk
    r = tl.arange(0, BLOCK_M)
    cap = (rb // n_tc) * BC + r // TT  # (BLOCK_M,)
    tok = (rb % n_tc) * TT + r % TT  # (BLOCK_M,)
    return cap, tok, (cap < B_t) & (tok < T)


@triton.autotune(configs=autotune_configs(_FWD_CONFIGS, "BLOCK_M", "BLOCK_S"), key=["T", "S", "DA", "DE"])
@triton.jit
def _pair_fwd_kernel(Q, U, K, V, KM, W, OUT, LSE, O,
                     sq_b, sq_h, sq_t, su_b, su_h, su_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                     B_t, B_i, H, T, S, DA, DE, scale,
                     T_P: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DE: tl.constexpr, STORE_STATS: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    BC: tl.constexpr = (BLOCK_M + T_P - 1) // T_P
    TT: tl.constexpr = BLOCK_M // BC
    cb = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64)
    n_tc = tl.cdiv(T, TT)
    da, de, sj = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DE), tl.arange(0, BLOCK_S)
    onehot = (tl.arange(0, BLOCK_M) // TT)[:, None] == tl.arange(0, BC)[None, :]  # (BLOCK_M, BC): row -> caption
    score = tl.zeros([BC], dtype=tl.float32)
    for h in range(H):
        for tc in range(n_tc):
            cap, tok, ok = _rows(cb * n_tc + tc, n_tc, B_t, T, T_P, BLOCK_M)
            w = tl.load(W + cap * T + tok, mask=ok, other=0.0)  # (BLOCK_M,) 1/n on real tokens
            q = tl.load(Q + cap[:, None] * sq_b + h * sq_h + tok[:, None] * sq_t + da[None, :],
                        mask=ok[:, None] & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
            u = tl.load(U + cap[:, None] * su_b + h * su_h + tok[:, None] * su_t + de[None, :],
                        mask=ok[:, None] & (de[None, :] < DE), other=0.0)  # (BLOCK_M, BLOCK_DE)
            m = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # finite: a fully masked tile gives no NaN
            z = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s = s0 + sj
                real = tl.load(KM + i * S + s, mask=s < S, other=0) != 0  # (BLOCK_S,)
                k = tl.load(K + i * sk_b + h * sk_h + s[:, None] * sk_s + da[None, :],
                            mask=(s[:, None] < S) & (da[None, :] < DA), other=0.0)  # (BLOCK_S, BLOCK_DA)
                v = tl.load(V + i * sv_b + h * sv_h + s[:, None] * sv_s + de[None, :],
                            mask=(s[:, None] < S) & (de[None, :] < DE), other=0.0)  # (BLOCK_S, BLOCK_DE)
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_S)
                logits = tl.where(real[None, :], logits, float("-inf"))
                sim = tl.dot(u, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_S) <u_t, v_j>
                m_new = tl.maximum(m, tl.max(logits, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(logits - m_new[:, None])
                z = z * alpha + tl.sum(p, axis=1)
                acc = acc * alpha + tl.sum(p * sim, axis=1)
                m = m_new
            o = acc / z  # (BLOCK_M,) Σ_j a_tj <u_t, v_j>; z > 0 as every image has a real patch
            if STORE_STATS:
                stat = ((i * H + h) * B_t + cap) * T + tok
                tl.store(LSE + stat, m + tl.log(z), mask=ok)
                tl.store(O + stat, o, mask=ok)
            score += tl.sum(tl.where(onehot, (w * o)[:, None], 0.0), axis=0)  # (BC,)
    c = cb * BC + tl.arange(0, BC)
    tl.store(OUT + c * B_i + i, score / H, mask=c < B_t)


@triton.autotune(configs=autotune_configs(_BWD_Q_CONFIGS, "BLOCK_M", "BLOCK_S"), key=["T", "S", "DA", "DE"])
@triton.jit
def _pair_bwd_q_kernel(Q, U, K, V, KM, W, G, LSE, O, DQ, DU,
                       sq_b, sq_h, sq_t, su_b, su_h, su_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                       B_t, B_i, H, T, S, DA, DE, scale, imgs_per_split,
                       T_P: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DE: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    BC: tl.constexpr = (BLOCK_M + T_P - 1) // T_P
    TT: tl.constexpr = BLOCK_M // BC
    rb, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cap, tok, ok = _rows(rb, tl.cdiv(T, TT), B_t, T, T_P, BLOCK_M)
    da, de, sj = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DE), tl.arange(0, BLOCK_S)
    w = tl.load(W + cap * T + tok, mask=ok, other=0.0)  # (BLOCK_M,)
    q = tl.load(Q + cap[:, None] * sq_b + h * sq_h + tok[:, None] * sq_t + da[None, :],
                mask=ok[:, None] & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
    u = tl.load(U + cap[:, None] * su_b + h * su_h + tok[:, None] * su_t + de[None, :],
                mask=ok[:, None] & (de[None, :] < DE), other=0.0)  # (BLOCK_M, BLOCK_DE)
    dq = tl.zeros([BLOCK_M, BLOCK_DA], dtype=tl.float32)
    du = tl.zeros([BLOCK_M, BLOCK_DE], dtype=tl.float32)
    i_end = tl.minimum((sp + 1) * imgs_per_split, B_i)
    for img in range(sp * imgs_per_split, i_end):
        i = tl.cast(img, tl.int64)
        g = tl.load(G + cap * B_i + i, mask=ok, other=0.0) * w  # (BLOCK_M,) in [-1, 1]
        stat = ((i * H + h) * B_t + cap) * T + tok
        lse = tl.load(LSE + stat, mask=ok, other=0.0)
        o = tl.load(O + stat, mask=ok, other=0.0)
        for s0 in range(0, S, BLOCK_S):
            s = s0 + sj
            real = tl.load(KM + i * S + s, mask=s < S, other=0) != 0
            k = tl.load(K + i * sk_b + h * sk_h + s[:, None] * sk_s + da[None, :],
                        mask=(s[:, None] < S) & (da[None, :] < DA), other=0.0)  # (BLOCK_S, BLOCK_DA)
            v = tl.load(V + i * sv_b + h * sv_h + s[:, None] * sv_s + de[None, :],
                        mask=(s[:, None] < S) & (de[None, :] < DE), other=0.0)  # (BLOCK_S, BLOCK_DE)
            logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            logits = tl.where(real[None, :], logits, float("-inf"))
            gp = g[:, None] * tl.exp(logits - lse[:, None])  # (BLOCK_M, BLOCK_S) g_t p_tj
            sim = tl.dot(u, tl.trans(v), input_precision=PRECISION)
            du += tl.dot(gp.to(v.dtype), v, input_precision=PRECISION)
            dq += tl.dot((gp * (sim - o[:, None])).to(k.dtype), k, input_precision=PRECISION)
    # partial sums of split sp: DQ (splits, B_t, H, T, DA), DU (splits, B_t, H, T, DE), contiguous fp32
    row = ((sp * B_t + cap) * H + h) * T + tok  # (BLOCK_M,)
    tl.store(DQ + row[:, None] * DA + da[None, :], dq * scale, mask=ok[:, None] & (da[None, :] < DA))
    tl.store(DU + row[:, None] * DE + de[None, :], du, mask=ok[:, None] & (de[None, :] < DE))


@triton.autotune(configs=autotune_configs(_BWD_K_CONFIGS, "BLOCK_M", "BLOCK_S"), key=["T", "S", "DA", "DE"])
@triton.jit
def _pair_bwd_k_kernel(Q, U, K, V, KM, W, G, LSE, O, DK, DV,
                       sq_b, sq_h, sq_t, su_b, su_h, su_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                       B_t, B_i, H, T, S, DA, DE, scale,
                       T_P: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DE: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    BC: tl.constexpr = (BLOCK_M + T_P - 1) // T_P
    TT: tl.constexpr = BLOCK_M // BC
    sb, h = tl.program_id(0), tl.program_id(2)
    i = tl.program_id(1).to(tl.int64)
    da, de = tl.arange(0, BLOCK_DA), tl.arange(0, BLOCK_DE)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    real = tl.load(KM + i * S + s, mask=s < S, other=0) != 0
    k = tl.load(K + i * sk_b + h * sk_h + s[:, None] * sk_s + da[None, :],
                mask=(s[:, None] < S) & (da[None, :] < DA), other=0.0)  # (BLOCK_S, BLOCK_DA)
    v = tl.load(V + i * sv_b + h * sv_h + s[:, None] * sv_s + de[None, :],
                mask=(s[:, None] < S) & (de[None, :] < DE), other=0.0)  # (BLOCK_S, BLOCK_DE)
    dk = tl.zeros([BLOCK_S, BLOCK_DA], dtype=tl.float32)
    dv = tl.zeros([BLOCK_S, BLOCK_DE], dtype=tl.float32)
    n_tc = tl.cdiv(T, TT)
    for rb in range(tl.cdiv(B_t, BC) * n_tc):
        cap, tok, ok = _rows(rb, n_tc, B_t, T, T_P, BLOCK_M)
        g = tl.load(G + cap * B_i + i, mask=ok, other=0.0) * tl.load(W + cap * T + tok, mask=ok, other=0.0)
        stat = ((i * H + h) * B_t + cap) * T + tok
        lse = tl.load(LSE + stat, mask=ok, other=0.0)
        o = tl.load(O + stat, mask=ok, other=0.0)
        q = tl.load(Q + cap[:, None] * sq_b + h * sq_h + tok[:, None] * sq_t + da[None, :],
                    mask=ok[:, None] & (da[None, :] < DA), other=0.0)  # (BLOCK_M, BLOCK_DA)
        u = tl.load(U + cap[:, None] * su_b + h * su_h + tok[:, None] * su_t + de[None, :],
                    mask=ok[:, None] & (de[None, :] < DE), other=0.0)  # (BLOCK_M, BLOCK_DE)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_S)
        logits = tl.where(real[None, :], logits, float("-inf"))
        gp = g[:, None] * tl.exp(logits - lse[:, None])  # g_t p_tj; 0 on padded tokens (g = 0)
        sim = tl.dot(u, tl.trans(v), input_precision=PRECISION)
        dv += tl.dot(tl.trans(gp).to(u.dtype), u, input_precision=PRECISION)
        dk += tl.dot(tl.trans(gp * (sim - o[:, None])).to(q.dtype), q, input_precision=PRECISION)
    row = ((i * H + h) * S + s)  # DK (B_i, H, S, DA), DV (B_i, H, S, DE), contiguous fp32
    tl.store(DK + row[:, None] * DA + da[None, :], dk * scale, mask=(s[:, None] < S) & (da[None, :] < DA))
    tl.store(DV + row[:, None] * DE + de[None, :], dv, mask=(s[:, None] < S) & (de[None, :] < DE))


# ---------------------------------------------------------------------------------------------- launchers


def _strides(*xs: torch.Tensor) -> list[int]:
    return [st for x in xs for st in x.stride()[:3]]


def _consts(q, u, T: int) -> dict:
    return dict(T_P=triton.next_power_of_2(T), BLOCK_DA=max(16, triton.next_power_of_2(q.shape[-1])),
                BLOCK_DE=max(16, triton.next_power_of_2(u.shape[-1])), PRECISION=dot_precision(q.dtype))


def _row_blocks(B_t: int, T: int, block_m: int) -> int:
    """Number of BLOCK_M row blocks covering B_t captions of T tokens (as _rows lays them out)."""
    t_p = triton.next_power_of_2(T)
    bc = (block_m + t_p - 1) // t_p
    return triton.cdiv(B_t, bc) * triton.cdiv(T, block_m // bc)


def pair_score_fwd(q, q_mask, u, k, k_mask, v, scale: float, store_stats: bool):
    """Scores (B_t, B_i) fp32, and (lse, o) of shape (B_i, H, B_t, T) fp32 when ``store_stats``."""
    (B_t, H, T, DA), (B_i, _, S, _), DE = q.shape, k.shape, u.shape[-1]
    w = (q_mask.float() / q_mask.sum(1, keepdim=True)).contiguous()  # (B_t, T) 1/n on real tokens
    km = k_mask.to(torch.int8).contiguous()  # (B_i, S)
    out = torch.empty(B_t, B_i, device=q.device, dtype=torch.float32)
    shape = (B_i, H, B_t, T) if store_stats else (1,)
    lse, o = (torch.empty(shape, device=q.device, dtype=torch.float32) for _ in range(2))
    c = _consts(q, u, T)

    def grid(meta):
        return (triton.cdiv(B_t, (meta["BLOCK_M"] + c["T_P"] - 1) // c["T_P"]), B_i)

    _pair_fwd_kernel[grid](q, u, k, v, km, w, out, lse, o, *_strides(q, u, k, v),
                           B_t, B_i, H, T, S, DA, DE, scale, STORE_STATS=store_stats, **c)
    return out, lse, o


def pair_score_bwd(grad, q, q_mask, u, k, k_mask, v, lse, o, scale: float, splits: int | None = None,
                   text: bool = True, image: bool = True):
    """Gradients (dq, du, dk, dv) in the input dtype, given dL/ds ``grad`` (B_t, B_i); the caption side
    (dq, du) is None unless ``text``, the image side (dk, dv) None unless ``image``."""
    (B_t, H, T, DA), (B_i, _, S, _), DE = q.shape, k.shape, u.shape[-1]
    w = (q_mask.float() / q_mask.sum(1, keepdim=True)).contiguous()  # (B_t, T)
    km = k_mask.to(torch.int8).contiguous()
    norm = grad.abs().max().clamp_min(1e-30)  # g / norm in [-1, 1]: no fp16 underflow in g·p
    g = (grad.float() / norm).contiguous()  # (B_t, B_i)
    c = _consts(q, u, T)
    dq = du = dk = dv = None
    if text:
        if splits is None:  # enough programs to fill the GPU: ~4 per SM
            splits = max(1, min(B_i, triton.cdiv(4 * num_sms(q.device), _row_blocks(B_t, T, 64) * H)))
        ips = triton.cdiv(B_i, splits)
        splits = triton.cdiv(B_i, ips)
        dq = torch.empty(splits, B_t, H, T, DA, device=q.device, dtype=torch.float32)
        du = torch.empty(splits, B_t, H, T, DE, device=q.device, dtype=torch.float32)
        _pair_bwd_q_kernel[lambda meta: (_row_blocks(B_t, T, meta["BLOCK_M"]), H, splits)](
            q, u, k, v, km, w, g, lse, o, dq, du, *_strides(q, u, k, v), B_t, B_i, H, T, S, DA, DE, scale, ips, **c)
        dq, du = (x.sum(0) if splits > 1 else x[0] for x in (dq, du))
    if image:
        dk = torch.empty(B_i, H, S, DA, device=q.device, dtype=torch.float32)
        dv = torch.empty(B_i, H, S, DE, device=q.device, dtype=torch.float32)
        _pair_bwd_k_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_S"]), B_i, H)](
            q, u, k, v, km, w, g, lse, o, dk, dv, *_strides(q, u, k, v), B_t, B_i, H, T, S, DA, DE, scale, **c)
    f = norm / H
    return tuple(None if x is None else (x * f).to(ref.dtype) for x, ref in ((dq, q), (du, u), (dk, k), (dv, v)))
