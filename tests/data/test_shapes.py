import hashlib
import re
from dataclasses import replace

import numpy as np
import pytest

from mmgeo.data import ShapesWorld, build_dataset
from mmgeo.data.shapes import COLORS, HELDOUT_COMBOS, SHAPES, SIZES, SPLITS, ShapeObject, is_heldout, perturb


def test_split_sizes_mirror_flickr30k():
    assert {s: len(ShapesWorld(s)) for s in SPLITS} == {"train": 29_000, "val": 1_014, "test": 1_000, "cogent": 1_000}


def test_same_seed_same_sample_other_seed_other_sample():
    a, b, c = ShapesWorld("test", seed=0), ShapesWorld("test", seed=0), ShapesWorld("test", seed=1)
    for i in (0, 17, 999):
        (ia, ca), (ib, cb), (ic, cc) = a[i], b[i], c[i]
        assert ca == cb and np.array_equal(np.asarray(ia), np.asarray(ib))
        assert ca != cc or not np.array_equal(np.asarray(ia), np.asarray(ic))


def test_splits_differ():
    assert ShapesWorld("train")[0][1] != ShapesWorld("test")[0][1]


def test_image_size_configurable():
    img, _ = ShapesWorld("test", image_size=48)[3]
    assert img.size == (48, 48) and img.mode == "RGB"
    assert ShapesWorld("test")[3][0].size == (64, 64)


def test_five_distinct_captions_that_use_varied_templates():
    ds = ShapesWorld("test")
    starts = set()
    for i in range(50):
        _, caps = ds[i]
        assert len(caps) == 5 and len(set(caps)) == 5
        starts |= {c.split()[0] for c in caps}
    assert {"there", "a", "in", "one", "two", "three", "four"} <= starts


def test_captions_describe_every_object_with_bound_attributes():
    ds = ShapesWorld("test")
    for i in range(100):
        objects, (_, caps) = ds.scene(i), ds[i]
        for cap in caps:
            found = re.findall(r"(\w+) (\w+) (circle|square|triangle|diamond)", cap)
            described = sorted((color, shape) for _, color, shape in found)
            assert described == sorted((o.color, o.shape) for o in objects), cap


def test_few_duplicate_scenes_in_test_split():
    ds = ShapesWorld("test")
    scenes = {tuple(sorted((o.shape, o.color, o.size, o.cell) for o in ds.scene(i))) for i in range(len(ds))}
    assert len(scenes) >= 990


def test_attribute_binding_matters():
    """Scenes that differ only in which shape carries which colour exist, and their captions differ."""
    ds = ShapesWorld("train", size=5000)
    seen = {}
    for i in range(len(ds)):
        objs = ds.scene(i)
        if len(objs) == 2 and objs[0].shape != objs[1].shape and objs[0].color != objs[1].color:
            seen.setdefault(frozenset((o.shape, o.color) for o in objs), i)
    swaps = 0
    for key, i in seen.items():
        (s1, c1), (s2, c2) = sorted(key)
        j = seen.get(frozenset({(s1, c2), (s2, c1)}))
        if j is not None:
            swaps += 1
            assert set(ds[i][1]).isdisjoint(ds[j][1])
    assert swaps > 0


def test_vocabulary_covers_captions():
    vocab = set(ShapesWorld.vocabulary())
    ds = ShapesWorld("train", size=300)
    words = {w for i in range(len(ds)) for c in ds[i][1] for w in c.split()}
    assert words <= vocab
    assert set(SHAPES) | set(COLORS) <= vocab


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown split"):
        ShapesWorld("dev")
    with pytest.raises(ValueError, match="too small"):
        ShapesWorld("test", image_size=8)
    with pytest.raises(IndexError, match="out of range"):
        ShapesWorld("test")[1000]
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("coco", "test")


def test_variant_changes_exactly_one_thing_and_is_deterministic():
    ds = ShapesWorld("train", size=400)
    kinds = set()
    for i in range(len(ds)):
        a = ds.scene(i)
        b = perturb(a, np.random.default_rng(i))
        assert len(a) == len(b)
        diff = [(x, y) for x, y in zip(a, b) if x != y]
        assert 1 <= len(diff) <= 2, (a, b)
        if len(diff) == 2:  # a swap: the same attribute values, exchanged
            (x1, y1), (x2, y2) = diff
            kinds.add("swap_colors" if (y1.color, y2.color) == (x2.color, x1.color) else "swap_cells")
        else:
            (x, y), = diff
            kinds |= {f for f in ("shape", "color", "size", "cell") if getattr(x, f) != getattr(y, f)}
        assert len({o.cell for o in b}) == len(b)  # still one object per cell
    assert kinds == {"shape", "color", "size", "cell", "swap_colors", "swap_cells"}
    (img1, caps1), (img2, caps2) = ds.variant(5), ds.variant(5)
    assert caps1 == caps2 and np.array_equal(np.asarray(img1), np.asarray(img2))
    assert set(caps1).isdisjoint(ds[5][1])


