"""mmgeo.eval.viz: attention maps per word, heatmap and curve PNGs."""

import torch

from mmgeo.eval.viz import attention_maps, main
from mmgeo.models.checkpoint import save_model

PNG = b"\x89PNG\r\n\x1a\n"


def test_attention_maps_per_word(tiny_model):
    words, maps = attention_maps(tiny_model, torch.randn(3, 32, 32), "a big red circle")
    assert words == ["a", "big", "red", "circle"]
    assert maps.shape == (4, 4, 4)
    torch.testing.assert_close(maps.sum(dim=(1, 2)), torch.ones(4))


def test_heatmap_png_from_synthetic_image(tiny_model, tmp_path):
    ckpt = save_model(tiny_model, tmp_path / "model.pt")
    out = main(["--ckpt", str(ckpt), "--image", "synthetic:1", "--out", str(tmp_path / "h.png")])
    assert out.read_bytes()[:8] == PNG


def test_curves_png_from_metrics_csv(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = ["step,train/loss,diag/entropy_head0,diag/erank_query,diag/logit_max,diag/head_redundancy_max"]
    rows += [f"{s},{3 - s / 10},,,," for s in range(0, 10)] + [f"{s},,{2 - s / 10},{7.5},{s},0.1" for s in (1, 5, 9)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    out = main(["curves", "--run", str(run), "--out", str(tmp_path / "d.png")])
    assert out.read_bytes()[:8] == PNG
