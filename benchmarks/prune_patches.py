"""Patch pruning's criteria side by side: how much exact text->image R@1 survives when each image keeps only S' of
its S patches (keys and values), chosen by three criteria.

    python -m benchmarks.prune_patches --ckpt runs/synthetic/model.pt [--keep 27 18 12 9] [--queries 200]
                                       [--captions-per-image 1] [--json out.json]
    python -m benchmarks.prune_patches --ckpt M --limit 40 --keep 8 --queries 10      # smoke run

Criteria, per image:
- attention mass: Σ over a sample of ``--queries`` captions of the *validation* split (never the evaluated ones)
  and their real tokens, summed over heads, of the softmax weight each patch receives — what
  ``serve build --keep-patches`` ranks by (``mmgeo.search.pruning``), from a sample of expected queries;
- key norm: mean over heads of |k_j| (needs no queries);
- random (seed 0): the floor.
A dropped patch is masked out (the score is then exactly that of a store without it). Scores are exact fp32
(``mmgeo.eval.retrieval.exact_scores``) of the first ``--captions-per-image`` captions of every image of the split
against all its images. The bytes columns are what the re-rank store would keep per image (fp16 and ``rq8``,
``mmgeo.search.codecs.bytes_per_image``, every kept patch real; a pruned store also keeps ceil(S/8) bytes of
kept-patch bits — not counted here). Prints a markdown table; --json writes the rows.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import add_checkpoint, add_json, environment, markdown_table, write_json

CRITERIA = ("attention mass", "key norm", "random")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint(p)
    p.add_argument("--keep", type=int, nargs="+", default=[27, 18, 12, 9], help="patches kept per image (S')")
    p.add_argument("--queries", type=int, default=200, help="validation captions whose attention ranks patches")
    p.add_argument("--captions-per-image", type=int, default=1, help="evaluated captions per test image")
    add_json(p, "the rows")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    import torch

    import mmgeo
    from mmgeo.data import build_dataset
    from mmgeo.eval.retrieval import encode_split, exact_scores
    from mmgeo.models.embedding import Embedding
    from mmgeo.search.codecs import bytes_per_image
    from mmgeo.search.pruning import attention_mass, query_tokens

    args = parse(argv)
    model = mmgeo.load_model(args.ckpt).eval()
    if not model.geometric:
        raise SystemExit(f"{args.ckpt} is a global-only model: patch pruning concerns the geometric re-rank")
    with torch.inference_mode():
        splits = {}
        for name in (args.split, "val"):
            ds = build_dataset(args.data, name, seed=0, image_size=model.cfg.image_size)
            if args.limit:
                ds = torch.utils.data.Subset(ds, range(min(args.limit, len(ds))))
            splits[name] = encode_split(model, ds, progress=False)
        test, val = splits[args.split], splits["val"]
        per_image = torch.bincount(test.text_to_image)  # captions of each image
        first = torch.cumsum(per_image, 0) - per_image  # (N,) index of each image's first caption
        rows_of = torch.cat([first + c for c in range(args.captions_per_image) if (c < per_image).all()])
        texts, owner, images = test.texts[rows_of], test.text_to_image[rows_of], test.images
        val_rows = torch.linspace(0, len(val.texts) - 1, min(args.queries, len(val.texts))).long()
        N, H, S, d_a = images.attn.shape
        d_e = images.value.shape[-1]
        sample = query_tokens(val.texts[val_rows])  # (H, t, d_a): what `serve build --keep-patches` ranks by
        criteria = {"attention mass": attention_mass(sample, images.attn, images.mask),
                    "key norm": images.attn.norm(dim=-1).mean(1),  # (N, S)
                    "random": torch.rand(N, S, generator=torch.Generator().manual_seed(0))}

        def r1(mask) -> float:
            scores = exact_scores(model, texts, Embedding(images.pooled, images.attn, images.value, mask), "geometric",
                                  progress=False)
            return 100 * (scores.argmax(1) == owner).float().mean().item()

        def sizes(keep: int) -> dict:
            return {"fp16_bytes": bytes_per_image("fp16", H, keep, d_a, d_e, "bool"),  # as the stores keep masks
                    "rq8_bytes": bytes_per_image("rq8", H, keep, d_a, d_e, "all")}

        rows = [{"keep": S, "criterion": "all patches", "text_to_image_R@1": r1(images.mask), **sizes(S)}]
        for keep in sorted({min(k, S) for k in args.keep}, reverse=True):
            for name in CRITERIA:
                crit = criteria[name].masked_fill(~images.mask, float("-inf"))  # padding is never kept
                kept = torch.zeros(N, S, dtype=torch.bool).scatter_(1, crit.topk(keep, dim=1).indices, True)
                rows.append({"keep": keep, "criterion": name, "text_to_image_R@1": r1(kept & images.mask),
                             **sizes(keep)})
    print(f"{len(texts)} captions x {N} images ({args.data} {args.split}), {S} patches, {len(val_rows)} validation "
          f"queries rank the patches; exact geometric text->image R@1")
    print(markdown_table(["patches kept", "criterion", "text→image R@1", "fp16 bytes", "rq8 bytes"],
                         ([r["keep"], r["criterion"], f"{r['text_to_image_R@1']:.1f}", f"{r['fp16_bytes']:,}",
                           f"{r['rq8_bytes']:,}"] for r in rows), align="rlrrr"))
    write_json(args.json, {"captions": len(texts), "images": N, "patches": S, "queries": len(val_rows), "rows": rows,
                           "environment": environment()})
    return rows


if __name__ == "__main__":
    main()
