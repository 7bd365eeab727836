"""The "shapes world": a procedural image–caption retrieval set that needs no download (docs/design.md §5).

Each scene holds 1–4 flat objects (shape, colour, size) in distinct cells of a 3×3 grid, drawn on
a lightly tinted background. Five captions per image describe *every* object, each in its own
template, object order and wording, so that a caption identifies its image and word order and
attribute binding matter ("a red circle above a blue square" ≠ "a blue circle above a red square").

Everything is a pure function of ``(seed, split, index)``: random access, no state, no files.
Splits mirror Flickr30K's Karpathy split sizes (29,000 / 1,014 / 1,000 images, 5 captions each).

Compositional generalisation (CLEVR-CoGenT, Johnson et al., CVPR 2017): six (colour, shape) pairs,
``HELDOUT_COMBOS`` — every colour once, every shape at least once — never occur in train / val / test
nor in their ``variant``s. A drawn object that would be one is recoloured, uniformly among the colours
allowed for its shape, from a side random stream, so the scene's own draws and every other object stay
as they were (scenes without such an object are unchanged: 441 of the 1,000 test images at seed 0). The
extra ``"cogent"`` split (1,000 images) draws ordinary scenes from its own split id, then makes one
object of each (chosen by the side stream) a held-out combo (uniform over the six): a model trained on
the ordinary splits meets those bindings there for the first time.

Limits: a handful of exact duplicate scenes exist by chance (about 5 in the 1,000 test images at
seed 0); captions never mention the background or the small position jitter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageDraw

from mmgeo.data.flickr import SPLIT_SIZES

SHAPES = ("circle", "square", "triangle", "diamond")
COLORS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 185),
    "orange": (245, 135, 25),
}
SIZES = ("small", "large")
SIZE_WORDS = {"small": ("small", "little"), "large": ("large", "big")}
# 3×3 grid: (row, col) -> phrases that name the cell (the first is canonical).
CELL_PHRASES = {
    (0, 0): ("in the top left", "at the upper left"),
    (0, 1): ("at the top", "in the top middle"),
    (0, 2): ("in the top right", "at the upper right"),
    (1, 0): ("on the left", "at the middle left"),
    (1, 1): ("in the center", "in the middle"),
    (1, 2): ("on the right", "at the middle right"),
    (2, 0): ("in the bottom left", "at the lower left"),
    (2, 1): ("at the bottom", "in the bottom middle"),
    (2, 2): ("in the bottom right", "at the lower right"),
}
COUNT_WORDS = ("one", "two", "three", "four")
SPLITS = {**SPLIT_SIZES, "cogent": 1_000}  # images: Flickr30K's Karpathy splits, plus the held-out-combo split
SPLIT_IDS = {"train": 0, "val": 1, "test": 2, "cogent": 3}
# (colour, shape) pairs absent from train / val / test, present once in every "cogent" scene.
HELDOUT_COMBOS = (("red", "triangle"), ("green", "diamond"), ("blue", "circle"), ("yellow", "square"),
                  ("purple", "diamond"), ("orange", "triangle"))
_ALLOWED_COLORS = {s: tuple(c for c in COLORS if (c, s) not in HELDOUT_COMBOS) for s in SHAPES}
_HELDOUT_STREAM = 4  # side rng stream default_rng([seed, split, idx, 4]); 1, 2: ShapesWorld, 3: scene_edits
_SS = 4  # supersampling factor of the drawing: anti-aliased edges
_N_OBJECTS_P = (0.04, 0.32, 0.32, 0.32)  # probability of 1, 2, 3, 4 objects


@dataclass(frozen=True)
class ShapeObject:
    shape: str  # one of SHAPES
    color: str  # a key of COLORS
    size: str  # one of SIZES
    cell: tuple[int, int]  # (row, col) on the 3×3 grid


def is_heldout(obj: ShapeObject) -> bool:
    """Whether ``obj``'s (colour, shape) is one of ``HELDOUT_COMBOS`` (only "cogent" scenes hold one)."""
    return (obj.color, obj.shape) in HELDOUT_COMBOS


