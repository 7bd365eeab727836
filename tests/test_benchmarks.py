"""The benchmark scripts run (at toy sizes) and print what they promise."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_score_memory_prints_side_by_side_and_skips_naive_past_the_limit(tmp_path):
    out = tmp_path / "rows.json"
    args = [sys.executable, "benchmarks/score_memory.py", "--batches", "8", "64", "--tokens", "4", "--patches", "4",
            "--dim", "4", "--limit-gib", "0.0001", "--chunk-elements", "256", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "naive GiB" in res.stdout and "chunked GiB" in res.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["naive"] is not None and rows[1]["naive"] is None  # 64² pairs pass the toy limit
    assert all(r["chunked"]["extra_bytes"] >= 0 for r in rows)
