"""Partial queries over the shapes world: what people type, and every image that answers it (docs/design.md §9).

A caption of the shapes world names every object of its scene, so any part of it identifies the image. People
search by naming a part: "a big purple circle in the top right". ``make_queries`` draws such queries — one or
two objects of a scene, each with its size, colour, shape and cell, in the grammar's wording (synonyms and
three templates) — and ``relevant_images`` finds every image of the split that satisfies one: the grammar's
parser reads the query (``shapes_grammar.parse``) and ``satisfies`` looks for distinct scene objects, one per
mentioned object, that hold every stated attribute. Other objects of the image may be anything.

``caption_queries`` draws the world's own full captions as queries the same way: a caption with no count word
is as true of an image that holds its objects and more, so its relevant set may hold more than its own image.

Limits: partial queries state cells, not relations between objects (full captions may); a query's relevant set
comes from the scene graph, which is what makes it an evaluation and never a training signal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from mmgeo.data.shapes import CELL_PHRASES, SIZE_WORDS, ShapeObject
from mmgeo.data.shapes_grammar import CELL_OF_PHRASE, Mention, ParsedCaption, align, holds, parse

QUERY_TEMPLATES = ("list", "there_is", "where_first")  # the grammar's templates a partial query may take
ATTRIBUTES = ("size", "color", "shape", "cell")  # what a mention states about its object


@dataclass(frozen=True)
class PartialQuery:
    text: str  # the query as a user would type it
    source: int  # the image it was drawn from (one of its relevant images)
    mentions: tuple[Mention, ...]  # the objects it names, each with a cell phrase


def _mention(obj: ShapeObject, rng: np.random.Generator) -> Mention:
    size_word = SIZE_WORDS[obj.size][rng.integers(2)]
    return Mention(size_word, obj.color, obj.shape, where=CELL_PHRASES[obj.cell][rng.integers(2)])


def make_queries(world, n: int, n_objects: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` queries naming ``n_objects`` (1 or 2) objects of random scenes of ``world`` (a ``ShapesWorld``).

    Deterministic in (seed, n_objects, query number); scenes with fewer objects than asked are passed over.
    """
    if n_objects not in (1, 2):
        raise ValueError(f"n_objects={n_objects}: partial queries name 1 or 2 objects")
    out = []
    for q in itertools.count():
        if len(out) == n:
            return out
        if q > 50 * n + 100:
            raise ValueError(f"could not draw {n} queries of {n_objects} objects from {len(world)} images")
        rng = np.random.default_rng([seed, n_objects, q])
        idx = int(rng.integers(len(world)))
        scene = world.scene(idx)
        if len(scene) < n_objects:
            continue
        objs = [scene[i] for i in rng.choice(len(scene), size=n_objects, replace=False)]
        template = QUERY_TEMPLATES[rng.integers(len(QUERY_TEMPLATES))]
        mentions = tuple(_mention(o, rng) for o in objs)
        out.append(PartialQuery(ParsedCaption(template, mentions).render(), idx, mentions))


def satisfies(parsed: ParsedCaption, scene: list[ShapeObject]) -> bool:
    """Whether distinct objects of ``scene``, one per mention, hold every attribute the mention states — a cell, or
    a relation to the first mention's object; other objects of the scene may be anything, except that a count
    caption ("two shapes : ...") also states how many objects the scene holds."""
    if parsed.template == "count":
        return align(parsed, scene) is not None
    return any(all(holds(m, scene[j], scene[perm[0]]) for m, j in zip(parsed.mentions, perm))
               for perm in itertools.permutations(range(len(scene)), len(parsed.mentions)))


def _satisfying(parsed: ParsedCaption, scenes: list[list[ShapeObject]]) -> np.ndarray:
    return np.array([i for i, s in enumerate(scenes) if satisfies(parsed, s)], dtype=np.int64)


def true_images(text: str, scenes: list[list[ShapeObject]]) -> np.ndarray:
    """Indices of every scene that ``text`` (a sentence of the grammar: a partial query or a full caption) is true
    of (``satisfies``), ascending."""
    parsed = parse(text)
    if parsed is None:
        raise ValueError(f"not a sentence of the shapes grammar: {text!r}")
    return _satisfying(parsed, scenes)


def relevant_images(text: str, scenes: list[list[ShapeObject]]) -> np.ndarray:
    """Indices of every scene that ``text`` (a partial query in the grammar) is true of, ascending."""
    parsed = parse(text)
    if parsed is None or parsed.template not in QUERY_TEMPLATES:
        raise ValueError(f"not a partial query of the shapes grammar: {text!r}")
    return _satisfying(parsed, scenes)


def caption_queries(world, n: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` of ``world``'s own captions as queries (image and caption drawn at random, deterministic in (seed,
    query number)): full captions, whose relevant set is every image they are true of (``true_images``), not only
    the image they were written for."""
    out = []
    for q in range(n):
        rng = np.random.default_rng([seed, 0, q])  # 0: no partial query kind uses it (they name 1 or 2 objects)
        idx = int(rng.integers(len(world)))
        captions = world.captions(idx)
        text = captions[int(rng.integers(len(captions)))]
        out.append(PartialQuery(text, idx, parse(text).mentions))
    return out


def wrong_values(query: PartialQuery, scene: list[ShapeObject]) -> dict[str, set[tuple]]:
    """What a wrong hit gets wrong, with values: for each mention, the scene's closest object (most attributes
    right; ties: the first in the scene) and each attribute (``ATTRIBUTES``) it differs in -> {attribute:
    {(asked, got), ...}}; empty for a hit that holds every mention's object."""
    wrong: dict[str, set[tuple]] = {}
    for m in query.mentions:  # a mention placed by a relation has no cell to get wrong
        want = (m.size, m.color, m.shape, CELL_OF_PHRASE[m.where] if m.where is not None else None)
        misses = [{a: (w, h) for a, w, h in zip(ATTRIBUTES, want, (o.size, o.color, o.shape, o.cell))
                   if w is not None and w != h} for o in scene]
        for a, pair in min(misses, key=len).items():
            wrong.setdefault(a, set()).add(pair)
    return wrong


def wrong_attributes(query: PartialQuery, scene: list[ShapeObject]) -> set[str]:
    """The attributes of ``wrong_values``: what a wrong hit gets wrong."""
    return set(wrong_values(query, scene))
