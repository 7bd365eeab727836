"""The benchmark scripts run (at toy sizes, as ``python -m benchmarks.NAME``) and print what they promise; the
packages benchmarks and experiments import without doing work, edit no sys.path and import no cycle."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_score_memory_prints_side_by_side_and_skips_naive_past_the_limit(tmp_path):
    out = tmp_path / "rows.json"
    args = [sys.executable, "-m", "benchmarks.score_memory", "--batches", "8", "64", "--tokens", "4", "--patches", "4",
            "--dim", "4", "--limit-gib", "0.0001", "--chunk-elements", "256", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "naive GiB" in res.stdout and "chunked GiB" in res.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["naive"] is not None and rows[1]["naive"] is None  # 64² pairs pass the toy limit
    assert all(r["chunked"]["extra_bytes"] >= 0 for r in rows)


def test_load_search_reports_both_clients_without_errors(tmp_path):
    """Toy gallery, 1 and 2 clients, a few requests: the light raw client and httpx both parse every reply."""
    for client in ("raw", "httpx"):
        out = tmp_path / f"{client}.json"
        args = [sys.executable, "-m", "benchmarks.load_search", "--count", "300", "--clients", "1", "2",
                "--seconds", "2", "--max-requests", "12", "--workdir", str(tmp_path / "work"), "--client", client,
                "--json", str(out)]
        res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        rows = json.loads(out.read_text())
        assert [(r["rerank"], r["clients"]) for r in rows] == [(False, 1), (False, 2), (True, 1), (True, 2)]
        assert all(r["errors"] == 0 and r["requests"] == 12 for r in rows)
        assert all(r["max_ms"] >= r["p999_ms"] >= r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)
        assert f"({client} client)" in res.stdout
        assert all(r["server_cpu_ms_per_request"] is not None and r["client_cpu_ms_per_request"] > 0 for r in rows)


def test_load_search_alternates_server_variants_over_rounds_and_summarizes(tmp_path):
    """Two server variants, two rounds, re-rank on only: four rows in the order round 1 (A, B), round 2 (A, B),
    each tagged with its variant and round, and a summary line per variant; a warm-up after each of the four server
    starts, in no row."""
    out = tmp_path / "rows.json"
    args = [sys.executable, "-m", "benchmarks.load_search", "--count", "300", "--clients", "1", "--rerank", "on",
            "--seconds", "2", "--max-requests", "6", "--rounds", "2", "--warmup-seconds", "1", "--server-args", "",
            "--server-args", "TOKENIZERS_PARALLELISM=false --batch-workers 1", "--workdir", str(tmp_path / "work"),
            "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())
    variant = "TOKENIZERS_PARALLELISM=false --batch-workers 1"
    assert [(r["round"], r["server_args"], r["rerank"]) for r in rows] == [
        (0, "", True), (0, variant, True), (1, "", True), (1, variant, True)]
    assert all(r["errors"] == 0 and r["requests"] == 6 for r in rows)
    assert "over 2 rounds" in res.stdout and f"[{variant}] top100, 1 clients" in res.stdout
    assert "[defaults] top100, 1 clients" in res.stdout
    warm = r"warm-up, not recorded: [1-9]\d* requests in 1 s at 1 client\(s\), 0 errors"
    assert len(re.findall(warm, res.stdout)) == 4


@pytest.mark.slow
def test_load_search_serves_the_folder_and_the_database_side_by_side(tmp_path):
    """--db local:DIR: the folder's rows loaded into an embedded PostgreSQL, both served in one run (rows tagged
    folder / db), the load's figures (insert rates, HNSW build, bytes per image) and first-stage recall reported."""
    pytest.importorskip("pgserver", reason="--db local:DIR starts PostgreSQL from the pgserver wheel (.[db])")
    out = tmp_path / "rows.json"
    args = [sys.executable, "-m", "benchmarks.load_search", "--count", "300", "--codec", "sq8", "--clients", "1",
            "--rerank", "on", "--seconds", "2", "--max-requests", "6", "--workdir", str(tmp_path / "work"),
            "--db", f"local:{tmp_path / 'pg'}", "--recall-ef", "40", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert [(r["gallery"], r["images"]) for r in got["rows"]] == [("folder", 300), ("db", 300)]
    assert all(r["errors"] == 0 and r["requests"] == 6 for r in got["rows"])
    assert got["rows"][1]["db_cpu_ms_per_request"] > 0 and got["rows"][0]["db_cpu_ms_per_request"] is None
    db = got["db"]
    assert db["count"] == 300 and db["hnsw_build_s"] >= 0 and db["live_insert_images_per_s"] > 0
    assert db["table_bytes_per_image"] > 0 and db["recall"]["gallery"]["40"] == 1.0  # 300 rows: HNSW finds all
    assert "[db] top100, 1 clients" in res.stdout and "first-stage recall@100" in res.stdout


@pytest.mark.slow
def test_load_search_builds_its_rows_from_a_trained_models_scenes(tmp_path):
    """--gallery-ckpt: the folder holds the model's encoding of the first --count synthetic train scenes, the
    database's rows past them are the same model's vectors of the next scenes (not random ones), the server encodes
    the queries with that model, and the recall is over its vectors; --ivfflat-lists serves it through IVFFlat
    (all four lists scanned: recall@50 1)."""
    pytest.importorskip("pgserver", reason="--db local:DIR starts PostgreSQL from the pgserver wheel (.[db])")
    import numpy as np
    import torch

    import mmgeo
    from mmgeo.data import ShapesWorld
    from mmgeo.io import file_sha256

    torch.manual_seed(3)
    ckpt, work, out = tmp_path / "model.pt", tmp_path / "work", tmp_path / "rows.json"
    mmgeo.save_model(mmgeo.create_model("geo-tiny").eval(), ckpt)
    args = [sys.executable, "-m", "benchmarks.load_search", "--count", "300", "--codec", "sq8", "--clients", "1",
            "--rerank", "on", "--seconds", "2", "--max-requests", "4", "--workdir", str(work),
            "--db", f"local:{tmp_path / 'pg'}", "--db-count", "340", "--db-only", "--gallery-ckpt", str(ckpt),
            "--ivfflat-lists", "4", "--work-mem", "64MB", "--recall-ef", "4", "--recall-k", "50",
            "--recall-captions", "10", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert [(r["gallery"], r["images"], r["errors"]) for r in got["rows"]] == [("db", 340, 0)]
    assert got["db"]["count"] == 340 and got["db"]["recall"]["gallery"]["4"] == 1.0
    assert got["db"]["ivfflat"]["lists"] == 4 and got["db"]["ivfflat"]["build_s"] >= 0
    recall = got["db"]["recall"]
    assert (recall["k"], recall["setting"], recall["captions"]) == (50, "probes", 10)
    assert "index pgvector-ivfflat" in res.stdout and \
        "recall@50 over 10 captions against exact (load-test rows): probes 4: 1.000" in res.stdout
    (folder,) = work.glob("index-300-*-trained-*")
    man = json.loads((folder / "manifest.json").read_text())
    assert man["count"] == 300 and man["model"]["sha256"] == file_sha256(ckpt)
    (pooled,) = work.glob("pooled-*-300-340.npy")
    model = mmgeo.load_model(ckpt)
    world = ShapesWorld("train", 0, image_size=model.cfg.image_size)
    rows = [0, 299, 300, 339]  # the folder's first and last, the database's first and last past it
    with torch.no_grad():
        want = model.encode_image([world[i][0] for i in rows]).pooled.float().numpy()
    np.testing.assert_allclose(np.load(pooled)[rows], want, atol=1e-4)


def test_load_search_reads_leading_assignments_as_the_servers_environment():
    from benchmarks.load_search import split_server_args

    assert split_server_args("A=1 B='x y' --workers 2 --opt=v") == (["--workers", "2", "--opt=v"],
                                                                   {"A": "1", "B": "x y"})
    assert split_server_args("") == ([], {})
    assert split_server_args("--batch-wait-ms 0 C=2") == (["--batch-wait-ms", "0", "C=2"], {})


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_load_search_counts_the_cpu_of_a_servers_worker_processes():
    """A parent that only waits, its child burning ~0.6 s of CPU: the tree's CPU time includes the child's."""
    from benchmarks.load_search import tree_cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               f"{burn!r}])"])
    try:
        deadline = time.monotonic() + 20
        while (tree_cpu_seconds(parent.pid) or 0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_seconds(parent.pid) >= 0.6
    finally:
        with contextlib.suppress(OSError):  # the parent may be gone already
            for task in Path(f"/proc/{parent.pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    os.kill(int(child), signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_train_speed_tiny(tmp_path):
    """Smoke size, this checkout against itself given as a path (no git history needed): JSON keys, throughputs.
    One torch thread: on a shared 2-core machine two threads can be many times slower (and the test much longer)."""
    out = tmp_path / "speed.json"
    args = [sys.executable, "-m", "benchmarks.train_speed", "--tiny", "--steps", "3", "--warmup", "1",
            "--warmup-runs", "1", "--json", str(out), "--compare", str(ROOT), "--", "--trainer.threads", "1"]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["warmup_runs"] == 1 and "warm-up run 1/1 ref, not recorded" in res.stderr
    assert res.stderr.index("warm-up run 1/1 ref") < res.stderr.index("repeat 1/1 ref")
    assert {"command", "config", "torch", "threads", "cpu", "checkouts", "ratio", "ratio_samples_per_s"} <= set(data)
    assert data["threads"] == 1 and data["ratio_samples_per_s"] > 0
    for label in ("ref", "current"):
        c = data["checkouts"][label]
        assert c["commit"] and c["path"] == str(ROOT) and len(c["runs"]) == 1
        med = c["median"]
        assert med["samples_per_s"] > 0 and med["steps_per_s"] > 0 and med["in_step_ms"] > 0
        assert med["samples_per_s"] == pytest.approx(med["steps_per_s"] * 16)  # --tiny: batch 16
        assert med["val_runs"] >= 1 and med["val_s"] > 0  # validation at the end of training, timed
        assert all(med[f"{k}_ms"] > 0 for k in ("data", "collate", "text_fwd", "image_fwd", "loss", "backward",
                                                "optimizer"))
        assert "overhead_ms" in med and med["cpu_ms"] > 0 and med["gemm_gflop"] > 0
        assert med["gemm_floor_ms"] == pytest.approx(med["gemm_gflop"] / data["gemm_peak_gflops"] * 1e3)
        assert med["ceiling_samples_per_s"] == pytest.approx(16e3 / med["gemm_floor_ms"])
    assert "| samples/s |" in res.stdout and "current/ref" in res.stdout and "fp32 GEMM peak here" in res.stdout
    assert f"json: {out}" in res.stdout


def test_train_speed_times_the_training_steps_whole_loss():
    """The breakdown's "score + loss" is the loss the training step computes, every term of the default config
    (distillation, the edit terms over the caption truth), not the contrastive terms alone."""
    import torch

    from benchmarks.train_speed_child import _loss
    from mmgeo.config import load_config
    from mmgeo.data.pairs import open_split
    from mmgeo.training import RetrievalModule, TrainConfig, build_loader, losses

    cfg = load_config(TrainConfig, str(ROOT / "configs" / "synthetic.yaml"),
                      ["--trainer.batch_size", "8", "--data.num_workers", "0"])
    torch.manual_seed(0)
    module = RetrievalModule(cfg)
    loader = build_loader(cfg, module, open_split(cfg.data, "train", 64, module.model.cfg.image_size))
    batch = loader.collate_fn([loader.dataset[k] for k in next(iter(loader.batch_sampler))])
    with pytest.warns(UserWarning, match="self.log"):  # no Trainer attached: Lightning warns and logs nothing
        step_loss = module.training_step(batch, 0)
    text = module.model.forward_text(batch["input_ids"], batch["attention_mask"])
    image = module.model.forward_image(batch["pixels"])
    timed = _loss(losses, module, {"text_fwd": text, "image_fwd": image, "collate": batch}, cfg)
    assert timed.item() == pytest.approx(step_loss.item(), rel=1e-5)
    B = int(batch["num_captions"])
    contrastive = losses.contrastive_loss(module.model, text[:B], image, cfg.loss.global_weight, False, text[B:])
    assert abs(contrastive["loss"].item() - step_loss.item()) > 1e-3  # the other terms are in what is timed


def test_train_speed_counts_a_linear_layers_three_gemms():
    """The step's GEMM work as the profiler counts it: forward, input and weight gradients of a linear layer are
    2·m·n·k FLOPs each (addmm once, mm twice), nothing counted twice through aten::linear / aten::matmul."""
    import torch

    from benchmarks.train_speed_child import gemm_gflop

    layer, x = torch.nn.Linear(96, 40), torch.randn(50, 96, requires_grad=True)
    assert gemm_gflop(lambda: layer(x).sum().backward()) == pytest.approx(3 * 2 * 50 * 96 * 40 / 1e9)
    w = torch.randn(3, 20, 8)
    assert gemm_gflop(lambda: torch.matmul(torch.randn(3, 10, 20), w)) == pytest.approx(2 * 3 * 10 * 20 * 8 / 1e9)


def test_codecs_benchmark_reports_every_codec_and_fills_its_section(tmp_path):
    """Toy split, a random-init tiny model: one row per codec with sizes, recalls, latency; the marked section of
    a markdown file is replaced and the text around it kept."""
    import torch

    import mmgeo
    from tests.conftest import TINY

    torch.manual_seed(0)
    ckpt = tmp_path / "m.pt"
    mmgeo.save_model(mmgeo.create_model("geo-tiny", **{**TINY, "d_a": 16, "d_e": 16}).eval(), ckpt)
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- codecs:start -->\nold\n<!-- codecs:end -->\nafter\n")
    args = [sys.executable, "-m", "benchmarks.codecs", "--ckpt", str(ckpt), "--limit", "20", "--codecs", "fp16", "sq8",
            "pq16", "--latency-queries", "3", "--k-prime", "8", "--out", str(tmp_path / "out"), "--report-to", str(doc),
            "--keep-patches", "14", "--prune-queries", "5"]  # 14 of 16 patches: 280 per head, enough to train pq16
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "codecs.json").read_text())
    pruned = [f"{c}, 14/16 patches" for c in ("fp16", "sq8", "pq16")]
    assert list(data["codecs"]) == ["fp16", "sq8", "pq16", *pruned] and data["images"] == 20 and data["k_prime"] == 8
    assert data["codecs"]["fp16, 14/16 patches"]["bytes_per_image"] == 2 * 14 * 32 * 2 + 14 + 2  # + 16 patch bits
    assert data["projected"]["pq16, 14/16 patches"]["bytes_per_image"] == 8 * 172 * 8 + 25  # 172 of 196, + bits
    fp16 = data["codecs"]["fp16"]["bytes_per_image"]
    assert fp16 == 2 * 16 * 32 * 2 + 16  # H x S x (d_a + d_e) x 2 bytes + a bool mask
    assert data["codecs"]["pq16"]["bytes_per_image"] == 2 * 16 * 2 and data["codecs"]["pq16"]["codebook_bytes"] > 0
    for row in data["codecs"].values():
        assert 0 <= row["text_to_image_R@1"] <= 1 and row["p99_ms"] >= row["median_ms"] > 0
    assert data["projected"]["fp16"]["1000000"] == data["projected"]["fp16"]["bytes_per_image"] * 10 ** 6
    text = doc.read_text()
    assert text.startswith("before\n<!-- codecs:start -->\n`python -m benchmarks.codecs") and "old" not in text
    assert text.endswith("<!-- codecs:end -->\nafter\n") and "| pq16 | 64 | 1/32.2 |" in text


