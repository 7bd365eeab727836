"""Exact evaluation of a retrieval split (docs/design.md §6): encode it, then score every (caption, image) pair by the
model's score — fine for a 1k-image test split. Two-stage evaluation (FAISS top-K' then geometric re-rank) goes
through the service's search code: ``mmgeo.eval.two_stage.rank_captions``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mmgeo.models import Embedding, GeoRetriever


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


def encode_images(model: GeoRetriever, dataset, batch_size: int = 256, progress: bool = True) -> Embedding:
    """Encode every image of ``dataset`` (``(image, captions)`` items) once, in order."""
    out = []
    for start in tqdm(range(0, len(dataset), batch_size), desc="encode images", disable=not progress):
        out.append(model.encode_image([dataset[i][0] for i in range(start, min(start + batch_size, len(dataset)))]))
    return Embedding.cat(out)


@torch.inference_mode()
def exact_scores(model: GeoRetriever, texts: Embedding, images: Embedding, mode: str,
                 rows_per_step: int = 500, progress: bool = True) -> torch.Tensor:
    """(N_text, N_image) scores of every pair, ``rows_per_step`` captions at a time."""
    out = [model.score(texts[i:i + rows_per_step], images, mode).float().cpu()
           for i in tqdm(range(0, len(texts), rows_per_step), desc=f"score {mode}", disable=not progress)]
    return torch.cat(out)
