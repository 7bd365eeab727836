"""Pictures of attention (docs/design.md, "Diagnostics"): where each caption word looks, and diagnostics over training.

    python -m mmgeo.eval.viz --ckpt runs/synthetic/model.pt --image synthetic:3 --text "a red circle" --out heatmap.png
    python -m mmgeo.eval.viz curves --run runs/synthetic --out diag.png

The heatmap of word t is softmax_j(<q_t, k_j> / sqrt(d_a)) over the image's patches, averaged over
heads, upsampled to the image and overlaid. ``--image synthetic:INDEX`` takes a test image of the
shapes world (and, without ``--text``, its first caption). ``curves`` plots the diag/* columns and
the training losses of a run's metrics.csv (written by train.py's AttentionDiagnostics callback).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mmgeo.config import CliParser, run_cli
from mmgeo.eval.plots import save_figure
from mmgeo.kernels import attention_weights


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@torch.no_grad()
def token_attention(q: torch.Tensor, q_mask: torch.Tensor, k: torch.Tensor, k_mask: torch.Tensor) -> torch.Tensor:
    """q (H, T, d_a), k (H, S, d_a), masks (T,), (S,) -> (T_real, S): the score's attention weights a_tj
    (``mmgeo.kernels.attention_weights``) averaged over heads, for the real tokens."""
    return attention_weights(q, k, k_mask[None].expand(q.shape[0], -1)).mean(0)[q_mask]  # (T_real, S)


def attention_maps(model, image, text: str) -> tuple[list[str], torch.Tensor]:
    """Per caption word (special tokens dropped), the head-averaged attention over the patch grid.

    image: a PIL image (preprocessed with ``model.preprocess``) or a preprocessed (3, H, W) tensor.
    Returns (words, maps (n_words, h, w)), each map summing to 1 over the grid.
    """
    if not getattr(model, "geometric", False):
        raise ValueError("attention maps need a geometric model; this one is global-only (score='global')")
    pixels = image if isinstance(image, torch.Tensor) else model.preprocess(image)
    tok = model.tokenize([text])
    ids = tok["input_ids"][0]
    t = model.forward_text(**{k: v.to(model.device) for k, v in tok.items()})
    i = model.forward_image(pixels.unsqueeze(0).to(model.device))
    attn = token_attention(t.attn[0], t.mask[0], i.attn[0], i.mask[0])  # (T_real, S); real tokens come first
    special = set(model.tokenizer.all_special_ids)
    keep = [j for j, x in enumerate(ids.tolist()) if t.mask[0, j] and x not in special]
    words = model.tokenizer.convert_ids_to_tokens([int(ids[j]) for j in keep])
    h, w = model.key_head.grid
    return words, attn[keep].view(len(keep), h, w).float().cpu()


def _load_image(spec: str, model):
    if spec.startswith("synthetic:"):
        from mmgeo.data import build_dataset

        idx = spec.split(":", 1)[1]
        if not idx.isdigit():
            raise ValueError(f"--image {spec!r}: INDEX of synthetic:INDEX must be a non-negative integer")
        idx = int(idx)
        image, captions = build_dataset("synthetic", "test", image_size=model.cfg.image_size, size=idx + 1)[idx]
        return image, captions[0]
    from mmgeo.data.images import open_image

    if not Path(spec).is_file():
        raise FileNotFoundError(f"image {spec!r} does not exist; pass a file or synthetic:INDEX (e.g. synthetic:0)")
    try:
        return open_image(spec), None
    except (OSError, ValueError, SyntaxError) as err:  # PIL's errors for a file it cannot read
        raise ValueError(f"image {spec!r} is not a readable image ({type(err).__name__}: {err})") from err


def plot_heatmaps(image, words: list[str], maps: torch.Tensor, out: str | Path, title: str = "") -> Path:
    """The image, then one panel per word with its (h, w) map upsampled and overlaid; writes a PNG."""
    plt = _plt()
    shown = image.convert("RGB").resize((256, 256)) if hasattr(image, "convert") else image
    up = F.interpolate(maps[:, None], size=(256, 256), mode="bilinear", align_corners=False)[:, 0]  # (n, 256, 256)
    cols = min(6, len(words) + 1)
    rows = math.ceil((len(words) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    axes.flat[0].imshow(shown)
    axes.flat[0].set_title("image", fontsize=9)
    for ax, word, m in zip(list(axes.flat)[1:], words, up):
        ax.imshow(shown)
        ax.imshow(m.numpy(), cmap="jet", alpha=0.5)
        ax.set_title(word, fontsize=9)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, out)


def plot_curves(run: str | Path, out: str | Path) -> Path:
    """diag/* columns and training losses of ``<run>/metrics.csv`` against the step; writes a PNG."""
    path = Path(run) / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; train with `python train.py --config ...` first")
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            for key, val in row.items():
                if val and (key.startswith("diag/") or key.startswith("train/loss")):
                    series.setdefault(key, []).append((int(row["step"]), float(val)))
    if not series:
        raise ValueError(f"{path} has no diag/* or train/loss* columns; train with aids.diagnostics_every_n_steps > 0")
    panels = {"losses": [k for k in series if k.startswith("train/")],
              "entropy": [k for k in series if "entropy" in k],
              "Q/K effective rank": [k for k in series if "erank" in k],
              "logit range": [k for k in series if "logit" in k],
              "head redundancy": [k for k in series if "redundancy" in k]}
    panels = {t: ks for t, ks in panels.items() if ks}
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), dpi=100, sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels.items()):
        for key in keys:
            steps, vals = zip(*series[key])
            ax.plot(steps, vals, label=key.split("/", 1)[1], marker="." if len(steps) < 30 else None)
        if title == "entropy":
            ax.axhline(0.5 * math.log(2), color="k", ls=":", lw=0.8, label="0.5·ln2 (collapse)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["curves"]:
        p = CliParser(prog="python -m mmgeo.eval.viz curves", description="diagnostics over training")
        p.add_argument("--run", required=True, help="run folder with metrics.csv, e.g. runs/synthetic")
        p.add_argument("--out", default="diag.png")
        args = p.parse_args(argv[1:])
        out = plot_curves(args.run, args.out)
    else:
        p = CliParser(prog="python -m mmgeo.eval.viz", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--ckpt", required=True, help="model.pt from train.py")
        p.add_argument("--image", required=True, help="image file, or synthetic:INDEX (a shapes-world test image)")
        p.add_argument("--text", default=None, help="caption (default for synthetic:INDEX: its first caption)")
        p.add_argument("--out", default="heatmap.png")
        args = p.parse_args(argv)
        from mmgeo.models.checkpoint import load_model

        model = load_model(args.ckpt)
        image, caption = _load_image(args.image, model)
        text = args.text or caption
        if not text:
            p.error("--text is required for an image file")
        words, maps = attention_maps(model, image, text)
        score = float(model.score(model.encode_text([text]), model.encode_image([image]))[0, 0])  # geometric
        out = plot_heatmaps(image, words, maps, args.out, title=f"{text}   (geometric score {score:.4f})")
    print(f"written {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
