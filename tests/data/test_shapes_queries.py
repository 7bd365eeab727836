"""Partial queries of the shapes world and their relevant sets, checked on hand-made scenes."""

import numpy as np
import pytest

from mmgeo.data.shapes import ShapeObject, ShapesWorld
from mmgeo.data.shapes_grammar import Mention, parse
from mmgeo.data.shapes_queries import (
    PartialQuery,
    caption_queries,
    count_queries,
    make_queries,
    object_queries,
    plural_queries,
    query_images,
    relation_queries,
    relevant_images,
    satisfies,
    true_images,
    wrong_attributes,
    wrong_values,
)

RED_CIRCLE_TL = ShapeObject("circle", "red", "large", (0, 0))
BLUE_SQUARE_C = ShapeObject("square", "blue", "small", (1, 1))
SCENES = [
    [RED_CIRCLE_TL, BLUE_SQUARE_C],  # 0: both
    [RED_CIRCLE_TL],  # 1: the circle alone
    [ShapeObject("square", "red", "large", (0, 0)), BLUE_SQUARE_C],  # 2: a red *square* where the circle was
    [ShapeObject("circle", "red", "small", (0, 0))],  # 3: small, not big
    [ShapeObject("circle", "red", "large", (0, 1)), ShapeObject("circle", "green", "large", (2, 2))],  # 4: wrong cell
    [BLUE_SQUARE_C, ShapeObject("diamond", "yellow", "small", (2, 0)), RED_CIRCLE_TL],  # 5: both, other order, more
]


@pytest.mark.parametrize("text, expect", [
    ("a big red circle in the top left", [0, 1, 5]),
    ("a large red circle at the upper left", [0, 1, 5]),  # synonyms
    ("there is a big red circle in the top left", [0, 1, 5]),
    ("in the top left a big red circle", [0, 1, 5]),
    ("a small blue square in the center", [0, 2, 5]),
    ("a big red circle in the top left and a small blue square in the middle", [0, 5]),
    ("in the center a little blue square and in the top left a big red circle", [0, 5]),
    ("a big red square in the top left and a small blue square in the center", [2]),
    ("a big red circle in the top left and a big red circle in the top left", []),  # two distinct objects needed
    ("a small yellow diamond in the bottom left", [5]),
])
def test_relevant_images_by_hand(text, expect):
    assert relevant_images(text, SCENES).tolist() == expect


def test_relevance_agrees_with_the_grammar_on_full_captions():
    """Every full caption of a scene, whatever its template, is true of that scene, and so is every sub-list of
    the mentions of one that places each object in its cell; a caption the grammar finds a complete description of
    a scene (``describes``) is true of it, and of another scene only when it has no count word."""
    from mmgeo.data.shapes_grammar import describes

    world = ShapesWorld("test", image_size=48, size=40)
    scenes = [world.scene(i) for i in range(len(world))]
    for i in range(len(world)):
        for caption in world[i][1]:
            parsed = parse(caption)
            assert satisfies(parsed, scenes[i]) and i in true_images(caption, scenes)
            if parsed.template in ("list", "there_is", "where_first"):
                for m in parsed.mentions:
                    assert satisfies(parsed.with_mentions((m,)), scenes[i])
            for scene in scenes:
                if describes(caption, scene):
                    assert satisfies(parsed, scene)
                elif parsed.template == "count":
                    assert not satisfies(parsed, scene)


@pytest.mark.parametrize("text, expect", [
    ("a big red circle in the top left", [0, 1, 5]),  # a full caption of scene 1, as true of 0 and 5
    ("one shape : a big red circle in the top left", [1]),  # ... but "one shape" says scene 1 alone
    ("two shapes : a big red circle in the top left and a small blue square in the center", [0]),
    ("a small blue square in the center with a big red circle above and to the left of it", [0, 5]),
    ("a small blue square in the center with a big red circle below it", []),  # the relation is wrong
    ("a big red circle in the top left with a small blue square below and to the right of it", [0, 5]),
])
def test_full_captions_by_hand(text, expect):
    assert true_images(text, SCENES).tolist() == expect


def test_caption_queries_are_the_worlds_captions():
    world = ShapesWorld("test", image_size=48, size=60)
    queries = caption_queries(world, 30, seed=2)
    assert queries == caption_queries(world, 30, seed=2) and queries != caption_queries(world, 30, seed=3)
    for q in queries:
        assert q.text in world.captions(q.source) and q.mentions == parse(q.text).mentions


