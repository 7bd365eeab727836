"""Caption hard negatives in training: made from the caption text alone, batched after the captions."""

import numpy as np
import pytest
import torch

from mmgeo.data import ShapesWorld
from mmgeo.data.caption_edits import EDIT_KINDS
from mmgeo.data.pairs import CaptionPairs, Collate
from tests.app.test_train_eval import _train


def test_pairs_carry_edited_captions_and_collate_puts_them_after_the_captions():
    world = ShapesWorld("train", size=8, image_size=32)
    pairs = CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=2,
                         negative_kinds=EDIT_KINDS, vocabulary=ShapesWorld.vocabulary())
    items = [pairs[(i, 0, 0)] for i in range(4)]
    for item in items:
        (_, caption, negatives), = item["pairs"]
        assert caption in world[item["index"]][1]
        assert 1 <= len(negatives) <= 2 and caption not in negatives
        assert sorted(set(" ".join(negatives).split()) - set(ShapesWorld.vocabulary())) == []
    again = [pairs[(i, 0, 0)] for i in range(4)]
    assert [it["pairs"][0][1:] for it in items] == [it["pairs"][0][1:] for it in again]  # deterministic
    batch = Collate(lambda texts: {"texts": texts})(items)
    n_neg = sum(len(it["pairs"][0][2]) for it in items)
    assert int(batch["num_captions"]) == 4 and len(batch["texts"]) == 4 + n_neg
    assert batch["texts"][:4] == [it["pairs"][0][1] for it in items]
    source = [i for i, it in enumerate(items) for _ in it["pairs"][0][2]]  # each negative's pair
    assert batch["negative_source"].tolist() == source
    assert not batch["partial"].any()  # no caption was cut to a sub-caption


def test_training_with_caption_negatives_changes_the_loss(tmp_path):
    """Same seed, same steps: the run with negatives logs a different (larger) loss at step 0."""
    def first_loss(run):
        import csv

        rows = [r for r in csv.DictReader(open(run.parent / "metrics.csv")) if r.get("train/loss")]
        return float(rows[0]["train/loss"])

    plain = _train(tmp_path / "plain", steps=1, extra=["--data.caption_negatives", "0"])
    negs = _train(tmp_path / "negs", steps=1, extra=["--data.caption_negatives", "2"])
    assert np.isfinite(first_loss(negs)) and first_loss(negs) > first_loss(plain)


def test_partial_captions_cut_the_caption_before_its_negatives_are_made():
    """partial_captions=1: every caption of a scene with 2+ objects is a sub-caption of one of its captions, and
    its negatives edit that sub-caption; 0 (the default) draws exactly what it drew before."""
    from mmgeo.data.caption_parts import object_phrases
    from mmgeo.data.shapes_grammar import parse

    world = ShapesWorld("train", size=12, image_size=32)
    make = lambda share: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=2,  # noqa: E731
                                      vocabulary=ShapesWorld.vocabulary(), partial_captions=share)
    full, cut = make(0.0), make(1.0)
    assert [full[(i, 0, 0)]["pairs"][0][1:] for i in range(12)] == \
        [make(0.0)[(i, 0, 0)]["pairs"][0][1:] for i in range(12)]
    n_cut = 0
    for i in range(12):
        (_, caption, negatives), = cut[(i, 0, 0)]["pairs"]
        if len(world.scene(i)) < 2:
            assert caption in world[i][1]
            continue
        phrases = {p for c in world[i][1] for p in object_phrases(c)}
        assert set(caption.split(" and ")) <= phrases and caption not in world[i][1]
        n_cut += 1
        for neg in negatives:  # an edit of the sub-caption, naming as many objects
            assert neg != caption and len(neg.split(" and ")) == len(caption.split(" and "))
        if parse(caption) is not None:
            assert len(parse(caption).mentions) < len(world.scene(i))
    assert n_cut >= 8
    with np.testing.assert_raises(ValueError):
        make(1.5)


def test_negative_weights_reach_the_pairs_and_a_bad_config_is_refused():
    """data.negative_weights makes noun replacements the common negative; a weight for an unknown kind is refused
    when the config is read."""
    world = ShapesWorld("train", size=16, image_size=32)
    make = lambda weights: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=1,  # noqa: E731
                                        vocabulary=ShapesWorld.vocabulary(), negative_weights=weights)
    shapes = set("circle square triangle diamond".split())
    named = lambda text: sorted(w for w in text.split() if w in shapes)  # noqa: E731  the shape words of a caption

    def noun_changes(pairs):  # negatives whose shape words differ from their caption's
        items = [pairs[(i, 0, 0)]["pairs"][0] for i in range(16)]
        return sum(named(neg) != named(caption) for _, caption, negatives in items for neg in negatives)

    assert noun_changes(make({"replace_noun": 50})) >= 14 > noun_changes(make(None))

    from mmgeo.training.config import load_train_config

    assert load_train_config("configs/synthetic.yaml", ["--data.negative_weights", "{replace_noun: 3}"]).data \
        .negative_weights == {"replace_noun": 3}
    with pytest.raises(ValueError, match="replace_nouns"):
        load_train_config("configs/synthetic.yaml", ["--data.negative_weights", "{replace_nouns: 2}"])


