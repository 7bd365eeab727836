"""CPU scoring speed side by side: exact geometric scoring of a test-split-sized problem, and the re-rank of one
query's candidates from an fp16 and a coded store — this tree against another checkout or commit.

    python -m benchmarks.cpu_score [--compare REF] [--captions 5000] [--images 1000] [--threads 2] [--repeats 2]
                                   [--gallery 5000] [--codec rq8] [--queries 200] [--logit-scale 1] [--json out.json]
    python -m benchmarks.cpu_score --captions 40 --images 20 --gallery 300 --queries 5    # smoke run, seconds

Inputs are random and seeded, shaped like the default model (``geo-tiny``: heads, d_a, d_e and patches from this
tree's registry; each caption's real tokens drawn uniformly from --tokens LO HI, the synthetic captions' range), and
saved once, so every checkout scores the same numbers; ``--logit-scale`` scales the queries, so that the
softmaxes need the max shift a trained model's do. "exact": ``pair_score_reference`` of every (caption, image)
pair with --threads threads, what eval's exact scoring runs on CPU. "rerank": ``rerank_candidates`` of each of
--queries captions against 100 random ids of a random gallery of --gallery images (built here once per codec, fp16
and --codec, and read by every checkout), one thread, median ms per query. Each checkout is measured in its own
process (``benchmarks/cpu_score_child.py``, its working directory and first sys.path entry the checkout), ref and
current alternating, --repeats times each; the table gives
medians and the current/ref ratio, and a checksum of the exact scores shows both computed the same numbers.
Last, the arithmetic floor: the FLOPs of exact scoring's two GEMMs per head (every real token against every
patch) at this CPU's measured fp32 GEMM peak, the time no fp32 implementation of the score can go below here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    ROOT,
    add_compare,
    add_json,
    alternate,
    checkout_of,
    commit,
    environment,
    gemm_peak,
    logger,
    markdown_table,
    run_in_checkout,
    write_json,
)

CHILD = Path(__file__).resolve().with_name("cpu_score_child.py")  # runs in the checkout measured
log = logger("cpu_score")


def make_inputs(args, tmp: Path) -> dict:
    """Random inputs (saved under ``tmp``) and galleries, shaped like this tree's ``geo-tiny``."""
    import torch
    import torch.nn.functional as F

    from mmgeo.models.registry import model_config
    from mmgeo.search.build import build_random_gallery

    cfg = model_config("geo-tiny")
    H, d_a, d_e, S = cfg.num_heads, cfg.d_a, cfg.d_e, (cfg.image_size // cfg.patch_size) ** 2
    lo, hi = args.tokens
    g = torch.Generator().manual_seed(0)
    n = torch.randint(lo, hi + 1, (args.captions,), generator=g)  # real tokens per caption
    T = hi
    data = {"q": args.logit_scale * torch.randn(args.captions, H, T, d_a, generator=g),
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
    shape = {"H": H, "T": T, "S": S, "d_a": d_a, "d_e": d_e, "tokens": [lo, hi], "logit_scale": args.logit_scale}
    # the two GEMMs per head of exact scoring, <q_t, k_j> and <u_t, v_j>, over every real token and patch
    flops = 2 * int(n.sum()) * args.images * S * H * (d_a + d_e)
    return {"inputs": str(tmp / "inputs.pt"), "galleries": galleries, "shape": shape, "gemm_flops": flops}


def measure(checkout: Path, common: dict, tmp: Path, tag: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=tmp))
    (work / "spec.json").write_text(json.dumps(common))
    res = run_in_checkout(CHILD, [str(work / "spec.json")], checkout, capture_output=True, text=True)
    if res.returncode or not (work / "result.json").is_file():
        raise SystemExit(f"measurement of {checkout} failed (exit {res.returncode}); its output ends:\n"
                         + (res.stdout + res.stderr)[-3000:])
    return json.loads((work / "result.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_compare(p)
    p.add_argument("--captions", type=int, default=5000, help="exact scoring: captions (the test split has 5,000)")
    p.add_argument("--images", type=int, default=1000, help="exact scoring: images (the test split has 1,000)")
    p.add_argument("--tokens", type=int, nargs=2, default=[20, 41], metavar=("LO", "HI"),
                   help="real tokens per caption, drawn uniformly")
    p.add_argument("--threads", type=int, default=2, help="torch threads for exact scoring (eval's default: all)")
    p.add_argument("--gallery", type=int, default=5000, help="images of the random re-rank galleries")
    p.add_argument("--codec", default="rq8", help="the coded store measured beside fp16")
    p.add_argument("--queries", type=int, default=200, help="re-ranked queries (100 candidates each)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per checkout, alternating")
    p.add_argument("--logit-scale", type=float, default=1.0, help="queries scaled by this: at 1 every logit stays "
                   "under SAFE_LOGIT and no softmax needs its max shift; a trained model's often do (e.g. 10)")
    add_json(p)
    args = p.parse_args()
    with checkout_of(args.compare, log) as ref, tempfile.TemporaryDirectory(prefix="cpu_score-") as tmp:
        checkouts = {"current": ROOT} if ref is None else {"current": ROOT, "ref": ref}
        commits = {k: commit(v, short=False) for k, v in checkouts.items()}
        common = {**make_inputs(args, Path(tmp)), "threads": args.threads, "queries": args.queries}

        def run(name: str, r: int) -> dict:
            log(f"measuring {name} ({r + 1}/{args.repeats}) ...")
            return measure(checkouts[name], common, Path(tmp), name)

        runs = alternate(sorted(checkouts, reverse=True), args.repeats, run)  # ref first, then current
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
    env = environment()
    print(f"\nCPU: {env['cpu']}; shapes {common['shape']}; medians of {args.repeats} run(s) each, alternating")
    for n in names:
        print(f"  {n}: {commits[n]}")
    ratio = "ref" in runs
    print("\n" + markdown_table(["", *names, *(["current / ref"] if ratio else [])],
                               ([label, *(f"{med[n][key]:.3f}" for n in names),
                                 *([f"{med['current'][key] / med['ref'][key]:.2f}×"] if ratio else [])]
                                for key, label in rows), align="l" + "r" * (len(names) + ratio)))
    sums = {n: runs[n][0]["checksum"] for n in names}
    print("\nchecksum of the exact scores: " + ", ".join(f"{n} {s:.6f}" for n, s in sums.items()))
    bound = {"gemm_flops": common["gemm_flops"], "gemm_peak_gflops": peak, "gemm_s": common["gemm_flops"] / peak / 1e9}
    print(f"arithmetic floor: exact scoring's two GEMMs per head are {bound['gemm_flops'] / 1e12:.3g} TFLOP here; "
          f"at this CPU's fp32 GEMM peak with {args.threads} thread(s) ({peak:.0f} GFLOP/s, best 2048³ matmul) "
          f"they alone take {bound['gemm_s']:.3g} s (the softmax's exp2, products and sums come on top)")
    write_json(args.json, {"args": vars(args), "shape": common["shape"], "commits": commits, "runs": runs,
                           "median": med, "cpu": env["cpu"], "floor": bound, "environment": env})


if __name__ == "__main__":
    main()
