"""The training loop's pieces: data drawn at the model's input size, batches that split over devices."""

from pathlib import Path

import pytest

from mmgeo.data.pairs import open_split
from mmgeo.training.config import load_train_config
from mmgeo.training.loop import RUN_OUTPUTS, build_loader, existing_run, parse_args, prepare_run_dir, resume_checkpoint
from mmgeo.training.module import RetrievalModule
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
TINY_ARGS = [x for k, v in TINY.items() if k != "image_size" for x in (f"--model_args.{k}", str(v))]


@pytest.mark.parametrize("size", [32, 48])
def test_batches_are_drawn_at_the_models_image_size(size):
    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + ["--model_args.image_size", str(size),
                                                                    "--trainer.batch_size", "4",
                                                                    "--data.num_workers", "0"])
    module = RetrievalModule(cfg)
    train = open_split(cfg.data, "train", 8, module.model.cfg.image_size)
    assert train.image_size == size
    loader = build_loader(cfg, module, train)
    batch = next(iter(loader))
    assert batch["pixels"].shape == (4, 3, size, size)
    assert int(batch["num_captions"]) == 4 and batch["input_ids"].shape[0] == 4 + 4 * 2  # 2 caption negatives each


@pytest.mark.parametrize("config", ["synthetic", "synthetic_clip", "synthetic_ddp", "synthetic_full_captions"])
def test_synthetic_configs_keep_48_px_and_a_6x6_patch_grid(config):
    """The shapes world is drawn at geo-tiny's 48 px: 3×3 scene cells of 2×2 patches of 8 px."""
    cfg = load_train_config(ROOT / "configs" / f"{config}.yaml")
    model = RetrievalModule(cfg).model
    assert model.cfg.image_size == 48 and model.patch_grid == (6, 6)


def test_batch_must_split_over_devices_and_variants():
    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + ["--trainer.batch_size", "6",
                                                                    "--data.hard_negatives", "true",
                                                                    "--trainer.devices", "2"])
    with pytest.raises(SystemExit, match=r"batch_size=6 must split into 2 device\(s\) × 2 pair\(s\) per image"):
        build_loader(cfg, RetrievalModule(cfg), open_split(cfg.data, "train", 8, 32))


def test_caption_groups_make_batches_of_neighbours_and_mark_true_captions():
    """data.caption_groups 4 over 64 shapes images: batches are groups of caption neighbours, and with
    mask_true_captions the batch says which captions are true of which other images (the caption's own words)."""
    from mmgeo.data.caption_groups import caption_true_of, phrase_words

    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + [
        "--trainer.batch_size", "8", "--data.num_workers", "0", "--data.caption_groups", "4",
        "--data.mask_true_captions", "true", "--data.partial_captions", "1.0", "--data.caption_negatives", "0"])
    module = RetrievalModule(cfg)
    train = open_split(cfg.data, "train", 64, 32)
    loader = build_loader(cfg, module, train)
    assert loader.batch_sampler.group == 4 and loader.batch_sampler.neighbours.shape == (64, 16)
    seen, near = 0, 0
    for batch in loader:
        items = batch["index"].tolist()
        near += sum(all(b in loader.batch_sampler.neighbours[g[0]] for b in g[1:]) for g in (items[:4], items[4:]))
        epoch, step = int(batch["epoch"]), int(batch["step"])
        captions = [loader.dataset[(i, epoch, step)]["pairs"][0][1] for i in items]  # the captions drawn
        images = [[p for c in train.captions(i) for p in phrase_words(c)] for i in items]
        expect = [[i != j and caption_true_of(phrase_words(captions[i]), images[j]) for j in range(8)]
                  for i in range(8)]
        assert batch["positives"].tolist() == expect
        seen += int(batch["positives"].sum())
    assert seen > 0  # sub-captions of neighbours are often true of each other
    assert near >= 12  # of 16 groups: most are an anchor and its listed neighbours (late ones may be pooled)


