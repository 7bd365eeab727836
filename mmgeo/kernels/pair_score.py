"""pair_score: the geometric score of every (caption, image) pair (docs/design.md §2, §4).

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
and the baseline for benchmarks. ``pair_score_reference`` computes the same numbers with padding
tokens dropped, as two GEMMs per head over the patches of a block of images (``candidate_scores``,
also the re-rank of a query's candidates), in blocks of at most ``BLOCK_ELEMENTS`` attention weights
(cache-sized); under autograd, when all blocks together would pass ``chunk_elements``, each block is
recomputed in backward (activation checkpointing), so peak memory grows with the block, not with
B_t·B_i·T·S.

The fused Triton kernels (``_pair_score_triton``, imported only when used) run FlashAttention's
online softmax (Dao et al. 2022) over patch tiles with the <u, v> GEMM fused in, forward and
backward; they never write B_t·B_i·T·S weights, only two floats per (image, head, caption, token)
for backward (FlashAttention's log-sum-exp trick). ``pair_score`` picks the path with
``MMGEO_KERNELS`` = auto | triton | reference (see ``mmgeo.kernels._common``).

Self-check (``auto`` only): the first call per class — dtype, device and the compiled forward variant
(T, d_a, d_e padded to powers of two as the kernel pads them; whether backward statistics are stored) —
runs the Triton forward on 3 captions × 2 images of the call's H, T, S (at most 512), d_a, d_e next to
``pair_score_reference``; on a mismatch or an exception it warns once and that class runs the reference
from then on. ``MMGEO_KERNELS=triton`` skips the check: failures raise.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from mmgeo.kernels._common import MAX_GRID_Y, kernel_backend, next_power_of_2, self_checked, use_triton
from mmgeo.kernels.scale import attention_scale

DEFAULT_CHUNK_ELEMENTS = 1 << 26  # attention weights alive at once under autograd (256 MiB in fp32)
BLOCK_ELEMENTS = 1 << 20  # attention weights per block: small enough to stay in a CPU core's cache
TOKENS_PER_BLOCK = 512  # rows of each block's GEMMs
SAFE_LOGIT = 80.0  # |base-2 logit| below this: 2^logit cannot overflow (fp32 max ≈ 2^128), no max shift needed
LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x·log2 e); q is scaled by it once, so the softmax runs on exp2
LN2 = 0.6931471805599453  # ln 2 = d(2^x)/dx / 2^x


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
    return _block(q, q_mask, u, k, k_mask, v, attention_scale(q.shape[-1], scale))


def _block_weights(q, u, k, v, mask, shift: bool):
    """Unnormalised weights 2^(<q_t, k_j> - m) and <u_t, v_j> of a block, both (H, n, b, S), and the
    per-(token, image) max m (H, n, b) when ``shift`` (else None). q (H, n, d_a) scaled by scale·log2(e), so
    2^<q, k> = e^(scale·<q, k>) (torch's exp2 is several times faster than its exp on CPU), u (H, n, d_e),
    k (H, b, S, d_a), v (H, b, S, d_e), mask (b, S) or None."""
    H, n, _ = q.shape
    b, S = k.shape[1], k.shape[2]
    logits = torch.bmm(q, k.reshape(H, b * S, -1).transpose(1, 2)).view(H, n, b, S)  # (H, n, b, S)
    if mask is not None:
        logits.masked_fill_(~mask[None, None], float("-inf"))
    row_max = logits.amax(-1, keepdim=True) if shift else None  # (H, n, b, 1)
    if shift:
        logits -= row_max
    weights = logits.exp2_()  # in place: bmm keeps no output for backward
    uv = torch.bmm(u, v.reshape(H, b * S, -1).transpose(1, 2)).view(H, n, b, S)  # <u_t, v_j>
    return weights, uv, None if row_max is None else row_max[..., 0]


def _block_scores(q, u, k, v, mask, shift: bool):
    """Σ_j a_tj <u_t, v_j> of a block without autograd: (H, n, b), and the per-(token, image) max logit."""
    weights, uv, row_max = _block_weights(q, u, k, v, mask, shift)
    total = weights.sum(-1)  # (H, n, b)
    return weights.mul_(uv).sum(-1).div_(total), row_max  # in place: an elementwise pass, not a batched GEMV


class _BlockScore(torch.autograd.Function):
    """Σ_j a_tj <u_t, v_j> per head for a block: (H, n, b), with a hand-written backward.

    q (H, n, d_a) scaled (by scale·log2(e): base-2 logits), u (H, n, d_e), k (H, b, S, d_a), v (H, b, S, d_e),
    mask (b, S) or None.
    Backward (s = Σ_j a_j uv_j):  d uv_j = g·a_j,  d logit_j = ln2·g·a_j·(uv_j − s); then four GEMMs.
    Autograd through the forward's ops would cost about twice as much (expanded reductions).
    """

    @staticmethod
    def forward(ctx, q, u, k, v, mask, shift: bool):
        if not any(ctx.needs_input_grad[:4]):
            return _block_scores(q, u, k, v, mask, shift)[0]
        weights, uv, _ = _block_weights(q, u, k, v, mask, shift)
        attn = weights.div_(weights.sum(-1, keepdim=True))  # a_tj
        out = (attn * uv).sum(-1)  # (H, n, b)
        H, b, S = k.shape[:3]
        ctx.save_for_backward(q, u, k.reshape(H, b * S, -1), v.reshape(H, b * S, -1), attn, uv, out)
        ctx.shape = (b, S)
        return out

    @staticmethod
    def backward(ctx, g):
        q, u, k2, v2, attn, uv, out = ctx.saved_tensors
        H, n, _ = q.shape
        d_uv = attn * g[..., None]  # (H, n, b, S)
        d_logits = uv.sub_(out[..., None]).mul_(d_uv).view(H, n, -1)  # in place: uv is not needed again
        d_uv = d_uv.view(H, n, -1)
        dq, dk = torch.bmm(d_logits, k2).mul_(LN2), torch.bmm(d_logits.transpose(1, 2), q).mul_(LN2)  # base-2 logits
        du, dv = torch.bmm(d_uv, v2), torch.bmm(d_uv.transpose(1, 2), u)
        b, S = ctx.shape
        return dq, du, dk.view(H, b, S, -1), dv.view(H, b, S, -1), None, None


def candidate_scores(q, u, keys, values, mask, scale: float | None = None, block_elements: int = BLOCK_ELEMENTS,
                     recompute: bool = False) -> torch.Tensor:
    """Σ_j a_tj <u_t, v_j> of N packed tokens against B_i images, summed over heads: (N, B_i).

    q (H, N, d_a), u (H, N, d_e): real tokens only (any mix of captions), in the accumulation dtype;
    keys (H, B_i, S, d_a), values (H, B_i, S, d_e), mask (B_i, S) bool (True = real patch).
    Each head is two GEMMs over all patches of a block of images at once (<q_t, k_j> and <u_t, v_j>);
    blocks hold at most ``block_elements`` attention weights. The softmax runs in base 2 (q scaled by
    scale·log2(e) once, weights 2^logit: the same numbers, torch's exp2 being the fast one on CPU) and skips its
    max shift when |<q, k>|·scale·log2(e) is bounded below ``SAFE_LOGIT`` (Cauchy–Schwarz on the norms).
    ``recompute``: each block is recomputed in backward (activation checkpointing).
    """
    H, N, _ = q.shape
    B_i, S = mask.shape
    q = q * (attention_scale(q.shape[-1], scale) * LOG2E)  # base-2 logits
    shift = bool(q.norm(dim=-1).amax() * keys.norm(dim=-1).amax() >= SAFE_LOGIT) if N and B_i else False
    masked = not bool(mask.all())
    ct = max(1, min(N, TOKENS_PER_BLOCK, block_elements // (H * S)))  # tokens per block: a GEMM's rows
    ci = max(1, min(B_i, block_elements // (H * S * ct)))  # images per block

    def block(qb, ub, kb, vb, mb):
        return _BlockScore.apply(qb, ub, kb, vb, mb if masked else None, shift).sum(0)  # (n, b)

    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, u, keys, values))
    with torch.autocast(q.device.type, enabled=False):  # in the inputs' dtype (fp32 accumulation) under autocast
        if not grad and shift and B_i > ci:
            return _scores_folded_shift(q, u, keys, values, mask if masked else None, ct, ci)
        rows = []
        for a in range(0, N, ct):
            cols = []
            for c in range(0, B_i, ci):
                args = (q[:, a:a + ct], u[:, a:a + ct], keys[:, c:c + ci], values[:, c:c + ci], mask[c:c + ci])
                cols.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
            rows.append(torch.cat(cols, dim=1))
    return torch.cat(rows, dim=0) if rows else q.new_zeros(0, B_i)


def attention_logits(q, k, scale: float | None = None) -> torch.Tensor:
    """scale · <q_t, k_j> in fp32 (or wider): q (..., T, d_a), k (..., S, d_a) -> (..., T, S)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return (q.to(acc) @ k.to(acc).transpose(-1, -2)) * attention_scale(q.shape[-1], scale)


def attention_weights(q, k, k_mask=None, scale: float | None = None) -> torch.Tensor:
    """a_tj = softmax_j(scale · <q_t, k_j>) over real patches: the weights the score averages <u_t, v_j>
    with, for heatmaps and diagnostics. q (..., T, d_a), k (..., S, d_a) with matching leading dims,
    k_mask (..., S) bool or None -> (..., T, S) in fp32 (or wider)."""
    logits = attention_logits(q, k, scale)  # (..., T, S)
    if k_mask is not None:
        logits = logits.masked_fill(~k_mask.unsqueeze(-2), float("-inf"))
    return logits.softmax(dim=-1)


def _scores_folded_shift(q, u, keys, values, mask, ct: int, ci: int) -> torch.Tensor:
    """``candidate_scores`` without autograd when the logits may pass ``SAFE_LOGIT``: (N, B_i).

    The softmax's shift is folded into the logit GEMM: for each block of tokens the first block of
    images is scored with the exact per-row max, whose max over those images m_t becomes the shift of
    every later block (a column -m_t on q against a column of ones on k), so no block needs the max
    pass and the subtraction. A later block where 2^(<q, k> - m_t) overflows or vanishes entirely is
    redone with its exact max. q is already scaled (base-2 logits); mask (B_i, S) or None.
    """
    H, N, _ = q.shape
    B_i, S = keys.shape[1], keys.shape[2]
    keys_aug = torch.cat([keys, keys.new_ones(H, B_i, S, 1)], dim=-1)  # (H, B_i, S, d_a + 1)
    out = q.new_empty(N, B_i)
    for a in range(0, N, ct):
        qb, ub = q[:, a:a + ct], u[:, a:a + ct]
        n = qb.shape[1]
        q_aug = None
        for c in range(0, B_i, ci):
            mb = None if mask is None else mask[c:c + ci]
            part = None
            if q_aug is not None:  # shift folded in: logits - m_t straight out of the GEMM
                part = _block_scores(q_aug, ub, keys_aug[:, c:c + ci], values[:, c:c + ci], mb, False)[0]
                if not bool(torch.isfinite(part).all()):  # overflow, or every weight of a row underflowed
                    part = None
            if part is None:
                part, row_max = _block_scores(qb, ub, keys[:, c:c + ci], values[:, c:c + ci], mb, True)
                if q_aug is None:
                    shift = row_max.amax(dim=-1)  # (H, n): max logit of each token over this block's images
                    q_aug = torch.cat([qb, -shift[..., None]], dim=-1)  # (H, n, d_a + 1)
            out[a:a + n, c:c + part.shape[-1]] = part.sum(0)
    return out


def pair_score_reference(q, q_mask, u, k, k_mask, v, scale: float | None = None,
                         chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                         block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Blocked plain-PyTorch pair score: real tokens packed, two GEMMs per head and block of images.

    Padding tokens are dropped before any arithmetic (captions of a batch differ in length), and the
    per-token sums are averaged per caption at the end. Blocks hold at most ``min(chunk_elements,
    block_elements)`` attention weights; under autograd, when all blocks together would pass
    ``chunk_elements``, each block is recomputed in backward, so peak memory grows with the block,
    not with B_t·B_i·T·S.
    """
    _check(q, q_mask, u, k, k_mask, v)
    scale = attention_scale(q.shape[-1], scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    (bt, h, _, _), (bi, _, s, _) = q.shape, k.shape
    owner, pos = q_mask.nonzero(as_tuple=True)  # (N,) caption and position of every real token
    Q = q[owner, :, pos].to(acc).transpose(0, 1)  # (H, N, d_a)
    U = u[owner, :, pos].to(acc).transpose(0, 1)  # (H, N, d_e)
    keys = k.to(acc).transpose(0, 1).contiguous()  # (H, B_i, S, d_a)
    values = v.to(acc).transpose(0, 1).contiguous()  # (H, B_i, S, d_e)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, u, k, v))
    recompute = grad and len(owner) * bi * h * s > chunk_elements
    per_token = candidate_scores(Q, U, keys, values, k_mask, scale, min(chunk_elements, block_elements), recompute)
    w = (1.0 / (q_mask.sum(dim=1).to(acc) * h))[owner]  # (N,) 1/(n_c·H): mean over tokens and heads
    return torch.zeros(bt, bi, dtype=acc, device=q.device).index_add(0, owner, per_token * w[:, None])


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


def _self_check(H: int, T: int, S: int, d_a: int, d_e: int, dtype, device, scale: float, stats: bool) -> bool:
    """``MMGEO_KERNELS=auto``: whether the Triton forward passed its check for this class (``_common.self_checked``)."""
    variant = (next_power_of_2(T), max(16, next_power_of_2(d_a)), max(16, next_power_of_2(d_e)), stats)

    def probe():
        from mmgeo.kernels._pair_score_triton import pair_score_fwd

        g, s = torch.Generator().manual_seed(0), min(S, 512)
        mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
        q, u, k, v = mk(3, H, T, d_a), mk(3, H, T, d_e), mk(2, H, s, d_a), mk(2, H, s, d_e)
        q_mask = (torch.arange(T)[None] < torch.tensor([[T], [max(1, T // 2)], [1]])).to(device)  # (3, T)
        k_mask = torch.rand(2, s, generator=g) > 0.25  # (2, s): holes anywhere
        k_mask[:, 0] = True
        k_mask = k_mask.to(device)
        got = pair_score_fwd(q, q_mask, u, k, k_mask, v, scale, store_stats=stats)[0]  # (3, 2) fp32
        return got, pair_score_reference(q, q_mask, u, k, k_mask, v, scale=scale)

    return self_checked("pair_score", dtype, device, variant, probe)


def pair_score(q, q_mask, u, k, k_mask, v, scale: float | None = None,
               chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Public entry point: geometric score (B_t, B_i), differentiable in q, u, k and v.

    Runs the fused Triton kernel or the chunked reference as ``MMGEO_KERNELS`` says (default auto:
    Triton for CUDA tensors in fp32 / fp16 / bf16 when triton imports, once its self-check passed).
    ``chunk_elements`` bounds the reference's blocks only.
    """
    if not use_triton("pair_score", q, u, k, v):
        return pair_score_reference(q, q_mask, u, k, k_mask, v, scale=scale, chunk_elements=chunk_elements)
    _check(q, q_mask, u, k, k_mask, v)
    if len({x.device for x in (q, q_mask, u, k, k_mask, v)}) > 1:
        raise ValueError(f"all inputs must be on one device; got q, q_mask, u, k, k_mask, v on "
                         f"{[str(x.device) for x in (q, q_mask, u, k, k_mask, v)]}: move them first")
    dtype = torch.promote_types(torch.promote_types(q.dtype, u.dtype), torch.promote_types(k.dtype, v.dtype))
    scale = attention_scale(q.shape[-1], scale)
    if kernel_backend() == "auto":
        stats = torch.is_grad_enabled() and any(x.requires_grad for x in (q, u, k, v))
        (_, H, T, d_a), S, d_e = q.shape, k.shape[2], u.shape[-1]
        if not _self_check(H, T, S, d_a, d_e, dtype, q.device, scale, stats):
            return pair_score_reference(q, q_mask, u, k, k_mask, v, scale=scale, chunk_elements=chunk_elements)
    q, u, k, v = (_last_dim_contiguous(x.to(dtype)) for x in (q, u, k, v))  # one dtype (mixed under autocast)
    if k.shape[0] <= MAX_GRID_Y:  # the kernels put B_i on a CUDA grid axis of at most 65,535
        return _PairScoreTriton.apply(q, q_mask, u, k, k_mask, v, scale)
    return torch.cat([_PairScoreTriton.apply(q, q_mask, u, k[c:c + MAX_GRID_Y], k_mask[c:c + MAX_GRID_Y],
                                             v[c:c + MAX_GRID_Y], scale)
                      for c in range(0, k.shape[0], MAX_GRID_Y)], dim=1)
