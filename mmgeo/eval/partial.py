"""Partial queries: does a query that names one or two objects find an image that holds them? (docs/design.md §9)

Full-caption R@K hides this: every caption of the shapes world names every object, so any part of it identifies
its image. Here each query (``mmgeo.data.shapes_queries``) has a relevant *set* — every image of the split the
query is true of — and a ranking is scored as a search engine is: P@1, P@5, nDCG@10 (binary gains) and mean
average precision, plus what wrong first hits get wrong (size, colour, shape, cell; typed queries also relation
and count). Three kinds are typed as people write them, outside the training grammar: "object" ("a red circle",
no cell, a size half the time), "relation" ("a big blue triangle below a small red square") and "count" ("two
shapes: a big green circle and a small purple square"). The
world's own captions are scored the same way ("full_caption"): one with no count word is as true of an image that
holds its objects and more, which R@1 (one relevant image) counts wrong; "own@1" (the query's own image first)
beside P@1 shows how much of R@1's miss is that.

Rankings come from exact scores over the whole split (geometric or global) or from the service's two-stage
search (``mmgeo.search.two_stage.search_texts``: FAISS top-K' by the global vector, geometric re-rank), where
AP is computed over the K' returned images (relevant images past them count as missed).

Limits: shapes world only (relevance needs the scene graph); ties in a score are broken by image id.
"""

from __future__ import annotations

import numpy as np
import torch

from mmgeo.data.shapes_queries import (
    ATTRIBUTES,
    PartialQuery,
    caption_queries,
    count_queries,
    make_queries,
    object_queries,
    query_images,
    relation_queries,
    wrong_values,
)

QUERY_KINDS = {  # JSON key -> how its queries are drawn (mmgeo.data.shapes_queries)
    "one_object": lambda world, n, seed: make_queries(world, n, 1, seed),  # one object, its cell
    "two_object": lambda world, n, seed: make_queries(world, n, 2, seed),  # two objects, their cells
    "object": object_queries,  # typed: "a red circle", a size half the time, no cell
    "relation": relation_queries,  # typed: "X below Y", no cells
    "count": count_queries,  # typed: "two shapes: X and Y", no cells
    "full_caption": caption_queries,  # the world's own captions
}
METRICS = ("P@1", "P@5", "nDCG@10", "mAP")


def average_precision(ranked: np.ndarray, relevant: np.ndarray) -> float:
    """AP of one ranking (image ids, best first; may be a prefix of the gallery) against the relevant ids."""
    hits = np.isin(ranked, relevant)  # (L,)
    if not hits.any():
        return 0.0
    precision_at_hits = np.cumsum(hits)[hits] / (np.flatnonzero(hits) + 1)
    return float(precision_at_hits.sum() / len(relevant))


def ndcg(ranked: np.ndarray, relevant: np.ndarray, k: int = 10) -> float:
    """nDCG@k with binary gains (Järvelin & Kekäläinen 2002)."""
    discounts = 1.0 / np.log2(np.arange(2, k + 2))  # (k,)
    gains = np.isin(ranked[:k], relevant).astype(float)
    ideal = discounts[:min(k, len(relevant))].sum()
    return float((gains * discounts[:len(gains)]).sum() / ideal)


def ranking_metrics(rankings: list[np.ndarray], relevant: list[np.ndarray]) -> dict[str, float]:
    """Mean P@1, P@5, nDCG@10 and AP over queries; ``rankings[q]`` image ids best first (at least 10)."""
    if any(len(r) == 0 for r in relevant):
        raise ValueError("every partial query needs at least one relevant image")
    p = {k: np.mean([np.isin(r[:k], rel).sum() / k for r, rel in zip(rankings, relevant)]) for k in (1, 5)}
    return {"P@1": float(p[1]), "P@5": float(p[5]),
            "nDCG@10": float(np.mean([ndcg(r, rel) for r, rel in zip(rankings, relevant)])),
            "mAP": float(np.mean([average_precision(r, rel) for r, rel in zip(rankings, relevant)]))}


