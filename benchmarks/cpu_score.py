"""CPU scoring speed side by side: exact geometric scoring of a test-split-sized problem, and the re-rank of one
query's candidates from an fp16 and a coded store — this tree against another checkout or commit.

    python benchmarks/cpu_score.py [--compare REF] [--captions 5000] [--images 1000] [--threads 2] [--repeats 2]
                                   [--gallery 5000] [--codec rq8] [--queries 200] [--json out.json]
    python benchmarks/cpu_score.py --captions 40 --images 20 --gallery 300 --queries 5    # smoke run, seconds

Inputs are random and seeded, shaped like the default model (``geo-tiny``: heads, d_a, d_e and patches from this
tree's registry; each caption's real tokens drawn uniformly from --tokens LO HI, the synthetic captions' range), and
saved once, so every checkout scores the same numbers. "exact": ``pair_score_reference`` of every (caption, image)
pair with --threads threads, what eval's exact scoring runs on CPU. "rerank": ``rerank_candidates`` of each of
--queries captions against 100 random ids of a random gallery of --gallery images (built here once per codec, fp16
and --codec, and read by every checkout), one thread, median ms per query. Each checkout is measured in its own
process (cwd and sys.path[0] = the checkout), ref and current alternating, --repeats times each; the table gives
medians and the current/ref ratio, and a checksum of the exact scores shows both computed the same numbers.
Last, the arithmetic floor: the FLOPs of exact scoring's two GEMMs per head (every real token against every
patch) at this CPU's measured fp32 GEMM peak, the time no fp32 implementation of the score can go below here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from train_speed import cpu_model, describe, materialise  # noqa: E402 - after the path


def log(msg: str) -> None:
    print(f"[cpu_score] {msg}", file=sys.stderr, flush=True)


def make_inputs(args, tmp: Path) -> dict:
    """Random inputs (saved under ``tmp``) and galleries, shaped like this tree's ``geo-tiny``."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from mmgeo.models.registry import model_config
    from mmgeo.search.build import build_random_gallery

    cfg = model_config("geo-tiny")
    H, d_a, d_e, S = cfg.num_heads, cfg.d_a, cfg.d_e, (cfg.image_size // cfg.patch_size) ** 2
    lo, hi = args.tokens
    g = torch.Generator().manual_seed(0)
    n = torch.randint(lo, hi + 1, (args.captions,), generator=g)  # real tokens per caption
    T = hi
    data = {"q": torch.randn(args.captions, H, T, d_a, generator=g),
            "u": F.normalize(torch.randn(args.captions, H, T, d_e, generator=g), dim=-1),
            "q_mask": torch.arange(T)[None] < n[:, None],
            "k": torch.randn(args.images, H, S, d_a, generator=g),
            "v": F.normalize(torch.randn(args.images, H, S, d_e, generator=g), dim=-1),
            "k_mask": torch.ones(args.images, S, dtype=torch.bool)}
    torch.save(data, tmp / "inputs.pt")
    galleries = {}
    for codec in dict.fromkeys(["fp16", args.codec]):
        t = time.perf_counter()
        log(f"building a random {args.gallery:,}-image gallery ({codec}) ...")
        build_random_gallery(tmp / f"gallery-{codec}", args.gallery, H, S, d_a, cfg.d_e, cfg.d_global,
                             index_type="flat", codec=codec)
        log(f"  {time.perf_counter() - t:.0f} s")
        galleries[codec] = str(tmp / f"gallery-{codec}")
    shape = {"H": H, "T": T, "S": S, "d_a": d_a, "d_e": d_e, "tokens": [lo, hi]}
    # the two GEMMs per head of exact scoring, <q_t, k_j> and <u_t, v_j>, over every real token and patch
    flops = 2 * int(n.sum()) * args.images * S * H * (d_a + d_e)
    return {"inputs": str(tmp / "inputs.pt"), "galleries": galleries, "shape": shape, "gemm_flops": flops}


def gemm_peak(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """This CPU's fp32 GEMM rate (GFLOP/s): best of ``repeats`` square ``size`` matmuls on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best / 1e9


def child(spec_path: str) -> None:
    """One measurement in the checkout that is the working directory; writes result.json next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, os.getcwd())
    import numpy as np
    import torch

    from mmgeo.kernels.pair_score import pair_score_reference
    from mmgeo.search.store import Gallery
    from mmgeo.search.two_stage import rerank_candidates

    d = torch.load(spec["inputs"], weights_only=True)  # tensors only
    torch.set_num_threads(spec["threads"])
    args = (d["q"], d["q_mask"], d["u"], d["k"], d["k_mask"], d["v"])
    with torch.inference_mode():
        pair_score_reference(*(x[:8] for x in args[:3]), *args[3:])  # warm-up
        t = time.perf_counter()
        scores = pair_score_reference(*args)  # (N_t, N_i)
        exact_s = time.perf_counter() - t
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rerank = {}
    with torch.inference_mode():
        for codec, root in spec["galleries"].items():
            gal = Gallery(root)
            ids = [rng.choice(gal.count, size=min(100, gal.count), replace=False) for _ in range(spec["queries"])]
            times = []
            for i, c in enumerate([ids[0]] * 3 + ids):  # 3 warm-up calls
                row = i % len(d["q"])
                t = time.perf_counter()
                rerank_candidates(d["q"][row], d["q_mask"][row], d["u"][row], gal, c)
                times.append(time.perf_counter() - t)
            rerank[codec] = statistics.median(times[3:]) * 1e3
    out = {"exact_s": exact_s, "checksum": float(scores.double().sum()), "rerank_ms": rerank}
    Path(spec_path).with_name("result.json").write_text(json.dumps(out))


def measure(checkout: Path, common: dict, tmp: Path, tag: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=tmp))
    (work / "spec.json").write_text(json.dumps(common))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # nothing written into the checkout
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(work / "spec.json")],
                         cwd=checkout, env=env, capture_output=True, text=True)
    if res.returncode or not (work / "result.json").is_file():
        raise SystemExit(f"measurement of {checkout} failed (exit {res.returncode}); its output ends:\n"
                         + (res.stdout + res.stderr)[-3000:])
    return json.loads((work / "result.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", metavar="REF", help="commit, tag, branch or checkout directory to compare against")
    p.add_argument("--captions", type=int, default=5000, help="exact scoring: captions (the test split has 5,000)")
    p.add_argument("--images", type=int, default=1000, help="exact scoring: images (the test split has 1,000)")
    p.add_argument("--tokens", type=int, nargs=2, default=[20, 41], metavar=("LO", "HI"),
                   help="real tokens per caption, drawn uniformly")
    p.add_argument("--threads", type=int, default=2, help="torch threads for exact scoring (eval's default: all)")
    p.add_argument("--gallery", type=int, default=5000, help="images of the random re-rank galleries")
    p.add_argument("--codec", default="rq8", help="the coded store measured beside fp16")
    p.add_argument("--queries", type=int, default=200, help="re-ranked queries (100 candidates each)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per checkout, alternating")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    checkouts = {"current": ROOT}
    made = None
    if args.compare:
        checkouts["ref"], is_new = materialise(args.compare)
        made = checkouts["ref"] if is_new else None
    commits = {k: describe(v) for k, v in checkouts.items()}
    try:
        with tempfile.TemporaryDirectory(prefix="cpu_score-") as tmp:
            common = {**make_inputs(args, Path(tmp)), "threads": args.threads, "queries": args.queries}
            runs = {k: [] for k in checkouts}
            for r in range(args.repeats):
                for name in sorted(checkouts, reverse=True):  # ref first, then current
                    log(f"measuring {name} ({r + 1}/{args.repeats}) ...")
                    runs[name].append(measure(checkouts[name], common, Path(tmp), name))
    finally:
        if made is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(made)], cwd=ROOT, capture_output=True)
    report(args, common, runs, commits, gemm_peak(args.threads))


