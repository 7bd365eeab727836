"""Sub-captions cut by text rules: shapes-world templates and Flickr-style captions."""

import numpy as np
import pytest

from mmgeo.data.caption_parts import (
    fewer_phrases,
    object_phrases,
    objects_only,
    partial_caption,
    plural_count,
    stated_count,
    typed_caption,
    typed_relation,
    with_plurals,
)
from mmgeo.data.shapes import ShapesWorld
from mmgeo.data.shapes_grammar import parse


@pytest.mark.parametrize("caption, phrases", [
    ("a big red circle in the center and a small blue square at the top",
     ["a big red circle in the center", "a small blue square at the top"]),
    ("there is a big red circle in the center , a small blue square at the top and a big green diamond on the left",
     ["a big red circle in the center", "a small blue square at the top", "a big green diamond on the left"]),
    ("two shapes : a big red circle in the center and a small blue square at the top",
     ["a big red circle in the center", "a small blue square at the top"]),
    ("in the top left a small red circle , at the bottom a big blue square",
     ["in the top left a small red circle", "at the bottom a big blue square"]),
    ("a big red circle in the center with a small blue square above and to the left of it",
     ["a big red circle in the center", "a small blue square"]),  # "above ... it" names no object of its own
    # Flickr-style captions: punctuation attached, capitals, a final period
    ("A man in a blue shirt and a woman in a red dress are walking down the street.",
     ["A man in a blue shirt", "a woman in a red dress are walking down the street"]),
    ("A black and white dog runs with a ball in its mouth.", ["A black and white dog runs", "a ball in its mouth"]),
    ("There is a little girl on a swing, a boy pushing her.", ["a little girl on a swing", "a boy pushing her"]),
    ("Two young guys with shaggy hair look at their hands while hanging out in the yard.",
     ["Two young guys with shaggy hair look at their hands while hanging out in the yard"]),
    ("A dog runs through the grass, in the sun.", ["A dog runs through the grass , in the sun"]),  # no noun: glued
])
def test_object_phrases(caption, phrases):
    assert object_phrases(caption) == phrases


def test_partial_captions_of_the_shapes_world_parse_and_name_fewer_objects():
    """Every sub-caption of a shapes caption (cells kept) is a sentence of the grammar naming 1-2 of its objects."""
    world = ShapesWorld("train", image_size=48, size=60)
    rng = np.random.default_rng(0)
    seen = 0
    for i in range(len(world)):
        for caption in world[i][1]:
            sub = partial_caption(caption, rng)
            if len(world.scene(i)) < 2:
                assert sub is None
                continue
            parsed, full = parse(sub), parse(caption)
            assert sub != caption and 1 <= len(sub.split(" and ")) <= 2
            if full.template != "relations":  # relation pieces lose their place: not a grammar sentence alone
                assert parsed is not None and len(parsed.mentions) < len(full.mentions)
                assert set(parsed.mentions) <= set(full.mentions)
                seen += 1
    assert seen > 100


def test_a_single_phrase_gives_no_sub_caption():
    assert partial_caption("a big red circle in the center", np.random.default_rng(0)) is None
    assert partial_caption("A dog.", np.random.default_rng(0)) is None


@pytest.mark.parametrize("caption, count", [
    ("two shapes : a big blue square in the center and a small red circle on the left", 2),
    ("one shape : a small red circle on the left", 1),
    ("Four people: two men and two women on a bench.", 4),  # Flickr-style, if ever written so
    ("two men sit on a bench", None),  # a count of one kind of thing, not of the picture
    ("a small red circle on the left", None),
    ("there is a dog : it runs", None),
])
def test_stated_count(caption, count):
    assert stated_count(caption) == count


