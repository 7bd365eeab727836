#!/usr/bin/env bash
# The main job on the embedded default: install, train geo-tiny on the synthetic shapes world (CPU),
# evaluate on its 1,000-image test split, print the R@K table. Extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
.venv/bin/python train.py --config configs/synthetic.yaml "$@"
.venv/bin/python eval.py --ckpt runs/synthetic/model.pt --data synthetic --split test --out runs/synthetic/results.json \
  --plot runs/synthetic/recall.png
