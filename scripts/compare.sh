#!/usr/bin/env bash
# Geometric model vs CLIP baseline on the shapes world, several seeds: same data, same steps, same towers,
# same caption negatives. For each seed in SEEDS (default "0 1 2") trains configs/synthetic.yaml and
# configs/synthetic_clip.yaml (runs/<config>_s<seed>/), evaluates each on the test split (R@K + the
# compositional suite on all 1,000 images) and on the compositional-generalisation split "cogent"
# (held-out colour-shape combos), then prints mean ± std over seeds (benchmarks/compare_table.py).
# Extra arguments go to every train.py run; REUSE=1 keeps a run whose model.pt exists.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
PY=.venv/bin/python
runs=()
for seed in ${SEEDS:-0 1 2}; do
  for cfg in synthetic synthetic_clip; do
    run="runs/${cfg}_s${seed}"
    if [ "${REUSE:-0}" = 1 ] && [ -f "$run/model.pt" ]; then
      echo "reusing $run/model.pt (REUSE=1)"
    else
      $PY train.py --config "configs/$cfg.yaml" --name "${cfg}_s${seed}" --trainer.seed "$seed" "$@" 2>&1 | tail -n 1
    fi
    for split in test cogent; do
      $PY eval.py --ckpt "$run/model.pt" --split "$split" --suite all --out "$run/results_$split.json" | tail -n 3
    done
    runs+=("$run")
  done
done
$PY benchmarks/compare_table.py "${runs[@]}"
