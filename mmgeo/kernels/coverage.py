"""coverage: how much of an image's salient content a caption explains (docs/design.md §9).

    c_tj     = mean_h  a_htj · max(0, <u_ht, v_hj>)     token t looks at patch j and agrees with what is there
    m_j      = max over real tokens t of c_tj
    cov(c,i) = Σ_j o_j m_j / Σ_j o_j                    o_j in (0, 1): patch j's salience (``PatchSalience``)

The geometric score ``s`` asks whether each word finds its object, so a caption scores the same on its image and on
a denser image holding the same objects and more; ``cov`` is what tells them apart (an object no word explains lowers
it). ``GeoRetriever.score`` adds ``coverage_weight · cov`` to ``s`` when that weight is set.

Shapes and dtypes:
    q (B_t, H, T, d_a), q_mask (B_t, T) bool, u (B_t, H, T, d_e)     a caption's queries and values (as pair_score)
    k (B_i, H, S, d_a), k_mask (B_i, S) bool, v (B_i, H, S, d_e)     an image's keys and values
    salience (B_i, S) in (0, 1)
    -> (B_t, B_i) in float32 (float64 for float64 inputs).
Plain PyTorch only (any device, autograd): there is no Triton kernel for it. A block of captions holds
(block, B_i, H, T, S) weights at once. ``score_and_coverage`` computes ``s`` and ``cov`` of every pair in one pass
without autograd (exact evaluation): the attention weights and <u, v> of each block serve both.
"""

from __future__ import annotations

import torch

from mmgeo.kernels.pair_score import BLOCK_ELEMENTS as SCORE_BLOCK_ELEMENTS
from mmgeo.kernels.pair_score import LOG2E, SAFE_LOGIT, TOKENS_PER_BLOCK, _block_weights, _check
from mmgeo.kernels.scale import attention_scale

EPS = 1e-6  # guards Σ_j o_j of an image whose salience is all but zero
BLOCK_ELEMENTS = 1 << 23  # attention weights per block of captions
NORMAL_TOTAL = {torch.float32: 2.0 ** -100, torch.float64: 2.0 ** -1000}  # a softmax's sum of 2^logit under this
# may rest on subnormal weights (fp32's smallest normal is 2^-126): score_and_coverage redoes it with its exact max