def test_prune_patches_reports_every_criterion(tmp_path):
    """Toy splits, a random-init tiny model: keeping every patch scores as the unpruned store under each criterion;
    fewer patches: one row per criterion, bytes in proportion."""
    import torch

    import mmgeo
    from tests.conftest import TINY

    torch.manual_seed(0)
    ckpt = tmp_path / "m.pt"
    mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY).eval(), ckpt)
    out = tmp_path / "prune.json"
    args = [sys.executable, "-m", "benchmarks.prune_patches", "--ckpt", str(ckpt), "--limit", "20", "--keep", "16", "8",
            "--queries", "5", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    S, rows = data["patches"], data["rows"]
    assert S == 16 and data["images"] == 20 and data["captions"] == 20 and data["queries"] == 5
    assert [(r["keep"], r["criterion"]) for r in rows] == [(16, "all patches")] + [
        (k, c) for k in (16, 8) for c in ("attention mass", "key norm", "random")]
    full = rows[0]
    for r in rows[1:]:
        assert 0 <= r["text_to_image_R@1"] <= 100
        assert all(r[b] * S == full[b] * r["keep"] for b in ("fp16_bytes", "rq8_bytes"))
        if r["keep"] == S:
            assert r["text_to_image_R@1"] == full["text_to_image_R@1"]
    assert "| 8 | attention mass |" in res.stdout


def test_cpu_score_compares_two_checkouts_on_the_same_numbers(tmp_path):
    """Toy sizes, this tree against itself (a checkout directory): both score the same inputs to the same sum,
    which is the definition's (``pair_score_naive``) on those inputs; every timing is there, with its ratio."""
    import argparse

    import torch

    from mmgeo.kernels.pair_score import pair_score_naive

    out = tmp_path / "cpu.json"
    args = [sys.executable, "-m", "benchmarks.cpu_score", "--captions", "12", "--images", "7", "--gallery", "40",
            "--codec", "sq8", "--queries", "3", "--repeats", "1", "--compare", str(ROOT), "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    (cur,), (ref,) = data["runs"]["current"], data["runs"]["ref"]
    assert abs(cur["checksum"] - ref["checksum"]) < 1e-4 and cur["exact_s"] > 0 and ref["exact_s"] > 0
    assert set(cur["rerank_ms"]) == {"fp16", "sq8"} and min(cur["rerank_ms"].values()) > 0
    assert "| exact scoring, 12 × 7 pairs, 2 threads (s) |" in res.stdout and "current / ref" in res.stdout
    floor = data["floor"]  # FLOPs of the two GEMMs per head over the real tokens: 2·N·images·S·H·(d_a + d_e)
    assert floor["gemm_peak_gflops"] > 0 and "arithmetic floor" in res.stdout
    from benchmarks.cpu_score import make_inputs

    ns = argparse.Namespace(captions=12, images=7, tokens=[20, 41], gallery=40, codec="sq8", logit_scale=1.0)
    made = make_inputs(ns, tmp_path)
    d = torch.load(made["inputs"], weights_only=True)
    (tmp_path / "x3").mkdir()
    scaled = torch.load(make_inputs(argparse.Namespace(**{**vars(ns), "logit_scale": 3.0}), tmp_path / "x3")["inputs"],
                        weights_only=True)  # --logit-scale: the same queries, scaled
    torch.testing.assert_close(scaled["q"], 3.0 * d["q"])
    torch.testing.assert_close(scaled["k"], d["k"])
    H, S, d_a, d_e = d["q"].shape[1], d["k"].shape[2], d["q"].shape[-1], d["u"].shape[-1]
    assert made["gemm_flops"] == floor["gemm_flops"] == 2 * int(d["q_mask"].sum()) * 7 * S * H * (d_a + d_e)
    assert floor["gemm_s"] == pytest.approx(floor["gemm_flops"] / floor["gemm_peak_gflops"] / 1e9)
    want = pair_score_naive(d["q"], d["q_mask"], d["u"], d["k"], d["k_mask"], d["v"]).double().sum()
    assert abs(cur["checksum"] - float(want)) < 1e-4


def test_text_encode_times_both_ways_on_the_same_batches(tmp_path):
    out = tmp_path / "text.json"
    args = [sys.executable, "-m", "benchmarks.text_encode", "--batch-sizes", "1", "6", "--batches", "2",
            "--rounds", "2", "--json", str(out)]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "own/packed" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 6]
    assert rows[0]["padding"] == 0 and rows[1]["padding"] > 0  # six captions of different lengths are padded
    assert all(len(r["own_all"]) == len(r["packed_all"]) == 2 and r["max_abs_diff"] < 1e-4 for r in rows)


PACKAGES = ("benchmarks", "experiments")


def _modules() -> dict[str, Path]:
    return {f"{pkg}.{p.stem}" if p.stem != "__init__" else pkg: p for pkg in PACKAGES
            for p in sorted((ROOT / pkg).glob("*.py"))}


def test_every_script_imports_without_work_and_runs_as_a_module():
    """Importing any of them (a fresh interpreter, from the repository root) loads no torch, numpy or mmgeo and
    prints nothing; every script but the harness's helpers has a main() behind ``if __name__ == "__main__"``."""
    import ast

    names = sorted(_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'mmgeo', 'lightning'}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout == "[]\n" and not res.stderr, res.stdout + res.stderr
    helpers = {"__init__", "harness", "gpu_check_inputs", "gpu_check_model", "gpu_check_report", "compare_report",
               "load_db"}
    for name, path in _modules().items():
        if path.stem in helpers:
            continue
        tree = ast.parse(path.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body), name


def test_no_sys_path_edits_and_no_import_cycles():
    """Imports resolve from the repository root (``python -m``), never through sys.path edits; benchmarks and
    experiments import no cycle (lazy imports inside functions count), and benchmarks never imports experiments."""
    import ast

    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} touches sys.path")
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                graph[name] |= (subs & set(modules)) or ({node.module} & set(modules))
        graph[name].discard(name)
    assert not [(m, d) for m, deps in graph.items() for d in deps
                if m.startswith("benchmarks") and d.startswith("experiments")]

    def visit(m, stack):
        for dep in graph[m]:
            assert dep not in stack, "import cycle: " + " -> ".join([*stack, dep])
            visit(dep, [*stack, dep])

    for m in graph:
        visit(m, [m])