def report(args, common: dict, runs: dict, commits: dict, peak: float) -> None:
    rows = [("exact_s", f"exact scoring, {args.captions:,} × {args.images:,} pairs, {args.threads} threads (s)")]
    rows += [(f"rerank_ms.{c}", f"re-rank of 100 candidates, {c} store, 1 thread (ms / query)")
             for c in common["galleries"]]

    def value(run, key):
        a, _, b = key.partition(".")
        return run[a][b] if b else run[a]

    med = {k: {key: statistics.median(value(r, key) for r in rs) for key, _ in rows} for k, rs in runs.items()}
    names = [n for n in ("ref", "current") if n in runs]
    print(f"\nCPU: {cpu_model()}; shapes {common['shape']}; medians of {args.repeats} run(s) each, alternating")
    for n in names:
        print(f"  {n}: {commits[n]}")
    print("\n| | " + " | ".join(names) + (" | current / ref |" if "ref" in runs else " |"))
    print("|---|" + "---:|" * (len(names) + ("ref" in runs)))
    for key, label in rows:
        cells = [f"{med[n][key]:.3f}" for n in names]
        if "ref" in runs:
            cells.append(f"{med['current'][key] / med['ref'][key]:.2f}×")
        print(f"| {label} | " + " | ".join(cells) + " |")
    sums = {n: runs[n][0]["checksum"] for n in names}
    print("\nchecksum of the exact scores: " + ", ".join(f"{n} {s:.6f}" for n, s in sums.items()))
    bound = {"gemm_flops": common["gemm_flops"], "gemm_peak_gflops": peak, "gemm_s": common["gemm_flops"] / peak / 1e9}
    print(f"arithmetic floor: exact scoring's two GEMMs per head are {bound['gemm_flops'] / 1e12:.3g} TFLOP here; "
          f"at this CPU's fp32 GEMM peak with {args.threads} thread(s) ({peak:.0f} GFLOP/s, best 2048³ matmul) "
          f"they alone take {bound['gemm_s']:.3g} s (the softmax's exp2, products and sums come on top)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "shape": common["shape"], "commits": commits,
                                               "runs": runs, "median": med, "cpu": cpu_model(), "floor": bound},
                                              indent=1))


if __name__ == "__main__":
    main()