def explained_patches(logits: torch.Tensor, uv: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """m_j from logits and <u, v> (..., H, T, S) and a token mask broadcastable to (..., T): (..., S)."""
    c = (logits.softmax(-1) * uv.clamp(min=0)).mean(-3)  # (..., T, S)
    return c.masked_fill(~token_mask[..., None], 0).amax(-2)  # (..., S); c >= 0, so padding never wins


def coverage_ratio(explained: torch.Tensor, salience: torch.Tensor) -> torch.Tensor:
    """Σ_j o_j m_j / Σ_j o_j over the last axis."""
    return (explained * salience).sum(-1) / salience.sum(-1).clamp(min=EPS)


def coverage(q, q_mask, u, k, k_mask, v, salience, scale: float | None = None) -> torch.Tensor:
    """cov for every (caption, image) pair: (B_t, B_i). See the module docstring.

    A block of captions at a time, its real tokens packed (padding dropped) as ``pair_score_reference`` does: per
    head one GEMM for the logits and one for <u, v> over all the images' patches, then each caption's max over its
    tokens from the tokens put back in place (c >= 0, so the zeros at padding never win).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = attention_scale(q.shape[-1], scale)
    (B_t, H, T, d_a), (B_i, _, S, d_e) = q.shape, v.shape
    o = salience.to(acc) * k_mask.to(acc)  # (B_i, S): padding patches carry no salience
    K = k.to(acc).transpose(0, 1).reshape(H, B_i * S, d_a)  # (H, B_i·S, d_a)
    V = v.to(acc).transpose(0, 1).reshape(H, B_i * S, d_e)  # (H, B_i·S, d_e)
    step = max(1, BLOCK_ELEMENTS // max(1, B_i * H * T * S))
    out = []
    for start in range(0, B_t, step):
        mb = q_mask[start:start + step]  # (b, T)
        qb = (q[start:start + step].to(acc) * scale).transpose(1, 2)[mb].transpose(0, 1)  # (H, n, d_a) real tokens
        ub = u[start:start + step].to(acc).transpose(1, 2)[mb].transpose(0, 1)  # (H, n, d_e)
        n = qb.shape[1]
        logits = torch.bmm(qb, K.transpose(1, 2)).view(H, n, B_i, S)  # (H, n, B_i, S)
        if not bool(k_mask.all()):
            logits = logits.masked_fill(~k_mask[None, None], float("-inf"))
        uv = torch.bmm(ub, V.transpose(1, 2)).view(H, n, B_i, S)  # <u_t, v_j>
        c = (logits.softmax(-1) * uv.clamp(min=0)).mean(0)  # (n, B_i, S): c_tj
        placed = c.new_zeros(mb.shape[0], T, B_i, S)
        placed[mb] = c  # (b, T, B_i, S): zeros at padding
        out.append(coverage_ratio(placed.amax(1), o))  # (b, B_i)
    return torch.cat(out)


@torch.no_grad()
def score_and_coverage(q, q_mask, u, k, k_mask, v, salience, scale: float | None = None,
                       block_elements: int = SCORE_BLOCK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, cov) of every (caption, image) pair, each (B_t, B_i): ``pair_score``'s and ``coverage``'s numbers (up to
    float rounding) from one pass over the attention weights, without autograd. Shapes as the module docstring.

    Blocks as ``pair_score_reference``'s (real tokens packed, two GEMMs per head over a block of images, base-2
    softmax), but each block of tokens holds whole captions, so each caption's max over its tokens (m_j) is taken
    in the block. One in-place product 2^logit·<u_t, v_j> serves both: its sum over patches gives s, its positive
    part c_tj (as a_tj > 0). A softmax that may pass ``SAFE_LOGIT`` is shifted by its exact max in the first block
    of images of each block of tokens and by that block's max over its images after (folded into the logit GEMM
    as a column -m_t against a column of ones); a later block where a product overflows or a softmax's sum falls
    under ``NORMAL_TOTAL`` (weights near or past underflow) is redone with its exact max.
    """
    _check(q, q_mask, u, k, k_mask, v)
    acc = torch.promote_types(q.dtype, torch.float32)
    (B_t, H, _, _), (B_i, _, S, _) = q.shape, k.shape
    if not B_t or not B_i:
        return q.new_zeros(B_t, B_i, dtype=acc), q.new_zeros(B_t, B_i, dtype=acc)
    owner, pos = q_mask.nonzero(as_tuple=True)  # (N,) every real token, caption after caption
    Q = q[owner, :, pos].to(acc).transpose(0, 1) * (attention_scale(q.shape[-1], scale) * LOG2E)  # (H, N, d_a)
    U = u[owner, :, pos].to(acc).transpose(0, 1)  # (H, N, d_e)
    keys = k.to(acc).transpose(0, 1).contiguous()  # (H, B_i, S, d_a)
    values = v.to(acc).transpose(0, 1).contiguous()  # (H, B_i, S, d_e)
    o = salience.to(acc) * k_mask.to(acc)  # (B_i, S): padding patches carry no salience
    mask = None if bool(k_mask.all()) else k_mask
    shift = bool(Q.norm(dim=-1).amax() * keys.norm(dim=-1).amax() >= SAFE_LOGIT)  # |logit| bound (Cauchy-Schwarz)
    keys_aug = torch.cat([keys, keys.new_ones(H, B_i, S, 1)], dim=-1) if shift else None  # (H, B_i, S, d_a + 1)
    lengths = q_mask.sum(1)  # (B_t,) real tokens per caption
    ends = lengths.cumsum(0)  # (B_t,) where each caption's tokens end in the packed rows
    tokens = max(int(lengths.max()), min(len(owner), TOKENS_PER_BLOCK, block_elements // (H * S)))
    s_out, cov = Q.new_empty(B_t, B_i), Q.new_empty(B_t, B_i)
    first = 0  # first caption of the block
    while first < B_t:
        t0 = int(ends[first - 1]) if first else 0
        last = max(first + 1, int(torch.searchsorted(ends, t0 + tokens, right=True)))  # whole captions that fit
        t1, lens = int(ends[last - 1]), lengths[first:last]
        qb, ub = Q[:, t0:t1], U[:, t0:t1]  # (H, n, d)
        images = max(1, min(B_i, block_elements // (H * S * (t1 - t0))))
        q_aug = None  # with the first image block's max folded in, once known
        for c in range(0, B_i, images):
            cols, mb = slice(c, c + images), None if mask is None else mask[c:c + images]
            weights = None
            if q_aug is not None:
                weights, uv, _ = _block_weights(q_aug, ub, keys_aug[:, cols], values[:, cols], mb, False)
                total = weights.sum(-1, keepdim=True)  # (H, n, b, 1)
                flow = weights.mul_(uv)  # (H, n, b, S): 2^logit <u_t, v_j>, in place (redone from scratch if bad)
                if not bool(torch.isfinite(flow).all() and (total >= NORMAL_TOTAL[acc]).all()):
                    weights = None  # overflow, or a row's weights all near or past underflow: redo with the max
            if weights is None:
                weights, uv, row_max = _block_weights(qb, ub, keys[:, cols], values[:, cols], mb, shift)
                total = weights.sum(-1, keepdim=True)  # (H, n, b, 1)
                flow = weights.mul_(uv)  # (H, n, b, S): 2^logit <u_t, v_j>, in place
                if shift and q_aug is None:
                    q_aug = torch.cat([qb, -row_max.amax(-1, keepdim=True)], dim=-1)  # (H, n, d_a + 1)
            per_token = (flow.sum(-1, keepdim=True) / total).sum(0)[..., 0]  # (n, b): Σ_j a_tj <u_t, v_j>, Σ heads
            s_out[first:last, cols] = torch.segment_reduce(per_token, "sum", lengths=lens, axis=0) / (lens[:, None] * H)
            a_uv = flow.clamp_(min=0).div_(total)  # (H, n, b, S): a_tj max(<u_t, v_j>, 0), as a_tj > 0
            c_tj = a_uv[0]
            for h in range(1, H):
                c_tj = c_tj.add_(a_uv[h])  # (n, b, S): H · c_tj
            explained = torch.segment_reduce(c_tj, "max", lengths=lens, axis=0) / H  # (captions, b, S): m_j
            cov[first:last, cols] = coverage_ratio(explained, o[cols])
        first = last
    return s_out, cov


def candidate_explained(q, u, keys, values, mask, scale: float | None = None) -> torch.Tensor:
    """m_j of one caption's real tokens (q (H, n, d_a), u (H, n, d_e)) for K candidates: keys (H, K, S, d_a),
    values (H, K, S, d_e), mask (K, S) -> (K, S), the layout of ``candidate_scores``."""
    scale = attention_scale(q.shape[-1], scale)
    logits = torch.einsum("hnd,hksd->khns", q.float() * scale, keys.float())  # (K, H, n, S)
    if not bool(mask.all()):
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    uv = torch.einsum("hne,hkse->khns", u.float(), values.float())  # (K, H, n, S)
    return explained_patches(logits, uv, torch.ones(q.shape[1], dtype=torch.bool, device=q.device))


def candidate_coverage(q, u, keys, values, mask, salience, scale: float | None = None) -> torch.Tensor:
    """cov of one caption against K candidates (``candidate_explained``'s shapes; salience (K, S)) -> (K,)."""
    return coverage_ratio(candidate_explained(q, u, keys, values, mask, scale), salience.float() * mask)


def coverage_naive(q, q_mask, u, k, k_mask, v, salience, scale: float | None = None) -> torch.Tensor:
    """The definition with loops over pairs: for tests."""
    scale = attention_scale(q.shape[-1], scale)
    out = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64)
    for b in range(q.shape[0]):
        qb, ub = q[b][:, q_mask[b]].double(), u[b][:, q_mask[b]].double()  # (H, n, d)
        for c in range(k.shape[0]):
            kc, vc, real = k[c][:, k_mask[c]].double(), v[c][:, k_mask[c]].double(), k_mask[c]
            a = ((qb @ kc.transpose(1, 2)) * scale).softmax(-1)  # (H, n, S_real)
            m = (a * (ub @ vc.transpose(1, 2)).clamp(min=0)).mean(0).amax(0)  # (S_real,)
            o = salience[c][real].double()
            out[b, c] = (o * m).sum() / o.sum().clamp(min=EPS)
    return out
