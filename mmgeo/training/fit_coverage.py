"""Fit a trained model's coverage salience with the rest of it frozen (docs/design.md §2, §9).

    python train.py --config configs/synthetic.yaml --coverage.weight 0 --name nocov   # a model without the fit
    python -m mmgeo.training.fit_coverage --ckpt runs/nocov/model.pt \
        --out runs/nocov/model_coverage.pt [--data synthetic --images 2000 --weight 0.05]

Every caption of the first ``--images`` images of the training split is a query; its candidates are the
``--candidates`` images those captions' own model ranks first by the geometric score ``s`` (where a denser image
holding the same objects sits), among every image or (``--shortlist`` N) the N its global score ranks first.
Only ``PatchSalience`` (w, b) learns: cross-entropy over the candidates of ``scale · (s + β_fit · cov)``, the
caption's own image the target; a caption whose image is not a candidate is left out. Captions and their images
are the only signal, as for training. The same model, with ``coverage_weight`` β
(``--weight``) and the fitted salience, is written to ``--out`` (never over an existing file). ``train.py`` runs the
same fit after training when its config's ``coverage.weight`` is set. Limits: geometric models only; the
images, their keys and every candidate's m_j are held in memory (2,000 shapes-world images: about 1 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mmgeo.training.config import CoverageConfig


@torch.inference_mode()
def candidate_terms(texts, images, k: int, shortlist: int = 0):
    """Per caption: its top-``k`` images by ``s`` (Q, k), their s (Q, k) and their m_j (Q, k, S). ``shortlist`` > 0:
    ``s`` only over the ``shortlist`` images the global score ranks first for the caption (the served first stage,
    docs/design.md §7), else over every image."""
    from mmgeo.kernels import candidate_scores, pair_score
    from mmgeo.kernels.coverage import candidate_explained

    keys, values = images.attn.transpose(0, 1), images.value.transpose(0, 1)  # (H, N, S, d)
    real = lambda x, r: x[r][:, texts.mask[r]].float()  # noqa: E731  (H, n, d): caption r's real tokens
    if 0 < shortlist < len(images.mask):
        short = (texts.pooled.float() @ images.pooled.float().T).topk(shortlist, dim=1).indices  # (Q, K')
        H = keys.shape[0]
        s_short = torch.stack([candidate_scores(real(texts.attn, r), real(texts.value, r), keys[:, ids].float(),
                                                values[:, ids].float(), images.mask[ids]).mean(0) / H
                               for r, ids in enumerate(short)])  # (Q, K'): mean over tokens and heads, as pair_score
        best = s_short.topk(min(k, shortlist), dim=1)
        indices, scores = short.gather(1, best.indices), best.values  # (Q, k)
    else:
        s = torch.cat([pair_score(texts.attn[i:i + 256], texts.mask[i:i + 256], texts.value[i:i + 256], images.attn,
                                  images.mask, images.value).float() for i in range(0, len(texts), 256)])  # (Q, N)
        scores, indices = s.topk(min(k, s.shape[1]), dim=1)
    explained = torch.stack([candidate_explained(real(texts.attn, r), real(texts.value, r), keys[:, ids],
                                                 values[:, ids], images.mask[ids]) for r, ids in enumerate(indices)])
    return indices, scores, explained


def fit_salience(model, texts, images, owners: torch.Tensor, cfg: CoverageConfig, log=print, terms=None):
    """Fit a ``PatchSalience`` to the encoded ``texts`` / ``images`` (``owners``: each caption's image) -> (the
    salience, a record of the fit). ``terms``: ``candidate_terms(texts, images, cfg.candidates, cfg.shortlist)`` when
    already computed."""
    from mmgeo.kernels.coverage import coverage_ratio
    from mmgeo.layers import PatchSalience

    # clones: tensors made under inference mode cannot enter autograd
    terms = terms if terms is not None else candidate_terms(texts, images, cfg.candidates, cfg.shortlist)
    cand, s, explained = (x.clone() for x in terms)
    hit = cand == owners[:, None]  # (Q, k)
    rows = hit.any(1)  # captions whose own image is a candidate
    cand, s, explained, target = cand[rows], s[rows], explained[rows], hit[rows].float().argmax(1)
    if not len(cand):
        raise ValueError("no caption has its own image among its candidates: nothing to fit")
    salience = PatchSalience(model.cfg.num_heads, model.cfg.d_a)
    keys, mask = images.attn.float().clone(), images.mask.clone()  # (N, H, S, d_a), (N, S)
    scale = float(model.logit_scale_geo.detach().exp().clamp(max=100.0))
    opt = torch.optim.Adam(salience.parameters(), lr=cfg.lr)

    def scores():
        o = salience(keys) * mask  # (N, S)
        return s + cfg.fit_weight * coverage_ratio(explained, o[cand])  # (Q, k)

    first = float((s.argmax(1) == target).float().mean())
    for step in range(cfg.steps):
        loss = F.cross_entropy(scale * scores(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            log(f"step {step}: loss {float(loss.detach()):.4f}")
    with torch.no_grad():
        last = float((scores().argmax(1) == target).float().mean())
    return salience, {"captions": len(texts), "fitted_on": len(cand), "own_first_before": first,
                      "own_first_after_at_fit_weight": last, "final_loss": float(loss.detach())}


def with_coverage(model, salience, weight: float):
    """A copy of ``model`` whose score adds ``weight`` · cov with ``salience``."""
    from mmgeo.models.geo_retriever import GeoRetriever

    out = GeoRetriever(dataclasses.replace(model.cfg, coverage_weight=weight))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("salience.")}
    state.update({f"salience.{k}": v.detach() for k, v in salience.state_dict().items()})
    out.load_state_dict(state)
    return out.eval()


def fit_into(model, dataset, cfg: CoverageConfig, out: Path, log=print) -> dict:
    """Fit ``model``'s coverage on ``dataset`` (its first ``cfg.images`` items) and write the model with it to
    ``out`` (train.py: the run's own model.pt) -> the fit's record."""
    from mmgeo.eval.retrieval import encode_split
    from mmgeo.models.checkpoint import save_model

    split = encode_split(model, [dataset[i] for i in range(min(cfg.images, len(dataset)))])
    salience, record = fit_salience(model, split.texts, split.images, split.text_to_image, cfg, log)
    save_model(with_coverage(model, salience, cfg.weight), out)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="a geometric model (model.pt)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the model with coverage (new file)")
    parser.add_argument("--data", default="synthetic", help="dataset name, as eval.py's --data")
    parser.add_argument("--data-root", default=None, help="flickr30k: its folder, file or HF id")
    parser.add_argument("--split", default="train")
    for f in dataclasses.fields(CoverageConfig):  # the train config's coverage section (weight: 0.05 here)
        default = 0.05 if f.name == "weight" else f.default
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=default)
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"error: {args.out} exists; fit_coverage never overwrites a file: choose another --out", file=sys.stderr)
        return 2
    from mmgeo.data import build_dataset
    from mmgeo.models.checkpoint import load_model

    try:
        model = load_model(args.ckpt)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not model.geometric:
        print("error: coverage needs a geometric model; this one is global-only (score='global')", file=sys.stderr)
        return 2
    try:
        cfg = CoverageConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CoverageConfig)})
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dataset = build_dataset(args.data, args.split, image_size=model.cfg.image_size, size=cfg.images,
                            root=args.data_root)
    record = fit_into(model, dataset, cfg, args.out)
    print(json.dumps({"ckpt": str(args.ckpt), "out": str(args.out), **dataclasses.asdict(cfg), **record}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
