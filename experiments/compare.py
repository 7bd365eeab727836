"""Geometric model vs CLIP baseline, each at its own best recipe found with the same search budget, several seeds.

    python -m experiments.compare                                   # geo-tiny vs clip-tiny, full budget (hours)
    python -m experiments.compare --models geo-tiny clip-tiny --lrs 5e-4 1e-3 2e-3 --temperatures 0.03 0.07 \
        --caption-negatives 0 2 --search-steps 500 --steps 1000 --seeds 0 1 2 --out runs/compare
    python -m experiments.compare --budget tiny --out /tmp/compare  # toy sizes, a couple of minutes (the test)
    python -m experiments.compare --report-to docs/measurements/retrieval.md   # also fill its compare section

1. Recipe search, the same for every model: each point of the grid learning rate (``--lrs``) × initial temperature
   (``--temperatures``: ``model_args.init_temperature_global``, and ``init_temperature_geo`` for a geometric model)
   × caption negatives (``--caption-negatives``: ``data.caption_negatives``, rule-based hard negatives any model can
   use) [× ``--weight-decays`` × ``--warmup-steps`` when given] is trained ``--search-steps`` steps with
   ``--search-seed`` from the model's base config (geo-tiny: configs/synthetic_full_captions.yaml,
   clip-tiny: configs/synthetic_clip.yaml, any other registered name: configs/synthetic_full_captions.yaml with
   ``--model NAME``), then scored on the validation split (eval.py, text->image R@1, exact and served). A geometric
   model has two temperatures: ``--global-temperatures`` searches its global one on its own axis (full: 0.03 0.07;
   empty: tied to the geometric one); a global-only model has one temperature, searched over every value either axis
   takes.
   Served = the service's two-stage search (global top-K' then geometric re-rank, eval.py ``--mode two-stage``)
   for a geometric model, the global ranking itself for a global-only one. Best = highest served val R@1 (ties:
   exact, then lower lr). The best recipe is written as a config: configs/compare_<model>.yaml (``--budget
   tiny``: <out>/recipes/).
2. That config trained for ``--steps`` steps with every seed of ``--seeds`` and evaluated on the test split
   (``eval.py --suite all``: R@K, the compositional suite, partial queries) and, on the shapes world, on the
   ``cogent`` split; a geometric model's test split also served (``--mode two-stage``: R@K and partial queries).
3. Writes to ``--out`` (default runs/compare): compare.json (every run: recipe, seed, val R@1 curves from its
   metrics.csv, wall seconds, test metrics), results.md (search grids, chosen recipes, mean ± std and lowest seed
   per model, geometric-minus-baseline margin paired by seed, the step each seed's global loss leaves its ln B
   plateau, wall time, commit, machine, date, command) and compare.png (val R@1 against steps and against wall seconds).

Resumable: a run whose model.pt and eval JSON exist is reused; a run folder with step checkpoints but no model.pt
is continued with train.py's ``--resume``; a run folder trained with another config stops the script (move it
away or choose another ``--out``), nothing is deleted. Extra ``--section.key value`` arguments go to every
training run (and into the recipe configs), e.g. ``--trainer.threads 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from benchmarks.harness import ROOT, add_out, add_report_to, check_markers, commit, cpu_model, logger, report_to
from experiments.compare_report import PLATEAU_MARGIN, markdown, plot, summarise

BASE_CONFIGS = {"geo-tiny": "configs/synthetic_full_captions.yaml", "clip-tiny": "configs/synthetic_clip.yaml"}
DEFAULT_BASE = "configs/synthetic_full_captions.yaml"
# a geo-tiny shrunk to test size (the test suite's TINY overrides)
TINY_MODEL_ARGS = dict(text_hidden=32, text_layers=1, text_heads=2, image_embed_dim=32, image_depth=1, image_heads=2,
                       image_size=32, patch_size=8, key_hidden=16, query_hidden=32, num_heads=2, d_a=8, d_e=8,
                       d_global=16)
BUDGETS = {
    # 500 search steps: at 200, every clip-tiny recipe tried was still on its ln B plateau
    # (docs/measurements/retrieval.md)
    "full": dict(search_steps=500, steps=1000, lrs=[5e-4, 1e-3, 2e-3], temperatures=[0.03, 0.07],
                 global_temperatures=[0.03, 0.07], caption_negatives=[0, 2], val_limit=None, limit=None,
                 suite_limit=None, val_points=10, extra=[]),
    "tiny": dict(search_steps=3, steps=3, lrs=[1e-3, 2e-3], temperatures=[0.07], global_temperatures=[0.07],
                 caption_negatives=[0, 2],
                 val_limit=6, limit=6, suite_limit=6, val_points=3,
                 extra=[x for k, v in TINY_MODEL_ARGS.items() for x in (f"--model_args.{k}", str(v))]
                 + ["--trainer.batch_size", "8", "--data.train_size", "64", "--data.val_size", "6",
                    "--data.num_workers", "0", "--trainer.log_every_n_steps", "1",
                    "--aids.diagnostics_every_n_steps", "0"]),
}
GRID_KEYS = ("optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.name", "data.caption_negatives",
             "model_args.init_temperature_global", "model_args.init_temperature_geo")
OWN_KEYS = GRID_KEYS + ("trainer.seed", "trainer.max_steps", "name", "out_dir", "model")
NOT_RECIPE = ("out_dir", "name", "trainer.threads", "data.num_workers")  # may differ between a run and a rerun


def done(how: str, reused: bool) -> str:
    """The progress line's note on how a run was obtained."""
    return "reused: " if reused else f"{how}, " if how.startswith("resumed") else ""


