"""The training config: model_args checked against ModelConfig, removed keys named with their new place."""

import pytest

from mmgeo.config import ConfigError
from mmgeo.training.config import AidsConfig, DataConfig, load_train_config

SYNTHETIC = "configs/synthetic.yaml"


def test_aids_default_off_and_checked():
    a = AidsConfig()
    assert a.clip_qk is None and a.freeze_value_fraction == 0 and a.ortho_weight == 0
    with pytest.raises(ValueError, match="freeze_value_fraction"):
        AidsConfig(freeze_value_fraction=1.0)
    with pytest.raises(ValueError, match="clip_qk"):
        AidsConfig(clip_qk=0)


def test_model_args_unknown_field_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        load_train_config(SYNTHETIC, ["--model_args.d_aa", "64"])
    msg = str(err.value)
    assert "model_args: unknown key(s) ['d_aa'] (did you mean 'd_a' for 'd_aa'?)" in msg
    assert "valid keys of ModelConfig: [" in msg and "'qk_init_gain'" in msg and "'image_size'" in msg


@pytest.mark.parametrize("args,match", [
    (["--model_args.d_a", "many"], r"model_args\.d_a: expected int, got 'many' \(str\)"),
    (["--model_args.d_a", "6.5"], r"model_args\.d_a: expected int, got 6\.5 \(float\)"),
    (["--model_args.phrase_window", "true"], r"model_args\.phrase_window: expected int, got True \(bool\)"),
    (["--model_args.text_vocab", "a"], r"model_args\.text_vocab: 'a' is not a list\[str\] \| None"),
    (["--model_args", "3"], "expected a mapping of ModelConfig fields"),
])
def test_model_args_wrong_type_is_named(args, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(SYNTHETIC, args)


def test_model_args_values_take_their_field_type():
    cfg = load_train_config(SYNTHETIC, ["--model_args.d_a", "64", "--model_args.text_dropout", "0",
                                        "--model_args.qk_init_gain", "1", "--model_args.image_mean", "[0, 0.5, 1]"])
    assert cfg.model_args == {"image_conv_stem": True, "d_a": 64, "text_dropout": 0.0, "qk_init_gain": 1.0,
                              "image_mean": (0.0, 0.5, 1.0)}
    assert isinstance(cfg.model_args["text_dropout"], float) and isinstance(cfg.model_args["qk_init_gain"], float)


@pytest.mark.parametrize("key,value,new", [("aids.qk_init_gain", "0.1", "model_args.qk_init_gain"),
                                           ("data.image_size", "48", "model_args.image_size")])
def test_removed_keys_name_their_new_place(key, value, new, tmp_path):
    with pytest.raises(ConfigError, match=rf"{key} is no longer a setting: set {new} "):
        load_train_config(SYNTHETIC, [f"--{key}", value])
    section, leaf = key.split(".")
    old = tmp_path / "old.yaml"
    old.write_text(f"model: geo-tiny\n{section}:\n  {leaf}: {value}\n")
    with pytest.raises(ConfigError, match=rf"old\.yaml\.{key} is no longer a setting: set {new} "):
        load_train_config(old)


def test_unknown_section_key_suggests_the_near_miss():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_step'\] \(did you mean 'max_steps' for"):
        load_train_config(SYNTHETIC, ["--trainer.max_step", "3"])


@pytest.mark.parametrize("field, value", [("caption_groups_by", "count"), ("fewer_phrase_negatives", -1),
                                          ("mask_true_of", "whole"), ("caption_groups", 1)])
def test_data_options_refuse_values_they_do_not_know(field, value):
    with pytest.raises(ValueError, match=field):
        DataConfig(**{field: value})
