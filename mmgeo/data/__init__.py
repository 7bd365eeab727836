"""Datasets: every one yields ``ds[i] -> (PIL.Image, list[str])`` — one image, all its captions."""

from mmgeo.data.shapes import ShapesWorld

__all__ = ["ShapesWorld", "build_dataset"]


def build_dataset(name: str, split: str, seed: int = 0, image_size: int = 64, size: int | None = None):
    """Create a retrieval dataset by name (``synthetic`` is the embedded shapes world)."""
    if name == "synthetic":
        return ShapesWorld(split=split, seed=seed, image_size=image_size, size=size)
    raise ValueError(f"unknown dataset {name!r}; available: 'synthetic' (Flickr30K loaders arrive with issue 5)")
