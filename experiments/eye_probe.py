"""Whether the eye is the limit: how well a model's image tower can tell the shapes-world's shapes apart at all.

    python -m experiments.eye_probe                                   # the geo-tiny tower, patchify vs conv stems
    python -m experiments.eye_probe --steps 600 --stems patchify conv conv-full --out runs/eye_probe.json

The image tower of ``geo-tiny`` (``mmgeo.models.towers.build_image_tower``: the ViT and its stem, nothing of the
text side) is trained *supervised*, from scratch, to name what each of the 3×3 cells holds (nothing or one of the
four shapes) from the mean of that cell's patch tokens, with the scene graph as labels. That is an upper bound on
what the tower can see, reached with far more direct signal than contrastive training gives it; the scene graph
is used here only to measure, never to train the product (docs/design.md §9). Printed per stem: shape accuracy on
the test split's small and large objects, the circle/square and triangle/diamond confusions of small objects, and
the tower's forward + backward seconds per batch of 64, measured side by side in one run.

Stems (``--stems``): ``patchify`` (the ViT's one strided convolution), ``conv`` (``image_conv_stem``: stride-2 3×3
convolutions, Xiao et al. 2021) and ``conv-full`` (``image_stem_full_res``: the same after one stride-1 3×3
convolution at the input resolution) and ``conv-p4`` (the conv stem with 4 px patches: a 12×12 token grid, 4× the
tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

STEMS = {"patchify": {}, "conv": {"image_conv_stem": True},
         "conv-full": {"image_conv_stem": True, "image_stem_full_res": True},
         "conv-p4": {"image_conv_stem": True, "patch_size": 4}}


def _labels(world, idx):
    """(9,) cell labels (0 empty, 1 + shape index) and (9,) sizes (0 small, 1 large, -1 empty) of one scene."""
    from mmgeo.data.shapes import SHAPES

    lab, size = [0] * 9, [-1] * 9
    for o in world.scene(idx):
        c = o.cell[0] * 3 + o.cell[1]
        lab[c], size[c] = 1 + SHAPES.index(o.shape), int(o.size == "large")
    return lab, size


def _tensors(world, n, transform):
    import torch

    pix, lab, size = [], [], []
    for i in range(n):
        img, _ = world[i]
        pix.append(transform(img))
        a, b = _labels(world, i)
        lab.append(a)
        size.append(b)
    return torch.stack(pix), torch.tensor(lab), torch.tensor(size)  # (n, 3, H, W), (n, 9), (n, 9)


class Probe:
    """The tower and a linear head over each cell's pooled patch tokens (9 cells × 5 classes)."""

    def __init__(self, cfg):
        from torch import nn

        from mmgeo.models.towers import build_image_tower

        self.vit = build_image_tower(cfg)
        self.grid = cfg.image_size // cfg.patch_size
        self.head = nn.Linear(self.vit.embed_dim, 5)
        self.params = list(self.vit.parameters()) + list(self.head.parameters())

    def logits(self, pixels):
        from mmgeo.models.towers import patch_tokens

        tokens, _ = patch_tokens(self.vit, pixels)  # (B, S, C)
        B, S, C = tokens.shape
        g = self.grid
        cells = tokens.view(B, 3, g // 3, 3, g // 3, C).mean((2, 4)).reshape(B, 9, C)  # (B, 9, C)
        return self.head(cells)  # (B, 9, 5)


def run_stem(name, args, train, test, log):
    import torch
    import torch.nn.functional as F

    from mmgeo.models.registry import model_config

    torch.manual_seed(args.seed)
    cfg = model_config("geo-tiny", **STEMS[name])
    probe = Probe(cfg)
    opt = torch.optim.AdamW(probe.params, lr=args.lr, weight_decay=0.05)
    pix, lab, _ = train
    gen = torch.Generator().manual_seed(args.seed)
    seconds = []
    probe.vit.train()
    for step in range(args.steps):
        rows = torch.randint(len(pix), (args.batch_size,), generator=gen)
        t0 = time.perf_counter()
        loss = F.cross_entropy(probe.logits(pix[rows]).flatten(0, 1), lab[rows].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        if (step + 1) % 100 == 0:
            log(f"{name}: step {step + 1}/{args.steps} loss {loss.item():.4f}")
    probe.vit.eval()
    tpix, tlab, tsize = test
    with torch.no_grad():
        pred = torch.cat([probe.logits(tpix[i:i + 256]).argmax(-1) for i in range(0, len(tpix), 256)])  # (n, 9)
    out = {"stem": name, "steps": args.steps, "train_s_per_step": sorted(seconds)[len(seconds) // 2]}
    for size_name, s in (("small", 0), ("large", 1)):
        m = tsize == s
        out[f"{size_name}_shape_acc"] = float((pred[m] == tlab[m]).float().mean())
        for a, b in ((1, 2), (3, 4)):  # circle/square, triangle/diamond (1 + SHAPES index)
            pair = m & ((tlab == a) | (tlab == b))
            out[f"{size_name}_confused_{a}{b}"] = int((pair & ((pred == a) | (pred == b)) & (pred != tlab)).sum())
    out["empty_acc"] = float((pred[tsize == -1] == 0).float().mean())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stems", nargs="+", default=list(STEMS), choices=list(STEMS))
    parser.add_argument("--steps", type=int, default=600, help="training steps per stem (batch --batch-size)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-images", type=int, default=8000, help="first N train images, drawn once")
    parser.add_argument("--test-images", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.models.registry import model_config
    from mmgeo.models.towers import build_image_tower, image_transform, resolve_preprocessing

    cfg = model_config("geo-tiny")
    resolve_preprocessing(cfg, build_image_tower(cfg))
    transform = image_transform(cfg)
    train = _tensors(ShapesWorld("train", image_size=cfg.image_size, size=args.train_images), args.train_images,
                     transform)
    test = _tensors(ShapesWorld("test", image_size=cfg.image_size, size=args.test_images), args.test_images,
                    transform)
    rows = [run_stem(name, args, train, test, lambda m: print(m, flush=True)) for name in args.stems]
    print(f"\n| stem | small shape acc | large shape acc | small circle↔square / triangle↔diamond errors | "
          f"empty acc | s / step (B {args.batch_size}) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stem']} | {100 * r['small_shape_acc']:.1f} | {100 * r['large_shape_acc']:.1f} | "
              f"{r['small_confused_12']} / {r['small_confused_34']} | {100 * r['empty_acc']:.1f} | "
              f"{r['train_s_per_step']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