def _relation(a: ShapeObject, b: ShapeObject) -> str:
    """Where ``a`` lies relative to ``b`` in words ("above", "to the left of", ...)."""
    (ra, ca), (rb, cb) = a.cell, b.cell
    vertical = "above" if ra < rb else "below" if ra > rb else ""
    horizontal = "to the left of" if ca < cb else "to the right of" if ca > cb else ""
    if vertical and horizontal:
        return f"{vertical} and {horizontal}"
    return vertical or horizontal


def perturb(objects: list[ShapeObject], rng: np.random.Generator) -> list[ShapeObject]:
    """The scene with exactly one change that its captions would state differently; the change never
    makes a held-out (colour, shape) combo (``HELDOUT_COMBOS``)."""
    objs = list(objects)
    i = int(rng.integers(len(objs)))
    o = objs[i]
    kinds = ["color", "shape", "size", "move"]
    if len(objs) > 1:
        kinds += ["swap_colors", "swap_cells"]
    kind = kinds[rng.integers(len(kinds))]
    if kind == "color":
        objs[i] = replace(o, color=rng.choice([c for c in _ALLOWED_COLORS[o.shape] if c != o.color]).item())
    elif kind == "shape":
        shapes = [s for s in SHAPES if s != o.shape and o.color in _ALLOWED_COLORS[s]]
        objs[i] = replace(o, shape=rng.choice(shapes).item())
    elif kind == "size":
        objs[i] = replace(o, size="large" if o.size == "small" else "small")
    elif kind == "move":
        free = [(r, c) for r in range(3) for c in range(3) if (r, c) not in {x.cell for x in objs}]
        objs[i] = replace(o, cell=free[rng.integers(len(free))])
    else:
        j = int(rng.choice([j for j in range(len(objs)) if j != i]))
        a, b = objs[i], objs[j]
        allowed = b.color in _ALLOWED_COLORS[a.shape] and a.color in _ALLOWED_COLORS[b.shape]
        if kind == "swap_colors" and a.color != b.color and allowed:
            objs[i], objs[j] = replace(a, color=b.color), replace(b, color=a.color)
        elif kind == "swap_cells" and (a.shape, a.color, a.size) != (b.shape, b.color, b.size):
            objs[i], objs[j] = replace(a, cell=b.cell), replace(b, cell=a.cell)
        else:  # the swap would change nothing or make a held-out combo: recolour instead
            objs[i] = replace(a, color=rng.choice([c for c in _ALLOWED_COLORS[a.shape] if c != a.color]).item())
    return objs


