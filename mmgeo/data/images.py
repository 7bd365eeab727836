"""Image files: which suffixes count as images, listing a folder, decoding one under the one pixel cap.

``MAX_PIXELS`` is the single decompression-bomb limit of mmgeo: datasets (``mmgeo.data.flickr``), gallery
builds (``mmgeo.search.store``) and the service's uploads (``serve``) all refuse images with more pixels.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

MAX_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold (about 0.25 GB of RGB)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


def list_images(folder: str | os.PathLike) -> list[Path]:
    """Image files under ``folder`` (recursive, by suffix), sorted for a stable id order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {str(folder)!r} does not exist")
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def open_image(path, max_pixels: int = MAX_PIXELS):
    """PIL RGB image of a path or file object, fully decoded; raises ValueError / OSError on an unreadable
    file or one over ``max_pixels`` pixels (checked on the header, before decoding)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            if im.width * im.height > max_pixels:
                raise ValueError(f"{im.width}x{im.height} pixels is over the limit of {max_pixels}")
            return im.convert("RGB")
