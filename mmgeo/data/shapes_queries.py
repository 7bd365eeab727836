"""Partial queries over the shapes world: what people type, and every image that answers it (docs/design.md §9).

A caption of the shapes world names every object of its scene, so any part of it identifies the image. People
search by naming a part: "a big purple circle in the top right". ``make_queries`` draws such queries — one or
two objects of a scene, each with its size, colour, shape and cell, in the grammar's wording (synonyms and
three templates) — and ``relevant_images`` finds every image of the split that satisfies one: the grammar's
parser reads the query (``shapes_grammar.parse``) and ``satisfies`` looks for distinct scene objects, one per
mentioned object, that hold every stated attribute. Other objects of the image may be anything.

``caption_queries`` draws the world's own full captions as queries the same way: a caption with no count word
is as true of an image that holds its objects and more, so its relevant set may hold more than its own image.

``object_queries``, ``relation_queries`` and ``count_queries`` write what people type outside the training
grammar, with no cells: "a red circle" or "a small red circle" (one object of a scene, its size said half the
time), "a big blue triangle below a small red square" (two objects of a scene and where one lies from the other)
and "two shapes: a big green circle and a small purple square" (every object of a scene and how many there are).
The grammar names every object with its size and cell, writes a relation as "... with X below it" and a count with
every object's cell, so these ask whether the model reads the words rather than the grammar's word order. A typed
relation is read as people mean it: "below" states the row only (the object lies in a lower row, any column),
"below and to the left of" both row and column; its relevant set comes from the query's mentions
(``satisfies_typed``), not from a parse of its text.

Limits: a query's relevant set comes from the scene graph, which is what makes it an evaluation and never a
training signal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from mmgeo.data.shapes import CELL_PHRASES, COUNT_WORDS, SIZE_WORDS, ShapeObject
from mmgeo.data.shapes_grammar import (
    CELL_OF_PHRASE,
    RELATIONS,
    Mention,
    ParsedCaption,
    align,
    holds,
    parse,
    relation_words,
)

QUERY_TEMPLATES = ("list", "there_is", "where_first")  # the grammar's templates a partial query may take
MENTION_ATTRIBUTES = ("size", "color", "shape", "cell")  # what a mention states about its object
ATTRIBUTES = MENTION_ATTRIBUTES + ("relation", "count")  # what a wrong hit may get wrong (the last two: typed queries)
# typed relation words -> (sign of the row difference, sign of the column difference), None where the words say
# nothing: people's "below" is any lower row, the grammar's "below it" the same column
LOOSE_RELATIONS = {words: (dv or None, dh or None) for words, (dv, dh) in RELATIONS.items()}


@dataclass(frozen=True)
class PartialQuery:
    text: str  # the query as a user would type it
    source: int  # the image it was drawn from (one of its relevant images)
    mentions: tuple[Mention, ...]  # the objects it names, each with a cell phrase (typed: none, or a relation to
    # the first mention)
    typed: bool = False  # written as people type it, outside the grammar: relevance from the mentions
    # (``satisfies_typed``), not from a parse of ``text``
    count: int | None = None  # typed count queries: how many objects the text says the image holds


def _scenes(world, n: int, seed: int, stream: int, min_objects: int, what: str):
    """(rng, image index, scene) of random scenes of ``world`` holding ``min_objects`` or more, each draw from
    ``default_rng([seed, stream, draw number])`` (streams: 0 caption_queries, 1-2 make_queries, 3 relation_queries,
    4 count_queries, 5 object_queries, 6 plural_queries); the caller stops after ``n`` queries, and too many
    passed-over scenes raise."""
    for q in itertools.count():
        if q > 50 * n + 100:
            raise ValueError(f"could not draw {n} {what} from {len(world)} images")
        rng = np.random.default_rng([seed, stream, q])
        idx = int(rng.integers(len(world)))
        scene = world.scene(idx)
        if len(scene) >= min_objects:
            yield rng, idx, scene


def _mention(obj: ShapeObject, rng: np.random.Generator) -> Mention:
    size_word = SIZE_WORDS[obj.size][rng.integers(2)]
    return Mention(size_word, obj.color, obj.shape, where=CELL_PHRASES[obj.cell][rng.integers(2)])


def make_queries(world, n: int, n_objects: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` queries naming ``n_objects`` (1 or 2) objects of random scenes of ``world`` (a ``ShapesWorld``).

    Deterministic in (seed, n_objects, query number); scenes with fewer objects than asked are passed over.
    """
    if n_objects not in (1, 2):
        raise ValueError(f"n_objects={n_objects}: partial queries name 1 or 2 objects")
    out: list[PartialQuery] = []
    if n == 0:
        return out
    for rng, idx, scene in _scenes(world, n, seed, n_objects, n_objects, f"queries of {n_objects} objects"):
        objs = [scene[i] for i in rng.choice(len(scene), size=n_objects, replace=False)]
        template = QUERY_TEMPLATES[rng.integers(len(QUERY_TEMPLATES))]
        mentions = tuple(_mention(o, rng) for o in objs)
        out.append(PartialQuery(ParsedCaption(template, mentions).render(), idx, mentions))
        if len(out) == n:
            return out