class ShapesWorld:
    """Deterministic synthetic retrieval split: ``ds[i] -> (PIL.Image, [5 captions])``.

    Args:
        split: "train", "val", "test" (no held-out combo) or "cogent" (one in every scene).
        seed: scene seed; the same (seed, split, i) always gives the same sample.
        image_size: side of the square RGB image in pixels (64 by default).
        size: number of images (defaults to the Flickr30K-like split size).
    """

    captions_per_image = 5

    def __init__(self, split: str = "test", seed: int = 0, image_size: int = 64, size: int | None = None):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {sorted(SPLITS)}")
        if image_size < 16:
            raise ValueError(f"image_size={image_size} is too small to draw shapes; use 16 px or more")
        if size is not None and size <= 0:
            raise ValueError(f"size={size} must be positive")
        self.split, self.seed, self.image_size = split, seed, image_size
        self.size = SPLITS[split] if size is None else size

    def __len__(self) -> int:
        return self.size

    def _rng(self, idx: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx])

    def scene(self, idx: int) -> list[ShapeObject]:
        """The objects of image ``idx`` (what the captions describe)."""
        if not 0 <= idx < self.size:
            raise IndexError(f"index {idx} out of range for {self.split} split of {self.size} images")
        rng = self._rng(idx)
        n = int(rng.choice(4, p=_N_OBJECTS_P)) + 1
        cells = rng.choice(9, size=n, replace=False)
        objects = [
            ShapeObject(
                shape=SHAPES[rng.integers(len(SHAPES))],
                color=list(COLORS)[rng.integers(len(COLORS))],
                size=SIZES[rng.integers(len(SIZES))],
                cell=(int(c) // 3, int(c) % 3),
            )
            for c in cells
        ]
        return self._hold_out(objects, idx)

    def _hold_out(self, objects: list[ShapeObject], idx: int) -> list[ShapeObject]:
        """Recolour held-out combos away; in "cogent", then make one object a held-out combo."""
        held = [i for i, o in enumerate(objects) if is_heldout(o)]
        if not held and self.split != "cogent":
            return objects
        side = np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx, _HELDOUT_STREAM])
        for i in held:
            allowed = _ALLOWED_COLORS[objects[i].shape]
            objects[i] = replace(objects[i], color=allowed[side.integers(len(allowed))])
        if self.split == "cogent":
            i = int(side.integers(len(objects)))
            color, shape = HELDOUT_COMBOS[side.integers(len(HELDOUT_COMBOS))]
            objects[i] = replace(objects[i], color=color, shape=shape)
        return objects

    def __getitem__(self, idx: int) -> tuple[Image.Image, list[str]]:
        objects = self.scene(idx)
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx, 1])  # drawing + wording
        return self._render(objects, rng), self._captions(objects, rng)

    def captions(self, idx: int) -> list[str]:
        """``self[idx][1]`` without drawing the image (the same random draws, none of the pixels)."""
        objects = self.scene(idx)
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx, 1])  # as in __getitem__
        self._layout(objects, rng)
        return self._captions(objects, rng)

    def variant(self, idx: int) -> tuple[Image.Image, list[str]]:
        """A hard negative for image ``idx``: its scene with one thing changed (a colour, a shape, a
        size, a position, or two objects' colours or places swapped), drawn and captioned anew.

        Training on such pairs side by side makes the contrast hinge on binding and position rather
        than on which colours are present (NegCLIP, Yuksekgonul et al., ICLR 2023, does the same with
        text-side negatives).
        """
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx, 2])
        objects = perturb(self.scene(idx), rng)
        return self._render(objects, rng), self._captions(objects, rng)

    def sample_with_state(self, idx: int) -> tuple[Image.Image, list[str], dict]:
        """``self[idx]`` plus the bit-generator state right before its captions are drawn.

        ``replay_captions(objects, state)`` on an edited scene then draws the same templates, object
        order and synonyms, so only the words the edit touches change (mmgeo.data.scene_edits).
        """
        objects = self.scene(idx)
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], idx, 1])  # as in __getitem__
        image = self._render(objects, rng)
        state = rng.bit_generator.state
        return image, self._captions(objects, rng), state

    def replay_captions(self, objects: list[ShapeObject], state: dict) -> list[str]:
        """The five captions of ``objects`` drawn from ``state`` (see ``sample_with_state``)."""
        bit_generator = getattr(np.random, state["bit_generator"])()
        bit_generator.state = state
        return self._captions(objects, np.random.Generator(bit_generator))

    # ---------------------------------------------------------------- drawing
    def _layout(self, objects: list[ShapeObject], rng: np.random.Generator) -> tuple:
        """Every random draw of a drawing, in order: background, then per object (radius, centre, colour)."""
        cell = self.image_size * _SS / 3
        bg = tuple(int(v) for v in 225 + rng.integers(-20, 21, size=3))
        shapes = []
        for obj in objects:
            radius = cell * (0.24 if obj.size == "small" else 0.42) * rng.uniform(0.92, 1.08)
            jitter = max(0.0, cell * 0.47 - radius)  # keep the shape inside its cell
            cy = (obj.cell[0] + 0.5) * cell + rng.uniform(-jitter, jitter)
            cx = (obj.cell[1] + 0.5) * cell + rng.uniform(-jitter, jitter)
            color = tuple(int(np.clip(c + rng.integers(-15, 16), 0, 255)) for c in COLORS[obj.color])
            shapes.append((obj.shape, radius, cx, cy, color))
        return bg, shapes

    def _render(self, objects: list[ShapeObject], rng: np.random.Generator) -> Image.Image:
        side = self.image_size * _SS
        bg, shapes = self._layout(objects, rng)
        img = Image.new("RGB", (side, side), bg)
        draw = ImageDraw.Draw(img)
        for shape, r, cx, cy, color in shapes:
            if shape == "circle":
                draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
            elif shape == "square":
                s = r * 0.85
                draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=color)
            elif shape == "triangle":
                draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=color)
            else:  # diamond
                draw.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=color)
        return img.reduce(_SS)  # box-filter average of ss×ss blocks: anti-aliased, 10× cheaper than LANCZOS

    # ---------------------------------------------------------------- captions
    @staticmethod
    def _noun(obj: ShapeObject, rng: np.random.Generator) -> str:
        size = SIZE_WORDS[obj.size][rng.integers(2)]
        return f"a {size} {obj.color} {obj.shape}"

    @staticmethod
    def _where(obj: ShapeObject, rng: np.random.Generator) -> str:
        return CELL_PHRASES[obj.cell][rng.integers(2)]

    @staticmethod
    def _join(parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else " , ".join(parts[:-1]) + " and " + parts[-1]

    def _captions(self, objects: list[ShapeObject], rng: np.random.Generator) -> list[str]:
        templates = [self._t_list, self._t_there_is, self._t_where_first, self._t_relations, self._t_count]
        out = []
        for t in rng.permutation(len(templates)):
            order = [objects[i] for i in rng.permutation(len(objects))]
            out.append(templates[t](order, rng))
        return out

    def _t_list(self, objs, rng):  # "a small red circle in the top left and a big blue square ..."
        return self._join([f"{self._noun(o, rng)} {self._where(o, rng)}" for o in objs])

    def _t_there_is(self, objs, rng):  # "there is a small red circle in the top left , ..."
        return "there is " + self._join([f"{self._noun(o, rng)} {self._where(o, rng)}" for o in objs])

    def _t_where_first(self, objs, rng):  # "in the top left a small red circle , ..."
        return self._join([f"{self._where(o, rng)} {self._noun(o, rng)}" for o in objs])

    def _t_relations(self, objs, rng):  # "a small red circle in the top left above a big blue square"
        first = f"{self._noun(objs[0], rng)} {self._where(objs[0], rng)}"
        rest = [f"{self._noun(o, rng)} {_relation(o, objs[0])} it" for o in objs[1:]]
        return first if not rest else first + " with " + self._join(rest)

    def _t_count(self, objs, rng):  # "two shapes : a big blue square in the center and ..."
        noun = "shape" if len(objs) == 1 else "shapes"
        body = self._join([f"{self._noun(o, rng)} {self._where(o, rng)}" for o in objs])
        return f"{COUNT_WORDS[len(objs) - 1]} {noun} : {body}"

    # ---------------------------------------------------------------- vocabulary
    @staticmethod
    def vocabulary() -> list[str]:
        """Every word the captions can contain, sorted (for a word-level tokenizer)."""
        words = {"a", "and", "there", "is", "with", "it", "shape", "shapes", ",", ":", "above", "below"}
        words |= {"to", "the", "left", "right", "of"}
        words |= set(SHAPES) | set(COLORS) | set(COUNT_WORDS)
        words |= {w for pair in SIZE_WORDS.values() for w in pair}
        words |= {w for phrases in CELL_PHRASES.values() for p in phrases for w in p.split()}
        return sorted(words)
