"""Rule-based caption edits (NegCLIP-style text negatives) on Flickr-style and shapes-world captions."""

import re
from collections import Counter

import numpy as np
import pytest

from mmgeo.data import ShapesWorld
from mmgeo.data.caption_edits import _NOUN_GROUPS, ALL_EDIT_KINDS, EDIT_KINDS, NOUNS, caption_negatives, edit_caption
from mmgeo.data.shapes_grammar import describes, parse

# Flickr30K-style sentences (written for these tests): colours, sizes, nouns, relations, case, punctuation.
FLICKR = [
    "A man in a blue shirt is standing next to a woman in a red dress .",
    "Blue jeans and a red shirt hang on a line .",
    "Two young boys in orange shirts play with a black dog in front of a wooden fence.",
    "A little girl in a pink dress is sitting on the lap of a big man.",
    "An old woman with a gray scarf walks her dog down the street.",
    "A dog jumps over a log to catch a frisbee.",
    "The brown horse is standing behind the white fence , next to a tree .",
    "A woman wearing sunglasses and a hat sits on top of a large rock.",
    "Three men in orange vests work on the left side of the road .",
    "A child in a yellow raincoat stands under an umbrella .",
    "A RED CAR AND A BLUE BUS",
    "A man's black dog and a white cat play in the grass.",
    "A young man in a grey t-shirt and a green cap rides a bike .",
    "A girl sits on a park bench .",
]
SWAPS = ("swap_attribute", "swap_noun")


def _edit(caption, kind, seed=0, **kw):
    return edit_caption(caption, kind, np.random.default_rng(seed), **kw)


def _bag(text):
    """Multiset of lower-case words, a/an as one word (the article follows the word after it)."""
    return Counter("a" if w == "an" else w for w in re.findall(r"[^\W\d_]+(?:-[^\W\d_]+)*", text.lower()))


@pytest.mark.parametrize("caption, kind, expected", [
    (FLICKR[0], "swap_attribute", "A man in a red shirt is standing next to a woman in a blue dress ."),
    (FLICKR[1], "swap_attribute", "Red jeans and a blue shirt hang on a line ."),  # case stays with the position
    (FLICKR[2], "swap_attribute", "Two young boys in black shirts play with an orange dog in front of a wooden fence."),
    (FLICKR[2], "flip_relation", "Two young boys in orange shirts play with a black dog behind a wooden fence."),
    (FLICKR[3], "swap_attribute", "A big girl in a pink dress is sitting on the lap of a little man."),
    (FLICKR[5], "flip_relation", "A dog jumps under a log to catch a frisbee."),
    (FLICKR[5], "swap_noun", "A frisbee jumps over a log to catch a dog."),
    (FLICKR[6], "flip_relation", "The brown horse is standing in front of the white fence , next to a tree ."),
    (FLICKR[6], "swap_attribute", "The white horse is standing behind the brown fence , next to a tree ."),
    (FLICKR[7], "flip_relation", "A woman wearing sunglasses and a hat sits underneath a large rock."),  # phrase
    (FLICKR[8], "flip_relation", "Three men in orange vests work on the right side of the road ."),
    (FLICKR[9], "flip_relation", "A child in a yellow raincoat stands over an umbrella ."),
    (FLICKR[10], "swap_attribute", "A BLUE CAR AND A RED BUS"),
    (FLICKR[10], "swap_noun", "A RED BUS AND A BLUE CAR"),
    (FLICKR[11], "swap_attribute", "A man's white dog and a black cat play in the grass."),
    (FLICKR[12], "swap_attribute", "A young man in a green t-shirt and a grey cap rides a bike ."),
    (FLICKR[13], "swap_noun", "A bench sits on a park girl ."),  # "park" modifies "bench": not swapped
    ("a little orange triangle on the left and a small red square in the top right", "swap_attribute",
     "a little red triangle on the left and a small orange square in the top right"),  # little ~ small: kept
    ("a little orange triangle on the left and a small red square in the top right", "swap_noun",
     "a little orange square on the left and a small red triangle in the top right"),
])
def test_hand_checked_edits(caption, kind, expected):
    assert all(_edit(caption, kind, seed) == expected for seed in range(5))  # the only candidate


