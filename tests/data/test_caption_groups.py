"""Caption-neighbour batches and caption truth: text rules on hand-made shapes and Flickr-style captions."""

import numpy as np
import pytest
import torch

from mmgeo.data.caption_edits import caption_negatives
from mmgeo.data.caption_groups import (
    caption_neighbours,
    caption_true_of,
    dataset_neighbours,
    grouped_order,
    phrase_words,
    superset_neighbours,
    true_of,
    true_pairs,
)
from mmgeo.data.caption_parts import object_phrases
from mmgeo.data.shapes import ShapesWorld


def _image(*captions):
    return [p for c in captions for p in phrase_words(c)]


@pytest.mark.parametrize("caption, captions, true", [
    ("a big purple circle in the top right",
     ["in the top right a big purple circle and a small red square on the left"], True),  # word order free
    ("a big purple circle in the top right", ["a big purple square in the top right and a small red circle"], False),
    ("a big purple circle", ["a big purple circle in the center with a small red square above it"], True),
    ("a big purple circle and a small red square", ["a big purple circle in the center with a small red square "
                                                    "above it"], True),
    ("a big purple circle and a small blue square", ["a big purple circle in the center with a small red square "
                                                     "above it"], False),  # one phrase of two is false
    ("a large purple circle in the top right", ["a big purple circle in the top right"], False),  # a synonym: unknown
    ("A dog runs", ["A black dog runs through the grass.", "A dog in the grass."], True),
    ("a brown dog", ["A black dog runs through the grass."], False),
    ("A man in a blue shirt", ["A man in a blue shirt and a woman in a red dress are walking."], True),
    # a place is true only of the same place: fewer place words name another cell, not less of the same one
    ("a big green triangle in the middle", ["a big green triangle in the bottom middle"], False),
    ("a big green triangle in the middle", ["a big green triangle in the top middle and a red circle"], False),
    ("a big green triangle in the middle", ["a big green triangle in the middle and a red circle"], True),
    ("a big green triangle", ["a big green triangle in the bottom middle"], True),  # no place named: any place
    ("a green triangle in the middle", ["a big green triangle in the middle"], True),  # an attribute left out
    ("a dog on the left", ["A brown dog on the left of the bench."], True),
    ("a dog in front of a car", ["A dog in front of a red car."], True),
    ("a dog in front of a car", ["A dog in front of the left car."], False),
])
def test_a_caption_is_true_of_an_image_when_each_phrase_lies_in_one_of_its_phrases(caption, captions, true):
    assert caption_true_of(phrase_words(caption), _image(*captions)) is true


def test_true_pairs_leave_the_diagonal_out():
    captions = ["a big purple circle", "a small red square on the left", "a big purple circle in the center"]
    images = [_image("a big purple circle in the center"), _image("a small red square on the left"),
              _image("a big purple circle in the center and a small red square on the left")]
    got = true_pairs([phrase_words(c) for c in captions], images)
    assert got.tolist() == [[False, False, True], [False, False, True], [True, False, False]]


def test_true_of_is_the_rule_for_every_pair():
    """The matrix form equals caption_true_of pair by pair: shapes-world captions, their object phrases alone (true
    of several images), rule edits (seldom true), a caption without phrases, the place cases above and Flickr-style
    phrases."""
    world = ShapesWorld("train", image_size=32, size=40)
    rng = np.random.default_rng(0)
    captions = [c for i in range(len(world)) for c in world.captions(i)[:2]]
    queries = captions + [p for c in captions[:20] for p in object_phrases(c)] + [""] + [
        n for c in captions[:40] for n in caption_negatives(c, rng, n=2)] + [
        "a big green triangle in the middle", "a big green triangle", "a green triangle in the bottom middle",
        "A dog runs", "a brown dog"]
    images = [_image(*world.captions(i)) for i in range(len(world))] + [
        [], _image("a big green triangle in the bottom middle"), _image("a big green triangle in the middle"),
        _image("A black dog runs through the grass.", "A dog in the grass.")]  # words no query phrase holds
    words = [phrase_words(q) for q in queries]
    got = true_of(words, images)
    want = torch.tensor([[caption_true_of(c, image) for image in images] for c in words])
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert 100 < int(want.sum()) < want.numel() // 4  # many true pairs and many false: the test can tell them apart
    assert true_of([], images).shape == (0, len(images)) and not true_of(words, [[]]).any()


