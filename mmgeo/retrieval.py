"""Scoring a gallery: encode a retrieval split, score exactly or in two stages (DESIGN §2, §6).

``exact``: every (caption, image) pair by the model's score — fine for a 1k-image test split.
``two-stage``: FAISS top-K' on the global vectors, then re-rank those K' by the geometric score.
Items outside a query's K' keep their global score and rank after every candidate, so ranks past
K' stay meaningful (ordered by the first stage) and recall lost by the first stage shows up as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mmgeo.index import build_flat_index, search
from mmgeo.models import Embedding, GeoRetriever

CANDIDATE_OFFSET = 4.0  # both scores lie in [-1, 1]: +4 puts every re-ranked candidate first


@dataclass
class EncodedSplit:
    texts: Embedding  # one row per caption
    images: Embedding  # one row per image
    text_to_image: torch.Tensor  # (N_text,) index of each caption's image


def encode_split(model: GeoRetriever, dataset, batch_size: int = 256, progress: bool = True) -> EncodedSplit:
    """Encode every image once and every caption of it (CLIP_benchmark's retrieval protocol)."""
    texts, images, owners = [], [], []
    bar = tqdm(total=len(dataset), desc="encode", unit="img", disable=not progress)
    for start in range(0, len(dataset), batch_size):
        batch = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        images.append(model.encode_image([im for im, _ in batch]))
        captions = [(start + j, c) for j, (_, caps) in enumerate(batch) for c in caps]
        texts.append(model.encode_text([c for _, c in captions]))
        owners += [i for i, _ in captions]
        bar.update(len(batch))
    bar.close()
    return EncodedSplit(Embedding.cat(texts), Embedding.cat(images), torch.tensor(owners))


@torch.inference_mode()
def exact_scores(model: GeoRetriever, texts: Embedding, images: Embedding, mode: str,
                 rows_per_step: int = 500, progress: bool = True) -> torch.Tensor:
    """(N_text, N_image) scores of every pair, ``rows_per_step`` captions at a time."""
    out = [model.score(texts[i:i + rows_per_step], images, mode).float().cpu()
           for i in tqdm(range(0, len(texts), rows_per_step), desc=f"score {mode}", disable=not progress)]
    return torch.cat(out)


@torch.inference_mode()
def rerank(model: GeoRetriever, queries: Embedding, gallery: Embedding, k_prime: int, queries_are_text: bool,
           progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-stage scores of each query against the gallery -> (scores (N_q, N_g), candidate ids (N_q, K')).

    Candidates (FAISS top-K' by global score) get ``geometric + CANDIDATE_OFFSET``; the rest keep
    their global score.
    """
    _, cand = search(build_flat_index(gallery.pooled), queries.pooled, k_prime)  # (N_q, K')
    scores = queries.pooled.float().cpu() @ gallery.pooled.float().cpu().T  # (N_q, N_g) first stage
    for i in tqdm(range(len(queries)), desc="re-rank", disable=not progress):
        q, g = queries[i:i + 1], gallery[cand[i]]
        s = model.score(q, g) if queries_are_text else model.score(g, q).T  # (1, K')
        scores[i, cand[i]] = s[0].float().cpu() + CANDIDATE_OFFSET
    return scores, cand


def two_stage_scores(model: GeoRetriever, split: EncodedSplit, k_prime: int = 100,
                     progress: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """-> (text->image scores, image->text scores, both (N_text, N_image)), and first-stage recall.

    ``first_stage`` reports the fraction of queries whose true item is among the K' candidates: the
    ceiling the re-rank can reach.
    """
    t2i, cand_t = rerank(model, split.texts, split.images, k_prime, True, progress)
    i2t_t, cand_i = rerank(model, split.images, split.texts, k_prime, False, progress)
    hit_t = (cand_t == split.text_to_image[:, None]).any(1).float().mean()
    owners = split.text_to_image[cand_i]  # (N_i, K') image of each candidate caption
    hit_i = (owners == torch.arange(len(split.images))[:, None]).any(1).float().mean()
    recall = {"k_prime": k_prime, "text_to_image_first_stage_recall": float(hit_t),
              "image_to_text_first_stage_recall": float(hit_i)}
    return t2i, i2t_t.T, recall
