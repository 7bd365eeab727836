"""Datasets: every one yields ``ds[i] -> (PIL.Image, list[str])`` — one image, all its captions."""

from mmgeo.data.caption_edits import EDIT_KINDS, caption_negatives, edit_caption
from mmgeo.data.flickr import Flickr30K, check_split, detect_format
from mmgeo.data.images import MAX_PIXELS
from mmgeo.data.shapes import HELDOUT_COMBOS, SPLITS, ShapesWorld

__all__ = ["EDIT_KINDS", "Flickr30K", "HELDOUT_COMBOS", "MAX_PIXELS", "SPLITS", "ShapesWorld", "build_dataset",
           "caption_negatives", "detect_format", "edit_caption"]


def build_dataset(name: str, split: str, seed: int = 0, image_size: int = 64, size: int | None = None,
                  root: str | None = None, data_format: str | None = None, max_pixels: int = MAX_PIXELS,
                  shards: str | None = None):
    """Create a retrieval dataset by name: ``synthetic`` (the embedded shapes world; splits ``SPLITS``, with
    ``cogent`` its held-out-combo split), ``flickr30k`` (Karpathy train / val / test from ``root``, layout
    ``data_format`` = hf | karpathy | csv, None = detect) or ``webdataset`` (the samples of the ``shards``
    pattern in listing order, ``mmgeo.data.shards.ShardSamples``: the shards are the split)."""
    if name == "synthetic":
        return ShapesWorld(split=split, seed=seed, image_size=image_size, size=size)
    if name == "flickr30k":
        check_split(split)
        if not root:
            raise ValueError("flickr30k needs its location: --data-root PATH (eval.py) or data.root (train.py); "
                             "see data/README.md for how to fetch it")
        return Flickr30K(root, split, data_format=data_format, size=size, max_pixels=max_pixels)
    if name == "webdataset":
        if not shards:
            raise ValueError("webdataset needs its shards: --shards PATTERN (eval.py, serve build) or data.shards "
                             "(train.py), e.g. 'data/shards/{00000..00009}.tar'")
        from mmgeo.data.shards import ShardSamples

        return ShardSamples(shards, size=size, max_pixels=max_pixels)
    raise ValueError(f"unknown dataset {name!r}; available: 'synthetic', 'flickr30k', 'webdataset'")