def test_caption_groups_are_refused_where_they_cannot_hold():
    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + ["--trainer.batch_size", "6",
                                                                    "--data.caption_groups", "4"])
    with pytest.raises(SystemExit, match="data.caption_groups=4 needs map-style data .* must divide the 6 images"):
        build_loader(cfg, RetrievalModule(cfg), open_split(cfg.data, "train", 8, 32))
    with pytest.raises(ValueError, match="caption_groups=1: use 0"):
        load_train_config("configs/synthetic.yaml", ["--data.caption_groups", "1"])


def test_resume_names_a_missing_checkpoint(tmp_path):
    assert resume_checkpoint(tmp_path, None) is None
    with pytest.raises(SystemExit, match="does not exist"):
        resume_checkpoint(tmp_path, str(tmp_path / "nope.ckpt"))


def _a_run(run: Path) -> None:
    (run / "checkpoints").mkdir(parents=True)
    for name in ("model.pt", "config.yaml", "metrics.csv", "samples.tsv", "checkpoints/step=000002.ckpt"):
        (run / name).write_text(name)


@pytest.mark.parametrize("marker", ["model.pt", "metrics.csv", "checkpoints/step=000004.ckpt"])
def test_a_folder_holding_a_run_is_refused(tmp_path, marker):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / marker).write_text("x")
    with pytest.raises(SystemExit, match=rf"run folder {tmp_path} already holds a run \(.*\); .*--name OTHER.*"
                                         r"--resume.*--overwrite: removes model.pt, config.yaml, metrics.csv"):
        prepare_run_dir(tmp_path)


def test_a_folder_without_a_run_is_used(tmp_path):
    prepare_run_dir(tmp_path / "missing")
    (tmp_path / "checkpoints").mkdir()
    for name in ("config.yaml", "notes.txt", "checkpoints/.step=000002.ckpt.abc.tmp"):  # no run: nothing to lose
        (tmp_path / name).write_text(name)
    prepare_run_dir(tmp_path)
    assert existing_run(tmp_path) == []


def test_overwrite_removes_only_the_runs_outputs(tmp_path):
    _a_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "results.json").write_text("{}")
    assert existing_run(tmp_path) == ["model.pt", "checkpoints/ (1 step checkpoint, newest step=000002.ckpt)",
                                      "metrics.csv"]
    prepare_run_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "results.json"]
    assert set(RUN_OUTPUTS) >= {"model.pt", "config.yaml", "metrics.csv", "checkpoints", "samples.tsv"}


def test_only_rank_zero_removes(tmp_path, monkeypatch):
    """Every rank checks the folder the same way; a rank other than 0 leaves removing to rank 0."""
    import lightning as L

    _a_run(tmp_path)
    monkeypatch.setattr(L.pytorch.utilities.rank_zero_only, "rank", 1)
    with pytest.raises(SystemExit, match="already holds a run"):
        prepare_run_dir(tmp_path)
    prepare_run_dir(tmp_path, overwrite=True)
    assert (tmp_path / "model.pt").is_file()


def test_resume_keeps_the_run_and_resume_with_overwrite_is_an_error(tmp_path):
    _a_run(tmp_path)
    prepare_run_dir(tmp_path, resume="last")
    assert (tmp_path / "model.pt").is_file()
    with pytest.raises(SystemExit, match="give one, not both"):
        prepare_run_dir(tmp_path, resume="last", overwrite=True)
    with pytest.raises(SystemExit) as err:
        parse_args(["--config", "configs/synthetic.yaml", "--resume", "--overwrite"])
    assert err.value.code == 2  # argparse: not allowed together


def test_parse_args_reads_overwrite():
    assert parse_args(["--config", "configs/synthetic.yaml", "--overwrite"])[1:] == (None, True)
    assert parse_args(["--config", "configs/synthetic.yaml", "--resume"])[1:] == ("last", False)
