"""Evaluation negatives and rewrites of shapes-world captions, generated from the scene (docs/design.md §9).

For each caption of a test image: one minimally edited caption per edit type (``EDIT_TYPES``) that is
false for the image, and meaning-preserving rewrites (``REWRITE_TYPES``) that stay true. Edits that
keep the number of objects are made on the scene and captioned by replaying ShapesWorld's own
caption generator from the random state it used (``ShapesWorld.sample_with_state``): same templates,
object order and synonyms, so only the words the edit touches change ("red"<->"blue", "top left" ->
"top right", and in the relation template the relation words that follow from the new scene).
``drop_object`` and the rewrites edit the parsed caption instead (mmgeo.data.shapes_grammar).

Every negative is checked false for the scene and every rewrite checked true with
``shapes_grammar.describes``; a negative that is still true (possible in the relation template,
which states positions only relative to the first object) is discarded and counted, and the next
candidate edit is tried. The scene graph only *checks* these evaluation negatives; it never makes
training signal (docs/design.md §9). Deterministic given (seed, split, idx).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
from PIL import Image

from mmgeo.data.edit_items import CompositionalItem, ItemSet
from mmgeo.data.shapes import (
    CELL_PHRASES,
    COLORS,
    HELDOUT_COMBOS,
    SHAPES,
    SIZES,
    SPLIT_IDS,
    ShapeObject,
    ShapesWorld,
)
from mmgeo.data.shapes_grammar import Mention, ParsedCaption, align, describes, parse, relation_words

SWAPS = {"swap_color": "color", "swap_shape": "shape", "swap_size": "size"}
REPLACES = {"replace_color": ("color", tuple(COLORS)), "replace_shape": ("shape", SHAPES),
            "replace_size": ("size", SIZES)}
FLIPS = {"flip_left_right": lambda r, c: (r, 2 - c), "flip_top_bottom": lambda r, c: (2 - r, c)}
EDIT_TYPES = (*SWAPS, *REPLACES, "swap_position", *FLIPS, "replace_object", "drop_object")
REWRITE_TYPES = ("shuffle_order", "synonyms")
EDIT_STREAM = 3  # rng stream of the edit choices: default_rng([seed, split, idx, 3]); 1 and 2 are ShapesWorld's


def _kind(o: ShapeObject) -> tuple[str, str, str]:
    return o.shape, o.color, o.size


def _heldout(objects: list[ShapeObject]) -> set[tuple[str, str]]:
    return {(o.color, o.shape) for o in objects} & set(HELDOUT_COMBOS)


def edited_scenes(objects: list[ShapeObject], edit: str) -> list[list[ShapeObject]]:
    """Every scene one ``edit`` away from ``objects`` (same length and object slots), in a fixed order.

    Edits never bring in a held-out (colour, shape) combo the scene lacks (``HELDOUT_COMBOS``): a
    negative must be told apart by binding, not by a combination the model never saw in training.
    """
    objs, out = list(objects), []

    def put(changes: dict[int, dict]) -> None:
        out.append([replace(o, **changes[i]) if i in changes else o for i, o in enumerate(objs)])

    pairs = list(itertools.combinations(range(len(objs)), 2))
    if edit in SWAPS:
        a = SWAPS[edit]
        for i, j in pairs:
            if getattr(objs[i], a) != getattr(objs[j], a):
                put({i: {a: getattr(objs[j], a)}, j: {a: getattr(objs[i], a)}})
    elif edit == "swap_position":
        for i, j in pairs:
            if _kind(objs[i]) != _kind(objs[j]):
                put({i: {"cell": objs[j].cell}, j: {"cell": objs[i].cell}})
    elif edit in REPLACES:
        a, values = REPLACES[edit]
        for i, o in enumerate(objs):
            for v in values:
                if v != getattr(o, a):
                    put({i: {a: v}})
    elif edit in FLIPS:
        taken = {o.cell for o in objs}
        for i, o in enumerate(objs):
            cell = FLIPS[edit](*o.cell)
            if cell != o.cell and cell not in taken:
                put({i: {"cell": cell}})
    elif edit == "replace_object":
        for i, o in enumerate(objs):
            for s, c in itertools.product(SHAPES, COLORS):
                if s != o.shape and c != o.color:
                    put({i: {"shape": s, "color": c}})
    else:
        raise ValueError(f"unknown scene edit {edit!r}; choose one of {EDIT_TYPES[:-1]}")
    return [new for new in out if _heldout(new) <= _heldout(objs)]


def drop_mention(parsed: ParsedCaption, mention: int) -> str | None:
    """The caption without one mentioned object (count word follows), or None for the relation
    template's first object, which every relation refers to."""
    if len(parsed.mentions) < 2 or (parsed.template == "relations" and mention == 0):
        return None
    return parsed.with_mentions(parsed.mentions[:mention] + parsed.mentions[mention + 1:]).render()


def synonyms(parsed: ParsedCaption) -> str:
    """Every size word and cell phrase replaced by its other variant (big<->large, small<->little)."""
    def flip(m: Mention) -> Mention:
        size = next(ws for ws in (("small", "little"), ("large", "big")) if m.size_word in ws)
        where = m.where and next(ps for ps in CELL_PHRASES.values() if m.where in ps)
        return replace(m, size_word=size[1 - size.index(m.size_word)],
                       where=where and where[1 - where.index(m.where)])
    return parsed.with_mentions(tuple(flip(m) for m in parsed.mentions)).render()


