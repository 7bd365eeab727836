"""Scene-generated negatives and rewrites of the shapes world, checked by the caption grammar."""

import numpy as np
import pytest

from mmgeo.data import ShapesWorld
from mmgeo.data.scene_edits import EDIT_TYPES, REWRITE_TYPES, edit_image, edited_scenes, shapes_edit_items
from mmgeo.data.shapes import HELDOUT_COMBOS, ShapeObject
from mmgeo.data.shapes_grammar import SIZE_OF_WORD, align, describes, parse

WORLD = ShapesWorld("test")


@pytest.fixture(scope="module")
def edits():
    return [edit_image(WORLD, i) for i in range(200)]


def _diff(a: str, b: str) -> list[tuple[str, str]]:
    ta, tb = a.split(), b.split()
    assert len(ta) == len(tb), (a, b)
    return [(x, y) for x, y in zip(ta, tb) if x != y]


def test_sample_with_state_is_getitem_and_replays_its_captions():
    for i in (0, 5, 123, 999):
        image, captions, state = WORLD.sample_with_state(i)
        ref_image, ref_captions = WORLD[i]
        assert captions == ref_captions and np.array_equal(np.asarray(image), np.asarray(ref_image))
        assert WORLD.replay_captions(WORLD.scene(i), state) == captions


def test_describes_every_original_caption_and_parses_it_back_word_for_word():
    for i in range(500):
        scene, (_, captions) = WORLD.scene(i), WORLD[i]
        for caption in captions:
            assert parse(caption).render() == caption
            assert describes(caption, scene), (caption, scene)


def test_describes_rejects_false_incomplete_and_ungrammatical_captions():
    red = ShapeObject("circle", "red", "large", (1, 1))
    blue = ShapeObject("square", "blue", "small", (0, 0))
    scene = [red, blue]
    assert describes("a big red circle in the center and a little blue square in the top left", scene)
    assert describes("two shapes : a little blue square at the upper left and a large red circle in the middle", scene)
    assert describes("a large red circle in the center with a small blue square above and to the left of it", scene)
    assert describes("a small blue square in the top left with a big red circle below and to the right of it", scene)
    for false in [
        "a big blue circle in the center and a little red square in the top left",  # colours bound wrongly
        "a big red circle in the center and a little blue square in the top right",  # wrong cell
        "a big red circle in the center",  # incomplete
        "three shapes : a big red circle in the center and a little blue square in the top left",  # count
        "one shapes : a big red circle in the center",  # agreement
        "a large red circle in the center with a small blue square above it",  # only half the relation
        "a large red circle in the center with a small blue square below and to the left of it",
        "a big red circle in the center , a little blue square in the top left",  # list must end in "and"
        "a big red circle and a little blue square",  # no positions
        "a big red circle in the center and a little blue square in the top left and",
        "",
    ]:
        assert not describes(false, scene), false
    # the relation template only fixes positions relative to the first object
    moved = [red, ShapeObject("square", "blue", "small", (0, 0))]
    low = [ShapeObject("circle", "red", "large", (2, 2)), ShapeObject("square", "blue", "small", (0, 1))]
    assert describes("a small blue square in the top left with a big red circle below and to the right of it", moved)
    assert describes("a large red circle in the bottom right with a small blue square above and to the left of it",
                     low)


def test_every_negative_is_false_and_every_rewrite_true(edits):
    n_neg = n_rw = 0
    for e in edits:
        for caption, negatives, rewrites in zip(e.captions, e.negatives, e.rewrites):
            for edit, texts in negatives.items():
                assert edit in EDIT_TYPES and len(texts) == 1
                assert parse(texts[0]) is not None and not describes(texts[0], e.scene), (edit, caption, texts)
                n_neg += 1
            for rewrite, texts in rewrites.items():
                assert rewrite in REWRITE_TYPES and texts[0] != caption and describes(texts[0], e.scene)
                n_rw += 1
    assert n_neg > 200 * 5 * 9 and n_rw > 200 * 5 * 1.8  # most edits are possible for most scenes


def test_swap_and_replace_edits_change_only_the_expected_words(edits):
    for e in edits:
        for caption, negatives in zip(e.captions, e.negatives):
            cap = parse(caption)
            for edit, (neg,) in negatives.items():
                if edit in ("swap_color", "swap_shape"):
                    (a, b), (c, d) = _diff(caption, neg)
                    assert (c, d) == (b, a)  # two words exchanged, nothing else
                elif edit == "swap_size":
                    changes = _diff(caption, neg)
                    assert len(changes) == 2 and all(SIZE_OF_WORD[x] != SIZE_OF_WORD[y] for x, y in changes)
                elif edit in ("replace_color", "replace_shape", "replace_size"):
                    assert len(_diff(caption, neg)) == 1
                elif edit == "replace_object":
                    assert len(_diff(caption, neg)) == 2
                elif edit in ("swap_position", "flip_left_right", "flip_top_bottom"):
                    new = parse(neg)  # same objects, same order, same words for them: only positions moved
                    assert new.template == cap.template
                    assert [m.noun for m in new.mentions] == [m.noun for m in cap.mentions]
                elif edit == "drop_object":
                    new = parse(neg)
                    assert len(new.mentions) == len(cap.mentions) - 1
                    assert new.template == cap.template or len(new.mentions) == 1  # one object: same text
                    assert all(m in cap.mentions for m in new.mentions)


def test_edits_never_bring_in_a_heldout_combo(edits):
    for e in edits:
        own = {(o.color, o.shape) for o in e.scene}
        for negatives in e.negatives:
            for (neg,) in negatives.values():
                combos = {(m.color, m.shape) for m in parse(neg).mentions}
                assert not (combos - own) & set(HELDOUT_COMBOS), neg


def test_impossible_edits_are_skipped_and_counted():
    one = next(i for i in range(len(WORLD)) if len(WORLD.scene(i)) == 1)
    e = edit_image(WORLD, one)
    for negatives, rewrites in zip(e.negatives, e.rewrites):
        assert not {"swap_color", "swap_shape", "swap_size", "swap_position", "drop_object"} & set(negatives)
        assert {"replace_color", "replace_object"} <= set(negatives) and "shuffle_order" not in rewrites
    assert e.unavailable["swap_color"] == e.unavailable["drop_object"] == e.unavailable["shuffle_order"] == 5
    assert edited_scenes(e.scene, "swap_position") == []


def test_item_set_counts_add_up_and_are_deterministic():
    items = shapes_edit_items(WORLD, limit=30)
    assert len(items) == 150 and items.report["images"] == 30 and items.report["captions"] == 150
    for edit in EDIT_TYPES:
        have = sum(edit in it.negatives for it in items)
        assert have + items.report["unavailable"].get(edit, 0) == 150
    again = shapes_edit_items(WORLD, limit=30)
    assert [(it.caption, it.negatives, it.rewrites) for it in again] == [(it.caption, it.negatives, it.rewrites)
                                                                           for it in items]
    assert all(align(parse(it.caption), WORLD.scene(it.image_id)) for it in items)
    other = shapes_edit_items(ShapesWorld("test", seed=1), limit=30)
    assert [it.negatives for it in other] != [it.negatives for it in items]
