"""data/prepare_flickr30k.py --check: passes on the right counts, fails loudly otherwise."""

import importlib.util
from pathlib import Path

from tests.data.flickr_fixtures import COUNTS, write_karpathy

SCRIPT = Path(__file__).resolve().parents[2] / "data" / "prepare_flickr30k.py"


def _script():
    spec = importlib.util.spec_from_file_location("prepare_flickr30k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_counts(tmp_path, capsys):
    prep, root = _script(), write_karpathy(tmp_path)
    assert prep.check(str(root), expected=COUNTS) == []
    assert prep.main(["--check", str(root)]) == 1  # the fixture is not the real 29,000 / 1,014 / 1,000
    out = capsys.readouterr().out
    assert "FLICKR30K CHECK FAILED" in out and "train: 8 images, expected 29000" in out


def test_check_reports_bad_samples(tmp_path):
    root = write_karpathy(tmp_path, bad=True)
    problems = _script().check(str(root), expected=COUNTS)
    assert any("skipped" in p and "missing_file" in p for p in problems)
