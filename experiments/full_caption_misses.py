"""Where full-caption R@1's misses go: per caption template, and how many first hits the caption is true of too.

    python -m experiments.full_caption_misses --ckpt runs/synthetic_full_captions/model.pt runs/synthetic/model.pt
    python -m experiments.full_caption_misses --ckpt RUN/model.pt --split train --images 2000 --out misses.json

Every caption of the first ``--images`` images of a shapes-world split is ranked exactly (geometric score) against
those images, as R@1 does. A miss whose first hit the caption is also true of (``shapes_queries.satisfies``: it
holds the caption's objects, and others; a count caption must also match the count) is a *tie the scene graph
allows*: R@1, with one relevant image per caption, counts it wrong. ``R@1 without those`` is what R@1 would be if
every such tie were broken toward the caption's own image. Per template ("there is ...", "two shapes : ...",
"in the top left a ...", the list, the relation chain) the count of captions, of captions true of another image of
the split (``--true-of-another``: a scan over every pair, the same for every model), of misses, of misses to a
true image, and of misses to a denser image holding the caption's objects (for a count caption: whatever its count
says, so a count the first hit breaks shows there). Shapes world only
(truth needs the scene graph, which is used here only to measure; docs/design.md §9).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path


def _true_of_another(world, n_images: int) -> dict[str, int]:
    """Per template, the captions of the first ``n_images`` images true of another of those images (any model)."""
    from mmgeo.data.shapes_grammar import TEMPLATES, parse
    from mmgeo.data.shapes_queries import true_images

    scenes, out = [world.scene(i) for i in range(n_images)], Counter()
    for own in range(n_images):
        for text in world.captions(own):
            out[parse(text).template] += bool((true_images(text, scenes) != own).any())
    return {t: out[t] for t in TEMPLATES}


def _misses(model, world, n_images: int) -> dict:
    import torch

    from mmgeo.data.shapes_grammar import TEMPLATES, parse
    from mmgeo.data.shapes_queries import satisfies
    from mmgeo.eval.retrieval import encode_images, exact_scores

    images_ = [world[i] for i in range(n_images)]
    scenes = [world.scene(i) for i in range(n_images)]
    captions = [(i, c) for i in range(n_images) for c in images_[i][1]]
    with torch.inference_mode():
        images = encode_images(model, images_, progress=False)
        texts = model.encode_text([c for _, c in captions])
        top = exact_scores(model, texts, images, "geometric", progress=False).argmax(1).tolist()  # (N_text,)
    rows = {t: Counter() for t in TEMPLATES}
    for (own, text), first in zip(captions, top):
        parsed = parse(text)
        row = rows[parsed.template]
        row["captions"] += 1
        if first != own:
            row["misses"] += 1
            row["misses_to_a_true_image"] += satisfies(parsed, scenes[first])
            uncounted = dataclasses.replace(parsed, template="list") if parsed.template == "count" else parsed
            row["misses_to_a_denser_holder"] += len(scenes[first]) > len(scenes[own]) and satisfies(uncounted,
                                                                                                  scenes[first])
    total = sum((r for r in rows.values()), Counter())
    n = total["captions"]
    return {"images": n_images, "captions": n, "R@1": 1 - total["misses"] / n,
            "R@1_without_true_ties": 1 - (total["misses"] - total["misses_to_a_true_image"]) / n,
            "misses": total["misses"], "misses_to_a_true_image": total["misses_to_a_true_image"],
            "misses_to_a_denser_holder": total["misses_to_a_denser_holder"],
            "per_template": {t: dict(r) for t, r in rows.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", nargs="+", required=True, help="model.pt files, one row each")
    parser.add_argument("--split", default="test", choices=("train", "val", "test", "cogent"))
    parser.add_argument("--images", type=int, default=None, help="the split's first N images (default: all)")
    parser.add_argument("--true-of-another", action="store_true",
                        help="also count, per template, the captions true of another image of those scanned")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.models.checkpoint import load_model

    rows, truth = [], None
    for ckpt in args.ckpt:
        model = load_model(ckpt)
        world = ShapesWorld(args.split, image_size=model.cfg.image_size)
        n = min(args.images or len(world), len(world))
        rows.append({"ckpt": str(ckpt), "split": args.split, **_misses(model, world, n)})
    if args.true_of_another:
        truth = _true_of_another(world, n)
        print("captions true of another image, per template:", truth, f"({sum(truth.values())} in all)")
    print("\n| model | captions | R@1 | misses | of which to a true image | R@1 without those | per template: misses "
          "(to a true image) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        per = "; ".join(f"{t} {c.get('misses', 0)} ({c.get('misses_to_a_true_image', 0)})"
                        for t, c in r["per_template"].items())
        print(f"| {r['ckpt']} | {r['captions']} | {100 * r['R@1']:.1f} | {r['misses']} | "
              f"{r['misses_to_a_true_image']} | {100 * r['R@1_without_true_ties']:.1f} | {per} |")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "true_of_another": truth}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