def test_collate_marks_each_edit_true_of_the_other_images_the_text_rules_allow():
    """negative_truth: an edit is true of image j when the rules say so, never of its own source, and of none when
    the edit leaves the caption's object phrases as they were (the rule cannot see it); with loss.edit_truth whole,
    an edit of a whole caption is true only of images it names every object of."""
    def item(i, caption, negatives, image_captions):
        from mmgeo.data.caption_groups import phrase_words
        from mmgeo.data.caption_parts import stated_count
        from mmgeo.data.pairs import CaptionTruth

        truth = [CaptionTruth(phrase_words(caption), [p for c in image_captions for p in phrase_words(c)],
                              [phrase_words(n) for n in negatives], max(len(phrase_words(c)) for c in image_captions),
                              [stated_count(n) for n in negatives])]
        return {"pairs": [(torch.zeros(1), caption, negatives)], "partial": [False],
                "fewer": [[False] * len(negatives)], "index": i, "epoch": 0,
                "step": 0, "truth": truth}

    items = [item(0, "a small red circle on the left",
                  ["a small red square on the left", "a big red circle on the left"],
                  ["a small red circle on the left and a big blue square on the right"]),
             item(1, "a small red square on the left", ["a small red circle on the left"],
                  ["a small red square on the left", "there is a small red square on the left and a green circle"]),
             item(2, "a green circle below it", ["a green circle above it"],
                  ["a blue square and a green circle below it"]),
             item(3, "a big red circle on the left", ["a big red circle on the right"],
                  ["a big red circle on the left", "a small red square on the left"])]
    items[1]["partial"] = [True]  # its caption a sub-caption
    batch = Collate(lambda texts: {"texts": texts})(items)
    assert batch["negative_source"].tolist() == [0, 0, 1, 2, 3]
    assert batch["partial"].tolist() == [False, True, False, False]
    assert batch["negative_truth"].tolist() == [
        [False, True, False, True],  # "a small red square on the left": images 1 and 3, not its source 0
        [False, False, False, True],  # "a big red circle on the left": image 3
        [True, False, False, False],  # "a small red circle on the left" (of image 1's): image 0, not source 1
        [False, False, False, False],  # a flipped relation to "it": the phrases are the caption's, so no truth
        [False, False, False, False]]  # "a big red circle on the right": nobody
    # as a whole description: each edit names one object; only image 3's captions name one (the others two)
    assert batch["negative_whole"].tolist() == [[False, False, False, True]] * 5
    from mmgeo.training.config import LossConfig
    from mmgeo.training.module import edit_queries

    whole = edit_queries(batch, LossConfig(edit_query_weight=1.0, edit_truth="whole")).truth
    assert whole.tolist() == [
        [False, False, False, True],  # an edit of a whole caption: not image 1's, which holds one more object
        [False, False, False, True],
        [True, False, False, False],  # an edit of a sub-caption keeps "contains": image 0 holds its object
        [False, False, False, False],
        [False, False, False, False]]
    assert edit_queries(batch, LossConfig(edit_query_weight=1.0)).truth.tolist() == batch["negative_truth"].tolist()
    assert edit_queries(batch, LossConfig(edit_query_weight=1.0, edit_truth="counts")).truth.tolist() == \
        batch["negative_truth"].tolist()  # no edit states a count


