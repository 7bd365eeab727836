"""Mean ± std over seeds of R@1 and the compositional suite, per model, from eval.py's JSON files.

    python benchmarks/compare_table.py runs/synthetic_s0 runs/synthetic_s1 ... runs/synthetic_clip_s2

Each run folder holds ``results_test.json`` and ``results_cogent.json`` (``eval.py --suite all``) and
``config.yaml``; runs are grouped by their config's model name. Prints markdown tables (mean ± std,
and the lowest seed) and writes them as JSON next to the first run's parent (``compare.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml


def _load(run: Path) -> dict:
    out = {"model": yaml.safe_load((run / "config.yaml").read_text().split("\n", 1)[1])["model"]}
    for split in ("test", "cogent"):
        path = run / f"results_{split}.json"
        if path.is_file():
            out[split] = json.loads(path.read_text())
    return out


def _rows(result: dict) -> dict[str, float]:
    """Flat {row name: value in %} of one eval JSON."""
    m, comp = result["metrics"], result["compositional"]
    rows = {"text→image R@1": m["text_to_image_R@1"], "image→text R@1": m["image_to_text_R@1"]}
    rows.update({f"{k}": v["accuracy"] for k, v in comp["edits"].items() if v["accuracy"] is not None})
    rows["all edits"] = comp["all_edits"]["accuracy"]
    rows.update({f"consistency: {k}": v["consistency"] for k, v in comp["consistency"].items()
                 if v["consistency"] is not None})
    return {k: 100 * v for k, v in rows.items()}


def table(runs: list[Path]) -> dict:
    by_model: dict[str, list[dict]] = {}
    for run in runs:
        r = _load(run)
        by_model.setdefault(r["model"], []).append(r)
    out = {}
    for split in ("test", "cogent"):
        models = {name: [_rows(r[split]) for r in rs if split in r] for name, rs in by_model.items()}
        models = {k: v for k, v in models.items() if v}
        if not models:
            continue
        names = list(next(iter(models.values()))[0])
        print(f"\n**{split} split** — mean ± std over seeds (lowest seed), %\n")
        print("| | " + " | ".join(f"{k} (n={len(v)})" for k, v in models.items()) + " |")
        print("|---|" + "---|" * len(models))
        out[split] = {}
        for row in names:
            cells = []
            for name, seeds in models.items():
                vals = [s[row] for s in seeds if row in s]
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                cells.append(f"{statistics.mean(vals):.1f} ± {sd:.1f} ({min(vals):.1f})")
                out[split].setdefault(row, {})[name] = {"mean": statistics.mean(vals), "std": sd, "min": min(vals),
                                                         "seeds": vals}
            print(f"| {row} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    paths = [Path(p) for p in sys.argv[1:]]
    result = table(paths)
    dest = paths[0].parent / "compare.json"
    dest.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {dest}")