def first_hit_errors(queries: list[PartialQuery], rankings: list[np.ndarray], relevant: list[np.ndarray],
                     scenes) -> dict:
    """Of the queries whose first hit is wrong: how many, the share whose first hit has each attribute wrong, the
    share wrong in that attribute alone, and the confusions ``"asked -> got"`` per attribute (counts, most first)."""
    wrong = [(q, r[0]) for q, r, rel in zip(queries, rankings, relevant) if r[0] not in rel]
    counts, alone = dict.fromkeys(ATTRIBUTES, 0), dict.fromkeys(ATTRIBUTES, 0)
    confusions: dict[str, dict[str, int]] = {a: {} for a in ATTRIBUTES}
    for q, top in wrong:
        values = wrong_values(q, scenes[int(top)])
        for a, pairs in values.items():
            counts[a] += 1
            alone[a] += len(values) == 1
            for asked, got in pairs:
                label = f"{_show(asked)} -> {_show(got)}"
                confusions[a][label] = confusions[a].get(label, 0) + 1
    share = lambda c: c / len(wrong) if wrong else 0.0  # noqa: E731
    return {"wrong_first_hits": len(wrong), "attribute_wrong": {a: share(c) for a, c in counts.items()},
            "attribute_wrong_alone": {a: share(c) for a, c in alone.items()},
            "confusions": {a: dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) for a, c in confusions.items()}}


