"""Re-rank store codecs side by side: bytes per image, two-stage R@1 / R@5 through a built index, re-rank latency
per query, build time, and the store size projected to 1M / 100M images at the ``geo-vitb16-bert`` shapes.

    python -m benchmarks.codecs --ckpt runs/synthetic/model.pt [--codecs fp16 sq8 ... ] [--split test]
                                [--k-prime 100] [--latency-queries 300] [--out runs/codecs]
                                [--report-to docs/measurements/serving.md]   # fills its <!-- codecs:start/end -->
    python -m benchmarks.codecs --ckpt M --limit 60 --codecs fp16 sq8 --latency-queries 5   # smoke run

The split is encoded once. Exact fp32 scoring of every (caption, image) pair is the reference. Each codec's index
is built from those encoded images (``build_gallery_from_embedding``: fp16 arrays, then the codec's quantizers
trained on them and the codes written; "build s" is that, image encoding excluded) and evaluated by
``evaluate_split`` over it: FAISS top-K' by global score, re-ranked from the store (image->text read from the
text->image candidates, as eval.py does). Latency: the same queries and the same FAISS candidates for every codec,
``rerank_candidates`` timed per query with the codecs interleaved query by query (one thread), so machine load
falls on all of them alike. Writes results.md and codecs.json under --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    add_checkpoint,
    add_out,
    add_report_to,
    alternate,
    check_markers,
    elapsed_ms,
    environment,
    logger,
    markdown_table,
    measured_on,
    report_to,
    write_json,
)

SCALES = (1_000_000, 100_000_000)
RECALLS = ("text_to_image_R@1", "text_to_image_R@5", "image_to_text_R@1", "image_to_text_R@5")
log = logger("codecs")
BIG_MODEL = "geo-vitb16-bert"


def parse(argv=None) -> argparse.Namespace:
    from mmgeo.search.codecs import CODECS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint(p)
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--k-prime", type=int, default=100)
    p.add_argument("--latency-queries", type=int, default=300, help="captions timed per codec")
    p.add_argument("--keep-patches", type=int, nargs="*", default=[], metavar="N",
                   help="also build each codec pruned to N patches per image (mmgeo.search.pruning)")
    p.add_argument("--prune-queries", type=int, default=200,
                   help="sample captions for pruning: the first N of the validation split (never the evaluated one)")
    add_out(p, "runs/codecs", "codecs.json, results.md")
    add_report_to(p, "codecs")
    return p.parse_args(argv)


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def projected(codec: str, kept: float = 1.0) -> dict:
    """Bytes per image and store size at 1M / 100M images for the big model's shapes (every patch real), keeping
    the fraction ``kept`` of its patches (plus the kept-patch bits when pruned)."""
    from mmgeo.models.registry import model_config
    from mmgeo.search.codecs import bytes_per_image

    cfg = model_config(BIG_MODEL)
    S = (cfg.image_size // cfg.patch_size) ** 2
    L = S if kept == 1.0 else max(1, round(S * kept))
    per = bytes_per_image(codec, cfg.num_heads, L, cfg.d_a, cfg.d_e, "bool" if codec == "fp16" else "all")
    per += 0 if L == S else -(-S // 8)
    return {"bytes_per_image": per, **{str(n): per * n for n in SCALES}}


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"


def latencies(model, galleries: dict, texts, candidates, n: int) -> dict:
    """Per codec: milliseconds of ``rerank_candidates`` per query over the same candidates, interleaved."""
    import torch

    from mmgeo.search.two_stage import rerank_candidates

    def rerank(c: str, i: int) -> float:
        return elapsed_ms(lambda: rerank_candidates(texts.attn[i], texts.mask[i], texts.value[i], galleries[c],
                                                    candidates[i]))

    with torch.inference_mode():  # query by query, every codec in turn, who goes first rotating
        times = alternate(galleries, min(n, len(texts)), rerank, rotate=True)
    return {c: {"median_ms": statistics.median(v), "p99_ms": sorted(v)[min(len(v) - 1, int(0.99 * len(v)))]}
            for c, v in times.items()}


def main(argv=None) -> dict:
    args = parse(argv)
    import faiss
    import numpy as np
    import torch

    from mmgeo.data import build_dataset
    from mmgeo.eval.metrics import retrieval_metrics
    from mmgeo.eval.retrieval import encode_split, exact_scores
    from mmgeo.eval.two_stage import evaluate_split
    from mmgeo.models.checkpoint import load_model
    from mmgeo.search.build import build_gallery_from_embedding
    from mmgeo.search.store import Gallery

    if args.report_to:
        check_markers(Path(args.report_to).resolve(), "codecs")
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.ckpt, device="cpu")
    dataset = build_dataset(args.data, args.split, image_size=model.cfg.image_size, size=args.limit)
    split = encode_split(model, dataset)
    exact = retrieval_metrics(exact_scores(model, split.texts, split.images, "geometric"), split.text_to_image)
    S = (model.cfg.image_size // model.cfg.patch_size) ** 2
    variants = [(c, None) for c in args.codecs] + [(c, n) for n in args.keep_patches for c in args.codecs]
    sample = None
    if args.keep_patches:  # sample captions from another split than the one evaluated
        val = build_dataset(args.data, "val", image_size=model.cfg.image_size, size=args.prune_queries)
        sample = encode_split(model, val).texts[:args.prune_queries]
    rows, galleries, kept = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="mmgeo-codecs-") as tmp:
        for codec, keep in variants:
            name = codec if keep is None else f"{codec}, {keep}/{S} patches"
            kept[name] = 1.0 if keep is None else keep / S
            t = time.perf_counter()
            build_gallery_from_embedding(model, split.images, Path(tmp) / name, index_type="flat", codec=codec,
                                         keep_patches=keep, prune_queries=sample if keep else None)
            build_s = time.perf_counter() - t
            galleries[name] = g = Gallery(Path(tmp) / name)
            scores, _ = evaluate_split(model, split, args.k_prime, gallery=g)
            m = retrieval_metrics(scores, split.text_to_image, scores_i2t=scores)
            rows[name] = {"bytes_per_image": g.store["bytes_per_image"], "codebook_bytes": g.store["codebook_bytes"],
                           "rel_error": g.store.get("rel_error"), "build_s": round(build_s, 2),
                           **{k: m[k] for k in RECALLS}, **{f"delta_{k}": m[k] - exact[k] for k in RECALLS}}
            log(f"{name}: {g.store['bytes_per_image']} B/image, text->image R@1 "
                  f"{pct(m['text_to_image_R@1'])} (exact {pct(exact['text_to_image_R@1'])})")
        q = np.ascontiguousarray(split.texts.pooled.float().numpy())  # (N_t, d_g)
        _, cand = galleries[next(iter(galleries))].index.search(q[:args.latency_queries], args.k_prime)  # (n, K')
        for codec, lat in latencies(model, galleries, split.texts, cand, args.latency_queries).items():
            rows[codec].update(lat)
        galleries.clear()  # close the memory maps before the folder goes
    fp16_bytes = rows["fp16"]["bytes_per_image"] if "fp16" in rows else None
    result = {"ckpt": str(args.ckpt), "data": args.data, "split": args.split, "images": len(split.images),
              "captions": len(split.texts), "k_prime": args.k_prime, "exact": {k: exact[k] for k in RECALLS},
              "codecs": rows, "projected": {n: projected(n.split(",")[0], kept[n]) for n in rows},
              "model_for_projection": BIG_MODEL, "prune_queries": args.prune_queries if args.keep_patches else 0,
              "command": "python -m benchmarks.codecs " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment()}
    text = markdown(result, fp16_bytes)
    write_json(out / "codecs.json", result)
    (out / "results.md").write_text(text)
    print(text)
    if args.report_to:
        report_to(Path(args.report_to).resolve(), "codecs", text)
    return result


def markdown(r: dict, fp16_bytes: int | None) -> str:
    e = r["exact"]
    head = ["codec", "bytes / image", "of fp16", "codebooks", "T→I R@1", "T→I R@5", "I→T R@1", "I→T R@5",
            "Δ R@1 vs exact (T→I / I→T)", "re-rank ms / query (median / p99)", "build s"]

    def row(c: str, x: dict) -> list:
        return [c, f"{x['bytes_per_image']:,}", f"1/{fp16_bytes / x['bytes_per_image']:.1f}" if fp16_bytes else "–",
                human(x["codebook_bytes"]), *(pct(x[k]) for k in RECALLS),
                f"{100 * x['delta_text_to_image_R@1']:+.1f} / {100 * x['delta_image_to_text_R@1']:+.1f}",
                f"{x['median_ms']:.2f} / {x['p99_ms']:.2f}", f"{x['build_s']:.1f}"]

    lines = [f"`{r['command']}` — {r['data']} {r['split']}, {r['images']:,} images, {r['captions']:,} captions, "
             f"K' = {r['k_prime']}, one thread. Exact fp32 scoring: text→image R@1 {pct(e['text_to_image_R@1'])}, "
             f"image→text R@1 {pct(e['image_to_text_R@1'])}. {measured_on(r['environment'])}", "",
             markdown_table(head, (row(c, x) for c, x in r["codecs"].items()), align="l" + "r" * 10)]
    if r.get("prune_queries"):
        lines += ["", f"Pruned rows keep each image's patches of most attention mass from the first "
                  f"{r['prune_queries']} captions of the validation split (mmgeo.search.pruning); their bytes include "
                  "the kept-patch bits."]
    lines += ["", f"Projected re-rank store at the `{r['model_for_projection']}` shapes (every patch real; pruned rows "
              "keep the same fraction of its patches; codebooks not included):", "",
              markdown_table(["codec", "bytes / image", "1M images", "100M images"],
                             ([c, f"{p['bytes_per_image']:,}", *(human(p[str(n)]) for n in SCALES)]
                              for c, p in r["projected"].items()), align="lrrr")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
