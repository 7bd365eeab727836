"""eval.py --suite compositional | all end to end: a random geo-tiny, synthetic scene edits or SugarCREPE."""

import json

import pytest
import torch

import eval as eval_app
import mmgeo
from mmgeo.data.scene_edits import EDIT_TYPES
from mmgeo.data.sugarcrepe import SUGARCREPE_TYPES
from tests.conftest import TINY
from tests.data.sugarcrepe_fixtures import write_sugarcrepe

SUITE_KEYS = {"task", "score", "edits", "all_edits", "consistency", "counts", "timing_s"}


def test_compositional_suite_writes_its_json(random_geo_tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(random_geo_tiny), "--suite", "compositional", "--limit", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["task"] == "compositional" and "metrics" not in result
    comp = result["compositional"]
    assert SUITE_KEYS <= set(comp) and comp["score"] == "geometric"
    assert set(comp["edits"]) <= set(EDIT_TYPES) and {"swap_color", "replace_object"} <= set(comp["edits"])
    assert comp["counts"]["images"] == 8 and comp["counts"]["captions"] == 40
    assert {"shuffle_order", "synonyms", "all_rewrites"} <= set(comp["consistency"])
    assert 0 <= comp["all_edits"]["accuracy"] <= 1 and comp["all_edits"]["n"] > 8 * 5 * 5
    printed = capsys.readouterr().out
    assert "| swap_color" in printed and "| all edits" in printed


def test_suite_all_adds_compositional_next_to_retrieval(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "small.safetensors"
    mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY).eval(), ckpt)
    result = eval_app.main(["--ckpt", str(ckpt), "--suite", "all", "--limit", "3"])
    assert result["counts"] == {"images": 3, "captions": 15} and "text_to_image_R@1" in result["metrics"]
    assert result["compositional"]["counts"]["images"] == 3
    assert result["partial_queries"]["one_object"]["exact_geometric"]["P@1"] >= 0  # the partial suite beside them


def test_sugarcrepe_through_eval(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "small.safetensors"
    mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY).eval(), ckpt)
    json_dir, image_dir = write_sugarcrepe(tmp_path / "sc")
    args = ["--ckpt", str(ckpt), "--data", "sugarcrepe", "--data-root", str(json_dir)]
    result = eval_app.main([*args, "--image-root", str(image_dir), "--suite", "compositional"])
    assert set(result["compositional"]["edits"]) == set(SUGARCREPE_TYPES)
    assert result["compositional"]["counts"]["images"] == 2
    with pytest.raises(SystemExit, match="--suite compositional"):
        eval_app.main([*args, "--image-root", str(image_dir)])
    with pytest.raises(SystemExit, match="--image-root"):
        eval_app.main([*args, "--suite", "compositional"])
    with pytest.raises(SystemExit, match="val2017"):
        eval_app.main([*args, "--image-root", str(tmp_path / "missing"), "--suite", "compositional"])
