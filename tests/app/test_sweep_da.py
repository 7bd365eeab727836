"""python -m experiments.sweep_da at a toy size: two d_a points, a few steps, a tiny model (each point in a child
process, ``python -m experiments.sweep_da --worker`` from the repository root)."""

import pytest

from experiments import sweep_da as sweep
from tests.conftest import TINY


@pytest.mark.slow
def test_sweep_writes_table_and_plot(tmp_path):
    md, png = tmp_path / "sweep.md", tmp_path / "sweep.png"
    tiny = [x for k, v in TINY.items() if k != "d_a" for x in (f"--model_args.{k}", str(v))]
    rows = sweep.main(["--d-a", "8", "16", "--steps", "2", "--limit", "4", "--out-dir", str(tmp_path / "runs"),
                       "--md", str(md), "--png", str(png), "--trainer.batch_size", "8", "--data.train_size", "16",
                       "--data.num_workers", "0", "--aids.diagnostics_every_n_steps", "0",
                       *tiny])
    assert [r["d_a"] for r in rows] == [8, 16]
    assert rows[1]["params"] > rows[0]["params"] and all(r["peak_rss_mb"] > 0 for r in rows)
    assert all(0 <= r["t2i_R@1"] <= 1 and r["images"] == 4 for r in rows)
    table = md.read_text()
    assert "| 8 |" in table and "| 16 |" in table and "steps = 2" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
