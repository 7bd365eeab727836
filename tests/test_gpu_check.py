"""benchmarks/gpu_check.py --dry-run: the GPU check's code path on CPU (interpreted Triton, tiny shapes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("correctness", "kernel_speed", "training", "evaluation")


def test_gpu_check_dry_run_fills_every_section(tmp_path):
    """One dry run: every section ran within its budget with rows, every correctness case that ran passed,
    bf16 and grid-limit cases are skipped with their reason, and the markdown has one table per section."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    args = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report) == {"environment", *SECTIONS}
    env_keys = {"gpu", "driver", "cuda", "torch", "triton", "python", "commit", "dry_run", "triton_mode", "exp_per_s"}
    assert env_keys <= set(report["environment"])
    assert report["environment"]["dry_run"] and report["environment"]["triton_mode"] == "interpreted"
    for name in SECTIONS:
        sec = report[name]
        assert sec["status"] == "ok" and sec["error"] is None, (name, sec.get("error"))
        assert sec["results"], name
        assert all(r["status"] in ("ok", "skipped") for r in sec["results"]), (name, sec["results"])
        assert all(r.get("reason") for r in sec["results"] if r["status"] == "skipped"), name

    cases = report["correctness"]["results"]
    ran = [c for c in cases if c["status"] == "ok"]
    assert {(c["kernel"], c["dtype"]) for c in ran} == {(k, d) for k in ("pair_score", "geo_attention")
                                                        for d in ("float32", "float16")}
    assert all(c["pass"] and "Triton" in c["path"] and c["max_rel"] <= c["tol"] for c in ran), ran
    assert all(set(c["outputs"]) >= {"out", "dq", "dk", "dv"} for c in ran)
    assert all("interpreter" in c["reason"] for c in cases if c["status"] == "skipped")
    assert any(c["dtype"] == "bfloat16" for c in cases if c["status"] == "skipped")

    speed = report["kernel_speed"]["results"]
    assert {r["impl"] for r in speed if r["kernel"] == "pair_score"} == {"triton", "naive", "reference",
                                                                         "compile(eager) naive"}
    assert {r["impl"] for r in speed if r["kernel"] == "geo_attention"} == {"triton", "sdpa-flash"}
    # rows past a section's time budget are skipped with their reason (asserted above; a slow or loaded machine
    # may get there); every row that ran carries its figures, and each kernel's Triton row runs first
    ran = [r for r in speed if r["status"] == "ok"]
    assert {r["kernel"] for r in ran if r["impl"] == "triton"} == {"pair_score", "geo_attention"}
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["exp_bound_ms"] > 0 and r["time_over_triton"] > 0 for r in ran)
    assert all(r["triton_speedup"] > 0 for r in ran if r["impl"] == "triton" and "triton_speedup" in r)
    assert any("triton_speedup" in r for r in ran)

    train = report["training"]["results"]
    assert [r["model"] for r in train][:2] == ["geo-vitb16-bert", "clip-vitb16-bert"]
    assert "open_clip" in train[2]["model"]
    assert train[0]["status"] == "ok"
    assert all(r["steps"] == 2 and r["samples_per_s"] > 0 for r in train if r["status"] == "ok")

    ev = {r["what"].split()[0]: r for r in report["evaluation"]["results"]}
    assert ev["exact"]["status"] == "ok" and ev["exact"]["seconds"] > 0
    assert ev["two-stage"]["status"] == "skipped" or ev["two-stage"]["queries_per_s"] > 0

    md = (tmp_path / "gpu_check.md").read_text()
    assert md == res.stdout.rstrip("\n") + "\n" or md.strip() in res.stdout
    assert "| gpu | driver |" in md
    for name in SECTIONS:
        assert f"### {name} (ok" in md
    assert "| kernel | case | dtype | config | pass |" in md and "| model | batch | steps |" in md


def test_gpu_check_without_cuda_asks_for_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a CUDA GPU is present: the real run would start")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "no CUDA GPU: run with --dry-run on CPU" in res.stderr
    assert not (tmp_path / "gpu_check.json").exists()
