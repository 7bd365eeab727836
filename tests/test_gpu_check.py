"""python -m benchmarks.gpu_check --dry-run: the GPU check's code path on CPU (interpreted Triton, tiny shapes); the
same by path from any folder, with --out relative to that folder or absolute, leaving nothing in the repository."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("correctness", "kernel_speed", "training", "evaluation")


def test_gpu_check_dry_run_fills_every_section(tmp_path):
    """One dry run: every section ran within its budget with rows, every correctness case that ran passed,
    bf16 and grid-limit cases are skipped with their reason, and the markdown has one table per section."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    args = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path)]
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
        pytest.skip("a CUDA GPU is present: the real run would start")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "no CUDA GPU: run with --dry-run on CPU" in res.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def _new_files() -> set[str]:
    """Untracked files of the repository (not ignored), as ``git status`` lists them."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # a status that takes no lock a concurrent git command needs
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True, check=True, env=env).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


@pytest.mark.parametrize("relative", [True, False], ids=["relative-out", "absolute-out"])
def test_gpu_check_runs_by_path_from_any_folder(tmp_path, relative):
    """``python /path/to/benchmarks/gpu_check.py --dry-run --out OUT`` started in a folder outside the repository:
    exit 0, every section with a status (only the evaluation section runs, the rest are skipped as not selected),
    the report under OUT resolved against that folder, and no file left in the repository."""
    here = tmp_path / "elsewhere"
    here.mkdir()
    out = "gc" if relative else str(tmp_path / "gc")
    before = _new_files()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    args = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--sections", "evaluation",
            "--out", out]
    res = subprocess.run(args, cwd=here, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    where = here / out if relative else Path(out)
    report = json.loads((where / "gpu_check.json").read_text())
    assert set(report) == {"environment", *SECTIONS}
    assert all(report[name].get("status") for name in SECTIONS), report
    assert report["evaluation"]["status"] == "ok" and report["evaluation"]["results"]
    assert all(report[n]["status"] == "skipped" and "not selected" in report[n]["error"] for n in SECTIONS[:3])
    md = (where / "gpu_check.md").read_text()
    assert all(f"### {name} (" in md for name in SECTIONS) and "### evaluation (ok" in md
    assert sorted(p.name for p in where.iterdir()) == ["gpu_check.json", "gpu_check.md"]  # the parts are gone
    assert not list(ROOT.glob(".*.json")) and not (relative and (ROOT / out).exists())
    assert _new_files() <= before, sorted(_new_files() - before)


def test_a_section_that_writes_no_json_is_reported_failed(tmp_path, monkeypatch):
    """A section's process that ends without its JSON (exit 0 or a crash): the section gets the status
    "failed: no output" and the markdown has its table, no KeyError."""
    from benchmarks import gpu_check
    from benchmarks.gpu_check_report import markdown

    codes = iter([0, 1, 0, -9])

    class Silent:  # a section process that writes nothing
        pid = 0

        def __init__(self, args, **kwargs):
            self.args = args

        def wait(self, timeout=None):
            return next(codes)

    monkeypatch.setattr(gpu_check.subprocess, "Popen", Silent)
    report = gpu_check.run_sections(tmp_path, dry=True)
    assert [report[n]["status"] for n in SECTIONS] == ["failed: no output"] * 4
    assert "crashed (exit code 1)" in report["kernel_speed"]["error"]
    env = {"dry_run": True, "gpu": "none (CPU)", "exp_per_s": 1.0, "command": "python -m benchmarks.gpu_check"}
    md = markdown({"environment": env, **report})
    assert all(f"### {name} (failed: no output" in md for name in SECTIONS)
    assert markdown({"environment": env, "training": {"budget_s": 1.0}}).count("failed: no output") == 1


def test_launches_in_parts_count_as_the_triton_path(monkeypatch):
    """The correctness check's path test: a batch past one grid axis comes back as a concatenation of Triton
    launches (an H200 run marked such cases failed on the path alone, every error inside tolerance)."""
    import importlib

    import torch

    pytest.importorskip("triton")
    from benchmarks.gpu_check import triton_path
    from benchmarks.gpu_check_inputs import pair_inputs
    from mmgeo.kernels import pair_score

    monkeypatch.setenv("MMGEO_KERNELS", "triton")
    monkeypatch.setattr(importlib.import_module("mmgeo.kernels.pair_score"), "MAX_GRID_Y", 2)  # 3 images: 2 launches
    (q, u, k, v), (qm, km) = pair_inputs(2, 3, 1, 4, 8, 8, 8, torch.float32, torch.device("cpu"))
    out = pair_score(q.requires_grad_(), qm, u, k, km, v)
    assert type(out.grad_fn).__name__ == "CatBackward0" and triton_path(out.grad_fn)
    assert not triton_path(torch.cat([q * 2, q + 1]).grad_fn)  # a concatenation of anything else is not
