"""Whether coverage's β is better learned than set: the salience and β fitted together on whole captions and their
object phrases, against the fit with β set (docs/design.md §9).

    python -m experiments.coverage_weight --ckpt runs/nocov/model.pt [--phrases 1.0 --weight 0.05]

(``runs/nocov``: configs/synthetic.yaml trained with ``--coverage.weight 0 --name nocov``.)

The set fit is ``mmgeo.training.fit_coverage``'s (β ``--weight``, whole captions). The learned fit starts β there and
learns log β with the salience, adding a second loss weighted by ``--phrases``: one object phrase
(``caption_parts.object_phrases``) of each training caption that names two or more is a query whose positives are
every candidate with a caption holding that phrase (case and spacing aside: the caption text only, as training),
scored by multi-positive cross-entropy. Each variant is scored on the test split by the first hit among each query's
10 best images by ``s``: whole captions (their own image), one- and two-object queries, and the four queries of the
typed-query test (relevance by the scene graph, ``mmgeo.data.shapes_queries``). Shapes world only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

TYPED = ("a big purple circle in the top right", "a small red square on the left",
         "a big green triangle in the middle", "a small blue diamond at the bottom")  # tests/serve/test_typed_queries


def phrase_queries(captions: list[list[str]], rng) -> tuple[list[str], list[set[int]]]:
    """One object phrase of each caption that names two or more, and the images (indices of ``captions``, one list
    per image) whose captions hold that phrase."""
    from mmgeo.data.caption_parts import object_phrases

    def norm(phrase: str) -> str:
        return " ".join(phrase.lower().split())

    held: dict[str, set[int]] = {}
    for i, caps in enumerate(captions):
        for caption in caps:
            for phrase in object_phrases(caption):
                held.setdefault(norm(phrase), set()).add(i)
    texts, positives = [], []
    for caps in captions:
        for caption in caps:
            phrases = object_phrases(caption)
            if len(phrases) >= 2:
                phrase = phrases[int(rng.integers(len(phrases)))]
                texts.append(phrase)
                positives.append(held[norm(phrase)])
    return texts, positives


def _terms(texts, images, positives: list[set[int]], k: int, terms=None):
    """candidate_terms (``terms`` when already computed) plus each candidate's relevance (Q, k) bool."""
    import torch

    from mmgeo.training.fit_coverage import candidate_terms

    cand, s, explained = (x.clone() for x in (terms if terms is not None else candidate_terms(texts, images, k)))
    relevant = torch.tensor([[j in p for j in row] for row, p in zip(cand.tolist(), positives)])
    return cand, s, explained, relevant


def _nll(logits, relevant):
    """Multi-positive cross-entropy: -log of the softmax mass on the relevant candidates, mean over queries."""
    return (logits.logsumexp(1) - logits.masked_fill(~relevant, float("-inf")).logsumexp(1)).mean()


def fit_learned(model, split, captions, cfg, phrases: float, seed: int = 0, caption_terms=None):
    """Salience and β fitted on whole captions + ``phrases`` · object phrases -> (salience, β). ``caption_terms``:
    the whole captions' ``candidate_terms`` when already computed."""
    import numpy as np
    import torch

    from mmgeo.kernels.coverage import coverage_ratio
    from mmgeo.layers import PatchSalience

    full = _terms(split.texts, split.images, [{o} for o in split.text_to_image.tolist()], cfg.candidates,
                  caption_terms)
    texts, positives = phrase_queries(captions, np.random.default_rng(seed))
    with torch.inference_mode():
        phrase_texts = model.encode_text(texts)
    part = _terms(phrase_texts, split.images, positives, cfg.candidates)  # clones: outside inference mode
    terms = [(w, [x[t[3].any(1)] for x in t]) for w, t in ((1.0, full), (phrases, part)) if w > 0]
    salience = PatchSalience(model.cfg.num_heads, model.cfg.d_a)
    log_beta = torch.nn.Parameter(torch.tensor(math.log(cfg.weight)))
    keys, mask = split.images.attn.float().clone(), split.images.mask.clone()  # (N, H, S, d_a), (N, S)
    scale = float(model.logit_scale_geo.detach().exp().clamp(max=100.0))
    opt = torch.optim.Adam([*salience.parameters(), log_beta], lr=cfg.lr)
    for _ in range(cfg.steps):
        o = salience(keys) * mask  # (N, S)
        loss = sum(w * _nll(scale * (s + log_beta.exp() * coverage_ratio(m, o[c])), r) for w, (c, s, m, r) in terms)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return salience, float(log_beta.detach().exp())


