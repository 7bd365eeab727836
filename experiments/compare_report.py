"""The report of ``experiments/compare.py``: mean ± std over seeds, margins paired by seed, the markdown of
results.md (search grids, chosen recipes, tables, loss plateau, wall time) and compare.png (validation R@1
against steps and against wall seconds)."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

PLATEAU_MARGIN = 0.1  # a run has left its loss plateau when train/loss_global < ln B - this


def rows_of(result: dict, ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, float]:
    """Flat {row: value in %} of one eval JSON (R@K for each of ``ks``, both directions; served text→image R@1; the
    suite's accuracies; partial-query P@1). Served = ``result["served"]`` (two-stage) for a geometric model, the
    global ranking itself for a global-only one."""
    m = result["metrics"]
    rows = {f"{a}→{b} R@{k}": m[f"{d}_R@{k}"] for d, a, b in (("text_to_image", "text", "image"),
                                                                ("image_to_text", "image", "text"))
            for k in ks}
    global_only = result.get("score") == "global"
    served = result.get("served", {})
    if "metrics" in served or global_only:
        rows["served text→image R@1"] = (m if global_only else served["metrics"])["text_to_image_R@1"]
    partial = result.get("partial_queries", {})
    for kind in ("one_object", "two_object"):
        if kind in partial:
            name = kind.replace("_", "-")
            exact = partial[kind].get("exact_geometric", partial[kind]["exact_global"])
            rows[f"{name} P@1"] = exact["P@1"]
            rows[f"{name} P@1, global vector"] = partial[kind]["exact_global"]["P@1"]
            if global_only:
                rows[f"{name} P@1, served"] = exact["P@1"]
            elif kind in served.get("partial_queries", {}):
                rows[f"{name} P@1, served"] = served["partial_queries"][kind]["served"]["P@1"]
    comp = result.get("compositional")
    if comp:
        rows.update({k: v["accuracy"] for k, v in comp["edits"].items() if v["accuracy"] is not None})
        rows["all edits"] = comp["all_edits"]["accuracy"]
        rows.update({f"consistency: {k}": v["consistency"] for k, v in comp["consistency"].items()
                     if v["consistency"] is not None})
    return {k: 100 * v for k, v in rows.items()}


def mean_std(vals: list[float]) -> dict:
    return {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "seeds": vals}


def summarise(models: dict) -> tuple[dict, dict]:
    """-> ({split: {row: {model: mean/std/min/seeds}}}, {split: {row: {"G − B": mean/std/seeds}}})."""
    summary: dict = {}
    for name, m in models.items():
        for run in m["final"]:
            for split in ("test", "cogent"):
                if split in run:
                    for row, v in rows_of(run[split]).items():
                        summary.setdefault(split, {}).setdefault(row, {}).setdefault(name, {})[run["seed"]] = v
    margins: dict = {}
    geo = [n for n, m in models.items() if m["geometric"]]
    base = [n for n, m in models.items() if not m["geometric"]]
    for split, rows in summary.items():
        for row, per_model in rows.items():
            for g, b in itertools.product(geo, base):
                seeds = [s for s in per_model.get(g, {}) if s in per_model.get(b, {})]
                if seeds and row in ("text→image R@1", "image→text R@1", "served text→image R@1", "all edits",
                                     "one-object P@1", "one-object P@1, served"):
                    diff = [per_model[g][s] - per_model[b][s] for s in seeds]
                    margins.setdefault(split, {}).setdefault(row, {})[f"{g} − {b}"] = {**mean_std(diff),
                                                                                       "paired_seeds": seeds}
            for name in per_model:
                per_model[name] = {**mean_std(list(per_model[name].values())), "seed_ids": list(per_model[name])}
    return summary, margins


def cell(s: dict) -> str:
    return f"{s['mean']:.1f} ± {s['std']:.1f} ({s['min']:.1f})"


def markdown(data: dict, image: str) -> str:
    models, s = data["models"], data["settings"]
    sizes = s["grid_size"] if isinstance(s["grid_size"], dict) else {n: s["grid_size"] for n in models}
    tg = s["grid"].get("global_temperatures") or []
    out = ["## Geometric model vs baseline, each at its own best recipe (experiments/compare.py)", "",
           f"Every model gets the same recipe search: lr {s['grid']['lrs']} × initial "
           f"temperature {s['grid']['temperatures']} × caption negatives {s['grid']['caption_negatives']}"
           + "".join(f" × {k.replace('_', ' ')} {s['grid'][k]}"
                     for k in ("weight_decays", "warmup_steps", "optimizers") if s["grid"].get(k))
           + (f" × a geometric model's global temperature {tg} (a global-only model's one temperature takes every "
              "value of both axes)" if tg else "")
           + f" — {', '.join(f'{n}: {k} recipes' for n, k in sizes.items())} — {s['search_steps']} steps each, seed "
           f"{s['search_seed']}, scored by served text→image R@1 on the validation split (ties: exact; served = "
           f"the service's two-stage search for a geometric model, the global ranking for a global-only one; "
           f"{s['val_limit'] or 'all'} images); other settings (warm-up, "
           "weight decay, batch, towers, data) come from each model's base config. The best recipe is then trained "
           f"for {s['steps']} steps with seeds {s['seeds']} and evaluated on the test split"
           f"{' and on cogent' if s['synthetic'] else ''} ({s['limit'] or 'all'} images; suite on "
           f"{s['suite_limit'] or s['limit'] or 'all'}).", ""]
    out += ["### Recipe search (validation text→image R@1, %)", ""]
    for name, m in models.items():
        out += [f"**{name}** (base {m['base_config']})", "",
                "| recipe | val T→I R@1 | val served T→I R@1 | val I→T R@1 | train s |", "|---|---|---|---|---|"]
        for r in m["search"]:
            best = r["label"] == m["best"]["label"]
            label = f"**{r['label']}** (chosen)" if best else r["label"]
            served = r.get("val_served_R@1", r["val_R@1"])
            out.append(f"| {label} | {100 * r['val_R@1']:.1f} | {100 * served:.1f} | "
                       f"{100 * r['val_metrics']['image_to_text_R@1']:.1f} | "
                       f"{r['wall_s'] if r['wall_s'] is not None else '–'} |")
        out.append("")
    out += ["### Chosen recipes", "", "| model | recipe | val T→I R@1 | val served T→I R@1 | config |",
            "|---|---|---|---|---|"]
    out += [f"| {n} | {m['best']['label']} | {100 * m['best']['val_R@1']:.1f} | "
            f"{100 * m['best'].get('val_served_R@1', m['best']['val_R@1']):.1f} | `{m['recipe_config']}` |"
            for n, m in models.items()]
    out.append("")
    for split, rows in data["summary"].items():
        names = [n for n in models if any(n in v for v in rows.values())]
        out += [f"### {split} split, {s['steps']} steps — mean ± std over seeds (lowest seed), %", "",
                "| | " + " | ".join(f"{n} (n={len(models[n]['final'])})" for n in names) + " |",
                "|---|" + "---|" * len(names)]
        out += [f"| {row} | " + " | ".join(cell(v[n]) if n in v else "–" for n in names) + " |"
                for row, v in rows.items()]
        out.append("")
    if data["margins"]:
        pairs = sorted({p for rows in data["margins"].values() for v in rows.values() for p in v})
        out += ["### Margin, geometric − baseline, paired by seed (points)", "",
                "| split | row | " + " | ".join(pairs) + " |", "|---|---|" + "---|" * len(pairs)]
        for split, rows in data["margins"].items():
            out += [f"| {split} | {row} | " + " | ".join(f"{v[p]['mean']:+.1f} ± {v[p]['std']:.1f}" if p in v else "–"
                                                        for p in pairs) + " |" for row, v in rows.items()]
        out.append("")
    else:
        out += ["(No margin: the comparison needs a geometric and a global-score model.)", ""]
    out += [f"### Training loss plateau (first logged step where train/loss_global < ln B − {PLATEAU_MARGIN})", "",
            "| model | ln B | " + " | ".join(f"seed {x}" for x in s["seeds"]) + " |",
            "|---|---|" + "---|" * len(s["seeds"])]
    for name, m in models.items():
        if m["final"]:
            batch = m["final"][0]["batch_size"]
            steps = {r["seed"]: r["plateau_step"] for r in m["final"]}
            out.append(f"| {name}{'' if m['geometric'] else ' (baseline)'} | {math.log(batch):.2f} | "
                       + " | ".join(str(steps.get(x)) if steps.get(x) is not None else "never" for x in s["seeds"])
                       + " |")
    out += ["", "### Wall time of training (s)", "", "| model | search (all recipes) | final run (mean over seeds) |",
            "|---|---|---|"]
    for name, m in models.items():
        walls = [r["wall_s"] for r in m["final"] if r["wall_s"] is not None]
        search_s = sum(r["wall_s"] or 0 for r in m["search"])
        out.append(f"| {name} | {search_s:.1f} | {statistics.mean(walls):.1f} |" if walls else
                   f"| {name} | {search_s:.1f} | – |")
    out += ["", f"![validation R@1 against steps and wall seconds]({image})", "",
            f"Produced by (commit {data['commit']}, machine: {data.get('machine', 'not recorded')}, {data['date']}, "
            f"{data['wall_s'] / 60:.1f} min of wall time for "
            "this invocation; reused runs cost nothing):", "", f"    {data['command']}", ""]
    return "\n".join(out)


def plot(models: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_steps, ax_wall) = plt.subplots(1, 2, figsize=(10, 4))
    for name, m in models.items():
        key = f"val/{'geometric' if m['geometric'] else 'global'}/text_to_image_R@1"
        per_step: dict[int, list[float]] = {}
        wall: dict[int, list[float]] = {}
        for run in m["final"]:
            for step, v in run["val_curves"].get(key, []):
                per_step.setdefault(step, []).append(100 * v)
                t = run["wall_at_val_steps"].get(step)
                if t is not None:
                    wall.setdefault(step, []).append(t)
        steps = sorted(per_step)
        if not steps:
            continue
        mean = [statistics.mean(per_step[s]) for s in steps]
        ax_steps.plot(steps, mean, marker="o", label=name)
        timed = [s for s in steps if s in wall]
        ax_wall.plot([statistics.mean(wall[s]) for s in timed], [statistics.mean(per_step[s]) for s in timed],
                     marker="o", label=name)
    for ax, xlabel in ((ax_steps, "training step"), (ax_wall, "wall seconds of training")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val text→image R@1 (%), mean over seeds")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("each model at its best recipe")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
