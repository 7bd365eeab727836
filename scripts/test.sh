#!/usr/bin/env bash
# The test suite: install (if needed), lint, run pytest offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MMGEO_TEST_ARTIFACTS=${MMGEO_TEST_ARTIFACTS:-artifacts}  # e.g. the browser test's screenshot
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
