"""experiments/eye_probe.py: the image tower trained supervised on each cell's shape, one row per stem."""

import json


def test_eye_probe_writes_a_row_per_stem(tmp_path):
    from experiments import eye_probe

    out = tmp_path / "probe.json"
    assert eye_probe.main(["--stems", "patchify", "conv-full", "--steps", "2", "--batch-size", "4",
                           "--train-images", "12", "--test-images", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["stem"] for r in rows] == ["patchify", "conv-full"]
    for r in rows:
        assert all(0.0 <= r[k] <= 1.0 for k in ("small_shape_acc", "large_shape_acc", "empty_acc"))
        assert r["train_s_per_step"] > 0 and r["steps"] == 2
