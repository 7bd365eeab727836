"""What cogent's shape edits miss: the held-out (colour, shape) object, and whether the image side reads its shape.

    python -m experiments.heldout_shapes --ckpt runs/synthetic/model.pt
    python -m experiments.heldout_shapes --ckpt RUN/model.pt --images 300 --probe-train 4000 --out heldout.json

1. The compositional suite's shape edits (``--edits``, default replace_shape and swap_shape) on the first
   ``--images`` images of the ``cogent`` split, scored as ``mmgeo.eval.compositional.run_suite`` scores them (the
   true caption above the edit; ties fail), each (caption, edit) pair classed by the objects the edit changes: one of
   them the scene's held-out combo (``HELDOUT_COMBOS``, never in train / val / test), or only seen combos.
2. An image-side probe of the frozen model: each object of the test and cogent splits, as the mean of its cell's
   patch keys and values (every head), is given the shape of the nearest shape centroid (cosine), the centroids
   averaged over the objects of the first ``--probe-train`` training images of every colour *but the object's
   own*, so a colour prior cannot decide it (a held-out blue circle meets circles and squares of other colours
   only, as a seen red circle does). Chance is 25 %. ``--random`` adds the same probe over an untrained model of the
   same config: the probe's floor.

The scene graph is used only to measure, never to train (docs/design.md §9). Shapes world, a 3×3 grid of cells
that the patch grid divides evenly (geo-tiny: 6×6 patches).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def edit_split(model, world, n_images: int, edits: tuple[str, ...]) -> dict:
    """{edit: {"held-out" | "seen": {"n", "right"}}} over the suite's items of the first ``n_images`` images."""
    import torch

    from mmgeo.data.scene_edits import shapes_edit_items
    from mmgeo.data.shapes import HELDOUT_COMBOS
    from mmgeo.data.shapes_grammar import parse

    held, out = set(HELDOUT_COMBOS), {e: {k: Counter() for k in ("held-out", "seen")} for e in edits}
    groups: dict = {}
    for item in shapes_edit_items(world, n_images):
        groups.setdefault(item.image_key(), []).append(item)
    with torch.inference_mode():
        for group in groups.values():
            image = model.encode_image([group[0].load_image()])
            for item in group:
                negs = [(e, n) for e in edits for n in item.negatives.get(e, [])]
                if not negs:
                    continue
                s = model.score(model.encode_text([item.caption] + [n for _, n in negs]), image,
                                model.default_mode)[:, 0].tolist()  # (1 + edits,)
                true = parse(item.caption).mentions
                for j, (edit, neg) in enumerate(negs):
                    changed = [a for a, b in zip(true, parse(neg).mentions) if (a.color, a.shape) != (b.color, b.shape)]
                    row = out[edit]["held-out" if any((a.color, a.shape) in held for a in changed) else "seen"]
                    row["n"] += 1
                    row["right"] += s[0] > s[1 + j]
    return {e: {k: dict(c) for k, c in rows.items()} for e, rows in out.items()}


