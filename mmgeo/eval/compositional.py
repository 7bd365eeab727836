"""Compositional suite: does the model bind attributes to their objects? (docs/design.md §9)

For each item — an image, its true caption, minimally edited negatives by edit type and
meaning-preserving rewrites — the model scores every text against that image only. Reported:

- ``accuracy`` per edit type: share of (image, caption, negative) triples with s(caption) > s(negative)
  (chance 0.5; a tie counts as a failure, as in docs/design.md §6), and the number of triples ``n``;
  ``all_edits`` pools every triple. This is SugarCREPE's text-retrieval accuracy (Hsieh et al., 2023).
- ``consistency`` per rewrite type: share of (image, caption, rewrite, negative) quadruples in which
  the decision is the same for the rewrite as for the caption, [s(c) > s(n)] == [s(r) > s(n)]; a model
  invariant to meaning-preserving rewrites scores 1.0.

Items come from the shapes world (``shapes_items``: negatives generated from, and checked against,
the scene; mmgeo.data.scene_edits) or from SugarCREPE's JSON (``sugarcrepe_items``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from mmgeo.data.edit_items import CompositionalItem, ItemSet
from mmgeo.data.scene_edits import EDIT_TYPES, REWRITE_TYPES, shapes_edit_items
from mmgeo.data.sugarcrepe import SUGARCREPE_TYPES, load_sugarcrepe

__all__ = ["CompositionalItem", "ItemSet", "format_table", "run_suite", "shapes_items", "sugarcrepe_items"]


def shapes_items(dataset, limit: int | None = None, progress: bool = False) -> ItemSet:
    """Suite items for the first ``limit`` images of a ShapesWorld split (mmgeo.data.scene_edits)."""
    return shapes_edit_items(dataset, limit, progress=progress)


def sugarcrepe_items(json_dir, image_dir, limit: int | None = None, skip_bad: bool = False) -> ItemSet:
    """Suite items from SugarCREPE's published JSON files (mmgeo.data.sugarcrepe)."""
    return load_sugarcrepe(json_dir, image_dir, limit=limit, skip_bad=skip_bad)


def _groups(items: Sequence[CompositionalItem]) -> list[list[CompositionalItem]]:
    """Items grouped by image, in order of first appearance."""
    groups: dict[Any, list[CompositionalItem]] = {}
    for item in items:
        groups.setdefault(item.image_key(), []).append(item)
    return list(groups.values())


def _texts(group: list[CompositionalItem]) -> list[str]:
    """Every distinct text of one image's items (captions, negatives, rewrites), in a fixed order."""
    seen: dict[str, None] = {}
    for item in group:
        seen[item.caption] = None
        for texts in (*item.negatives.values(), *item.rewrites.values()):
            seen.update(dict.fromkeys(texts))
    return list(seen)


def _ordered(keys, first: Sequence[str]) -> list[str]:
    return [k for k in first if k in keys] + sorted(k for k in keys if k not in first)


def _rate(hits: int, n: int) -> float | None:
    return hits / n if n else None


@torch.inference_mode()
def run_suite(model, items: Sequence[CompositionalItem], mode: str | None = None, images_per_step: int = 32,
              progress: bool = True) -> dict:
    """Score ``items`` with ``model`` and return the suite's JSON-able result (module docstring).

    Each image is encoded once, its texts in one batch with the other images of the step, and each
    image's texts are scored against that image alone: ``model.score(texts[i:j], images[m:m+1], mode)``
    ((k, 1) scores), never a full N×N matrix. ``mode`` defaults to ``model.default_mode``.
    """
    from tqdm.auto import tqdm

    mode = mode or model.default_mode
    groups = _groups(items)
    if not groups:
        raise ValueError("the compositional suite got no items; check the data source (--limit, --data-root)")
    hits, counts = defaultdict(int), defaultdict(int)  # edit type -> correct triples, triples
    agree, quads = defaultdict(int), defaultdict(int)  # rewrite type -> consistent quadruples, quadruples
    bar = tqdm(total=len(groups), desc=f"compositional ({mode})", unit="img", disable=not progress)
    for start in range(0, len(groups), images_per_step):
        step = groups[start:start + images_per_step]
        images = model.encode_image([g[0].load_image() for g in step])
        texts_per_image = [_texts(g) for g in step]
        text_emb = model.encode_text([t for texts in texts_per_image for t in texts])
        offset = 0
        for m, (group, texts) in enumerate(zip(step, texts_per_image)):
            s = model.score(text_emb[offset:offset + len(texts)], images[m:m + 1], mode)  # (k, 1)
            score = dict(zip(texts, s[:, 0].float().cpu().tolist()))
            offset += len(texts)
            for item in group:
                sc = score[item.caption]
                for edit, negs in item.negatives.items():
                    counts[edit] += len(negs)
                    hits[edit] += sum(sc > score[n] for n in negs)
                for rewrite, rws in item.rewrites.items():
                    for r in rws:
                        for neg in (neg for negs in item.negatives.values() for neg in negs):
                            quads[rewrite] += 1
                            agree[rewrite] += (sc > score[neg]) == (score[r] > score[neg])
            bar.update(1)
    bar.close()
    edits = {k: {"accuracy": _rate(hits[k], counts[k]), "n": counts[k]}
             for k in _ordered(counts, EDIT_TYPES + SUGARCREPE_TYPES)}
    consistency = {k: {"consistency": _rate(agree[k], quads[k]), "n": quads[k]}
                   for k in _ordered(quads, REWRITE_TYPES)}
    consistency["all_rewrites"] = {"consistency": _rate(sum(agree.values()), sum(quads.values())),
                                   "n": sum(quads.values())}
    n_all = sum(counts.values())
    return {"task": "compositional", "score": mode, "edits": edits,
            "all_edits": {"accuracy": _rate(sum(hits.values()), n_all), "n": n_all}, "consistency": consistency,
            "counts": {**getattr(items, "report", {}), "images": len(groups), "captions": len(items)}}


def _markdown(rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"| {r[0]:<{widths[0]}} | {r[1]:>{widths[1]}} | {r[2]:>{widths[2]}} |" for r in rows]
    lines.insert(1, f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 1)}:|{'-' * (widths[2] + 1)}:|")
    return lines


def format_table(result: dict) -> str:
    """Markdown tables of the suite: edit type, n, accuracy (%); then rewrite type, n, consistency (%)."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    rows = [("edit type", "n", "accuracy")]
    rows += [(k, str(v["n"]), pct(v["accuracy"])) for k, v in result["edits"].items()]
    rows.append(("all edits", str(result["all_edits"]["n"]), pct(result["all_edits"]["accuracy"])))
    lines = _markdown(rows)
    cons = [(k, str(v["n"]), pct(v["consistency"])) for k, v in result.get("consistency", {}).items() if v["n"]]
    if cons:
        lines += [""] + _markdown([("rewrite type", "n", "consistency")] + cons)
    return "\n".join(lines)
