#!/usr/bin/env bash
# Create .venv and install mmgeo with its dev, serve and db extras (db: PostgreSQL + pgvector for --db and its tests). Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.mmgeo-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet --upgrade pip
  # torch first, pinned to the build this project is tested with (a wheel cached on our machines)
  .venv/bin/pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
  .venv/bin/pip install --quiet -e ".[dev,serve,db]"
  touch "$stamp"
fi