def _objects(model, world, n_images: int):
    """(N, C) cell features of every object of the first ``n_images`` images and their (colour, shape) list."""
    import torch

    g = model.cfg.image_size // model.cfg.patch_size
    if g % 3:
        raise ValueError(f"the probe pools each of the 3x3 cells; a {g}x{g} patch grid does not divide into them")
    feats, meta = [], []
    with torch.inference_mode():
        for start in range(0, n_images, 250):
            idx = range(start, min(n_images, start + 250))
            emb = model.encode_image([world[i][0] for i in idx])
            x = torch.cat([emb.attn.float(), emb.value.float()], -1).transpose(1, 2).flatten(2)  # (B, S, H·(d_a+d_e))
            cells = x.view(len(idx), 3, g // 3, 3, g // 3, -1).mean((2, 4)).flatten(1, 2)  # (B, 9, C)
            for b, i in enumerate(idx):
                for o in world.scene(i):
                    feats.append(cells[b, o.cell[0] * 3 + o.cell[1]])
                    meta.append((o.color, o.shape))
    return torch.nn.functional.normalize(torch.stack(feats), dim=-1), meta


def shape_probe(model, image_size: int, n_train: int, n_eval: int) -> dict:
    """Nearest-centroid shape accuracy of seen and held-out objects (module docstring, 2), and where they go."""
    import torch

    from mmgeo.data.shapes import COLORS, HELDOUT_COMBOS, SHAPES, ShapesWorld

    x, meta = _objects(model, ShapesWorld("train", image_size=image_size), n_train)
    centroids = {}
    for color in COLORS:
        rows = [[i for i, (c, s) in enumerate(meta) if s == shape and c != color] for shape in SHAPES]
        centroids[color] = torch.stack([x[r].mean(0) for r in rows])  # (4, C)
    out = {}
    for split in ("test", "cogent"):
        feats, objs = _objects(model, ShapesWorld(split, image_size=image_size), n_eval)
        counts, heldout_to = Counter(), Counter()
        for f, (color, shape) in zip(feats, objs):
            guess = SHAPES[int((centroids[color] @ f).argmax())]
            kind = "held-out" if (color, shape) in HELDOUT_COMBOS else "seen"
            counts[kind, "n"] += 1
            counts[kind, "right"] += guess == shape
            if kind == "held-out":
                heldout_to[f"{color} {shape} -> {guess}"] += 1
        out[split] = {k: {"n": counts[k, "n"], "right": counts[k, "right"]} for k in ("seen", "held-out")
                      if counts[k, "n"]}
        if heldout_to:
            out[split]["held-out_read_as"] = dict(sorted(heldout_to.items()))
    return out


def _pct(row: dict) -> str:
    return f"{100 * row['right'] / row['n']:.1f} ({row['n']})" if row.get("n") else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="a shapes-world model.pt")
    parser.add_argument("--images", type=int, default=300, help="cogent images of the suite split (default 300)")
    parser.add_argument("--edits", nargs="+", default=["replace_shape", "swap_shape"], help="suite edit types")
    parser.add_argument("--probe-train", type=int, default=4000, help="training images the centroids come from")
    parser.add_argument("--probe-eval", type=int, default=1000, help="test and cogent images the probe classes")
    parser.add_argument("--random", action="store_true", help="also probe an untrained model of the same config")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    import torch

    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.models.checkpoint import load_model
    from mmgeo.models.geo_retriever import GeoRetriever

    model = load_model(args.ckpt).eval()
    size = model.cfg.image_size
    result = {"ckpt": str(args.ckpt), "edits": edit_split(model, ShapesWorld("cogent", image_size=size),
                                                          args.images, tuple(args.edits)),
              "probe": {"trained": shape_probe(model, size, args.probe_train, args.probe_eval)}}
    if args.random:
        torch.manual_seed(0)
        result["probe"]["untrained"] = shape_probe(GeoRetriever(model.cfg).eval(), size, args.probe_train,
                                                   args.probe_eval)
    print(f"cogent, first {args.images} images: accuracy % (pairs) of the true caption over its shape edit")
    print("| edit | edits of the held-out object | edits of seen objects only |\n|---|---:|---:|")
    for edit, rows in result["edits"].items():
        print(f"| {edit} | {_pct(rows['held-out'])} | {_pct(rows['seen'])} |")
    print("\nimage-side probe: nearest shape centroid of other colours, accuracy % (objects); chance 25")
    print("| model | test, seen | cogent, seen | cogent, held-out |\n|---|---:|---:|---:|")
    for name, p in result["probe"].items():
        print(f"| {name} | {_pct(p['test']['seen'])} | {_pct(p['cogent']['seen'])} | "
              f"{_pct(p['cogent'].get('held-out', {}))} |")
    print("held-out objects read as:", result["probe"]["trained"]["cogent"].get("held-out_read_as"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
