"""experiments/typed_plurals.py: plural queries ranked as typed and as search corrects them."""

import json


def test_every_plural_is_corrected_and_both_rankings_are_scored(tmp_path, tiny_model):
    from experiments import typed_plurals
    from mmgeo.models.checkpoint import save_model

    ckpt = save_model(tiny_model, tmp_path / "m.pt")
    out = tmp_path / "plurals.json"
    assert typed_plurals.main(["--ckpt", str(ckpt), "--queries", "12", "--images", "300", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["queries"] == 12 and row["corrected_queries"] == 12  # the scratch vocabulary has no plurals
    assert all(typed.endswith("s") and corrected == typed[:-1] for typed, corrected in row["examples"])
    for name in ("typed", "corrected"):
        assert 0 <= row[name]["P@1"] <= row[name]["first_hit_holds_the_kind"] <= 1  # two of the kind hold one
        assert row[name]["mean_first_relevant_rank"] >= 1
    assert row["typed"] != row["corrected"]  # two different searches
    assert typed_plurals.main(["--ckpt", str(ckpt), "--json", str(out)]) != 0  # never over an existing file