def test_fewer_phrases_leave_one_object_of_a_shapes_caption_out():
    """Each copy is a sentence of the grammar naming all of the caption's objects but one (cells kept)."""
    world = ShapesWorld("train", image_size=48, size=40)
    rng = np.random.default_rng(0)
    seen = 0
    for i in range(len(world)):
        for caption in world[i][1]:
            full = parse(caption)
            copies = fewer_phrases(caption, rng, n=2)
            assert len(set(copies)) == len(copies) and (1 <= len(copies) <= 2 if len(full.mentions) > 1 else not copies)
            for sub in copies:
                if full.template == "relations":  # relation pieces lose their place: not a sentence alone
                    continue
                parsed = parse(sub)
                assert parsed is not None and len(parsed.mentions) == len(full.mentions) - 1
                assert set(parsed.mentions) <= set(full.mentions)
                seen += 1
    assert seen > 50


@pytest.mark.parametrize("caption, expected", [
    ("A man in a red shirt and a woman with a dog.", {"a woman and a dog", "A man in a red shirt and a dog",
                                                     "A man in a red shirt and a woman"}),
    ("Two dogs play, and a child watches them.", {"Two dogs play", "a child"}),
    ("A dog runs on the grass.", set()),
])
def test_fewer_phrases_of_flickr_style_captions(caption, expected):
    out = fewer_phrases(caption, np.random.default_rng(0), n=3)
    assert len(out) == len(expected) and set(out) == expected
    assert len(fewer_phrases(caption, np.random.default_rng(0), n=1)) == min(1, len(expected))


@pytest.mark.parametrize("caption, expected", [
    ("a small red square on the left", "a small square on the left"),
    ("in the top left a Big GREEN circle and a grey dog", "in the top left a Big circle and a dog"),
    ("a large triangle at the top", "a large triangle at the top"),
])
def test_without_colors_leaves_every_other_word(caption, expected):
    from mmgeo.data.caption_parts import without_colors

    assert without_colors(caption) == expected


def test_a_colorless_sub_caption_is_true_of_its_image_by_the_text_rules():
    from mmgeo.data.caption_groups import caption_true_of, phrase_words
    from mmgeo.data.caption_parts import partial_caption, without_colors
    from mmgeo.data.shapes import ShapesWorld

    world, rng = ShapesWorld("train", size=30, image_size=32), np.random.default_rng(0)
    for i in range(30):
        captions = world[i][1]
        sub = partial_caption(captions[0], rng)
        if sub is None:
            continue
        named = [p for c in captions for p in phrase_words(c)]
        assert caption_true_of(phrase_words(without_colors(sub)), named), sub


@pytest.mark.parametrize("caption, typed", [
    ("a big red circle in the center with a small blue square above and to the left of it",
     "a small blue square above and to the left of a big red circle"),
    ("a little red circle at the top with a big green diamond below it",
     "a big green diamond below a little red circle"),
    ("a big red circle in the center and a small blue square at the top", None),  # no phrase placed from another
    ("two shapes : a big red circle in the center and a small blue square at the top", None),
])
def test_typed_relation(caption, typed):
    assert typed_relation(caption, np.random.default_rng(0)) == typed


def test_typed_caption_takes_a_relation_from_the_caption_that_places_one_at_that_share():
    """``relations``: that share of the calls types a relation from whichever caption places an object, the others
    type the drawn caption as before; none placing one, or 0: the drawn caption's own rule, and no draw."""
    drawn = "two shapes : a big red circle in the center and a small blue square at the top"
    captions = [drawn, "a small blue square at the top with a big red circle below it"]
    typed = [typed_caption(drawn, np.random.default_rng(s), captions, relations=0.5) for s in range(200)]
    relation = "a big red circle below a small blue square"
    assert set(typed) == {relation, objects_only(drawn)}
    assert 70 < typed.count(relation) < 130
    assert typed_caption(drawn, np.random.default_rng(0), captions[:1], relations=1.0) == objects_only(drawn)
    rng = np.random.default_rng(0)
    assert typed_caption(drawn, rng, captions, relations=0.0) == objects_only(drawn)
    assert rng.random() == np.random.default_rng(0).random()  # nothing drawn when off


