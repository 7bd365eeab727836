"""Two-stage search over a gallery (docs/design.md §7): FAISS top-K' on the global vectors, then those K'
re-ranked by the geometric score against their stored keys/values. The service answers queries with
``search_texts``; evaluation (``mmgeo.eval.two_stage``: ``rank_captions``, ``evaluate_split``) runs every caption
of a split through the same function.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mmgeo.kernels import attention_scale, candidate_scores
from mmgeo.kernels.coverage import candidate_coverage, coverage_ratio
from mmgeo.kernels.pair_score import LOG2E, SAFE_LOGIT
from mmgeo.search.store import Gallery, RerankStore


def rerank_scores(q: torch.Tensor, q_mask: torch.Tensor, u: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor, coverage=None) -> torch.Tensor:
    """The geometric score (``GeoRetriever.score``'s numbers) of one caption against K candidate images.

    q (H, T, d_a), q_mask (T,), u (H, T, d_e) of the caption; keys (H, K, S, d_a), values (H, K, S, d_e) and
    mask (K, S), e.g. a block of ``Gallery.candidate_blocks`` -> (K,), by ``candidate_scores``: two GEMMs per
    head over all K·S patches at once (<q_t, k_j> and <u_t, v_j>), not K small ones. ``coverage``: the model's
    ``coverage_term`` (β, its ``PatchSalience``), which adds β·cov (``mmgeo.kernels.coverage``); None = s alone.
    """
    q, u = q[:, q_mask].float(), u[:, q_mask].float()  # (H, n, d) real tokens only
    per_token = candidate_scores(q, u, keys, values, mask)  # (n, K), summed over heads; scale 1/sqrt(d_a)
    s = per_token.mean(0) / q.shape[0]  # (K,): mean over tokens and heads
    if coverage is None:
        return s
    weight, salience = coverage
    return s + weight * candidate_coverage(q, u, keys, values, mask, salience(keys.transpose(0, 1)))


def table_scores(lut_k: torch.Tensor, lut_v: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                 mask: torch.Tensor, shift: bool = True, explained: bool = False):
    """``candidate_scores`` (Σ_j a_tj <u_t, v_j>, summed over heads: (n, K)) of keys and values that are sums of
    codewords, straight from their codes (``mmgeo.search.codecs.Codewords``), without decoding them.

    lut_k (H·M_k·256, n): every key codeword's dot product with each q_t scaled by scale·log2(e) (base-2 logits,
    as ``candidate_scores``: its weights are 2^logit, exp2 being torch's fast one on CPU); lut_v (H·M_v·256, n): with
    each u_t; key_rows (H, K, S, M_k), value_rows (H, K, S, M_v): the codes as rows of those tables; mask (K, S).
    A logit <q_t, k_j> is the sum of its M_k table entries (one ``embedding_bag``), so the work per candidate
    is M gathers of n numbers per patch instead of decoding d numbers and a d-long dot product per token.
    ``shift``: subtract each softmax's max (needed only when a logit can reach ``SAFE_LOGIT``). ``explained``: also
    return each patch's m_j (K, S), what coverage sums (``mmgeo.kernels.coverage``).
    """
    H, K, S, M_k = key_rows.shape
    n = lut_k.shape[1]
    logits = F.embedding_bag(key_rows.view(-1, M_k), lut_k, mode="sum").view(H, K, S, n)  # (H, K, S, n)
    uv = F.embedding_bag(value_rows.view(-1, value_rows.shape[-1]), lut_v, mode="sum").view(H, K, S, n)
    if not bool(mask.all()):
        logits.masked_fill_(~mask[None, :, :, None], float("-inf"))
    if shift:
        logits -= max_over_patches(logits)
    weights = logits.exp2_()  # (H, K, S, n)
    total = weights.sum(2)  # (H, K, n)
    flow = weights.mul_(uv)  # (H, K, S, n): 2^logit <u_t, v_j>, in place (weights are not needed any more)
    per_token = (flow.sum(2) / total).sum(0).T  # (n, K)
    if not explained:
        return per_token
    a_uv = flow.clamp_(min=0).div_(total[:, :, None])  # (H, K, S, n): a_tj max(<u_t, v_j>, 0), as a_tj > 0
    return per_token, a_uv.mean(0).amax(-1)  # (K, S): m_j of mmgeo.kernels.coverage


def max_over_patches(x: torch.Tensor) -> torch.Tensor:
    """x (H, K, S, n) -> its max over S (H, K, 1, n), by halving S: torch's amax over a middle dimension is ~3x
    slower on CPU than these elementwise maxima."""
    while x.shape[2] > 1:
        half = x.shape[2] // 2
        top = torch.maximum(x[:, :, :half], x[:, :, half:2 * half])
        x = top if x.shape[2] % 2 == 0 else torch.cat([top, x[:, :, 2 * half:]], 2)
    return x


def rerank_candidates(q: torch.Tensor, q_mask: torch.Tensor, u: torch.Tensor, gallery: RerankStore, ids,
                      block: int | None = None, coverage=None) -> torch.Tensor:
    """``rerank_scores`` of one caption (q (H, T, d_a), q_mask (T,), u (H, T, d_e)) against the gallery images
    ``ids`` (K,) -> (K,), a block of candidates at a time, whatever the store's codec: PQ / RQ codes scored from
    the caption's look-up tables (``table_scores``, ``Gallery.code_blocks``), fp16 and SQ read and decoded
    (``Gallery.candidate_blocks``), then scored and dropped. ``coverage`` as ``rerank_scores``: from codes, a
    patch's salience logit w·k_j is a sum of look-up entries too (w as one more query)."""
    if not gallery.scores_from_codes:
        return torch.cat([rerank_scores(q, q_mask, u, *kv, coverage) for kv in gallery.candidate_blocks(ids, block)])
    q, u = q[:, q_mask].float(), u[:, q_mask].float()  # (H, n, d) real tokens only
    H, n, d_a = q.shape
    q = q * (attention_scale(d_a) * LOG2E)  # base-2 logits (``table_scores``)
    keys = gallery.codewords["keys"]
    lut_k = keys.lut(q)  # (H·M_k·256, n)
    lut_v = gallery.codewords["values"].lut(u)  # (H·M_v·256, n)
    shift = bool((q.norm(dim=-1).amax(1) * keys.max_norm).amax() >= SAFE_LOGIT) if n else False  # |<q, k>| bound
    blocks = gallery.code_blocks(ids, block or gallery.block_size(2 * n))  # logits and <u, v>: 2n per patch
    if coverage is None:
        per_token = torch.cat([table_scores(lut_k, lut_v, *rows, shift) for rows in blocks], dim=1)  # (n, K)
        return per_token.mean(0) / H  # mean over tokens and heads
    weight, salience = coverage
    lut_o = keys.lut(salience.proj.weight.detach().float().view(H, 1, d_a))  # (H·M_k·256, 1): <w_h, codeword>
    out = []
    for key_rows, value_rows, mask in blocks:
        per_token, explained = table_scores(lut_k, lut_v, key_rows, value_rows, mask, shift, explained=True)
        _, K, L, M_k = key_rows.shape
        logit = F.embedding_bag(key_rows.reshape(-1, M_k), lut_o, mode="sum").view(H, K, L).sum(0)  # (K, L): w·k_j
        o = torch.sigmoid(logit + salience.proj.bias.detach().float())  # (K, L)
        out.append(per_token.mean(0) / H + weight * coverage_ratio(explained, o * mask))
    return torch.cat(out)


@torch.inference_mode()
def search_texts(model, gallery: Gallery, texts, ks, reranks, k_prime: int = 100) -> list[tuple[np.ndarray, ...]]:
    """Two-stage search for a batch of encoded captions -> one (ids (k,), scores (k,)) per caption, best first.

    One FAISS search for the batch over the global vectors (top ``max(k, k_prime)`` for a re-ranked query,
    top ``k`` otherwise); each re-ranked query's K' candidates are read (fp16 on disk, fp32 here) and
    re-scored by the geometric score against their stored keys/values (``rerank_candidates``). A gallery with
    ``each_first_stage`` (``mmgeo.search.database.DbGallery``) answers the first stage itself, the candidates' stored
    rows with their ids (one SQL query a caption), and each caption's rows are re-ranked the same way as soon as
    they arrive, while the database searches for the next captions.
    """
    q = np.ascontiguousarray(texts.pooled.float().cpu().numpy())  # (B, d_g)
    if any(reranks) and not model.geometric:
        raise ValueError("re-ranking needs a geometric model; this one is global-only: search with rerank off")
    texts = texts.to("cpu")
    each = getattr(gallery, "each_first_stage", None)
    if each is not None:  # a database (mmgeo.search.database): ids, global scores and codes, caption by caption
        want = [max(k, k_prime) if r else k for k, r in zip(ks, reranks)]
        return [_rerank(model, texts, i, ks[i], reranks[i], ids, g_scores, rows, np.arange(len(ids)))
                for i, (g_scores, ids, rows) in enumerate(each(q, want))]
    # an index directory: FAISS, then the candidates' rows read from the store by id
    want = [min(max(k, k_prime) if r else k, gallery.count) for k, r in zip(ks, reranks)]  # per query
    g_scores, ids = gallery.index.search(q, max(want))  # (B, W); HNSW / IVF may pad with -1
    valid = (ids >= 0) & (np.arange(ids.shape[1])[None] < np.asarray(want)[:, None])  # (B, W)
    return [_rerank(model, texts, i, ks[i], reranks[i], ids[i][valid[i]], g_scores[i][valid[i]], gallery,
                    ids[i][valid[i]]) for i in range(len(ks))]


def _rerank(model, texts, i: int, k: int, rerank: bool, ids: np.ndarray, g_scores: np.ndarray, store: RerankStore,
            pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Caption i's answer from its first-stage candidates ids (K',) with global scores, best first: the top k of
    them, re-ranked by the geometric score of their rows ``pos`` in ``store`` when ``rerank``."""
    if not rerank or not len(ids):
        return ids[:k], g_scores[:k]
    s = rerank_candidates(texts.attn[i], texts.mask[i], texts.value[i], store, pos,
                          coverage=model.coverage_term).numpy()
    order = np.argsort(-s, kind="stable")[:k]
    return ids[order], s[order]


def search_text(model, gallery: Gallery, text, k: int, rerank: bool = True, k_prime: int = 100):
    """Two-stage search for one encoded caption -> (ids (k,), scores (k,)) best first (``search_texts``)."""
    return search_texts(model, gallery, text[:1], [k], [rerank], k_prime)[0]