def _typed_mention(obj: ShapeObject, rng: np.random.Generator, relation: str | None = None) -> Mention:
    return Mention(SIZE_WORDS[obj.size][rng.integers(2)], obj.color, obj.shape, relation=relation)


def object_queries(world, n: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` typed one-object queries: "a red circle" (any size, anywhere) or, half of them, "a small red circle"
    (that size, anywhere), for an object of a random scene of ``world``. Deterministic in (seed, query number)."""
    out: list[PartialQuery] = []
    if n == 0:
        return out
    for rng, idx, scene in _scenes(world, n, seed, 5, 1, "object queries"):  # 5: this kind's stream
        obj = scene[int(rng.integers(len(scene)))]
        size_word = SIZE_WORDS[obj.size][rng.integers(2)] if rng.random() < 0.5 else None
        mention = Mention(size_word, obj.color, obj.shape)
        out.append(PartialQuery(mention.noun, idx, (mention,), typed=True))
        if len(out) == n:
            return out


def relation_queries(world, n: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` typed relation queries: "{object} {relation} {anchor}" for two objects of random scenes of ``world``
    (the relation in the grammar's words, e.g. "above and to the left of"); the mentions are (anchor, object).

    Deterministic in (seed, query number); one-object scenes are passed over."""
    out: list[PartialQuery] = []
    if n == 0:
        return out
    for rng, idx, scene in _scenes(world, n, seed, 3, 2, "relation queries"):  # 3: this kind's stream
        obj, anchor = (scene[i] for i in rng.choice(len(scene), size=2, replace=False))
        words = relation_words(obj, anchor)
        mentions = (_typed_mention(anchor, rng), _typed_mention(obj, rng, relation=words))
        out.append(PartialQuery(f"{mentions[1].noun} {words} {mentions[0].noun}", idx, mentions, typed=True))
        if len(out) == n:
            return out


def count_queries(world, n: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` typed count queries: "two shapes: {object} and {object}", every object of a random scene of ``world``
    in random order, no cells. Deterministic in (seed, query number)."""
    out = []
    for q in range(n):
        rng = np.random.default_rng([seed, 4, q])  # 4: this kind's stream
        idx = int(rng.integers(len(world)))
        scene = world.scene(idx)
        mentions = tuple(_typed_mention(scene[i], rng) for i in rng.permutation(len(scene)))
        nouns = [m.noun for m in mentions]
        body = nouns[0] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " and " + nouns[-1]
        head = f"{COUNT_WORDS[len(scene) - 1]} {'shape' if len(scene) == 1 else 'shapes'}"
        out.append(PartialQuery(f"{head}: {body}", idx, mentions, typed=True, count=len(scene)))
    return out


def plural_queries(world, n: int, seed: int = 0) -> list[PartialQuery]:
    """``n`` typed queries that count objects of one kind: "two yellow circles" for a random scene of ``world``
    holding two or more objects of one colour and shape (the count is how many it holds, no size, no cell); true of
    every image holding at least that many (one mention per object). The world's own captions never use a
    plural, so a scratch model reads "circles" only when trained with typed plurals (``data.typed_plurals``);
    else these measure how a query it cannot read fares, as typed and corrected (``mmgeo.models.vocab``).
    Deterministic in (seed, query number); a scene without two objects of one kind is passed over."""
    out: list[PartialQuery] = []
    if n == 0:
        return out
    for rng, idx, scene in _scenes(world, n, seed, 6, 2, "plural queries"):  # 6: this kind's stream
        kinds: dict[tuple[str, str], int] = {}
        for obj in scene:
            kinds[(obj.color, obj.shape)] = kinds.get((obj.color, obj.shape), 0) + 1
        many = sorted(k for k, c in kinds.items() if c > 1)
        if not many:
            continue
        color, shape = many[int(rng.integers(len(many)))]
        count = kinds[(color, shape)]
        mentions = (Mention(None, color, shape),) * count
        out.append(PartialQuery(f"{COUNT_WORDS[count - 1]} {color} {shape}s", idx, mentions, typed=True))
        if len(out) == n:
            return out


def _same_object(m: Mention, obj: ShapeObject) -> bool:
    return (m.color, m.shape) == (obj.color, obj.shape) and m.size in (None, obj.size)  # None: no size said


def _lies(words: str, obj: ShapeObject, anchor: ShapeObject) -> bool:
    """Whether ``obj`` lies ``words`` (a typed relation, ``LOOSE_RELATIONS``) from ``anchor``."""
    return all(s is None or s == np.sign(d) for s, d in
               zip(LOOSE_RELATIONS[words], (obj.cell[0] - anchor.cell[0], obj.cell[1] - anchor.cell[1])))


def satisfies_typed(query: PartialQuery, scene: list[ShapeObject]) -> bool:
    """Whether a typed query is true of ``scene``: distinct objects, one per mention, of the stated colour, shape
    and size (when stated), each relation holding from the first mention's object (``LOOSE_RELATIONS``), and the
    scene holding exactly ``query.count`` objects when the query states a count."""
    if query.count is not None and len(scene) != query.count:
        return False
    if not all(any(_same_object(m, o) for o in scene) for m in query.mentions):
        return False
    for perm in itertools.permutations(range(len(scene)), len(query.mentions)):
        objs = [scene[j] for j in perm]
        if all(_same_object(m, o) and (m.relation is None or _lies(m.relation, o, objs[0]))
               for m, o in zip(query.mentions, objs)):
            return True
    return False


def query_images(query: PartialQuery, scenes: list[list[ShapeObject]]) -> np.ndarray:
    """Indices of every scene ``query`` is true of, ascending: ``satisfies_typed`` for a typed query, else
    ``true_images`` of its text."""
    if not query.typed:
        return true_images(query.text, scenes)
    return np.array([i for i, s in enumerate(scenes) if satisfies_typed(query, s)], dtype=np.int64)


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
    right; ties: the first in the scene) and each attribute (``MENTION_ATTRIBUTES``) it differs in -> {attribute:
    {(asked, got), ...}}. A typed query whose closest objects are all right has the count wrong ({"count":
    {(asked, objects in the scene)}}) or a relation ({"relation": {(asked, where it lies: the grammar's words, or
    "the same object")}}). Empty for a hit that holds every mention's object (and, typed, the query is true of)."""
    wrong: dict[str, set[tuple]] = {}
    closest = []
    for m in query.mentions:  # a mention placed by a relation, or typed, has no cell to get wrong
        want = (m.size, m.color, m.shape, CELL_OF_PHRASE[m.where] if m.where is not None else None)
        misses = [{a: (w, h) for a, w, h in zip(MENTION_ATTRIBUTES, want, (o.size, o.color, o.shape, o.cell))
                   if w is not None and w != h} for o in scene]
        best = min(range(len(scene)), key=lambda j: len(misses[j]))
        closest.append(scene[best])
        for a, pair in misses[best].items():
            wrong.setdefault(a, set()).add(pair)
    if wrong or not query.typed or satisfies_typed(query, scene):
        return wrong
    if query.count is not None and len(scene) != query.count:
        return {"count": {(query.count, len(scene))}}
    for m, obj in zip(query.mentions[1:], closest[1:]):
        if m.relation is not None and not _lies(m.relation, obj, closest[0]):
            got = relation_words(obj, closest[0]) if obj is not closest[0] else "the same object"
            wrong.setdefault("relation", set()).add((m.relation, got))
    return wrong


def wrong_attributes(query: PartialQuery, scene: list[ShapeObject]) -> set[str]:
    """The attributes of ``wrong_values``: what a wrong hit gets wrong."""
    return set(wrong_values(query, scene))
