"""Mean ± std over seeds of R@1 and the compositional suite, per model, from eval.py's JSON files.

    python -m experiments.compare_table runs/synthetic_s0 runs/synthetic_s1 ... runs/synthetic_clip_s2

Each run folder holds ``results_test.json`` and ``results_cogent.json`` (``eval.py --suite all``) and
``config.yaml``; runs are grouped by their config's model name. Prints markdown tables (mean ± std,
and the lowest seed) and writes them as JSON next to the first run's parent (``compare.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from benchmarks.harness import markdown_table
from experiments.compare_report import cell, mean_std, rows_of


def _load(run: Path) -> dict:
    out = {"model": yaml.safe_load((run / "config.yaml").read_text().split("\n", 1)[1])["model"]}
    for split in ("test", "cogent"):
        path = run / f"results_{split}.json"
        if path.is_file():
            out[split] = json.loads(path.read_text())
    return out


def table(runs: list[Path]) -> dict:
    by_model: dict[str, list[dict]] = {}
    for run in runs:
        r = _load(run)
        by_model.setdefault(r["model"], []).append(r)
    out = {}
    for split in ("test", "cogent"):
        models = {name: [rows_of(r[split], ks=(1,)) for r in rs if split in r] for name, rs in by_model.items()}
        models = {k: v for k, v in models.items() if v}
        if not models:
            continue
        names = list(next(iter(models.values()))[0])
        out[split] = {row: {name: mean_std([s[row] for s in seeds if row in s]) for name, seeds in models.items()}
                      for row in names}
        print(f"\n**{split} split** — mean ± std over seeds (lowest seed), %\n")
        print(markdown_table(["", *(f"{k} (n={len(v)})" for k, v in models.items())],
                             ([row, *(cell(v) for v in per_model.values())] for row, per_model in out[split].items())))
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    paths = [Path(p) for p in argv]
    result = table(paths)
    dest = paths[0].parent / "compare.json"
    dest.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {dest}")
    return result


if __name__ == "__main__":
    main()