def test_an_edit_that_states_a_count_is_true_only_of_images_holding_that_many():
    """"one shape : a small red square on the left" is not true of an image holding that square and more."""
    from mmgeo.data.caption_groups import phrase_words
    from mmgeo.data.caption_parts import stated_count
    from mmgeo.data.pairs import CaptionTruth
    from mmgeo.training.config import LossConfig
    from mmgeo.training.module import edit_queries

    def item(i, caption, negatives, image_captions):
        named = [phrase_words(c) for c in image_captions]
        truth = CaptionTruth(phrase_words(caption), [p for c in named for p in c],
                             [phrase_words(n) for n in negatives], max(map(len, named)),
                             [stated_count(n) for n in negatives])
        return {"pairs": [(torch.zeros(1), caption, negatives)], "partial": [False],
                "fewer": [[False] * len(negatives)], "index": i, "epoch": 0,
                "step": 0, "truth": [truth]}

    items = [item(0, "one shape : a small red circle on the left", ["one shape : a small red square on the left",
                                                                    "a small red square on the left"],
                  ["one shape : a small red circle on the left"]),
             item(1, "two shapes : a small red square on the left and a big blue circle on the right", [],
                  ["two shapes : a small red square on the left and a big blue circle on the right"]),
             item(2, "one shape : a small red square on the left", [], ["one shape : a small red square on the left"])]
    batch = Collate(lambda texts: {"texts": texts})(items)
    assert batch["negative_truth"].tolist() == [[False, True, True], [False, True, True]]
    assert batch["negative_counted"].tolist() == [[True, False, True], [True, True, True]]
    counts = edit_queries(batch, LossConfig(edit_query_weight=1.0, edit_truth="counts")).truth
    assert counts.tolist() == [[False, False, True],  # "one shape : ...": image 2 only, not image 1's two shapes
                               [False, True, True]]  # without the count word: both


def test_training_with_edit_queries_logs_the_term(tmp_path):
    """loss.edit_query_weight turns on the caption truth the term needs (without masking true captions out of
    the InfoNCE negatives, which data.mask_true_captions does) and logs loss_edit_query."""
    import csv

    model = _train(tmp_path / "eq", steps=3, extra=["--data.caption_negatives", "2", "--data.partial_captions", "1.0",
                                                    "--loss.edit_query_weight", "1.0"])
    rows = [r for r in csv.DictReader(open(model.parent / "metrics.csv")) if r.get("train/loss")]
    assert "train/loss_edit_query" in rows[0]
    assert all(np.isfinite(float(r["train/loss_edit_query"])) for r in rows if r["train/loss_edit_query"])


def test_items_say_whether_their_caption_was_cut_to_a_sub_caption():
    world = ShapesWorld("train", size=16, image_size=32)
    pairs = CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=1, partial_captions=0.5)
    items = [pairs[(i, 0, 0)] for i in range(16)]
    cut = [it["partial"][0] for it in items]
    assert cut == [it["pairs"][0][1] not in world[it["index"]][1] for it in items]  # cut = not one of the five
    assert any(cut) and not all(cut)


def test_colorless_sub_captions_drop_the_colour_words_of_that_share_of_sub_captions_only():
    from mmgeo.data.caption_edits import ATTRIBUTES

    world = ShapesWorld("train", size=60, image_size=32)
    make = lambda share: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0,  # noqa: E731
                                      partial_captions=0.5, colorless_sub_captions=share)
    colored = lambda text: any(w in ATTRIBUTES["color"] for w in text.split())  # noqa: E731
    items = [make(0.5)[(i, 0, 0)] for i in range(60)]
    subs = [it["pairs"][0][1] for it in items if it["partial"][0]]
    wholes = [it["pairs"][0][1] for it in items if not it["partial"][0]]
    assert wholes and all(colored(c) for c in wholes)  # a whole caption keeps its colours
    assert 0 < sum(not colored(c) for c in subs) < len(subs)
    assert all(colored(it["pairs"][0][1]) for i in range(60) for it in [make(0.0)[(i, 0, 0)]])
    with pytest.raises(ValueError, match="colorless_sub_captions"):
        make(1.5)


def test_typed_captions_rewrite_that_share_of_the_items_not_cut_and_draw_nothing_when_off():
    from mmgeo.data.caption_parts import typed_caption
    from mmgeo.data.shapes import CELL_PHRASES

    world = ShapesWorld("train", size=60, image_size=32)
    make = lambda share: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0,  # noqa: E731
                                      partial_captions=0.5, typed_captions=share)
    before, typed = [make(0.0)[(i, 0, 0)] for i in range(60)], [make(0.5)[(i, 0, 0)] for i in range(60)]
    caption = lambda it: it["pairs"][0][1]  # noqa: E731
    cut = [b["partial"][0] for b in before]
    assert all(caption(b) == caption(t) for b, t, c in zip(before, typed, cut) if c)  # sub-captions as before
    changed = [(caption(b), caption(t)) for b, t, c in zip(before, typed, cut) if not c and caption(b) != caption(t)]
    assert 0 < len(changed) < cut.count(False)  # about half of the whole captions
    rng = np.random.default_rng(1)
    assert all(typed_caption(whole, rng) is not None for whole, _ in changed)
    cells = [phrase for phrases in CELL_PHRASES.values() for phrase in phrases]
    assert all(not t.endswith(" it") and not any(c in t for c in cells) for _, t in changed)  # no "below it", no cell
    assert all(t["partial"][0] for b, t, c in zip(before, typed, cut) if not c and caption(b) != caption(t))
    with pytest.raises(ValueError, match="typed_captions"):
        make(-0.1)