def _show(value) -> str:
    """A cell (row, col) as 'r,c'; other attribute values as they are."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def exact_rankings(scores: torch.Tensor, depth: int | None = None) -> list[np.ndarray]:
    """(Q, N) scores -> per query image ids by descending score (stable: ties by image id), ``depth`` long."""
    order = torch.sort(-scores.float(), dim=1, stable=True).indices[:, :depth]  # (Q, depth)
    return list(order.numpy())


def make_query_sets(world, n: int, seed: int = 0,
                    scenes=None) -> dict[str, tuple[list[PartialQuery], list[np.ndarray]]]:
    """For each kind of ``QUERY_KINDS``: ``n`` queries over ``world`` and each one's relevant image ids
    (``scenes``: the world's scenes when already read)."""
    scenes = scenes if scenes is not None else [world.scene(i) for i in range(len(world))]
    out = {}
    for kind, draw in QUERY_KINDS.items():
        queries = draw(world, n, seed)
        out[kind] = (queries, [query_images(q, scenes) for q in queries])
    return out


def relevant_counts(relevant: list[np.ndarray]) -> dict:
    """Relevant images per query: mean, min, the share with more than one, and "tied_own@1": the own@1 of a
    ranking that puts every relevant image first in random order (mean of 1/|relevant|), the most own@1 a model
    can reach without preferring the query's own image over other images the query is as true of."""
    sizes = np.array([len(r) for r in relevant])
    return {"mean": float(sizes.mean()), "min": int(sizes.min()), "more_than_one": float((sizes > 1).mean()),
            "tied_own@1": float((1.0 / sizes).mean())}


def in_first_stage(global_rankings: list[np.ndarray], relevant: list[np.ndarray], k_prime: int) -> float:
    """Share of queries with a relevant image among the global score's exact top ``k_prime``: what a flat first
    stage hands the re-rank, so a served miss of such a query is the re-rank's (or its codes'), the others the
    first stage's."""
    return float(np.mean([np.isin(r[:k_prime], rel).any() for r, rel in zip(global_rankings, relevant)]))


def score_rankings(queries, rankings, relevant, scenes) -> dict:
    """The record of one query set under one ranking: metrics, "own@1" (the share whose first hit is the image the
    query was drawn from: R@1 as full-caption retrieval counts it) and the first-hit error breakdown."""
    own = float(np.mean([r[0] == q.source for q, r in zip(queries, rankings)]))
    return {**ranking_metrics(rankings, relevant), "own@1": own,
            **first_hit_errors(queries, rankings, relevant, scenes)}


@torch.inference_mode()
def evaluate_partial_queries(model, world, images, n: int = 300, seed: int = 0, gallery=None,
                             k_prime: int = 100, batch_size: int = 256) -> dict:
    """Partial queries of ``world`` against its encoded ``images`` (an ``Embedding``, one row per image in the
    world's order): exact geometric and global rankings, and served two-stage over ``gallery`` when given (a
    ``Gallery`` built from the same images, checked) -> JSON record (``format_table`` prints it)."""
    from mmgeo.eval.retrieval import exact_scores
    from mmgeo.search.two_stage import search_texts

    scenes = [world.scene(i) for i in range(len(world))]
    modes = ["geometric", "global"] if model.geometric else ["global"]
    record: dict = {"queries": n, "seed": seed, "images": len(world), "k_prime": k_prime if gallery else None}
    if gallery is not None:
        gallery.check_images(images)
    for kind, (queries, relevant) in make_query_sets(world, n, seed, scenes).items():
        texts = model.encode_text([q.text for q in queries])
        entry = {"relevant_per_query": relevant_counts(relevant)}
        ranked = {mode: exact_rankings(exact_scores(model, texts, images, mode, progress=False)) for mode in modes}
        for mode in modes:
            entry[f"exact_{mode}"] = score_rankings(queries, ranked[mode], relevant, scenes)
        if gallery is not None:
            served = []
            for start in range(0, len(queries), batch_size):
                m = min(batch_size, len(queries) - start)
                served += [ids for ids, _ in search_texts(model, gallery, texts[start:start + m], [k_prime] * m,
                                                          [model.geometric] * m, k_prime)]
            entry["served"] = score_rankings(queries, served, relevant, scenes)
            entry["served"]["relevant_in_first_stage"] = in_first_stage(ranked["global"], relevant, k_prime)
        entry["examples"] = [q.text for q in queries[:3]]
        record[kind] = entry
    return record


def format_table(record: dict) -> str:
    """The partial-query record as a text table: one row per (query kind, ranking)."""
    head = f"{'queries':<14}{'ranking':<18}" + "".join(f"{m:>9}" for m in (*METRICS, "own@1")) + \
        "   wrong first hits: " + " / ".join(ATTRIBUTES)
    lines = [head, "-" * len(head)]
    for kind in QUERY_KINDS:
        entry = record.get(kind)
        for name, r in (entry or {}).items():
            if not isinstance(r, dict) or "P@1" not in r:
                continue
            shares = " / ".join(f"{r['attribute_wrong'][a]:.2f}" for a in ATTRIBUTES)
            lines.append(f"{kind:<14}{name:<18}" + "".join(f"{r[m]:>9.3f}" for m in (*METRICS, "own@1")) +
                         f"   {r['wrong_first_hits']:>4} wrong: {shares}")
    for kind in QUERY_KINDS:  # what the first ranking of each kind confuses most (the JSON has every count)
        name, r = next(((n, r) for n, r in (record.get(kind) or {}).items() if isinstance(r, dict) and "P@1" in r),
                       (None, None))
        top = sorted(((c, f"{a} {label}") for a, cs in (r or {}).get("confusions", {}).items()
                      for label, c in cs.items()), key=lambda x: -x[0])[:4]
        if top:
            lines.append(f"{kind} {name}, most confused: " + ", ".join(f"{t} ({c})" for c, t in top))
    first = {kind: (record.get(kind) or {}).get("served", {}).get("relevant_in_first_stage") for kind in QUERY_KINDS}
    if any(v is not None for v in first.values()):
        lines.append(f"served: a relevant image among the global score's top {record['k_prime']} (the first stage) "
                     "for " + ", ".join(f"{kind} {v:.3f}" for kind, v in first.items() if v is not None))
    full = (record.get("full_caption") or {}).get("relevant_per_query")
    if full:
        lines.append(f"full captions true of more than one image: {100 * full['more_than_one']:.1f} %; own@1 with "
                     f"every true image first, ties at random: {full['tied_own@1']:.3f}")
    return "\n".join(lines)

