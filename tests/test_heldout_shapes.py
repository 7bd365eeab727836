"""experiments/heldout_shapes.py: cogent's shape edits split by the held-out object, and the image-side probe."""

import json

import pytest
import torch


@pytest.fixture
def model_48(tiny_overrides):
    import mmgeo

    torch.manual_seed(0)
    return mmgeo.create_model("geo-tiny", **{**tiny_overrides, "image_size": 48, "patch_size": 8}).eval()


def test_the_split_adds_up_to_the_suites_own_count_and_accuracy(model_48):
    from experiments.heldout_shapes import edit_split
    from mmgeo.data.scene_edits import shapes_edit_items
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.eval.compositional import run_suite

    world = ShapesWorld("cogent", image_size=48)
    split = edit_split(model_48, world, 8, ("replace_shape", "swap_shape"))
    suite = run_suite(model_48, shapes_edit_items(world, 8), progress=False)["edits"]
    for edit, rows in split.items():
        n = sum(r.get("n", 0) for r in rows.values())
        right = sum(r.get("right", 0) for r in rows.values())
        assert n == suite[edit]["n"] > 0
        # the suite encodes a step's texts together, this split each image's: one near-tie may fall either way
        assert right / n == pytest.approx(suite[edit]["accuracy"], abs=1.01 / n)
    assert split["replace_shape"]["held-out"]["n"] > 0  # every cogent scene holds one held-out object


def test_the_probe_counts_one_held_out_object_per_cogent_image_and_none_in_test(model_48):
    from experiments.heldout_shapes import shape_probe
    from mmgeo.data.shapes import ShapesWorld

    out = shape_probe(model_48, 48, n_train=40, n_eval=10)
    assert "held-out" not in out["test"] and out["test"]["seen"]["n"] == sum(
        len(ShapesWorld("test", image_size=48).scene(i)) for i in range(10))
    assert out["cogent"]["held-out"]["n"] == 10
    assert sum(out["cogent"]["held-out_read_as"].values()) == 10
    for split in out.values():
        assert all(0 <= r["right"] <= r["n"] for k, r in split.items() if k != "held-out_read_as")


def test_main_writes_json_and_refuses_a_grid_the_cells_do_not_divide(tmp_path, model_48, tiny_model):
    from experiments import heldout_shapes
    from mmgeo.models.checkpoint import save_model

    out = tmp_path / "h.json"
    ckpt = save_model(model_48, tmp_path / "m.pt")
    assert heldout_shapes.main(["--ckpt", str(ckpt), "--images", "4", "--probe-train", "30", "--probe-eval", "6",
                                "--random", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["probe"]) == {"trained", "untrained"} and set(result["edits"]) == {"replace_shape",
                                                                                          "swap_shape"}
    with pytest.raises(ValueError, match="3x3 cells"):  # tiny_model: 32 px, 8 px patches -> a 4x4 grid
        heldout_shapes.shape_probe(tiny_model, 32, n_train=4, n_eval=2)