log = logger("compare")


def fmt(v: float) -> str:
    """1e-3 -> '1e-3', 0.03 -> '0.03', 2 -> '2'."""
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    if abs(v) < 0.01:
        mantissa, exp = f"{v:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    return f"{v:g}"


# ---------------------------------------------------------------------------------------------------- the grid

@dataclass(frozen=True)
class Recipe:
    lr: float
    temperature: float
    caption_negatives: int
    weight_decay: float | None = None  # None: the base config's
    warmup_steps: int | None = None
    global_temperature: float | None = None  # a geometric model's global one; None: = temperature
    optimizer: str | None = None  # optim.name (adamw, muon); None: the base config's

    @property
    def label(self) -> str:
        out = f"lr={fmt(self.lr)} T={fmt(self.temperature)}"
        out += "" if self.global_temperature is None else f" Tg={fmt(self.global_temperature)}"
        out += f" neg={self.caption_negatives}"
        out += "" if self.weight_decay is None else f" wd={fmt(self.weight_decay)}"
        out += "" if self.optimizer is None else f" opt={self.optimizer}"
        return out + ("" if self.warmup_steps is None else f" warmup={self.warmup_steps}")

    @property
    def folder(self) -> str:
        return self.label.replace("=", "").replace(" ", "_")

    def overrides(self, geometric: bool) -> list[str]:
        t_global = self.temperature if self.global_temperature is None else self.global_temperature
        out = ["--optim.lr", repr(self.lr), "--model_args.init_temperature_global", repr(t_global),
               "--data.caption_negatives", str(self.caption_negatives)]
        if geometric:
            out += ["--model_args.init_temperature_geo", repr(self.temperature)]
        if self.weight_decay is not None:
            out += ["--optim.weight_decay", repr(self.weight_decay)]
        if self.warmup_steps is not None:
            out += ["--optim.warmup_steps", str(self.warmup_steps)]
        if self.optimizer is not None:
            out += ["--optim.name", self.optimizer]
        return out

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def grid(args: argparse.Namespace, geometric: bool) -> list[Recipe]:
    """A geometric model: lr × T × negatives [× wd × warm-up] × global T (when searched apart) [× optimiser]; a
    global-only model has one temperature, searched over every value either temperature axis takes."""
    temperatures = args.temperatures if geometric else sorted(set(args.temperatures) | set(args.global_temperatures))
    axes = [args.lrs, temperatures, args.caption_negatives, args.weight_decays or [None], args.warmup_steps or [None],
            (args.global_temperatures or [None]) if geometric else [None], args.optimizers or [None]]
    return [Recipe(*point) for point in itertools.product(*axes)]


