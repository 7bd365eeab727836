from pathlib import Path

import pytest

import mmgeo
from mmgeo.config import ConfigError, load_config, parse_overrides
from mmgeo.training.config import TrainConfig

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"synthetic.yaml", "synthetic_clip.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_yaml_loads_against_the_train_schema(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# python train.py --config configs/" + path.name), first
    cfg = load_config(TrainConfig, path)
    mmgeo.model_config(cfg.model, **cfg.model_args)  # model name and overrides are valid too


def test_dotted_overrides_and_types():
    cfg = load_config(TrainConfig, "configs/synthetic.yaml",
                      ["--trainer.max_steps", "7", "--model_args.d_a=64", "--optim.lr", "3e-4"])
    assert cfg.trainer.max_steps == 7 and cfg.model_args == {"d_a": 64} and cfg.optim.lr == 3e-4
    assert parse_overrides(["--a.b.c", "[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize("args,match", [
    (["--trainer.max_step", "3"], r"unknown key\(s\) \['max_step'\]"),
    (["--trainer.max_steps", "many"], "expected int"),
    (["--trainer", "3"], "expected a mapping"),
    (["trainer.max_steps", "3"], "must look like"),
    (["--trainer.max_steps"], "needs a value"),
])
def test_bad_overrides_name_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TrainConfig, "configs/synthetic.yaml", args)