def test_edits_with_several_candidates_pick_one_of_them():
    cap = "a big purple circle in the top right and a small yellow square at the lower right"
    outs = {_edit(cap, "swap_attribute", s) for s in range(30)}
    assert outs == {"a big yellow circle in the top right and a small purple square at the lower right",
                    "a small purple circle in the top right and a big yellow square at the lower right"}
    outs = {_edit(cap, "flip_relation", s) for s in range(40)}
    assert outs == {"a big purple circle in the bottom right and a small yellow square at the lower right",
                    "a big purple circle in the top left and a small yellow square at the lower right",
                    "a big purple circle in the top right and a small yellow square at the upper right",
                    "a big purple circle in the top right and a small yellow square at the lower left"}
    outs = {_edit(cap, "replace_noun", s) for s in range(40)}
    shapes = "|".join(_NOUN_GROUPS["shape"].split())
    assert len(outs) == 6 and all(
        re.fullmatch(rf"a big purple ({shapes}) in the top right and a small yellow ({shapes}) at the lower right",
                     o) for o in outs)


def test_replacements_keep_number_group_and_article():
    for s in range(20):
        out = _edit("An elephant walks .", "replace_noun", s)
        m = re.fullmatch(r"(An?) (\w+) walks \.", out)
        animal = m.group(2)
        assert animal != "elephant" and animal in _NOUN_GROUPS["animal"].split()
        assert m.group(1) == ("An" if animal[0] in "aeiou" else "A")
        out = _edit("Two women walk .", "replace_noun", s)  # a plural stays plural
        word = re.fullmatch(r"Two (\w+) walk \.", out).group(1)
        assert word != "women" and NOUNS[word] == ("person", "p")
    sizes = {_edit("A big dog runs .", "replace_attribute", s) for s in range(30)}
    assert sizes == {"A small dog runs .", "A little dog runs .", "A tiny dog runs ."}  # the opposite size
    colours = {_edit("An orange hat .", "replace_attribute", s) for s in range(60)}
    assert "A blue hat ." in colours and all(re.fullmatch(r"An? \w+ hat \.", c) for c in colours)
    assert "An orange hat ." not in colours


@pytest.mark.parametrize("caption, kind", [
    ("A woman in a red dress is dancing .", "swap_attribute"),  # one colour
    ("A big dog and a large cat .", "swap_attribute"),  # synonyms: no change of meaning
    ("A gray cat next to a grey dog .", "swap_attribute"),
    ("Two women and a man walk .", "swap_noun"),  # plural vs singular
    ("A dog and a dog .", "swap_noun"),
    (FLICKR[0], "flip_relation"),
    ("Someone is smiling !", "replace_attribute"),
    ("Someone is smiling !", "replace_noun"),
    ("", "swap_noun"),
])
def test_none_when_the_kind_does_not_apply(caption, kind):
    assert _edit(caption, kind) is None


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown caption edit kind"):
        _edit(FLICKR[0], "negate")
    with pytest.raises(ValueError, match="choose from"):
        caption_negatives(FLICKR[0], np.random.default_rng(0), 2, kinds=("swap_noun", "paraphrase"))


def _skeleton(text):
    return re.sub(r"[^\W\d_]+(?:-[^\W\d_]+)*", "w", text)


def _all_captions():
    ds = ShapesWorld("test", size=40)
    return FLICKR + [c for i in range(len(ds)) for c in ds[i][1]]


def test_every_edit_differs_and_swaps_keep_the_bag_of_words():
    applied = Counter()
    for i, cap in enumerate(_all_captions()):
        for kind in EDIT_KINDS:
            out = _edit(cap, kind, i)
            if out is None:
                continue
            applied[kind] += 1
            assert out != cap
            if kind != "flip_relation":  # "behind" <-> "in front of" changes the word count
                assert _skeleton(out) == _skeleton(cap)  # spacing, punctuation, number of words kept
            if kind in SWAPS:
                assert _bag(out) == _bag(cap), (cap, out)
            else:
                assert _bag(out) != _bag(cap)
    assert all(applied[k] >= 10 for k in EDIT_KINDS), applied


def test_shapes_captions_stay_in_the_shapes_vocabulary():
    vocab = set(ShapesWorld.vocabulary())
    ds = ShapesWorld("test", size=30)
    for i in range(len(ds)):
        for cap in ds[i][1]:
            for neg in caption_negatives(cap, np.random.default_rng(i), n=5, vocabulary=vocab):
                assert set(neg.split()) <= vocab, neg
            assert len(caption_negatives(cap, np.random.default_rng(i), n=3, vocabulary=vocab)) == 3


