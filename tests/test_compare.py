"""python -m experiments.compare at its tiny budget: the same recipe search for both models, the best recipe written as
a config, three seeds on test and cogent, the report; a second run reuses every run. experiments.compare_table over
finished runs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgeo.training.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("geo-tiny", "clip-tiny")


def _compare(out: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.time()
    res = subprocess.run([sys.executable, "-m", "experiments.compare", "--budget", "tiny", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res, time.time() - start


def _progress(res: subprocess.CompletedProcess, stage: str) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith(f"[compare] {stage} ") and "... " in line
            and not line.endswith("...")]


@pytest.mark.slow
def test_compare_tiny_searches_alike_reports_and_resumes(tmp_path):
    out = tmp_path / "compare"
    first, first_s = _compare(out)
    data = json.loads((out / "compare.json").read_text())
    models = data["models"]
    assert list(models) == list(MODELS)
    assert models["geo-tiny"]["geometric"] and not models["clip-tiny"]["geometric"]

    # the same grid (lr × temperature × caption negatives), the same steps, for both models; the geometric model's
    # global temperature on its own axis
    grids = {name: [r["recipe"] for r in m["search"]] for name, m in models.items()}
    assert len(grids["geo-tiny"]) == len(grids["clip-tiny"]) == 4
    for recipes in grids.values():
        assert {(r["lr"], r["temperature"], r["caption_negatives"]) for r in recipes} == {
            (lr, 0.07, neg) for lr in (1e-3, 2e-3) for neg in (0, 2)}
    assert all(r["global_temperature"] == 0.07 for r in grids["geo-tiny"])
    assert not any("global_temperature" in r for r in grids["clip-tiny"])
    assert data["settings"]["search_steps"] == 3 and data["settings"]["seeds"] == [0, 1, 2]

    for name, m in models.items():
        # the best recipe is the grid's highest served val R@1, ties to exact, then the lower lr
        key = [(r["val_served_R@1"], r["val_R@1"]) for r in m["search"]]
        assert (m["best"]["val_served_R@1"], m["best"]["val_R@1"]) == max(key)
        assert m["best"]["recipe"]["lr"] == min(r["recipe"]["lr"] for r, k in zip(m["search"], key) if k == max(key))
        if not m["geometric"]:  # served = the global ranking itself
            assert all(r["val_served_R@1"] == r["val_R@1"] for r in m["search"])
        else:  # the two-stage evaluation of the validation split ran and is what was read
            served = json.loads((Path(m["search"][0]["run_dir"]) / "results_val_served.json").read_text())
            assert served["mode"] == "two-stage"
            assert m["search"][0]["val_served_R@1"] == served["metrics"]["text_to_image_R@1"]
        assert all(r["val_curves"] and 0 <= r["val_R@1"] <= 1 for r in m["search"])
        # written under the output folder (not configs/), loadable against the schema, and it is the recipe
        path = Path(m["recipe_config"])
        assert path.parent == out.resolve() / "recipes" and path.name == f"compare_{name}.yaml"
        assert path.read_text().startswith(f"# python train.py --config {path}\n")
        cfg = load_train_config(path)
        assert cfg.model == name and cfg.optim.lr == m["best"]["recipe"]["lr"]
        assert cfg.data.caption_negatives == m["best"]["recipe"]["caption_negatives"]
        best = m["best"]["recipe"]
        assert cfg.model_args["init_temperature_global"] == best.get("global_temperature", best["temperature"])
        assert ("init_temperature_geo" in cfg.model_args) == m["geometric"]
        # three seeds, each evaluated on test and cogent (R@K and the suite)
        assert [r["seed"] for r in m["final"]] == [0, 1, 2]
        for run in m["final"]:
            for split in ("test", "cogent"):
                assert {"text_to_image_R@1", "image_to_text_R@10"} <= set(run[split]["metrics"])
                assert "all_edits" in run[split]["compositional"]
            if m["geometric"]:  # the test split as the service serves it: R@K and partial queries
                served = run["test"]["served"]
                assert "text_to_image_R@1" in served["metrics"] and "served" in served["partial_queries"]["one_object"]
            assert run["wall_s"] > 0 and "val/global/text_to_image_R@1" in run["val_curves"]
        assert data["summary"]["test"]["text→image R@1"][name]["seed_ids"] == [0, 1, 2]
    assert set(data["margins"]["test"]["all edits"]) == {"geo-tiny − clip-tiny"}
    assert len(data["margins"]["test"]["text→image R@1"]["geo-tiny − clip-tiny"]["seeds"]) == 3

    md = (out / "results.md").read_text()
    for text in ("### Recipe search", "| **lr=", "### Chosen recipes", "### test split", "### cogent split",
                 "| text→image R@1 |", "| image→text R@10 |", "| all edits |", "### Margin, geometric − baseline",
                 "| test | text→image R@1 | ", "| served text→image R@1 |", "| one-object P@1 |",
                 "| one-object P@1, served |", "| test | one-object P@1 | ", "val served T→I R@1", "Tg=0.07",
                 "### Training loss plateau", "| clip-tiny (baseline) | 2.08 |",
                 "commit ", "python -m experiments.compare --budget tiny --out"):
        assert text in md, text
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = 2 * (4 + 3)
    assert len(_progress(first, "search")) + len(_progress(first, "final")) == runs
    assert not any("reused:" in line for line in _progress(first, "search"))

    # the same command again: nothing is trained or evaluated anew
    second, second_s = _compare(out)
    lines = _progress(second, "search") + _progress(second, "final")
    assert len(lines) == runs and all("reused:" in line for line in lines), lines
    again = json.loads((out / "compare.json").read_text())
    assert all(r["reused"] for m in again["models"].values() for r in m["search"] + m["final"])
    assert again["summary"] == data["summary"]
    assert second_s < first_s / 2, (first_s, second_s)


def test_the_global_temperature_is_searched_apart_and_the_baseline_takes_every_value():
    from experiments.compare import grid, parse

    args = parse(["--budget", "tiny", "--temperatures", "0.03", "0.07", "--global-temperatures", "0.05", "0.07"])
    geo, clip = grid(args, geometric=True), grid(args, geometric=False)
    assert {(r.temperature, r.global_temperature) for r in geo} == {(t, g) for t in (0.03, 0.07) for g in (0.05, 0.07)}
    assert {r.temperature for r in clip} == {0.03, 0.05, 0.07} and {r.global_temperature for r in clip} == {None}
    over = geo[1].overrides(geometric=True)
    assert over[over.index("--model_args.init_temperature_global") + 1] == repr(geo[1].global_temperature)
    assert over[over.index("--model_args.init_temperature_geo") + 1] == repr(geo[1].temperature)
    tied = grid(parse(["--budget", "tiny", "--global-temperatures"]), geometric=True)
    assert {r.global_temperature for r in tied} == {None} and "Tg=" not in tied[0].label


def test_a_run_killed_before_its_first_checkpoint_is_trained_again(tmp_path):
    """A folder with a metrics.csv but no model.pt and no step checkpoint: trained again over it (--overwrite),
    not refused as an existing run; its other files stay."""
    from experiments import compare
    from tests.conftest import TINY

    run = tmp_path / "run"
    overrides = ["--trainer.max_steps", "2", "--trainer.batch_size", "8", "--data.train_size", "16",
                 "--data.val_size", "0", "--data.num_workers", "0", "--aids.diagnostics_every_n_steps", "0",
                 "--trainer.checkpoint_every_n_steps", "0", "--trainer.log_every_n_steps", "1",
                 "--out_dir", str(tmp_path), "--name", "run",
                 *[x for k, v in TINY.items() for x in (f"--model_args.{k}", str(v))]]
    run.mkdir()
    (run / "metrics.csv").write_text("step,train/loss\n0,9.0\n")
    (run / "notes.txt").write_text("kept")
    how, _ = compare.train_run("configs/synthetic.yaml", overrides, run)
    assert how == "trained" and (run / "model.pt").is_file() and (run / "notes.txt").read_text() == "kept"
    assert "9.0" not in (run / "metrics.csv").read_text()
    assert compare.train_run("configs/synthetic.yaml", overrides, run)[0] == "reused"


def test_a_run_from_before_a_new_field_is_the_same_recipe_unless_that_field_is_set(tmp_path):
    """A run folder whose config.yaml lacks a field added since, at its default now: the same recipe (a new field is
    off by default); the field set away from its default, or any value changed: refused, naming the field."""
    import yaml

    from experiments.compare import check_same_config, resolved
    from mmgeo.config import to_dict

    BASE = "configs/synthetic_full_captions.yaml"  # the geometric base of the compare: no typed captions
    expected = resolved(BASE, [])
    saved = to_dict(load_train_config(ROOT / BASE, []))
    del saved["data"]["typed_captions"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    check_same_config(tmp_path, expected)  # the field did not exist then: same recipe
    with pytest.raises(SystemExit, match="data.typed_captions: None there, 0.5 now"):
        check_same_config(tmp_path, resolved(BASE, ["--data.typed_captions", "0.5"]))
    saved["optim"]["lr"] = 0.01
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(SystemExit, match="optim.lr: 0.01 there, 0.001 now"):
        check_same_config(tmp_path, expected)


def test_compare_table_means_over_seeds(tmp_path):
    """Two seeds of one model: mean, sample std and lowest seed of R@1 and of each edit type, per split."""
    def run(name, seed, r1, swap):
        d = tmp_path / f"{name}_s{seed}"
        d.mkdir()
        (d / "config.yaml").write_text(f"# python train.py --config x\nmodel: {name}\n")
        for split in ("test", "cogent"):
            result = {"metrics": {"text_to_image_R@1": r1, "image_to_text_R@1": r1},
                      "compositional": {"edits": {"swap_color": {"accuracy": swap, "n": 10}},
                                        "all_edits": {"accuracy": swap, "n": 10},
                                        "consistency": {"all_rewrites": {"consistency": 1.0, "n": 4}}}}
            (d / f"results_{split}.json").write_text(json.dumps(result))
        return str(d)

    runs = [run("geo-tiny", 0, 0.9, 0.8), run("geo-tiny", 1, 0.8, 1.0)]
    res = subprocess.run([sys.executable, "-m", "experiments.compare_table", *runs], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert "| swap_color | 90.0 ± 14.1 (80.0) |" in res.stdout
    table = json.loads((tmp_path / "compare.json").read_text())
    assert table["cogent"]["text→image R@1"]["geo-tiny"]["seeds"] == pytest.approx([90.0, 80.0])


def test_the_optimiser_is_an_axis_every_model_is_searched_over():
    from experiments.compare import Recipe, grid, parse

    args = parse(["--budget", "tiny", "--optimizers", "adamw", "muon"])
    for geometric in (True, False):
        recipes = grid(args, geometric)
        assert {r.optimizer for r in recipes} == {"adamw", "muon"}
        assert len(recipes) == 2 * len(grid(parse(["--budget", "tiny"]), geometric))
    muon = next(r for r in grid(args, True) if r.optimizer == "muon")
    over = muon.overrides(geometric=True)
    assert over[over.index("--optim.name") + 1] == "muon" and muon.label.endswith(" opt=muon")
    assert "--optim.name" not in Recipe(1e-3, 0.07, 0).overrides(geometric=True)  # unset: the base config's
    assert Recipe(**muon.as_dict()) == muon  # a best recipe read back from compare.json
    for bad in (["--optimizers", "sgd"], ["--optimizers", "muon", "muon"], ["--optim.name", "muon"]):
        with pytest.raises(SystemExit):
            parse(["--budget", "tiny", *bad])