def test_harness_alternates_rounds_and_writes_reports(tmp_path):
    from benchmarks import harness

    calls = []
    out = harness.alternate(["a", "b", "c"], 3, lambda n, r: calls.append((r, n)) or f"{n}{r}")
    assert calls == [(r, n) for r in range(3) for n in "abc"] and out == {n: [f"{n}{r}" for r in range(3)]
                                                                         for n in "abc"}
    calls.clear()
    harness.alternate(["a", "b", "c"], 3, lambda n, r: calls.append(n), rotate=True)
    assert calls == list("bca" "cab" "abc")  # who goes first moves on each round
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0 and harness.median([None]) is None
    assert harness.markdown_table(["x", "y"], [[1, "a"]], align="rl") == "| x | y |\n|---:|---|\n| 1 | a |"

    doc = tmp_path / "doc.md"
    doc.write_text("top\n<!-- t:start -->\nold\n<!-- t:end -->\nbottom\n")
    harness.report_to(doc, "t", "new table\n")
    assert doc.read_text() == "top\n<!-- t:start -->\nnew table\n<!-- t:end -->\nbottom\n"
    with pytest.raises(SystemExit, match="no section marked"):
        harness.check_markers(doc, "other")
    harness.write_json(tmp_path / "r.json", {"a": 1})
    harness.write_json(None, {"a": 1})  # no --json: nothing written
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}

    env = harness.environment()
    assert {"machine", "cpu", "cpus", "python", "commit", "command"} <= set(env)
    assert env["commit"] == "unknown" or len(env["commit"].split("+")[0]) >= 7
    assert harness.commit(tmp_path) == "unknown"  # not a git checkout


