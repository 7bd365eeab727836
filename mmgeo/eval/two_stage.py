"""Two-stage evaluation of a split by the service's own search (docs/design.md §6): every caption through
``mmgeo.search.two_stage.search_texts`` (FAISS top-K', geometric re-rank), its ranking as an (N_text, N_image) score
matrix for R@K, over a built gallery or a temporary one of the split's images.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mmgeo.search.build import build_gallery_from_embedding
from mmgeo.search.store import Gallery
from mmgeo.search.two_stage import search_texts

CANDIDATE_OFFSET = 4.0  # both scores lie in [-1, 1]: others at global - 4 rank below every re-ranked candidate


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
    """Two-stage evaluation of an encoded split (``mmgeo.eval.retrieval.EncodedSplit``) by the service's search over
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
