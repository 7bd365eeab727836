#!/usr/bin/env bash
# Geometric model vs CLIP baseline on the synthetic test split: same data, same steps, same towers.
# Trains configs/synthetic.yaml and configs/synthetic_clip.yaml, evaluates both (and the geometric
# model in two-stage mode), prints a markdown table. Extra arguments go to both train.py runs;
# REUSE=1 keeps a run whose runs/<name>/model.pt exists (e.g. from scripts/demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
PY=.venv/bin/python
for cfg in synthetic synthetic_clip; do
  if [ "${REUSE:-0}" = 1 ] && [ -f "runs/$cfg/model.pt" ]; then
    echo "reusing runs/$cfg/model.pt (REUSE=1)"
  else
    $PY train.py --config "configs/$cfg.yaml" "$@" 2>&1 | tail -n 3
  fi
  $PY eval.py --ckpt "runs/$cfg/model.pt" --out "runs/$cfg/results.json" --plot "runs/$cfg/recall.png" | tail -n 5
done
$PY eval.py --ckpt runs/synthetic/model.pt --mode two-stage --k-prime 100 --out runs/synthetic/results_two_stage.json \
  | tail -n 5
$PY - <<'PY'
import json
rows = [("geometric (geo-tiny), exact", "runs/synthetic/results.json"),
        ("geometric (geo-tiny), two-stage K'=100", "runs/synthetic/results_two_stage.json"),
        ("CLIP baseline (clip-tiny), global", "runs/synthetic_clip/results.json")]
print("| model | T→I R@1 | R@5 | R@10 | I→T R@1 | R@5 | R@10 |")
print("|---|---|---|---|---|---|---|")
for name, path in rows:
    m = json.load(open(path))["metrics"]
    cells = [f"{100 * m[f'{d}_R@{k}']:.1f}" for d in ("text_to_image", "image_to_text") for k in (1, 5, 10)]
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