def first_hits(model, variants: dict, test_images: int | None) -> dict[str, dict[str, float]]:
    """Per variant (name -> (salience or None, β)): the share of right first hits per query kind on the test split."""
    import torch

    with torch.no_grad():
        return _first_hits(model, variants, test_images)


def _first_hits(model, variants: dict, test_images: int | None) -> dict[str, dict[str, float]]:
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.data.shapes_queries import relevant_images
    from mmgeo.eval.partial import make_query_sets
    from mmgeo.eval.retrieval import encode_split
    from mmgeo.kernels.coverage import coverage_ratio

    world = ShapesWorld("test", image_size=model.cfg.image_size, size=test_images)
    scenes = [world.scene(i) for i in range(len(world))]
    split = encode_split(model, [world[i] for i in range(len(world))], progress=False)
    sets = make_query_sets(world, 300, 0, scenes)
    kinds = {"full_caption_R@1": (split.texts, [{o} for o in split.text_to_image.tolist()]),
             "typed": (model.encode_text(list(TYPED)), [set(relevant_images(t, scenes).tolist()) for t in TYPED])}
    for kind in ("one_object", "two_object"):
        queries, relevant = sets[kind]
        kinds[kind] = (model.encode_text([q.text for q in queries]), [set(r.tolist()) for r in relevant])
    terms = {kind: _terms(texts, split.images, positives, 10) for kind, (texts, positives) in kinds.items()}
    keys, mask = split.images.attn.float(), split.images.mask
    out = {}
    for name, (salience, beta) in variants.items():
        o = None if salience is None else salience(keys) * mask  # (N, S)
        score = {kind: s if o is None else s + beta * coverage_ratio(m, o[c]) for kind, (c, s, m, _) in terms.items()}
        out[name] = {"beta": beta, **{kind: float(r.gather(1, score[kind].argmax(1, keepdim=True)).float().mean())
                                      for kind, (*_, r) in terms.items()}}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, nargs="+", required=True, help="partial-recipe models (model.pt)")
    parser.add_argument("--weight", type=float, default=0.05, help="β of the set fit, and where the learned one starts")
    parser.add_argument("--phrases", type=float, default=1.0, help="weight of the object-phrase loss (learned fit)")
    parser.add_argument("--images", type=int, default=2000, help="the first N training images fit both")
    parser.add_argument("--steps", type=int, default=300, help="full-batch Adam steps of each fit")
    parser.add_argument("--test-images", type=int, default=None, help="the test split's first N images (all)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    import torch

    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.eval.retrieval import encode_split
    from mmgeo.models.checkpoint import load_model
    from mmgeo.training.config import CoverageConfig
    from mmgeo.training.fit_coverage import candidate_terms, fit_salience

    cfg = CoverageConfig(weight=args.weight, fit_weight=args.weight, images=args.images, steps=args.steps)
    rows = []
    for ckpt in args.ckpt:
        torch.manual_seed(0)
        model = load_model(ckpt).eval()
        world = ShapesWorld("train", image_size=model.cfg.image_size, size=args.images)
        items = [world[i] for i in range(len(world))]
        with torch.inference_mode():
            split = encode_split(model, items, progress=False)
        terms = candidate_terms(split.texts, split.images, cfg.candidates)  # both fits' whole-caption candidates
        set_salience, _ = fit_salience(model, split.texts, split.images, split.text_to_image, cfg,
                                       log=lambda _: None, terms=terms)
        salience, beta = fit_learned(model, split, [caps for _, caps in items], cfg, args.phrases,
                                     caption_terms=terms)
        variants = {"no coverage": (None, 0.0), "fit, β set": (set_salience, args.weight),
                    "fit with phrases, β learned": (salience, beta),
                    "the same salience, β set": (salience, args.weight)}
        for name, r in first_hits(model, variants, args.test_images).items():
            rows.append({"ckpt": str(ckpt), "variant": name, **r})
    print("\n| model | variant | β | whole captions R@1 | one-object P@1 | two-object P@1 | typed queries right |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ckpt']} | {r['variant']} | {r['beta']:.3f} | {100 * r['full_caption_R@1']:.1f} | "
              f"{100 * r['one_object']:.1f} | {100 * r['two_object']:.1f} | {round(4 * r['typed'])} / 4 |")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "fit": dataclasses.asdict(cfg), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