# ---------------------------------------------------------------- held-out combos (CLEVR-CoGenT-style split)
# sha256 of the first 300 test scenes that held no held-out combo (147 of them) and their captions,
# computed with the code from before the held-out rule: those samples must stay exactly as they were.
UNCHANGED_TEST_SHA256 = "241891fe5aca9d3c71ab65782425373cc64c4c5bf555a30310ddac474c5f26a1"


def _drawn_scene(ds: ShapesWorld, idx: int) -> list[ShapeObject]:
    """A copy of ShapesWorld.scene's draws without the held-out rule (what every scene was before it)."""
    rng = np.random.default_rng([ds.seed, 2, idx])  # the test split's id
    n = int(rng.choice(4, p=(0.04, 0.32, 0.32, 0.32))) + 1
    cells = rng.choice(9, size=n, replace=False)
    return [ShapeObject(SHAPES[rng.integers(4)], list(COLORS)[rng.integers(6)], SIZES[rng.integers(2)],
                        (int(c) // 3, int(c) % 3)) for c in cells]


def _combos(captions: list[str]) -> set[tuple[str, str]]:
    return {(c, s) for cap in captions for c, s in re.findall(r"(\w+) (circle|square|triangle|diamond)", cap)}


def test_heldout_combos_cover_every_colour_once_and_every_shape():
    assert len(HELDOUT_COMBOS) == 6 == len(set(HELDOUT_COMBOS))
    assert sorted(c for c, _ in HELDOUT_COMBOS) == sorted(COLORS)
    assert {s for _, s in HELDOUT_COMBOS} == set(SHAPES)


def test_ordinary_splits_never_hold_a_heldout_combo():
    for split, n in (("train", 5_000), ("val", None), ("test", None)):
        ds = ShapesWorld(split, size=n)
        assert not any(is_heldout(o) for i in range(len(ds)) for o in ds.scene(i)), split
    ds = ShapesWorld("test", size=50)
    assert not any(_combos(ds[i][1]) & set(HELDOUT_COMBOS) for i in range(len(ds)))


def test_every_cogent_scene_holds_exactly_one_heldout_combo():
    ds, again = ShapesWorld("cogent"), ShapesWorld("cogent")
    seen = set()
    for i in range(len(ds)):
        scene = ds.scene(i)
        held = [(o.color, o.shape) for o in scene if is_heldout(o)]
        assert len(held) == 1, scene
        assert len({o.cell for o in scene}) == len(scene)
        assert scene == again.scene(i)  # deterministic
        seen.add(held[0])
    assert seen == set(HELDOUT_COMBOS)
    img, caps = ds[7]
    assert caps == again[7][1] and np.array_equal(np.asarray(img), np.asarray(again[7][0]))
    assert len(_combos(caps) & set(HELDOUT_COMBOS)) == 1
    assert ds.scene(0) != ShapesWorld("test").scene(0) and ShapesWorld("cogent", seed=1).scene(0) != ds.scene(0)
    assert len(build_dataset("synthetic", "cogent", size=10)) == 10


def test_scenes_without_heldout_combos_are_unchanged():
    ds = ShapesWorld("test")
    digest, kept = hashlib.sha256(), 0
    for i in range(300):
        before, after = _drawn_scene(ds, i), ds.scene(i)
        assert len(before) == len(after)
        for b, a in zip(before, after):  # only a held-out object's colour may change
            assert a == b or (is_heldout(b) and not is_heldout(a) and replace(a, color=b.color) == b)
        if not any(is_heldout(o) for o in before):
            kept += 1
            objs = ";".join(f"{o.shape},{o.color},{o.size},{o.cell[0]},{o.cell[1]}" for o in after)
            digest.update(f"{i}|{objs}|{chr(10).join(ds[i][1])}\n".encode())
    assert kept == 147 and digest.hexdigest() == UNCHANGED_TEST_SHA256


def test_variants_never_hold_a_heldout_combo():
    ds = ShapesWorld("train", size=5_000)
    for i in range(len(ds)):
        for k in range(3):
            assert not any(is_heldout(o) for o in perturb(ds.scene(i), np.random.default_rng([i, k])))
    for i in range(100):
        assert not _combos(ds.variant(i)[1]) & set(HELDOUT_COMBOS)


def test_flickr30k_has_no_cogent_split():
    with pytest.raises(ValueError, match="only in the synthetic shapes world"):
        build_dataset("flickr30k", "cogent", root="data/flickr30k")
    with pytest.raises(ValueError, match="unknown split"):
        ShapesWorld("cogen")