def best_recipe(rows: list[dict]) -> dict:
    """Highest served val R@1; ties: exact val R@1, lower lr, then grid order."""
    return max(enumerate(rows), key=lambda ir: (ir[1]["val_served_R@1"], ir[1]["val_R@1"], -ir[1]["recipe"]["lr"],
                                                -ir[0]))[1]


# ------------------------------------------------------------------------------------------------ run folders

def base_config(model: str) -> tuple[str, list[str]]:
    """(base config, the override that selects the model) of a registered model."""
    if model in BASE_CONFIGS:
        return BASE_CONFIGS[model], []
    return DEFAULT_BASE, ["--model", model]


def is_geometric(model: str) -> bool:
    import mmgeo

    return mmgeo.model_config(model).score == "geometric"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resolved(config: str, overrides: list[str]) -> dict:
    """The flat resolved config train.py would write (JSON-normalised), without the keys that may change."""
    from mmgeo.config import to_dict
    from mmgeo.training.config import load_train_config

    flat = _flat(json.loads(json.dumps(to_dict(load_train_config(ROOT / config, overrides)))))
    return {k: v for k, v in flat.items() if k not in NOT_RECIPE}


def check_same_config(run_dir: Path, expected: dict) -> None:
    """Stop if the run folder was trained with another config: its results would be reused under a wrong label."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return
    from mmgeo.config import to_dict
    from mmgeo.training.config import TrainConfig

    found = {k: v for k, v in _flat(json.loads(json.dumps(yaml.safe_load(path.read_text())))).items()
             if k not in NOT_RECIPE}
    # a field added since that run, at its default, is the behaviour that run had (a new field is off by default)
    default = _flat(json.loads(json.dumps(to_dict(TrainConfig()))))
    found |= {k: default[k] for k in expected if k not in found and k in default and expected[k] == default[k]}
    diff = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
    if diff:
        shown = ", ".join(f"{k}: {found.get(k)!r} there, {expected.get(k)!r} now" for k in diff[:4])
        raise SystemExit(f"{run_dir} was trained with another config ({shown}); move that folder away or pass "
                         "another --out, then rerun (nothing was deleted)")


def wall_clock(run_dir: Path):
    """A Lightning callback writing <run>/wall.csv: (step, wall seconds since training started) after every step;
    a resumed run continues the clock of the rows before its checkpoint."""
    import lightning as L

    class WallClock(L.Callback):
        def on_train_start(self, trainer, module):
            path, self.rows = run_dir / "wall.csv", []
            if path.is_file():
                self.rows = sorted((s, t) for s, t in read_wall(run_dir).items() if s <= trainer.global_step)
            self.offset = self.rows[-1][1] if self.rows else 0.0
            self.start = time.time()
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w")
            self.file.write("step,seconds\n" + "".join(f"{s},{t:.3f}\n" for s, t in self.rows))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.file.write(f"{trainer.global_step},{self.offset + time.time() - self.start:.3f}\n")
            self.file.flush()

        def on_train_end(self, trainer, module):
            self.file.close()

    return WallClock()


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv -> {column: [(step, value), ...]} for the val R@1 and global-loss columns."""
    path = run_dir / "metrics.csv"
    out: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return out
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get("step", "") == "":
                continue
            for k, v in row.items():
                if v not in ("", None) and (k.endswith("text_to_image_R@1") or k == "train/loss_global"):
                    out.setdefault(k, []).append((int(float(row["step"])), float(v)))
    return out


def read_wall(run_dir: Path) -> dict[int, float]:
    path = run_dir / "wall.csv"
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return {int(s): float(t) for s, t in csv.reader(f) if s != "step"}


