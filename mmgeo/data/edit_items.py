"""Items of the compositional suite (docs/design.md §9): an image, its true caption, edited negatives and
meaning-preserving rewrites. Built by ``mmgeo.data.scene_edits`` (shapes world) and
``mmgeo.data.sugarcrepe`` (SugarCREPE's JSON); scored by ``mmgeo.eval.compositional.run_suite``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image


@dataclass
class CompositionalItem:
    """One true caption of one image with its negatives ``{edit_type: [caption]}`` (each false for
    the image) and rewrites ``{rewrite_type: [caption]}`` (each still true).

    ``image`` is a PIL image or a path, opened when scored; items with the same ``image_id`` share
    one image encoding (None: items share an encoding only when they hold the same image object).
    """

    image: Image.Image | str | Path
    caption: str
    negatives: dict[str, list[str]]
    rewrites: dict[str, list[str]] = field(default_factory=dict)
    image_id: Any = None

    def image_key(self) -> Any:
        return self.image_id if self.image_id is not None else ("object", id(self.image))

    def load_image(self) -> Image.Image:
        if isinstance(self.image, Image.Image):
            return self.image
        try:
            with Image.open(self.image) as im:
                return im.convert("RGB")
        except OSError as e:
            raise OSError(f"cannot read image {self.image} ({e}); re-download it or remove the entries that name it") \
                from e


class ItemSet(list):
    """A list of CompositionalItem with ``report``: what the builder dropped or skipped, by reason
    (copied into the suite's result so that nothing is lost silently)."""

    def __init__(self, items=(), report: dict | None = None):
        super().__init__(items)
        self.report: dict = dict(report or {})
