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
    assert cfg.trainer.max_steps == 7 and cfg.optim.lr == 3e-4
    assert cfg.model_args == {"image_conv_stem": True, "text_dropout": 0.0, "d_a": 64}  # merged into the config's own
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


# --- call_cli / CliParser: the command lines' one error style ----------------------------------------------------


def _refuse(err: BaseException):
    def main(argv):
        raise err

    return main


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("err, message", [
    (FileNotFoundError("checkpoint 'm.pt' does not exist"), "checkpoint 'm.pt' does not exist"),
    (ConfigError("trainer.max_steps: expected int, got 'x' (str)"), "trainer.max_steps: expected int"),
    (SystemExit("--resume continues the run, --overwrite replaces it"), "--resume continues the run"),
    (ValueError("--shard-size must be at least 1, got 0"), "--shard-size must be at least 1"),
], ids=["missing-file", "config", "refusal", "our-value-error"])
def test_a_users_mistake_is_one_error_line_and_status_2(err, message, capsys, monkeypatch):
    from mmgeo.config import call_cli

    monkeypatch.delenv("MMGEO_DEBUG", raising=False)
    assert call_cli(_refuse(err), []) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines


def test_open_errors_name_the_file_without_the_errno(tmp_path, capsys, monkeypatch):
    from mmgeo.config import call_cli

    monkeypatch.delenv("MMGEO_DEBUG", raising=False)
    assert call_cli(lambda argv: open(tmp_path / "none.txt"), []) == 2
    assert _stderr_lines(capsys) == [f"error: {tmp_path / 'none.txt'}: No such file or directory"]


def test_a_bug_is_one_line_naming_its_type_and_the_debug_switch(capsys, monkeypatch):
    """An error no user causes (a library's ValueError, a TypeError) is status 1, its type named; MMGEO_DEBUG=1 or
    --debug prints the traceback before the same line and status."""
    import json

    from mmgeo.config import call_cli

    monkeypatch.delenv("MMGEO_DEBUG", raising=False)
    assert call_cli(lambda argv: json.loads("{"), []) == 1  # a ValueError raised inside a library
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: JSONDecodeError: ") and "MMGEO_DEBUG=1" in lines[0]
    assert call_cli(_refuse(TypeError("bad operand")), ["--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1] == "error: TypeError: bad operand"
    monkeypatch.setenv("MMGEO_DEBUG", "1")
    assert call_cli(_refuse(FileNotFoundError("no such file m.pt")), []) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "error: no such file m.pt"


def test_call_cli_passes_argv_without_debug_and_returns_mains_status(capsys, monkeypatch):
    from mmgeo.config import call_cli

    monkeypatch.delenv("MMGEO_DEBUG", raising=False)
    seen = []
    assert call_cli(lambda argv: seen.append(argv) or 3, ["a", "--debug", "b", "--", "--debug"]) == 3
    assert call_cli(lambda argv: Path("x"), []) == 0  # a return value that is not a status: success
    assert seen == [["a", "b", "--", "--debug"]] and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as stop:  # a status (argparse's usage error, --help) passes through
        call_cli(_refuse(SystemExit(0)), [])
    assert stop.value.code == 0


def test_cli_parser_usage_errors_are_one_line(capsys):
    from mmgeo.config import CliParser

    p = CliParser(prog="tool")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--a", action="store_true")
    group.add_argument("--b", action="store_true")
    p.add_argument("--n", type=int)
    for argv, message in ((["--a", "--b"], "argument --b: not allowed with argument --a"),
                          (["--n", "x"], "argument --n: invalid int value: 'x'"), (["--c"], "unrecognized")):
        with pytest.raises(SystemExit) as stop:
            p.parse_args(argv)
        lines = _stderr_lines(capsys)
        assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert p.parse_args(["--debug"]).debug  # listed in --help; call_cli takes it off the command line


def test_an_unknown_caption_edit_kind_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown caption edit kind\(s\) \['negate'\]; choose from .*'add_axis'"):
        load_config(TrainConfig, "configs/synthetic.yaml", ["--data.negative_kinds", "[add_axis, negate]"])
    cfg = load_config(TrainConfig, "configs/synthetic.yaml", ["--data.negative_kinds", "[replace_noun, add_axis]"])
    assert cfg.data.negative_kinds == ["replace_noun", "add_axis"]
