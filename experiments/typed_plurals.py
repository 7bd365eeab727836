"""Queries a model cannot read, as typed and as search corrects them: "two yellow circles" on the shapes world.

    python -m experiments.typed_plurals --ckpt runs/synthetic/model.pt [--ckpt ...] [--queries 300] [--json out.json]

The shapes world's captions never use a plural, so a scratch model's vocabulary has no "circles" (unless trained
with ``data.typed_plurals``: then the two rankings are one): typed, the query is searched as "two yellow [UNK]";
`POST /search` corrects it to its ``did_you_mean`` ("two yellow circle", ``mmgeo.models.vocab``) unless asked not
to. For each model: ``plural_queries`` of the test split (every image
holding at least that many objects of that colour and shape is relevant, ``mmgeo.data.shapes_queries``), ranked by
the exact geometric score over the split as typed and as corrected: P@1, P@5, nDCG@10, mAP, the mean rank of the
first relevant image, and how often the first hit holds one object of the kind at least (the count aside). Shapes
world only; exact scores (the service's two-stage search re-ranks the global top K').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def measure(ckpt: str, n: int, seed: int = 0, size: int | None = None) -> dict:
    import numpy as np
    import torch

    from mmgeo.data import build_dataset
    from mmgeo.data.shapes_queries import plural_queries, query_images
    from mmgeo.eval.partial import exact_rankings, ranking_metrics
    from mmgeo.eval.retrieval import encode_images, exact_scores
    from mmgeo.models.checkpoint import load_model
    from mmgeo.models.vocab import vocabulary_hint

    model = load_model(ckpt)
    world = build_dataset("synthetic", "test", seed=seed, image_size=model.cfg.image_size, size=size)
    scenes = [world.scene(i) for i in range(len(world))]
    images = encode_images(model, world)
    queries = plural_queries(world, n, seed)
    relevant = [query_images(q, scenes) for q in queries]
    tokenizer = getattr(model, "tokenizer", None)
    corrected = [vocabulary_hint(tokenizer, q.text)["did_you_mean"] or q.text for q in queries]
    out = {"ckpt": ckpt, "queries": n, "distinct_queries": len({q.text for q in queries}),
           "relevant_per_query": float(np.mean([len(r) for r in relevant])), "corrected_queries": sum(
               c != q.text for c, q in zip(corrected, queries)), "examples": [(q.text, c) for q, c in
                                                                           zip(queries[:3], corrected[:3])]}
    for name, texts in (("typed", [q.text for q in queries]), ("corrected", corrected)):
        with torch.inference_mode():
            scores = exact_scores(model, model.encode_text(texts), images, "geometric", progress=False)
        ranked = exact_rankings(scores)
        first = [int(np.flatnonzero(np.isin(r, rel))[0]) + 1 for r, rel in zip(ranked, relevant)]
        kind = [sum((o.color, o.shape) == (q.mentions[0].color, q.mentions[0].shape) for o in scenes[r[0]]) > 0
                for q, r in zip(queries, ranked)]  # the first hit holds one of the kind, at least
        out[name] = {**ranking_metrics(ranked, relevant), "mean_first_relevant_rank": float(np.mean(first)),
                     "first_hit_holds_the_kind": float(np.mean(kind))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", action="append", required=True, help="a shapes-world model.pt (repeatable)")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--images", type=int, default=None, help="the test split's first N images (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the records here (a new file)")
    args = parser.parse_args(argv)
    if args.json is not None and args.json.exists():
        print(f"error: {args.json} exists: choose another --json", file=sys.stderr)
        return 2
    records = [measure(c, args.queries, size=args.images) for c in args.ckpt]
    print("| model | as | P@1 | P@5 | nDCG@10 | mAP | first relevant rank (mean) | first hit holds the kind |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        for name in ("typed", "corrected"):
            m = r[name]
            print(f"| {r['ckpt']} | {name} | {100 * m['P@1']:.1f} | {100 * m['P@5']:.1f} | {100 * m['nDCG@10']:.1f} "
                  f"| {100 * m['mAP']:.1f} | {m['mean_first_relevant_rank']:.1f} "
                  f"| {100 * m['first_hit_holds_the_kind']:.1f} |")
    for r in records:
        print(f"{r['ckpt']}: {r['distinct_queries']} distinct of {r['queries']} queries, "
              f"{r['relevant_per_query']:.1f} relevant images each, {r['corrected_queries']} corrected; "
              f"e.g. {r['examples']}")
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