@pytest.mark.parametrize("dense_limit", [1 << 25, 0], ids=["dense", "sparse"])
def test_neighbours_share_bound_attributes_not_only_words(monkeypatch, dense_limit):
    """Item 0 is nearest to the image holding the same two objects worded otherwise, not to the one with the same
    words bound the other way round (red circle / blue square vs blue circle / red square); the dense product (a
    small vocabulary) and the sparse one (a large one) agree."""
    monkeypatch.setattr("mmgeo.data.caption_groups._DENSE_LIMIT", dense_limit)
    captions = [
        ["a big red circle on the left and a small blue square on the right"],
        ["a small blue square on the right , a big red circle on the left"],   # same objects
        ["a big blue circle on the left and a small red square on the right"],  # same words, swapped colours
        ["a little green diamond at the top"],
        ["a little green triangle at the top"],
    ]
    got = caption_neighbours(captions, k=2, chunk=2)
    assert got.shape == (5, 2) and got[0, 0] == 1 and got[1, 0] == 0
    assert got[3, 0] == 4 and got[4, 0] == 3
    assert all(i not in row for i, row in enumerate(got))
    with pytest.raises(ValueError, match="0 < k < N"):
        caption_neighbours(captions, k=5)


def test_grouped_order_is_a_permutation_of_neighbour_groups():
    """Ten clusters of four (each item's nearest: its cluster, then the next cluster) and two items near only each
    other: every group is a cluster, the pair is the short remainder at the end."""
    rng = np.random.default_rng(0)
    N, group = 42, 4
    neighbours = np.array([[j for j in range(i // 4 * 4, i // 4 * 4 + 4) if j != i] + [(i + 4) % 40, (i + 5) % 40]
                           if i < 40 else [81 - i] * 5 for i in range(N)])
    order = grouped_order(rng.permutation(N), neighbours, group, np.random.default_rng(1))
    assert sorted(order.tolist()) == list(range(N))
    assert sorted(sorted(g // 4 for g in order[k:k + 4]) for k in range(0, 40, 4)) == [[c] * 4 for c in range(10)]
    assert sorted(order[40:].tolist()) == [40, 41]
    mixed = grouped_order(np.arange(12), np.array([[(i + 1) % 12] for i in range(12)]), 4, rng)  # one neighbour each
    assert sorted(mixed.tolist()) == list(range(12))  # pairs pooled into groups of four, nothing lost
    again = grouped_order(np.random.default_rng(0).permutation(N), neighbours, group, np.random.default_rng(1))
    assert (again == order).all()  # reproducible from its generators


def test_shapes_world_captions_without_drawing_are_the_same():
    world = ShapesWorld("train", image_size=32, size=30)
    assert all(world.captions(i) == world[i][1] for i in range(len(world)))


def test_superset_neighbours_are_images_a_whole_caption_is_true_of():
    """An image's superset neighbours hold every object phrase of its fullest caption (and more); an image none
    holds lists itself, which grouped_order passes over."""
    captions = [["a big red circle in the center"],  # 0: held by 1 and 2
                ["a big red circle in the center and a small blue square on the left"],  # 1: held by 2
                ["there is a small blue square on the left , a big red circle in the center and a green diamond",
                 "a big red circle in the middle"],
                ["a big red square in the center"],  # 3: held by none ("square" is not "circle")
                ["a small blue square on the left"]]  # 4: held by 1 and 2
    out = superset_neighbours(captions, k=3)
    assert out.shape == (5, 3) and out.dtype == np.int64
    assert out.tolist() == [[1, 2, 0], [2, 1, 1], [2, 2, 2], [3, 3, 3], [1, 2, 4]]
    with pytest.raises(ValueError, match="tfidf or superset"):
        dataset_neighbours(ShapesWorld("train", image_size=32, size=4), 2, progress=False, by="count")


def test_superset_neighbours_of_the_shapes_world_agree_with_the_text_rule():
    world = ShapesWorld("train", image_size=32, size=400)
    captions = [world.captions(i) for i in range(len(world))]
    out = dataset_neighbours(world, 4, progress=False, by="superset")
    phrases = [[p for c in caps for p in phrase_words(c)] for caps in captions]
    found = 0
    for i, row in enumerate(out):
        whole = max((phrase_words(c) for c in captions[i]), key=len)
        listed = [int(j) for j in row if j != i]
        assert all(caption_true_of(whole, phrases[j]) for j in listed)
        everyone = [j for j in range(len(world)) if j != i and caption_true_of(whole, phrases[j])]
        assert listed == everyone[:4]
        found += bool(listed)
    assert found >= 5