@pytest.mark.parametrize("caption, objects", [
    ("two shapes : a big red circle in the center and a small blue square at the top",
     "two shapes : a big red circle and a small blue square"),  # the count stays
    ("there is a big red circle in the center , a small blue square at the top and a big green diamond on the left",
     "a big red circle , a small blue square and a big green diamond"),
    ("in the top left a small red circle , at the bottom a big blue square",
     "a small red circle and a big blue square"),
    ("a big red circle", None),  # nothing to leave out
    ("A man in a blue shirt and a woman in a red dress are walking down the street.", "A man and a woman"),
])
def test_objects_only(caption, objects):
    assert objects_only(caption) == objects


def test_typed_captions_of_the_shapes_world_are_true_of_their_scene_as_people_read_them():
    """Every typed caption of a shapes caption, read as a typed query (a relation as people mean it, a count as
    stated), is true of the caption's own scene: the rule never writes a false caption."""
    from mmgeo.data.shapes_grammar import RELATIONS, Mention
    from mmgeo.data.shapes_queries import PartialQuery, satisfies_typed

    world = ShapesWorld("train", image_size=48, size=80)
    rng = np.random.default_rng(0)
    kinds = set()
    for i in range(len(world)):
        for caption in world.captions(i):
            typed = typed_caption(caption, rng)
            if typed is None:  # a one-object caption without a place to drop cannot be one
                continue
            toks = typed.split()
            count = stated_count(typed)
            body = toks[3:] if count else toks
            nouns = [Mention(*body[j + 1:j + 4]) for j in range(len(body)) if body[j] == "a"]
            words = " ".join(body[4:-4])
            if words in RELATIONS and len(nouns) == 2:  # "B below A": the mentions are (A, B placed from A)
                kinds.add("relation")
                mentions = (nouns[1], Mention(*body[1:4], relation=words))
            else:
                kinds.add("count" if count else "objects")
                mentions = tuple(nouns)
            assert satisfies_typed(PartialQuery(typed, i, mentions, typed=True, count=count), world.scene(i)), typed
    assert kinds == {"relation", "count", "objects"}


@pytest.mark.parametrize("caption, counted", [
    ("a big yellow circle in the top left and a small yellow circle at the bottom", "two yellow circles"),
    ("three shapes : a big red square on the left , a little red square at the top and a red circle in the center",
     "two red squares"),
    ("a small red circle in the top left with a big red circle below it and a red circle to the right of it",
     "three red circles"),
    ("a black dog and a black dog play in the park", "two black dogs"),
    ("a red circle and a blue circle", None),  # two circles, but not of one kind
    ("a big red circle in the center", None),
])
def test_plural_count(caption, counted):
    assert plural_count(caption) == counted


def test_plural_count_draws_one_of_several_kinds_and_with_plurals_adds_the_nouns_plurals():
    caption = "a red circle , a red circle , a blue square and a blue square"
    drawn = {plural_count(caption, np.random.default_rng(s)) for s in range(20)}
    assert drawn == {"two red circles", "two blue squares"}
    vocab = ShapesWorld.vocabulary()
    assert set(with_plurals(vocab)) - set(vocab) == {"circles", "squares", "triangles", "diamonds"}
    assert with_plurals(["a", "dog", "man"]) == ["a", "dog", "dogs", "man", "men"]


def test_typed_plurals_come_first_at_their_share_and_draw_nothing_when_off():
    world = ShapesWorld("train", size=400, image_size=32)
    named = [c for i in range(400) for c in world.captions(i)[:1] if plural_count(c)]
    assert len(named) > 30  # about one image in six names a kind twice
    for caption in named:
        assert typed_caption(caption, np.random.default_rng(0), plurals=1.0) == \
            plural_count(caption, np.random.default_rng(0))  # the same draw of a kind, when it names several
        half = [typed_caption(caption, np.random.default_rng(s), plurals=0.5) for s in range(40)]
        assert 5 < sum(t == plural_count(caption, np.random.default_rng(s)) for s, t in enumerate(half)) < 35
        a, b = np.random.default_rng(3), np.random.default_rng(3)
        assert typed_caption(caption, a, relations=0.5) == typed_caption(caption, b, relations=0.5, plurals=0.0)
        assert a.random() == b.random()  # off: the same draws as before plurals existed (runs replay)