def test_queries_are_true_of_their_source_and_deterministic():
    world = ShapesWorld("test", image_size=48, size=200)
    scenes = [world.scene(i) for i in range(len(world))]
    for n_objects in (1, 2):
        queries = make_queries(world, 50, n_objects, seed=3)
        assert queries == make_queries(world, 50, n_objects, seed=3)
        for q in queries:
            assert len(parse(q.text).mentions) == n_objects
            assert q.source in relevant_images(q.text, scenes)
    assert make_queries(world, 20, 1, seed=3) != make_queries(world, 20, 1, seed=4)
    with pytest.raises(ValueError, match="1 or 2"):
        make_queries(world, 5, 3)


def test_wrong_attributes_of_a_near_miss():
    q = make_queries(ShapesWorld("test", image_size=48, size=50), 1, 1)[0]
    m = q.mentions[0]
    from mmgeo.data.shapes_grammar import CELL_OF_PHRASE

    same = ShapeObject(m.shape, m.color, m.size, CELL_OF_PHRASE[m.where])
    other_shape = "circle" if m.shape != "circle" else "square"
    assert wrong_attributes(q, [same]) == set()
    assert wrong_attributes(q, [ShapeObject(other_shape, m.color, m.size, same.cell)]) == {"shape"}
    far = ShapeObject(other_shape, m.color, "small" if m.size == "large" else "large", same.cell)
    closer = ShapeObject(m.shape, m.color, m.size, (2, 2) if same.cell != (2, 2) else (0, 0))
    assert wrong_attributes(q, [far, closer]) == {"cell"}  # the closest object decides


def test_a_text_outside_the_grammar_is_refused():
    with pytest.raises(ValueError, match="not a partial query"):
        relevant_images("a red thing somewhere", SCENES)
    with pytest.raises(ValueError, match="not a partial query"):  # a full caption's template: see true_images
        relevant_images("one shape : a big red circle in the top left", SCENES)
    with pytest.raises(ValueError, match="not a sentence of the shapes grammar"):
        true_images("a red thing somewhere", SCENES)
    assert np.array_equal(relevant_images("a big green circle in the bottom right", SCENES), [4])


BIG_RED_CIRCLE, SMALL_BLUE_SQUARE = Mention("big", "red", "circle"), Mention("small", "blue", "square")


def typed_relation(obj: Mention, words: str, anchor: Mention) -> PartialQuery:
    """ "{obj} {words} {anchor}" as people type it (the mentions: the anchor, then the object placed from it)."""
    placed = Mention(obj.size_word, obj.color, obj.shape, relation=words)
    return PartialQuery(f"{obj.noun} {words} {anchor.noun}", 0, (anchor, placed), typed=True)


@pytest.mark.parametrize("obj, words, anchor, expect", [
    (SMALL_BLUE_SQUARE, "below", BIG_RED_CIRCLE, [0, 5]),  # a lower row: the column is not stated
    (SMALL_BLUE_SQUARE, "to the right of", BIG_RED_CIRCLE, [0, 5]),
    (SMALL_BLUE_SQUARE, "below and to the right of", BIG_RED_CIRCLE, [0, 5]),
    (SMALL_BLUE_SQUARE, "below and to the left of", BIG_RED_CIRCLE, []),  # both axes stated: the column is wrong
    (BIG_RED_CIRCLE, "below", SMALL_BLUE_SQUARE, []),
    (BIG_RED_CIRCLE, "above", SMALL_BLUE_SQUARE, [0, 5]),
    (Mention("big", "red", "circle"), "to the left of", Mention("big", "green", "circle"), [4]),
])
def test_typed_relations_by_hand(obj, words, anchor, expect):
    assert query_images(typed_relation(obj, words, anchor), SCENES).tolist() == expect


def test_typed_objects_by_hand():
    """A typed object without a size is true of an image holding that colour and shape at any size, anywhere; with
    one, of that size only."""
    red_circle = Mention(None, "red", "circle")
    assert red_circle.noun == "a red circle" and red_circle.size is None
    anysize = query_images(PartialQuery("a red circle", 0, (red_circle,), typed=True), SCENES).tolist()
    sized = query_images(PartialQuery("a big red circle", 0, (BIG_RED_CIRCLE,), typed=True), SCENES).tolist()
    holds = [i for i, s in enumerate(SCENES) if any((o.color, o.shape) == ("red", "circle") for o in s)]
    assert anysize == holds and set(sized) < set(anysize), (anysize, sized)
    small = [i for i, s in enumerate(SCENES) if any((o.size, o.color, o.shape) == ("small", "red", "circle")
                                                    for o in s) and i not in sized]
    assert small and set(small) <= set(anysize)  # a small red circle only: "a red circle" yes, "a big" one no
    assert wrong_values(PartialQuery("a big red circle", 0, (BIG_RED_CIRCLE,), typed=True), SCENES[small[0]]) == \
        {"size": {("large", "small")}}