def plateau_step(loss: list[tuple[int, float]], batch: int) -> int | None:
    """First logged step whose global loss is below ln(batch) - PLATEAU_MARGIN (None: never)."""
    return next((s for s, v in loss if v < math.log(batch) - PLATEAU_MARGIN), None)


def train_run(config: str, overrides: list[str], run_dir: Path) -> tuple[str, float]:
    """Train (or continue) one run in this process; -> (what was done, seconds)."""
    import mmgeo.training as training

    check_same_config(run_dir, resolved(config, overrides))
    if (run_dir / "model.pt").is_file():
        return "reused", 0.0
    argv = ["--config", str(ROOT / config), *overrides]
    how = "trained"
    if list((run_dir / "checkpoints").glob("step=*.ckpt")):
        argv.append("--resume")
        how = f"resumed from {training.latest_checkpoint(run_dir).name}"
    elif training.existing_run(run_dir):  # a metrics.csv only: killed before its first checkpoint
        argv.append("--overwrite")  # replaces what training wrote, keeps wall.csv / results (rewritten anyway)
        log(f"{run_dir} has no model.pt and no step checkpoint: training it again (its metrics.csv is replaced)")
    start = time.time()
    training.train(argv, callbacks=[wall_clock(run_dir)])
    return how, time.time() - start


def eval_run(run_dir: Path, split: str, extra: list[str], tag: str = "") -> tuple[dict, float, bool]:
    """eval.py on one split, or its JSON (results_<split><tag>.json) when it exists; -> (result, seconds, reused)."""
    import eval as eval_app

    out = run_dir / f"results_{split}{tag}.json"
    if out.is_file():
        return json.loads(out.read_text()), 0.0, True
    start = time.time()
    with contextlib.redirect_stdout(io.StringIO()):  # its tables: the JSON holds them
        result = eval_app.main(["--ckpt", str(run_dir / "model.pt"), "--split", split, "--out", str(out), *extra])
    return result, time.time() - start, False


def curves(run_dir: Path) -> dict:
    m, wall = read_metrics(run_dir), read_wall(run_dir)
    val = {k: v for k, v in m.items() if k.startswith("val/")}
    return {"val_curves": val, "wall_at_val_steps": {s: wall.get(s) for s in sorted({s for c in val.values()
                                                                                     for s, _ in c})},
            "loss_global": m.get("train/loss_global", [])}


# ------------------------------------------------------------------------------------------------ the stages