def test_typed_relations_raise_the_share_of_typed_captions_that_are_relations():
    """Every whole caption typed: about one in five is a relation at typed_relations 0 (the one template that places
    objects, less one-object scenes), about half or more at 0.5."""
    world = ShapesWorld("train", size=120, image_size=32)
    make = lambda share: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0,  # noqa: E731
                                      typed_captions=1.0, typed_relations=share)
    places = ("above", "below", "to the left of", "to the right of")
    share = {r: sum(any(w in make(r)[(i, 0, 0)]["pairs"][0][1] for w in places) for i in range(120)) / 120
             for r in (0.0, 0.5)}
    assert share[0.0] < 0.3 and share[0.5] > 0.4, share
    with pytest.raises(ValueError, match="typed_relations"):
        make(2.0)


def test_typed_plurals_count_one_kind_of_the_picture():
    """Every whole caption typed with typed_plurals 1: the captions that name a kind twice become "two yellow
    circles" and the count is the scene's; no other caption changes."""
    world = ShapesWorld("train", size=120, image_size=32)
    make = lambda share: CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0,  # noqa: E731
                                      typed_captions=1.0, typed_plurals=share)
    counted = 0
    for i in range(120):
        before, after = make(0.0)[(i, 0, 0)]["pairs"][0][1], make(1.0)[(i, 0, 0)]["pairs"][0][1]
        if before == after:
            continue
        counted += 1
        number, color, shapes = after.split()
        held = sum((o.color, o.shape) == (color, shapes[:-1]) for o in world.scene(i))
        assert held == ("one", "two", "three", "four").index(number) + 1 >= 2, (after, world.scene(i))
    assert 5 < counted < 60
    with pytest.raises(ValueError, match="typed_plurals"):
        make(1.5)


def test_true_captions_can_leave_whole_captions_their_negatives():
    """data.mask_true_of sub_captions: only a sub-caption's true images leave its negatives; a whole caption keeps
    every other image, so it still learns its own image above one that holds its objects and more."""
    from mmgeo.training.config import DataConfig
    from mmgeo.training.module import true_captions

    batch = {"positives": torch.tensor([[False, True], [True, False]]), "partial": torch.tensor([True, False])}
    assert true_captions(batch, DataConfig()) is None
    assert true_captions(batch, DataConfig(mask_true_captions=True)).tolist() == [[False, True], [True, False]]
    assert true_captions(batch, DataConfig(mask_true_captions=True, mask_true_of="sub_captions")).tolist() == [
        [False, True], [False, False]]
    with pytest.raises(ValueError, match="mask_true_of"):
        DataConfig(mask_true_of="whole")


def test_captions_with_a_phrase_left_out_are_image_side_negatives_only():
    """data.fewer_phrase_negatives: the copies come after the edits, flagged in Collate's negative_fewer; true of
    their own image, neither edit term takes them (no text->image query, no push below the rest)."""
    from mmgeo.data.caption_parts import object_phrases
    from mmgeo.training.config import LossConfig
    from mmgeo.training.module import edit_queries

    world = ShapesWorld("train", size=24, image_size=32)
    pairs = CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=2,
                         caption_truth=True, fewer_phrase_negatives=1)
    items = [pairs[(i, 0, 0)] for i in range(24)]
    batch = Collate(lambda texts: {"texts": texts})(items)
    texts, B = batch["texts"], int(batch["num_captions"])
    fewer = batch["negative_fewer"]
    assert fewer.any() and not fewer.all()
    for n in fewer.nonzero().flatten().tolist():  # all the caption's phrases but one
        caption = texts[int(batch["negative_source"][n])]
        assert len(object_phrases(texts[B + n])) == len(object_phrases(caption)) - 1
    for it in items:  # one copy exactly when the caption names two objects or more
        caption, negatives = it["pairs"][0][1:]
        assert sum(it["fewer"][0]) == (len(object_phrases(caption)) > 1) and it["fewer"][0][-1] == (
            len(object_phrases(caption)) > 1) and len(it["fewer"][0]) == len(negatives)
    for rows in ("all", "sub_captions", "true_of_another"):
        edits = edit_queries(batch, LossConfig(negative_query_weight=1.0, edit_query_weight=1.0,
                                               negative_query_rows=rows))
        assert not (edits.rows & fewer).any() and not edits.truth[fewer].any()
    plain = CaptionPairs(world, lambda im: torch.zeros(3, 32, 32), seed=0, caption_negatives=2)
    assert [plain[(i, 0, 0)]["pairs"][0][2] for i in range(24)] == [  # off: the same draws as before
        [n for n, f in zip(it["pairs"][0][2], it["fewer"][0]) if not f] for it in items]
