"""The compositional suite's arithmetic on a hand-made case, and a run on a real (tiny) model."""

import json

import pytest
import torch
from PIL import Image

from mmgeo.data import ShapesWorld
from mmgeo.eval.compositional import CompositionalItem, format_table, run_suite, shapes_items

# (image, text) -> score; scoring a text against another image than its own raises KeyError
SCORES = {
    (0, "c0"): 0.9, (0, "n0a"): 0.5, (0, "n0b"): 0.95, (0, "r0"): 0.6,
    (1, "c1"): 0.4, (1, "n1a"): 0.4, (1, "r1"): 0.5, (1, "r1s"): 0.3,  # n1a ties c1: a failure
    (1, "c1b"): 0.7, (1, "n1b"): 0.2, (1, "n1c"): 0.1,
    (2, "c2"): 0.3, (2, "n2a"): 0.1, (2, "n2b"): 0.8, (2, "r2"): 0.9,
}


class FakeModel:
    """Texts and images 'encode' to themselves; score looks the pair up in SCORES."""

    default_mode = "geometric"

    def __init__(self):
        self.images_encoded, self.score_shapes = [], []

    def encode_text(self, texts):
        return list(texts)

    def encode_image(self, images):
        ids = [im.getpixel((0, 0))[0] for im in images]
        self.images_encoded += ids
        return ids

    def score(self, texts, images, mode):
        assert mode == "geometric"
        self.score_shapes.append((len(texts), len(images)))
        return torch.tensor([[SCORES[(i, t)] for i in images] for t in texts])


def _image(i: int) -> Image.Image:
    return Image.new("RGB", (4, 4), (i, 0, 0))


def _items() -> list[CompositionalItem]:
    return [
        CompositionalItem(_image(0), "c0", {"swap_color": ["n0a"], "replace_size": ["n0b"]}, {"synonyms": ["r0"]}),
        CompositionalItem(_image(1), "c1", {"swap_color": ["n1a"]}, {"synonyms": ["r1"], "shuffle_order": ["r1s"]},
                          image_id="one"),
        CompositionalItem(_image(1), "c1b", {"swap_color": ["n1b"], "drop_object": ["n1c"]}, image_id="one"),
        CompositionalItem(_image(2), "c2", {"replace_size": ["n2a", "n2b"]}, {"synonyms": ["r2"]}),
    ]


@pytest.mark.parametrize("images_per_step", [1, 2, 32])
def test_accuracy_and_consistency_by_hand(images_per_step):
    model = FakeModel()
    r = run_suite(model, _items(), images_per_step=images_per_step, progress=False)
    # swap_color: c0>n0a yes, c1=n1a tie -> no, c1b>n1b yes; replace_size: c0<n0b, c2>n2a, c2<n2b; drop: c1b>n1c
    assert r["edits"] == {"swap_color": {"accuracy": pytest.approx(2 / 3), "n": 3},
                          "replace_size": {"accuracy": pytest.approx(1 / 3), "n": 3},
                          "drop_object": {"accuracy": 1.0, "n": 1}}
    assert list(r["edits"]) == ["swap_color", "replace_size", "drop_object"]  # EDIT_TYPES order
    assert r["all_edits"] == {"accuracy": pytest.approx(4 / 7), "n": 7}
    # synonyms: r0 agrees with c0 on n0a (both above) and n0b (both below); r1 beats n1a where c1 ties it;
    # r2 agrees on n2a, not on n2b. shuffle_order: r1s and c1 both fail to beat n1a -> agree.
    assert r["consistency"] == {"shuffle_order": {"consistency": 1.0, "n": 1},
                                "synonyms": {"consistency": pytest.approx(3 / 5), "n": 5},
                                "all_rewrites": {"consistency": pytest.approx(4 / 6), "n": 6}}
    assert r["counts"] == {"images": 3, "captions": 4} and r["score"] == "geometric"
    assert sorted(model.images_encoded) == [0, 1, 2]  # each image once, its two items share it
    assert all(n_images == 1 for _, n_images in model.score_shapes)  # (k texts x 1 image), never N x N
    assert sorted(k for k, _ in model.score_shapes) == [4, 4, 7]  # distinct texts per image
    json.dumps(r)


def test_format_table_lists_every_edit_and_the_pooled_rows():
    table = format_table(run_suite(FakeModel(), _items(), progress=False))
    assert "| edit type" in table and "| swap_color" in table and "66.7 |" in table
    assert "| all edits" in table and "57.1 |" in table and "| synonyms" in table and "60.0 |" in table


def test_no_items_is_an_error():
    with pytest.raises(ValueError, match="no items"):
        run_suite(FakeModel(), [], progress=False)


def test_runs_on_a_tiny_model_with_scene_edits(tiny_model):
    items = shapes_items(ShapesWorld("test", image_size=32), limit=3)
    r = run_suite(tiny_model, items, images_per_step=2, progress=False)
    assert r["counts"]["images"] == 3 and r["counts"]["captions"] == 15
    assert set(r["edits"]) == {k for it in items for k in it.negatives}
    assert all(0 <= v["accuracy"] <= 1 and v["n"] > 0 for v in r["edits"].values())
    assert r["all_edits"]["n"] == sum(len(t) for it in items for t in it.negatives.values())
    # the suite's decisions are the model's own scores of caption and negatives on the image
    item = items[0]
    negatives = [t for ts in item.negatives.values() for t in ts]
    texts = [item.caption] + negatives + [t for ts in item.rewrites.values() for t in ts]  # the suite's order
    s = tiny_model.score(tiny_model.encode_text(texts), tiny_model.encode_image([item.image]))[:, 0]
    wins = sum(bool(s[0] > x) for x in s[1:1 + len(negatives)])
    r1 = run_suite(tiny_model, items[:1], progress=False)
    assert round(r1["all_edits"]["accuracy"] * r1["all_edits"]["n"]) == wins
    json.dumps(r)
