#!/usr/bin/env bash
# The main job on the embedded default: install, train geo-tiny on the synthetic shapes world (CPU),
# evaluate on its 1,000-image test split: the R@K table, then the compositional suite (true caption vs
# minimally edited caption, per edit type) on its first 300 images. Extra arguments go to train.py.
# Each run replaces runs/synthetic (train.py --overwrite: only what training writes; other files there stay).
# Ends with the time each part took.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_env.sh
installed=$SECONDS
export HF_HUB_OFFLINE=1
.venv/bin/python train.py --config configs/synthetic.yaml --overwrite "$@"
trained=$SECONDS
.venv/bin/python eval.py --ckpt runs/synthetic/model.pt --data synthetic --split test --suite all --suite-limit 300 \
  --out runs/synthetic/results.json --plot runs/synthetic/recall.png
echo "demo: $((SECONDS - start)) s in all: install $((installed - start)) s, training $((trained - installed)) s" \
  "(with start-up and the coverage fit), evaluation $((SECONDS - trained)) s"
