import pytest
import torch

import mmgeo
from mmgeo.checkpoint import load_model, save_model
from mmgeo.data import ShapesWorld


def _scores(model):
    ds = ShapesWorld("test", image_size=32, size=4)
    t = model.encode_text([c for i in range(4) for c in ds[i][1]])
    i = model.encode_image([ds[i][0] for i in range(4)])
    return model.score(t, i), model.score(t, i, "global")


def test_save_load_gives_identical_scores(tmp_path, tiny_model):
    path = save_model(tiny_model, tmp_path / "m.pt")
    loaded = mmgeo.load_model(path)
    assert not loaded.training and loaded.cfg == tiny_model.cfg
    for a, b in zip(_scores(tiny_model), _scores(loaded)):
        assert torch.equal(a, b)


def test_preprocessing_travels_with_the_checkpoint(tmp_path, tiny_overrides):
    model = mmgeo.create_model("geo-tiny", **{**tiny_overrides, "image_mean": (0.1, 0.2, 0.3)})
    loaded = load_model(save_model(model, tmp_path / "m.pt"))
    assert loaded.cfg.image_mean == (0.1, 0.2, 0.3) and loaded.cfg.image_std == (0.5, 0.5, 0.5)


def test_lightning_style_checkpoint_loads(tmp_path, tiny_model):
    from mmgeo.checkpoint import model_record

    state = {f"model.{k}": v for k, v in tiny_model.state_dict().items()}
    torch.save({"state_dict": state, "mmgeo": model_record(tiny_model), "global_step": 3}, tmp_path / "last.ckpt")
    loaded = load_model(tmp_path / "last.ckpt")
    assert torch.equal(_scores(loaded)[0], _scores(tiny_model)[0])


def test_unsafe_or_foreign_files_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"config": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="weights_only"):
        load_model(tmp_path / "evil.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="no mmgeo model"):
        load_model(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match="train one"):
        load_model(tmp_path / "missing.pt")
