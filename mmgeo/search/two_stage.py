"""Two-stage search over a gallery (docs/design.md): FAISS top-K' on the global vectors, then those K'
re-ranked by the geometric score against their stored keys/values. The service answers queries with
``search_texts``; evaluation (``rank_captions``, ``evaluate_split``) runs every caption of a split through the
same function.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmgeo.kernels import attention_scale, candidate_scores
from mmgeo.kernels.pair_score import LOG2E, SAFE_LOGIT
from mmgeo.search.build import build_gallery_from_embedding
from mmgeo.search.store import Gallery

CANDIDATE_OFFSET = 4.0  # both scores lie in [-1, 1]: others at global - 4 rank below every re-ranked candidate


def rerank_scores(q: torch.Tensor, q_mask: torch.Tensor, u: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """The geometric score (``mmgeo.kernels.pair_score``'s numbers) of one caption against K candidate images.

    q (H, T, d_a), q_mask (T,), u (H, T, d_e) of the caption; keys (H, K, S, d_a), values (H, K, S, d_e) and
    mask (K, S), e.g. a block of ``Gallery.candidate_blocks`` -> (K,), by ``candidate_scores``: two GEMMs per
    head over all K·S patches at once (<q_t, k_j> and <u_t, v_j>), not K small ones.
    """
    q, u = q[:, q_mask].float(), u[:, q_mask].float()  # (H, n, d) real tokens only
    per_token = candidate_scores(q, u, keys, values, mask)  # (n, K), summed over heads; scale 1/sqrt(d_a)
    return per_token.mean(0) / q.shape[0]  # mean over tokens and heads


def table_scores(lut_k: torch.Tensor, lut_v: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                 mask: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """``candidate_scores`` (Σ_j a_tj <u_t, v_j>, summed over heads: (n, K)) of keys and values that are sums of
    codewords, straight from their codes (``mmgeo.search.codecs.Codewords``), without decoding them.

    lut_k (H·M_k·256, n): every key codeword's dot product with each q_t scaled by scale·log2(e) (base-2 logits,
    as ``candidate_scores``: its weights are 2^logit, exp2 being torch's fast one on CPU); lut_v (H·M_v·256, n): with
    each u_t; key_rows (H, K, S, M_k), value_rows (H, K, S, M_v): the codes as rows of those tables; mask (K, S).
    A logit <q_t, k_j> is the sum of its M_k table entries (one ``embedding_bag``), so the work per candidate
    is M gathers of n numbers per patch instead of decoding d numbers and a d-long dot product per token.
    ``shift``: subtract each softmax's max (needed only when a logit can reach ``SAFE_LOGIT``).
    """
    H, K, S, M_k = key_rows.shape
    n = lut_k.shape[1]
    logits = F.embedding_bag(key_rows.view(-1, M_k), lut_k, mode="sum").view(H, K, S, n)  # (H, K, S, n)
    uv = F.embedding_bag(value_rows.view(-1, value_rows.shape[-1]), lut_v, mode="sum").view(H, K, S, n)
    if not bool(mask.all()):
        logits.masked_fill_(~mask[None, :, :, None], float("-inf"))
    if shift:
        logits -= logits.amax(2, keepdim=True)
    weights = logits.exp2_()  # (H, K, S, n)
    return ((weights * uv).sum(2) / weights.sum(2)).sum(0).T  # (n, K)


def rerank_candidates(q: torch.Tensor, q_mask: torch.Tensor, u: torch.Tensor, gallery: Gallery, ids,
                      block: int | None = None) -> torch.Tensor:
    """``rerank_scores`` of one caption (q (H, T, d_a), q_mask (T,), u (H, T, d_e)) against the gallery images
    ``ids`` (K,) -> (K,), a block of candidates at a time, whatever the store's codec: PQ / RQ codes scored from
    the caption's look-up tables (``table_scores``, ``Gallery.code_blocks``), fp16 and SQ read and decoded
    (``Gallery.candidate_blocks``), then scored and dropped."""
    if not gallery.scores_from_codes:
        return torch.cat([rerank_scores(q, q_mask, u, *kv) for kv in gallery.candidate_blocks(ids, block)])
    q, u = q[:, q_mask].float(), u[:, q_mask].float()  # (H, n, d) real tokens only
    H, n, d_a = q.shape
    q = q * (attention_scale(d_a) * LOG2E)  # base-2 logits (``table_scores``)
    keys = gallery.codewords["keys"]
    lut_k = keys.lut(q)  # (H·M_k·256, n)
    lut_v = gallery.codewords["values"].lut(u)  # (H·M_v·256, n)
    shift = bool((q.norm(dim=-1).amax(1) * keys.max_norm).amax() >= SAFE_LOGIT) if n else False  # |<q, k>| bound
    blocks = gallery.code_blocks(ids, block or gallery.block_size(2 * n))  # logits and <u, v>: 2n per patch
    per_token = torch.cat([table_scores(lut_k, lut_v, *rows, shift) for rows in blocks], dim=1)  # (n, K)
    return per_token.mean(0) / H  # mean over tokens and heads


@torch.inference_mode()
def search_texts(model, gallery: Gallery, texts, ks, reranks, k_prime: int = 100) -> list[tuple[np.ndarray, ...]]:
    """Two-stage search for a batch of encoded captions -> one (ids (k,), scores (k,)) per caption, best first.

    One FAISS search for the batch over the global vectors (top ``max(k, k_prime)`` for a re-ranked query,
    top ``k`` otherwise); each re-ranked query's K' candidates are read (fp16 on disk, fp32 here) and
    re-scored by the geometric score against their stored keys/values (``rerank_candidates``).
    """
    want = [min(max(k, k_prime) if r else k, gallery.count) for k, r in zip(ks, reranks)]  # per query
    q = np.ascontiguousarray(texts.pooled.float().cpu().numpy())  # (B, d_g)
    g_scores, ids = gallery.index.search(q, max(want))  # (B, W); HNSW / IVF may pad with -1
    valid = (ids >= 0) & (np.arange(ids.shape[1])[None] < np.asarray(want)[:, None])  # (B, W)
    rows = [i for i in range(len(ks)) if reranks[i] and valid[i].any()]
    out = [(ids[i][valid[i]][:ks[i]], g_scores[i][valid[i]][:ks[i]]) for i in range(len(ks))]
    if not rows:
        return out
    if not model.geometric:
        raise ValueError("re-ranking needs a geometric model; this one is global-only: search with rerank off")
    texts = texts.to("cpu")
    for i in rows:
        c = ids[i][valid[i]]  # (K'_i,) candidates
        s = rerank_candidates(texts.attn[i], texts.mask[i], texts.value[i], gallery, c).numpy()  # (K'_i,)
        order = np.argsort(-s, kind="stable")[:ks[i]]
        out[i] = c[order], s[order]
    return out


def search_text(model, gallery: Gallery, text, k: int, rerank: bool = True, k_prime: int = 100):
    """Two-stage search for one encoded caption -> (ids (k,), scores (k,)) best first (``search_texts``)."""
    return search_texts(model, gallery, text[:1], [k], [rerank], k_prime)[0]


@dataclass
class CaptionRanking:
    """What two-stage search returned for every caption: its K' candidates, re-ranked, and their scores."""

    ids: list[np.ndarray]  # per caption (K'_i,) image ids, best first (K'_i < K' where HNSW / IVF-PQ found fewer)
    scores: list[np.ndarray]  # per caption (K'_i,) geometric scores
    k_prime: int

    def score_matrix(self, global_scores: torch.Tensor) -> torch.Tensor:
        """(N_text, N_image) scores whose order is the two-stage ranking: each caption's candidates keep their
        geometric scores (unchanged floats, so their ties and order are the re-rank's); every other image gets
        its ``global_scores`` (N_text, N_image) entry minus ``CANDIDATE_OFFSET``, below every candidate, so ranks
        past K' are ordered by the first stage's score."""
        out = global_scores.float().cpu() - CANDIDATE_OFFSET  # (N_t, N_i)
        for row, (ids, s) in enumerate(zip(self.ids, self.scores)):
            out[row, torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(s.astype(np.float32))  # (K'_i,)
        return out

    def first_stage_recall(self, text_to_image: torch.Tensor) -> dict[str, float]:
        """The re-rank's ceilings: captions whose image is among their candidates, and images that are among
        the candidates of at least one of their captions."""
        owner = text_to_image.cpu().numpy()  # (N_t,)
        hit = np.array([owner[r] in ids for r, ids in enumerate(self.ids)], dtype=bool)  # (N_t,)
        images_hit = len(np.unique(owner[hit])) / len(np.unique(owner))
        return {"text_to_image_first_stage_recall": float(hit.mean()),
                "image_to_text_first_stage_recall": float(images_hit)}


def rank_captions(model, gallery: Gallery, texts, k_prime: int = 100, batch_size: int = 256,
                  progress: bool = True) -> CaptionRanking:
    """Every encoded caption (an ``Embedding``) through the service's ``search_texts``, re-ranking its K'
    candidates, on any gallery (flat / HNSW / IVF-PQ / sharded) -> ``CaptionRanking``."""
    if isinstance(k_prime, bool) or not isinstance(k_prime, int) or k_prime < 1:
        raise ValueError(f"k_prime must be a positive integer, got {k_prime!r}")
    ids, scores = [], []
    for start in tqdm(range(0, len(texts), batch_size), desc="two-stage search", disable=not progress):
        n = min(batch_size, len(texts) - start)
        for i, s in search_texts(model, gallery, texts[start:start + n], [k_prime] * n, [True] * n, k_prime):
            ids.append(i)
            scores.append(s)
    return CaptionRanking(ids, scores, k_prime)


@torch.inference_mode()
def evaluate_split(model, split, k_prime: int = 100, index_type: str = "flat", gallery: Gallery | None = None,
                   progress: bool = True, codec: str = "fp16", keep_patches: int | None = None,
                   prune_queries=None) -> tuple[torch.Tensor, dict]:
    """Two-stage evaluation of an encoded split (``mmgeo.retrieval.EncodedSplit``) by the service's search over
    ``gallery`` (built from the split's images in the split's order: checked, GalleryError if not), or over a
    temporary gallery of the split's encoded images with ``index_type``, ``codec`` and ``keep_patches`` chosen by
    the encoded sample captions ``prune_queries`` (``mmgeo.search.pruning``).

    -> ((N_text, N_image) scores whose order is the two-stage ranking (``CaptionRanking.score_matrix``), used
    for both directions; the JSON record: "two_stage" (index, index_type, k_prime), "first_stage" (recalls),
    "measured" (how each direction was measured)).
    """
    global_scores = model.score(split.texts, split.images, "global").float().cpu()  # (N_t, N_i)
    if gallery is not None:
        gallery.check_images(split.images)
        ranking = rank_captions(model, gallery, split.texts, k_prime, progress=progress)
        where, kind, store = str(gallery.root), gallery.manifest["index_type"], gallery.store
    else:
        with tempfile.TemporaryDirectory(prefix="mmgeo-eval-") as tmp:
            build_gallery_from_embedding(model, split.images, Path(tmp) / "index", index_type=index_type,
                                         codec=codec, keep_patches=keep_patches, prune_queries=prune_queries)
            temp = Gallery(Path(tmp) / "index")
            ranking = rank_captions(model, temp, split.texts, k_prime, progress=progress)
            where, kind, store = None, temp.manifest["index_type"], temp.store
            del temp  # its memory maps, before the directory goes
    what = "fp16 keys/values" if store["codec"] == "fp16" else f"keys/values (decoded from {store['codec']} codes)"
    if store.get("patches"):
        what += f" of {store['patches']['kept']} of {store['patches']['of']} patches an image"
    measured = {
        "text_to_image": f"two-stage by the service's search (mmgeo.search.two_stage.search_texts): FAISS ({kind}) "
                         f"top-{k_prime} by global score, re-ranked by the geometric score of the stored {what}; "
                         "images outside a caption's candidates ranked after them by global score",
        "image_to_text": "two-stage, read from the text->image candidates (the service has no image->text "
                         "search): each image's captions that had it among their candidates, by geometric score, "
                         "then the other captions by global score"}
    return ranking.score_matrix(global_scores), {
        "two_stage": {"index": where, "index_type": kind, "k_prime": k_prime,
                      "store": {k: v for k, v in store.items() if k != "quantizers"}},
        "first_stage": {"k_prime": k_prime, **ranking.first_stage_recall(split.text_to_image)},
        "measured": measured}