def test_a_child_runs_in_the_checkout_it_measures(tmp_path):
    """``run_in_checkout``: a file of this tree runs with the other checkout first on sys.path (its mmgeo, its
    train.py), not this tree's and not the file's own folder; its arguments come through."""
    from benchmarks import harness

    other = tmp_path / "checkout"
    (other / "mmgeo").mkdir(parents=True)
    (other / "mmgeo" / "__init__.py").write_text("WHERE = 'other checkout'\n")
    script = tmp_path / "here" / "child.py"
    script.parent.mkdir()
    (script.parent / "mmgeo.py").write_text("WHERE = 'next to the script'\n")
    script.write_text("import json, sys\nimport mmgeo\nprint(json.dumps([mmgeo.WHERE, sys.argv]))\n")
    res = harness.run_in_checkout(script, ["a", "--b"], other, capture_output=True, text=True, check=True)
    where, argv = json.loads(res.stdout)
    assert where == "other checkout" and argv == [str(script), "a", "--b"]
    assert not list(other.rglob("__pycache__"))  # nothing written into the checkout


@pytest.mark.slow
def test_shard_loader_times_the_loaders_and_the_model_step(tmp_path):
    from tests.conftest import TINY

    out = tmp_path / "shards.json"
    tiny = [x for k, v in TINY.items() if k != "image_size" for x in (f"--model_args.{k}", str(v))]
    args = [sys.executable, "-m", "benchmarks.shard_loader", "--images", "40", "--per-shard", "10", "--steps", "2",
            "--model-steps", "1", "--workers", "1", "--json", str(out), "--", "--trainer.batch_size", "8", *tiny]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "| shard loader alone | 1 workers |" in res.stdout and "model step" in res.stdout
    rows = json.loads(out.read_text())
    assert rows["shard_loader_samples_per_s"] > 0 and rows["model_samples_per_s"] > 0 and rows["batch"] == 8