def search(model: str, args: argparse.Namespace, out: Path) -> list[dict]:
    config, pick = base_config(model)
    geometric = is_geometric(model)
    recipes = grid(args, geometric)
    every = max(1, args.search_steps // args.val_points)
    rows = []
    for i, recipe in enumerate(recipes, 1):
        run_dir = out / "search" / model / recipe.folder
        head = f"search {model} {recipe.label} ({i}/{len(recipes)}) ..."
        log(head)
        overrides = [*args.extra, *pick, *recipe.overrides(geometric), "--trainer.max_steps", str(args.search_steps),
                     "--trainer.seed", str(args.search_seed), "--trainer.val_every_n_steps", str(every),
                     "--trainer.checkpoint_every_n_steps", str(max(1, args.search_steps // 4)),
                     "--out_dir", str(run_dir.parent), "--name", run_dir.name]
        how, train_s = train_run(config, overrides, run_dir)
        val_args = [] if args.val_limit is None else ["--limit", str(args.val_limit)]
        result, eval_s, eval_reused = eval_run(run_dir, "val", val_args)
        r1 = served = result["metrics"]["text_to_image_R@1"]
        if geometric:  # what the service serves: global top-K', geometric re-rank
            two_stage, seconds, was = eval_run(run_dir, "val", [*val_args, "--mode", "two-stage"], tag="_served")
            served, eval_s = two_stage["metrics"]["text_to_image_R@1"], eval_s + seconds
            eval_reused = eval_reused and was
        reused = how == "reused" and eval_reused
        log(f"{head} {done(how, reused)}val R@1 {r1:.3f}, served {served:.3f} ({train_s + eval_s:.0f} s)")
        rows.append({"recipe": recipe.as_dict(), "label": recipe.label, "seed": args.search_seed,
                     "run_dir": str(run_dir), "trained": how, "reused": reused, "val_R@1": r1, "val_served_R@1": served,
                     "val_metrics": result["metrics"], "train_s": round(train_s, 1), "eval_s": round(eval_s, 1),
                     "wall_s": total_wall(run_dir), **curves(run_dir)})
    return rows


def total_wall(run_dir: Path) -> float | None:
    wall = read_wall(run_dir)
    return round(wall[max(wall)], 1) if wall else None


def write_recipe(model: str, best: dict, args: argparse.Namespace, recipes_dir: Path) -> Path:
    """The best recipe as a config: the model's base YAML + the recipe + the final run's settings."""
    from mmgeo.config import merge_dicts, parse_overrides

    config, pick = base_config(model)
    recipe = Recipe(**best["recipe"])
    data = yaml.safe_load((ROOT / config).read_text()) or {}
    every = max(1, args.steps // args.val_points)
    extra = parse_overrides([*args.extra, *pick, *recipe.overrides(is_geometric(model)),
                             "--trainer.max_steps", str(args.steps), "--trainer.val_every_n_steps", str(every),
                             "--trainer.checkpoint_every_n_steps", str(max(1, args.steps // 4))])
    merged = merge_dicts(data, extra)
    merged["name"] = f"compare_{model}"
    path = recipes_dir / f"compare_{model}.yaml"
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    text = (f"# python train.py --config {shown}\n"
            f"# {model} at its best recipe of `python -m experiments.compare` ({recipe.label}): validation "
            f"text->image R@1 {100 * best['val_R@1']:.1f}, served {100 * best['val_served_R@1']:.1f}\n# after "
            f"{args.search_steps} search steps (seed {args.search_seed}), the best of "
            f"{len(grid(args, is_geometric(model)))} recipes; trained here for {args.steps} steps.\n"
            + yaml.safe_dump({"name": merged.pop("name"), **merged}, sort_keys=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def final(model: str, recipe_path: Path, args: argparse.Namespace, out: Path, synthetic: bool) -> list[dict]:
    rows = []
    config = str(recipe_path)
    for i, seed in enumerate(args.seeds, 1):
        run_dir = out / "final" / model / f"s{seed}"
        head = f"final {model} seed={seed} ({i}/{len(args.seeds)}) ..."
        log(head)
        overrides = ["--trainer.seed", str(seed), "--out_dir", str(run_dir.parent), "--name", run_dir.name]
        how, train_s = train_run(config, overrides, run_dir)
        evals, eval_s, reused = {}, 0.0, how == "reused"
        limit = [] if args.limit is None else ["--limit", str(args.limit)]
        for split in ("test", "cogent") if synthetic else ("test",):
            extra = ["--suite", "all", *limit]
            extra += [] if args.suite_limit is None else ["--suite-limit", str(args.suite_limit)]
            result, seconds, was = eval_run(run_dir, split, extra)
            evals[split] = {k: v for k, v in result.items() if k != "diagnostics"}
            eval_s, reused = eval_s + seconds, reused and was
        if is_geometric(model):  # the test split as the service serves it: R@K and (shapes world) partial queries
            suites = ("retrieval", "partial") if synthetic else ("retrieval",)
            served = {}
            for suite in suites:
                result, seconds, was = eval_run(run_dir, "test", ["--suite", suite, "--mode", "two-stage", *limit],
                                                tag=f"_served_{suite}")
                served.update({k: result[k] for k in ("metrics", "partial_queries") if k in result})
                eval_s, reused = eval_s + seconds, reused and was
            evals["test"]["served"] = served
        said = ", ".join(f"{s} R@1 {r['metrics']['text_to_image_R@1']:.3f}" for s, r in evals.items())
        log(f"{head} {done(how, reused)}{said} ({train_s + eval_s:.0f} s)")
        c = curves(run_dir)
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["batch_size"]
        rows.append({"seed": seed, "run_dir": str(run_dir), "trained": how, "reused": reused,
                     "train_s": round(train_s, 1), "eval_s": round(eval_s, 1), "wall_s": total_wall(run_dir),
                     "batch_size": batch, "plateau_step": plateau_step(c["loss_global"], batch), **c, **evals})
    return rows


# ------------------------------------------------------------------------------------------------ the command

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["geo-tiny", "clip-tiny"], help="registered model names")
    p.add_argument("--budget", choices=sorted(BUDGETS), default="full",
                   help="full: the real settings; tiny: toy sizes (the test suite's)")
    p.add_argument("--lrs", nargs="+", type=float, help="grid: peak learning rates (full: 5e-4 1e-3 2e-3)")
    p.add_argument("--temperatures", nargs="+", type=float,
                   help="grid: initial temperatures, global and (geometric models) geometric (full: 0.03 0.07)")
    p.add_argument("--global-temperatures", nargs="*", type=float,
                   help="grid: a geometric model's initial global temperature, searched apart from --temperatures "
                   "(full: 0.03 0.07; given empty: tied to the geometric one)")
    p.add_argument("--caption-negatives", nargs="+", type=int, help="grid: data.caption_negatives (full: 0 2)")
    p.add_argument("--weight-decays", nargs="+", type=float, default=[],
                   help="grid (optional): optim.weight_decay (default: each base config's)")
    p.add_argument("--warmup-steps", nargs="+", type=int, default=[],
                   help="grid (optional): optim.warmup_steps (default: each base config's)")
    p.add_argument("--optimizers", nargs="+", choices=["adamw", "muon"], default=[],
                   help="grid (optional): optim.name, each model searched with every one (default: each base "
                   "config's)")
    p.add_argument("--search-steps", type=int, help="steps of each search run (full: 500)")
    p.add_argument("--search-seed", type=int, default=0, help="seed of the search runs")
    p.add_argument("--steps", type=int, help="steps of each final run (full: 1000)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the final runs")
    p.add_argument("--val-limit", type=int, help="search: validation images scored (full: all 1,014)")
    p.add_argument("--limit", type=int, help="final: test images scored (full: all)")
    p.add_argument("--suite-limit", type=int, help="final: images of the compositional suite (full: all)")
    p.add_argument("--val-points", type=int, help="validations during each run, for the curves (full: 10)")
    add_out(p, "runs/compare", "runs, compare.json, results.md, png")
    p.add_argument("--recipes-dir", default=None, help="where the best-recipe configs go (full: configs/, "
                   "tiny: <out>/recipes)")
    add_report_to(p, "compare", "results.md")
    args, extra = p.parse_known_args(argv)
    preset = BUDGETS[args.budget]
    for k in ("lrs", "temperatures", "global_temperatures", "caption_negatives", "search_steps", "steps",
              "val_limit", "limit", "suite_limit", "val_points"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    args.extra = list(preset["extra"]) + extra
    check(p, args, extra)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    import mmgeo
    from mmgeo.config import ConfigError, parse_overrides

    unknown = [m for m in args.models if m not in mmgeo.list_models()]
    if unknown:
        p.error(f"unknown model(s) {unknown}: pass --models with registered names ({', '.join(mmgeo.list_models())})")
    if len(set(args.models)) != len(args.models):
        p.error(f"--models lists a model twice: {args.models}")
    for axis in ("lrs", "temperatures", "caption_negatives", "seeds"):
        values = getattr(args, axis)
        if not values:
            p.error(f"--{axis.replace('_', '-')} is empty: give at least one value")
        if len(set(values)) != len(values):
            p.error(f"--{axis.replace('_', '-')} lists a value twice: {values}")
    for axis in ("global_temperatures", "weight_decays", "warmup_steps", "optimizers"):  # optional axes
        values = getattr(args, axis)
        if len(set(values)) != len(values):
            p.error(f"--{axis.replace('_', '-')} lists a value twice: {values}")
    if min(args.lrs) <= 0 or min(args.temperatures + args.global_temperatures) <= 0 or min(args.caption_negatives) < 0:
        p.error("learning rates and temperatures must be positive, caption negatives >= 0")
    if min(args.search_steps, args.steps, args.val_points) < 1:
        p.error("--search-steps, --steps and --val-points must be >= 1")
    try:
        flat = _flat(parse_overrides(extra))
    except ConfigError as err:
        p.error(f"extra arguments are train.py overrides (--section.key VALUE): {err}")
    own = sorted(k for k in flat if k in OWN_KEYS)
    if own:
        p.error(f"{own} are set by this script (grid axes: --lrs, --temperatures, --global-temperatures, "
                "--caption-negatives, --weight-decays, --warmup-steps, --optimizers; --search-steps, --steps, "
                "--seeds, --out): use those options")
    for model in args.models:  # the base config with the extra overrides must load before anything trains
        config, pick = base_config(model)
        try:
            resolved(config, [*args.extra, *pick])
        except (ConfigError, ValueError) as err:
            p.error(f"{model}: {config} with the extra overrides {extra} does not load: {err}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.time()
    args = parse(argv)
    out = Path(args.out).resolve()
    recipes_dir = Path(args.recipes_dir or (out / "recipes" if args.budget == "tiny" else ROOT / "configs")).resolve()
    sizes = {m: len(grid(args, is_geometric(m))) for m in args.models}
    if args.report_to:
        check_markers(Path(args.report_to).resolve(), "compare")  # before hours of training, not after
    synthetic = all(yaml.safe_load((ROOT / base_config(m)[0]).read_text())["data"]["name"] == "synthetic"
                    for m in args.models)
    log(f"{len(args.models)} models ({', '.join(f'{m}: {n} recipes' for m, n in sizes.items())}) × "
        f"{args.search_steps} steps, then {len(args.seeds)} "
        f"seeds × {args.steps} steps; runs under {out}")
    models: dict = {}
    for model in args.models:
        rows = search(model, args, out)
        best = best_recipe(rows)
        log(f"best {model}: {best['label']} (val R@1 {best['val_R@1']:.3f}, served {best['val_served_R@1']:.3f})")
        path = write_recipe(model, best, args, recipes_dir)
        models[model] = {"base_config": base_config(model)[0], "geometric": is_geometric(model), "search": rows,
                         "best": {k: best[k] for k in ("recipe", "label", "val_R@1", "val_served_R@1", "run_dir")},
                         "recipe_config": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)}
    for model in args.models:
        models[model]["final"] = final(model, ROOT / models[model]["recipe_config"], args, out, synthetic)
    summary, margins = summarise(models)
    grid_axes = {k: getattr(args, k) for k in ("lrs", "temperatures", "global_temperatures", "caption_negatives",
                                               "weight_decays", "warmup_steps", "optimizers")}
    data = {"command": "python -m experiments.compare " + shlex.join(argv), "commit": commit(),
            "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "wall_s": 0.0,
            "settings": {"budget": args.budget, "grid": grid_axes, "grid_size": sizes,
                         "search_steps": args.search_steps, "search_seed": args.search_seed, "steps": args.steps,
                         "seeds": args.seeds, "val_limit": args.val_limit, "limit": args.limit,
                         "suite_limit": args.suite_limit, "val_points": args.val_points, "synthetic": synthetic,
                         "extra_overrides": args.extra, "threads": os.environ.get("OMP_NUM_THREADS")},
            "models": models, "summary": summary, "margins": margins}
    out.mkdir(parents=True, exist_ok=True)
    plot(models, out / "compare.png")
    data["wall_s"] = round(time.time() - started, 1)
    (out / "compare.json").write_text(json.dumps(data, indent=2))
    md = markdown(data, "compare.png")
    (out / "results.md").write_text(md)
    if args.report_to:
        dest = Path(args.report_to).resolve()
        report_to(dest, "compare", markdown(data, os.path.relpath(out / "compare.png", dest.parent)))
    log(f"written {out / 'compare.json'}, {out / 'results.md'}, {out / 'compare.png'} ({data['wall_s']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