def test_negatives_are_distinct_differ_and_are_deterministic():
    for i, cap in enumerate(_all_captions()):
        negs = caption_negatives(cap, np.random.default_rng(i), n=4)
        assert negs == caption_negatives(cap, np.random.default_rng(i), n=4)
        assert len(set(negs)) == len(negs) and cap not in negs
        assert 1 <= len(negs) <= 4
    assert caption_negatives("Someone is smiling !", np.random.default_rng(0), n=3) == []
    only_swaps = caption_negatives(FLICKR[0], np.random.default_rng(0), n=5, kinds=SWAPS)
    assert all(_bag(n) == _bag(FLICKR[0]) for n in only_swaps) and len(only_swaps) >= 2
    seeds = {tuple(caption_negatives(FLICKR[2], np.random.default_rng(s), n=2)) for s in range(10)}
    assert len(seeds) > 1  # the seed matters


def test_kind_weights_make_a_kind_likelier_and_bad_weights_are_refused():
    caption = "a big purple circle in the top right"  # replace_attribute, replace_noun, flip_relation apply

    def shape_share(weights):
        negs = [caption_negatives(caption, np.random.default_rng(s), n=1, weights=weights)[0] for s in range(400)]
        return sum("circle" not in neg for neg in negs) / len(negs)

    assert 0.2 < shape_share(None) < 0.5  # uniform over the three kinds that apply
    assert shape_share({"replace_noun": 20}) > 0.8  # 20 / 22 expected
    assert shape_share({"flip_relation": 20}) < 0.15
    # no weights: the very draws of the uniform code path (runs made before weights replay)
    assert caption_negatives(caption, np.random.default_rng(3), n=2) == \
        caption_negatives(caption, np.random.default_rng(3), n=2, weights={})
    for weights, words in [({"replace_nouns": 2}, "unknown caption edit kind"), ({"replace_noun": 0}, "positive"),
                           ({"replace_noun": float("nan")}, "positive")]:
        with pytest.raises(ValueError, match=words):
            caption_negatives(caption, np.random.default_rng(0), n=1, weights=weights)
    with pytest.raises(ValueError, match="not among the kinds"):
        caption_negatives(caption, np.random.default_rng(0), n=1, kinds=SWAPS, weights={"replace_noun": 2})


@pytest.mark.parametrize("caption, expected", [
    ("a big red circle in the top left with a small blue square below it",
     {"a big red circle in the top left with a small blue square below and to the left of it",
      "a big red circle in the top left with a small blue square below and to the right of it"}),
    ("a blue triangle above a red square",
     {"a blue triangle above and to the left of a red square",
      "a blue triangle above and to the right of a red square"}),
    ("A green square to the left of a yellow circle .",
     {"A green square above and to the left of a yellow circle .",
      "A green square below and to the left of a yellow circle ."}),
])
def test_add_axis_gives_the_relation_its_other_axis(caption, expected):
    assert {_edit(caption, "add_axis", s) for s in range(30)} == expected


@pytest.mark.parametrize("caption", [
    "a blue triangle below and to the left of a red square",  # both axes stated already
    "a small red square in the top right and a big green circle on the left",  # places, no relation
    "A man stands to the left .",  # no "of": not a relation between two objects
])
def test_add_axis_none_without_a_one_axis_relation(caption):
    assert _edit(caption, "add_axis") is None


def test_add_axis_is_false_of_the_scene_in_the_shapes_world():
    """The grammar writes both axes, so a one-axis relation means the other is level: the edit is a negative."""
    ds, edited = ShapesWorld("test", size=200), 0
    for i in range(len(ds)):
        scene = ds.scene(i)
        for cap in ds[i][1]:
            out = _edit(cap, "add_axis", i)
            if out is not None:
                edited += 1
                assert describes(cap, scene) and parse(out) is not None and not describes(out, scene), (cap, out)
    assert edited >= 50, edited


def test_add_axis_is_named_not_drawn_by_default():
    assert "add_axis" not in EDIT_KINDS and "add_axis" in ALL_EDIT_KINDS
    cap = "a blue triangle below a red square"
    drawn = {n for s in range(40) for n in caption_negatives(cap, np.random.default_rng(s), 2)}
    assert not any("and to the" in n for n in drawn)
    drawn = {n for s in range(40) for n in caption_negatives(cap, np.random.default_rng(s), 2, kinds=ALL_EDIT_KINDS)}
    assert any("below and to the" in n for n in drawn)