def test_typed_counts_by_hand():
    two = PartialQuery("two shapes: a small blue square and a big red circle", 0, (SMALL_BLUE_SQUARE, BIG_RED_CIRCLE),
                       typed=True, count=2)
    assert query_images(two, SCENES).tolist() == [0]  # scene 5 holds both and a third
    one = PartialQuery("one shape: a big red circle", 1, (BIG_RED_CIRCLE,), typed=True, count=1)
    assert query_images(one, SCENES).tolist() == [1]
    assert wrong_values(two, SCENES[5]) == {"count": {(2, 3)}}
    assert wrong_values(two, SCENES[0]) == {}
    assert wrong_values(two, SCENES[2]) == {"shape": {("circle", "square")}}


def test_typed_plurals_by_hand():
    """ "two red circles": at least two distinct red circles, any size, anywhere; one red circle is not enough."""
    scenes = [[RED_CIRCLE_TL, ShapeObject("circle", "red", "small", (2, 2))],  # 0: two, sizes apart
              [RED_CIRCLE_TL, BLUE_SQUARE_C],  # 1: one
              [RED_CIRCLE_TL, ShapeObject("circle", "red", "small", (2, 2)), ShapeObject("circle", "red", "large",
                                                                                        (1, 0))],  # 2: three
              [ShapeObject("circle", "green", "large", (0, 0)), ShapeObject("circle", "red", "small", (2, 2))]]
    two = PartialQuery("two red circles", 0, (Mention(None, "red", "circle"),) * 2, typed=True)
    assert query_images(two, scenes).tolist() == [0, 2]


def test_plural_queries_count_one_kind_of_their_source():
    world = ShapesWorld("test", image_size=48, size=300)
    scenes = [world.scene(i) for i in range(len(world))]
    queries = plural_queries(world, 30, seed=5)
    assert queries == plural_queries(world, 30, seed=5) and len(queries) == 30
    for q in queries:
        kind = (q.mentions[0].color, q.mentions[0].shape)
        held = sum((o.color, o.shape) == kind for o in scenes[q.source])
        assert held >= 2 and len(q.mentions) == held and set(q.mentions) == {Mention(None, *kind)}
        assert q.text == f"{('one', 'two', 'three', 'four')[held - 1]} {kind[0]} {kind[1]}s" and q.typed
        assert q.source in query_images(q, scenes)


def test_a_wrong_relation_is_named_with_where_the_object_lies():
    q = typed_relation(SMALL_BLUE_SQUARE, "above", BIG_RED_CIRCLE)
    assert wrong_values(q, SCENES[0]) == {"relation": {("above", "below and to the right of")}}
    assert wrong_attributes(q, SCENES[1]) == {"color", "shape", "size"}  # no square: the closest is the circle


def test_typed_queries_are_true_of_their_source_outside_the_grammar_and_deterministic():
    world = ShapesWorld("test", image_size=48, size=200)
    scenes = [world.scene(i) for i in range(len(world))]
    for draw in (object_queries, relation_queries, count_queries):
        queries = draw(world, 40, seed=5)
        assert queries == draw(world, 40, seed=5) and queries != draw(world, 40, seed=6)
        for q in queries:
            assert q.typed and parse(q.text) is None  # what people type, not a sentence of the grammar
            assert q.source in query_images(q, scenes)
            assert all(m.where is None for m in q.mentions) and " in the " not in q.text
    for q in relation_queries(world, 40, seed=5):
        words = q.mentions[1].relation
        assert q.text == f"{q.mentions[1].noun} {words} {q.mentions[0].noun}" and q.count is None
    objects = object_queries(world, 40, seed=5)
    assert all(len(q.mentions) == 1 and q.text == q.mentions[0].noun and q.count is None for q in objects)
    assert 10 < sum(q.mentions[0].size_word is None for q in objects) < 30  # a size said half the time
    for q in count_queries(world, 40, seed=5):
        assert q.count == len(scenes[q.source]) == len(q.mentions)
        assert q.text.split(":")[0].endswith(("shape", "shapes"))