def reorder(parsed: ParsedCaption, order: tuple[int, ...], scene: list[ShapeObject],
            owners: tuple[int, ...]) -> str:
    """The caption with its objects in ``order``. In the relation template the new first object gets
    its cell phrase and the others their relation to it (``owners``: scene index of each mention)."""
    ms = [parsed.mentions[k] for k in order]
    if parsed.template == "relations":
        objs = [scene[owners[k]] for k in order]
        first = replace(ms[0], where=ms[0].where or CELL_PHRASES[objs[0].cell][0], relation=None)
        ms = [first] + [replace(m, where=None, relation=relation_words(o, objs[0])) for m, o in zip(ms[1:], objs[1:])]
    return parsed.with_mentions(tuple(ms)).render()


@dataclass
class ImageEdits:
    """The edits of one image: per caption ``{edit_type: [negative]}`` and ``{rewrite_type: [rewrite]}``."""

    idx: int
    image: Image.Image
    scene: list[ShapeObject]
    captions: list[str]
    negatives: list[dict[str, list[str]]]
    rewrites: list[dict[str, list[str]]]
    discarded: Counter = field(default_factory=Counter)  # candidate negatives still true for the scene
    unavailable: Counter = field(default_factory=Counter)  # captions left without a negative / rewrite


def edit_image(world: ShapesWorld, idx: int) -> ImageEdits:
    """Negatives and rewrites of every caption of ``world[idx]`` (module docstring)."""
    image, captions, state = world.sample_with_state(idx)
    scene = world.scene(idx)
    if world.replay_captions(scene, state) != captions:
        raise RuntimeError("ShapesWorld.replay_captions no longer reproduces its captions; keep "
                           "sample_with_state in step with __getitem__ (mmgeo/data/shapes.py)")
    parsed = [parse(c) for c in captions]
    owners = [p and align(p, scene) for p in parsed]
    bad = [c for c, o in zip(captions, owners) if o is None]
    if bad:
        raise RuntimeError(f"the caption checker does not accept {bad[0]!r} for its own scene {scene}; update "
                           "mmgeo/data/shapes_grammar.py to the caption templates of mmgeo/data/shapes.py")
    rng = np.random.default_rng([world.seed, SPLIT_IDS[world.split], idx, EDIT_STREAM])
    scenes = {edit: edited_scenes(scene, edit) for edit in EDIT_TYPES if edit != "drop_object"}
    replays: dict[tuple, list[str]] = {}

    def replayed(edited: list[ShapeObject], ci: int) -> str:  # caption ci of an edited scene
        if tuple(edited) not in replays:
            replays[tuple(edited)] = world.replay_captions(edited, state)
        return replays[tuple(edited)][ci]

    out = ImageEdits(idx, image, scene, captions, [], [])
    for ci, (caption, p, own) in enumerate(zip(captions, parsed, owners)):
        negs: dict[str, list[str]] = {}
        for edit in EDIT_TYPES:  # candidates in random order; the first one false for the scene is kept
            n = len(scene) if edit == "drop_object" else len(scenes[edit])
            for k in rng.permutation(n):
                neg = drop_mention(p, k) if edit == "drop_object" else replayed(scenes[edit][k], ci)
                if neg is None:
                    continue
                if describes(neg, scene):
                    out.discarded[edit] += 1
                    continue
                negs[edit] = [neg]
                break
            else:
                out.unavailable[edit] += 1
        rws: dict[str, list[str]] = {}
        for rewrite in REWRITE_TYPES:
            if rewrite == "synonyms":
                candidates = [synonyms(p)]
            else:
                orders = [o for o in itertools.permutations(range(len(scene))) if o != tuple(range(len(scene)))]
                candidates = [reorder(p, orders[k], scene, own) for k in rng.permutation(len(orders))]
            for c in candidates:
                if c != caption and describes(c, scene):
                    rws[rewrite] = [c]
                    break
                out.discarded[rewrite] += c != caption  # a rewrite that is no longer true
            else:
                out.unavailable[rewrite] += 1
        out.negatives.append(negs)
        out.rewrites.append(rws)
    return out


def shapes_edit_items(world: ShapesWorld, limit: int | None = None, progress: bool = False) -> ItemSet:
    """Suite items for the first ``limit`` images of ``world`` (all by default), one per caption.

    ``report``: images, captions, and by type the negatives ``discarded`` (still true for the
    scene) and captions ``unavailable`` (edit impossible for the scene, e.g. a swap with one object).
    """
    from tqdm.auto import tqdm

    n = len(world) if limit is None else min(limit, len(world))
    items, discarded, unavailable = ItemSet(), Counter(), Counter()
    for idx in tqdm(range(n), desc="scene edits", unit="img", disable=not progress):
        e = edit_image(world, idx)
        discarded.update(e.discarded)
        unavailable.update(e.unavailable)
        items += [CompositionalItem(e.image, c, neg, rw, image_id=idx)
                  for c, neg, rw in zip(e.captions, e.negatives, e.rewrites)]
    order = EDIT_TYPES + REWRITE_TYPES
    items.report = {"images": n, "captions": len(items),
                    "discarded": {k: discarded[k] for k in order if discarded[k]},
                    "unavailable": {k: unavailable[k] for k in order if unavailable[k]}}
    return items
