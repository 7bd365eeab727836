"""Benchmark a trained model with CLIP_benchmark's retrieval protocol (docs/design.md §6).

    python eval.py --ckpt runs/synthetic/model.pt --data synthetic --split test --out results.json \
        [--mode exact|two-stage] [--k-prime 100] [--index-type flat|hnsw|ivfpq|auto] [--codec C]
        [--keep-patches N --prune-queries FILE]                     # two-stage over a temporary gallery
    python eval.py --index INDEX_DIR --data synthetic --split test       # a gallery from `python -m serve build`
    python eval.py --db URL --data synthetic --split test      # a gallery from `python -m serve build --db URL`
    python eval.py --model openclip:ViT-B-32/laion2b_s34b_b79k --data flickr30k --data-root data/flickr30k
    python eval.py --ckpt runs/flickr30k_geo/model.pt --data flickr30k --data-root data/flickr30k [--data-format hf]
    python eval.py --ckpt runs/shards/model.pt --data webdataset --shards 'data/val/{00000..00001}.tar' [--limit N]
    python eval.py --ckpt runs/synthetic/model.pt --suite compositional [--limit 200]      # or --suite all
    python eval.py --ckpt M --suite compositional --data sugarcrepe --data-root JSON_DIR --image-root IMG_DIR
    python eval.py --ckpt runs/synthetic/model.pt --suite partial [--index INDEX_DIR] [--partial-queries 300]

--model openclip:ARCH[/TAG] evaluates any open_clip model zero-shot (global score; no TAG = random init).

exact: every (caption, image) pair scored by the model's own score (geometric, or global for a
CLIP-baseline model). two-stage: the search service's own code (mmgeo.search.two_stage): FAISS top-K' on the
global vectors, re-ranked by the geometric score of the stored keys/values — over a temporary gallery of the
split's images (--index-type, flat by default), or over a built gallery (--index DIR: its manifest names the
checkpoint; image i of the gallery must be image i of the split, as `python -m serve build --data` writes it),
or over a gallery in PostgreSQL (--db URL or local:DIR, as `serve run --db`: the same check, the same re-rank).
The service has no image->text search: two-stage image->text ranks are read from the text->image candidates
(JSON "measured" says how each direction was measured).
Prints a table and writes a JSON with "metrics" (R@1/5/10, mean / median rank, both directions),
"counts" (images and captions evaluated; for real data also "skipped", bad samples by reason) and
"diagnostics" (attention entropy, Q/K spectra, head redundancy, logit range on the first 64 images;
mmgeo.eval.diagnostics); --plot draws the recall@K curves.

--suite compositional (or all: next to retrieval) runs the binding suite of docs/design.md §9
(mmgeo.eval.compositional): true caption vs minimally edited caption on the same image, accuracy per edit type,
under "compositional" —
on the shapes world (negatives generated from, and checked against, the scene) or on SugarCREPE.

--suite partial (also in all) asks what people type: queries naming one or two objects of a shapes-world scene,
and relations and counts typed outside the training grammar ("a big blue triangle below a small red square"), each
scored against every image it is true of (P@1, P@5, nDCG@10, mAP; mmgeo.eval.partial), ranked exactly by the
geometric and by the global score, and served (two-stage) over --index or a temporary gallery in two-stage mode;
the split's own full captions are scored the same way, with own@1 (their own image first: R@1) beside P@1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mmgeo.config import CliParser, run_cli
from mmgeo.data import MAX_PIXELS, build_dataset
from mmgeo.eval.diagnostics import diagnose
from mmgeo.eval.metrics import DEFAULT_KS, NonFiniteScores, image_to_text_ranks, retrieval_metrics, text_to_image_ranks
from mmgeo.eval.plots import plot_recall_curves
from mmgeo.eval.retrieval import encode_images, encode_split, exact_scores
from mmgeo.models.checkpoint import load_model
from mmgeo.search.codecs import CODECS
from mmgeo.search.faiss_index import INDEX_TYPES

DIAGNOSTIC_IMAGES = 64  # images (with all their captions) the attention diagnostics look at


def format_table(metrics: dict[str, float], ks=DEFAULT_KS) -> str:
    head = ["direction"] + [f"R@{k}" for k in ks] + ["mean rank", "median rank"]
    rows = [head]
    for direction in ("text_to_image", "image_to_text"):
        rows.append([direction.replace("_", " ")] + [f"{100 * metrics[f'{direction}_R@{k}']:.1f}" for k in ks]
                    + [f"{metrics[f'{direction}_mean_rank']:.1f}", f"{metrics[f'{direction}_median_rank']:.1f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def nonfinite_diagnostics(model, split) -> str:
    """A line for the non-finite scores error: the attention diagnostics of the first images, when computable."""
    if not model.geometric:
        return ""
    keep = split.text_to_image < DIAGNOSTIC_IMAGES
    try:
        report = diagnose(model, split.texts[keep.to(split.texts.pooled.device)], split.images,
                          split.text_to_image[keep], warn=False)
    except Exception as err:  # noqa: BLE001 — the diagnostics of a broken model may fail too; say so
        return f"\nattention diagnostics failed as well: {type(err).__name__}: {err}"
    lg = report["logits"]
    return (f"\nattention diagnostics (first {DIAGNOSTIC_IMAGES} images): logits {lg['min']:.3g} .. {lg['max']:.3g}, "
            f"q std {lg['q_std']:.3g}, k std {lg['k_std']:.3g}"
            + "".join(f"\n  {w}" for w in report["warnings"]))


def evaluate_compositional(args, model) -> dict:
    """The compositional suite with the model's default score: synthetic scene edits or SugarCREPE."""
    from mmgeo.eval.compositional import run_suite, shapes_items, sugarcrepe_items

    start = time.time()
    if args.data == "sugarcrepe":
        if not args.data_root or not args.image_root:
            raise SystemExit("--data sugarcrepe needs --data-root JSON_DIR (the data/ folder of "
                             "github.com/RAIVNLab/sugar-crepe) and --image-root IMG_DIR (COCO val2017 images)")
        try:
            items = sugarcrepe_items(args.data_root, args.image_root, limit=args.limit,
                                     skip_bad=args.skip_bad)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from e
    elif args.data == "synthetic":
        limit = args.suite_limit or args.limit
        world = build_dataset("synthetic", args.split, seed=args.seed, size=limit,
                              image_size=args.image_size or model.cfg.image_size)
        items = shapes_items(world, limit, progress=True)
    else:
        raise SystemExit(f"the compositional suite needs edited captions: --data synthetic (generated from the "
                         f"scene) or --data sugarcrepe, not {args.data!r}")
    built = time.time()
    result = run_suite(model, items)
    result["timing_s"] = {"build": round(built - start, 2), "score": round(time.time() - built, 2)}
    return result


def load_model_and_index(args, device: str):
    """-> (model, its name for the JSON, the ``--index`` gallery or None). With ``--index`` the model is
    ``--ckpt`` or the checkpoint the manifest names, checked against the gallery as the service checks it."""
    index = args.index or args.db
    if args.model:
        if index:
            raise SystemExit("--index needs the checkpoint its gallery was built with (--ckpt, or none: the one "
                             "its manifest names), not --model")
        from mmgeo.models.openclip_adapter import load_openclip

        return load_openclip(args.model, device=device), args.model, None
    if not index:
        return load_model(args.ckpt, device=device), str(args.ckpt), None
    from mmgeo.search.store import Gallery, GalleryError

    try:
        if args.db:
            from mmgeo.search.database import DatabaseError, DbGallery

            try:
                gallery = DbGallery(args.db, ef_search=args.ef_search)
            except DatabaseError as err:
                raise SystemExit(str(err)) from err
        else:
            gallery = Gallery(index)
        ckpt = args.ckpt or gallery.model_record.get("path")
        if not ckpt:
            raise SystemExit(f"index {index} records no checkpoint path; pass --ckpt")
        model = load_model(ckpt, device=device)
        gallery.check_model(model, ckpt)
    except GalleryError as err:
        raise SystemExit(str(err)) from err
    return model, str(ckpt), gallery


def source_flags(args) -> str:
    """The ``serve build`` flags that index the split being evaluated."""
    return f"--shards '{args.shards}'" if args.data == "webdataset" else f"--data {args.data} --split {args.split}"


def evaluate(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    suite = args.suite
    if args.data == "sugarcrepe" and suite != "compositional":
        raise SystemExit("sugarcrepe is a compositional benchmark (caption vs edited caption): "
                         "use --suite compositional")
    model, name, gallery = load_model_and_index(args, device)
    if suite == "compositional":
        return {"dataset": args.data, "split": None if args.data == "sugarcrepe" else args.split,
                "model": name, "score": model.default_mode,
                "task": "compositional", "compositional": evaluate_compositional(args, model)}
    if suite == "partial":
        return evaluate_partial_only(args, model, name, gallery, device)
    mode = args.mode or ("two-stage" if gallery is not None else "exact")
    if mode == "two-stage" and not model.geometric:
        raise SystemExit("two-stage re-ranks with the geometric score, which this model (score='global') lacks; "
                         "use --mode exact")
    image_size = args.image_size or model.cfg.image_size
    limit = args.limit if args.limit is not None or gallery is None else len(gallery)
    dataset = build_dataset(args.data, args.split, seed=args.seed, image_size=image_size, size=limit,
                            root=args.data_root, data_format=args.data_format,
                            max_pixels=args.max_pixels, shards=args.shards)
    if gallery is not None and len(dataset) != len(gallery):
        raise SystemExit(f"index {gallery.root} holds {len(gallery)} images, {args.data} {args.split} (--limit "
                         f"{limit}) has {len(dataset)}: evaluate the split the index was built from, e.g. "
                         f"`python -m serve build {source_flags(args)} --limit N` then --limit N")
    start = time.time()
    split = encode_split(model, dataset, batch_size=args.batch_size)
    encode_s = time.time() - start
    result = {"dataset": args.data, "split": args.split, "model": name,
              "score": model.default_mode, "mode": mode, "task": "retrieval"}
    if mode == "exact":
        t2i = i2t = exact_scores(model, split.texts, split.images, model.default_mode)
        how = f"exact: every (caption, image) pair by the model's {model.default_mode} score"
        result["measured"] = {"text_to_image": how, "image_to_text": how}
    else:
        from mmgeo.eval.two_stage import evaluate_split
        from mmgeo.search.store import GalleryError

        try:  # the service's search code over --index, or over a temporary gallery of the split's images
            sample = None
            if args.keep_patches:  # the sample captions that choose each image's patches
                from mmgeo.search.pruning import read_captions

                sample = model.encode_text(read_captions(args.prune_queries))
            t2i, record = evaluate_split(model, split, args.k_prime, args.index_type or "flat",
                                         gallery, codec=args.codec or "fp16", keep_patches=args.keep_patches,
                                         prune_queries=sample)
        except GalleryError as err:
            where = f"index {gallery.root} was not built from this split: " if gallery is not None else ""
            raise SystemExit(f"{where}{err}") from err
        i2t = t2i  # image->text read from the same text->image candidates (record["measured"])
        result.update(record)
    score_s = time.time() - start - encode_s
    try:
        result["metrics"] = retrieval_metrics(t2i, split.text_to_image, scores_i2t=i2t)
    except NonFiniteScores as err:  # no R@K from NaN / inf scores: exit with the counts and what diagnostics say
        raise SystemExit(f"{err}{nonfinite_diagnostics(model, split)}") from err
    if args.plot:
        ranks = {"text -> image": text_to_image_ranks(t2i, split.text_to_image),
                 "image -> text": image_to_text_ranks(i2t, split.text_to_image)}
        title = f"{args.data} {args.split}: {model.default_mode} score, {mode}"
        result["plot"] = str(plot_recall_curves(ranks, args.plot, title=title))
    result["counts"] = {"images": len(split.images), "captions": len(split.texts)}
    if hasattr(dataset, "skipped"):  # real data: bad samples dropped when the dataset was indexed, by reason
        result["counts"]["skipped"] = dict(dataset.skipped)
    if model.geometric:  # attention diagnostics (docs/design.md §3, §8), first DIAGNOSTIC_IMAGES images + captions
        keep = split.text_to_image < DIAGNOSTIC_IMAGES
        result["diagnostics"] = {"images": min(DIAGNOSTIC_IMAGES, len(split.images)), **diagnose(
            model, split.texts[keep.to(split.texts.pooled.device)], split.images, split.text_to_image[keep])}
    else:
        result["diagnostics"] = {"skipped": "global-only model (score='global'): no attention to diagnose"}
    result["timing_s"] = {"encode": round(encode_s, 2), "score": round(score_s, 2),  # every pair, or two-stage search
                          "metrics_diagnostics": round(time.time() - start - encode_s - score_s, 2)}
    if suite == "all":
        result["task"] = "retrieval+compositional+partial"
        result["compositional"] = evaluate_compositional(args, model)
        result["partial_queries"] = evaluate_partial(args, model, dataset, split.images, gallery, mode)
    return result


def evaluate_partial(args, model, world, images, gallery, mode: str) -> dict:
    """Partial queries (mmgeo.eval.partial): exact rankings, and served two-stage over ``gallery`` (or a temporary
    gallery of the split's images when ``mode`` is two-stage)."""
    if args.data != "synthetic":
        return {"unavailable": "partial queries need the scene graph for their relevant sets: --data synthetic"}
    from mmgeo.eval.partial import evaluate_partial_queries

    run = lambda g: evaluate_partial_queries(model, world, images, n=args.partial_queries, seed=args.seed,  # noqa: E731
                                             gallery=g, k_prime=args.k_prime)
    if gallery is not None or mode != "two-stage":
        return run(gallery)
    import tempfile

    from mmgeo.search.build import build_gallery_from_embedding
    from mmgeo.search.store import Gallery

    with tempfile.TemporaryDirectory(prefix="mmgeo-partial-") as tmp:
        build_gallery_from_embedding(model, images, Path(tmp) / "index", index_type=args.index_type or "flat",
                                     codec=args.codec or "fp16")
        return run(Gallery(Path(tmp) / "index"))


def evaluate_partial_only(args, model, name, gallery, device) -> dict:
    """--suite partial: encode the split's images only, then ``evaluate_partial``."""
    limit = args.limit if args.limit is not None or gallery is None else len(gallery)
    world = build_dataset(args.data, args.split, seed=args.seed, image_size=args.image_size or model.cfg.image_size,
                          size=limit, root=args.data_root, data_format=args.data_format, max_pixels=args.max_pixels,
                          shards=args.shards)
    images = encode_images(model, world, args.batch_size)
    mode = args.mode or ("two-stage" if gallery is not None else "exact")
    return {"dataset": args.data, "split": args.split, "model": name, "score": model.default_mode, "mode": mode,
            "task": "partial", "partial_queries": evaluate_partial(args, model, world, images, gallery, mode)}


def print_partial(record: dict) -> None:
    if "unavailable" in record:
        print(f"\npartial queries: unavailable ({record['unavailable']})")
        return
    from mmgeo.eval.partial import format_table as partial_table

    served = f"; served = two-stage, K'={record['k_prime']}" if record["k_prime"] else ""
    n = record["queries"]
    print(f"\npartial queries: {n} naming one object, {n} naming two, {n} typed objects, {n} typed relations, {n} "
          f"typed counts and {n} of the split's full captions, over {record['images']} images; relevant = every "
          f"image the query is true of; own@1 = the first hit is the image the query was drawn from{served}")
    print(partial_table(record))


def main(argv: list[str] | None = None) -> dict:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="model.pt from train.py (or a Lightning .ckpt of ours)")
    which.add_argument("--model", help="openclip:ARCH[/TAG], e.g. openclip:ViT-B-32/laion2b_s34b_b79k (zero-shot)")
    p.add_argument("--data", default="synthetic",
                   help="dataset: synthetic (embedded shapes world), flickr30k, webdataset (--shards), or sugarcrepe "
                        "(--suite compositional)")
    p.add_argument("--shards", default=None, metavar="PATTERN",
                   help="webdataset: tar shards, brace-expanded (DIR/{00000..00009}.tar; pipe:CMD), read in order "
                        "(the shards are the split; --split is not used)")
    p.add_argument("--data-root", default=None, help="flickr30k: folder, CSV/TSV or HF id (data/README.md); "
                   "sugarcrepe: the folder of its JSON files")
    p.add_argument("--image-root", default=None, help="sugarcrepe: the folder of COCO val2017 images")
    p.add_argument("--skip-bad", action="store_true",
                   help="sugarcrepe: skip and count malformed entries / missing images instead of stopping")
    p.add_argument("--suite", default="retrieval", choices=["retrieval", "compositional", "partial", "all"],
                   help="retrieval: R@K (CLIP_benchmark); compositional: caption vs edited caption per edit "
                        "type (docs/design.md §9); partial: queries naming one or two objects, P@1 / P@5 / "
                        "nDCG@10 / mAP against every image they are true of (synthetic); all: every suite")
    p.add_argument("--partial-queries", type=int, default=300, metavar="N",
                   help="partial suite: N queries of each kind (one object, two objects, typed relation, typed count, "
                        "full caption)")
    p.add_argument("--suite-limit", type=int, default=None,
                   help="compositional suite on the shapes world: only the first N images (default: --limit / all)")
    p.add_argument("--data-format", default=None, choices=["hf", "karpathy", "csv"],
                   help="flickr30k layout (default: detect from --data-root)")
    p.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="flickr30k: skip images with more pixels")
    p.add_argument("--split", default="test", choices=["train", "val", "test", "cogent"],
                   help="cogent: the shapes world's held-out colour-shape combos (synthetic only)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--mode", default=None, choices=["exact", "two-stage"],
                   help="default: exact, or two-stage with --index")
    p.add_argument("--k-prime", type=int, default=100, help="two-stage: candidates re-ranked per query")
    p.add_argument("--index-type", default=None, choices=INDEX_TYPES,
                   help="two-stage: FAISS index of the temporary gallery of the split's images (default flat)")
    p.add_argument("--codec", default=None, choices=list(CODECS),
                   help="two-stage: re-rank store codec of the temporary gallery (default fp16; docs/serve.md)")
    p.add_argument("--keep-patches", type=int, default=None, metavar="N",
                   help="two-stage: the temporary gallery keeps N patches per image, those the --prune-queries "
                        "attend to most (docs/serve.md, patch pruning)")
    p.add_argument("--prune-queries", default=None, metavar="FILE",
                   help="two-stage: sample captions for --keep-patches, one per line (not the evaluated split's)")
    p.add_argument("--index", default=None, help="two-stage over a gallery from `python -m serve build` (built from "
                   "this split, same order); the model is --ckpt or the checkpoint its manifest names")
    p.add_argument("--db", default=None, metavar="URL", help="two-stage over a gallery in PostgreSQL from `python -m "
                   "serve build --db URL` (a postgresql:// URL, or local:DIR: an embedded one), as --index")
    p.add_argument("--ef-search", type=int, default=None, help="with --db: HNSW's candidate list (default 2 x "
                   "--k-prime, within 40..1000)")
    p.add_argument("--seed", type=int, default=0, help="synthetic data seed")
    p.add_argument("--image-size", type=int, default=0, help="synthetic image side (0 = the model's input size)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--plot", default=None, help="write recall@K curves (K = 1..50) to this PNG")
    args = p.parse_args(argv)
    if args.k_prime <= 0:
        p.error(f"--k-prime must be positive, got {args.k_prime}")
    if args.db and args.index:
        p.error("--index DIR and --db URL both name the gallery: give one")
    if args.ef_search is not None and not args.db:
        p.error("--ef-search goes with --db (HNSW in PostgreSQL)")
    if args.db:
        from mmgeo.search.db_connect import parse_db

        try:
            parse_db(args.db)
        except ValueError as err:
            p.error(str(err))
        if args.keep_patches:
            p.error("--keep-patches applies to the temporary gallery; a --db gallery keeps all patches (a database "
                    "build does not prune)")
    if not (args.ckpt or args.model or args.index or args.db):
        p.error("give the model: --ckpt MODEL.pt, --model openclip:ARCH[/TAG], or --index DIR (its checkpoint)")
    if (args.index or args.db) and args.mode == "exact":
        p.error("--index evaluates a built gallery by two-stage search: drop --mode exact (or drop --index)")
    if (args.index or args.db) and args.index_type:
        p.error("--index-type applies to the temporary gallery; an --index gallery has its own type")
    if (args.index or args.db) and args.codec:
        p.error("--codec applies to the temporary gallery; an --index gallery has its own codec")
    if (args.index or args.db) and args.keep_patches:
        p.error("--keep-patches applies to the temporary gallery; an --index gallery keeps what it was built with")
    if (args.keep_patches is None) != (args.prune_queries is None):
        p.error("--keep-patches N and --prune-queries FILE go together: the patches kept are those the sample "
                "captions attend to most")
    for flag, given in (("--index-type", args.index_type), ("--codec", args.codec),
                        ("--keep-patches", args.keep_patches)):
        if given and args.mode != "two-stage":
            p.error(f"{flag} applies to --mode two-stage")
    if args.prune_queries:
        from mmgeo.search.pruning import read_captions

        try:
            read_captions(args.prune_queries)  # refused before any model is loaded
        except (FileNotFoundError, ValueError) as err:
            p.error(str(err))
    if (args.data == "webdataset") != bool(args.shards):
        p.error("--data webdataset and --shards PATTERN go together (the shards are the split)")
    if args.partial_queries <= 0:
        p.error(f"--partial-queries must be positive, got {args.partial_queries}")
    if (args.index or args.db) and args.suite == "compositional":
        p.error("--index is for retrieval (--suite retrieval or all), not the compositional suite")
    result = evaluate(args)
    if "metrics" in result:
        c = result["counts"]
        print(f"\n{result['dataset']} {result['split']}: {c['images']} images, {c['captions']} captions — "
              f"{result['score']} score, {result['mode']} mode")
        if c.get("skipped"):
            print(f"skipped bad samples: {c['skipped']}")
        print(format_table(result["metrics"]))
        t = result["timing_s"]
        print(f"time: encode {t['encode']:.1f} s, {result['mode']} scoring {t['score']:.1f} s, "
              f"metrics + diagnostics {t['metrics_diagnostics']:.1f} s")
        if "first_stage" in result:
            fs, ts = result["first_stage"], result["two_stage"]
            t2i, i2t = fs["text_to_image_first_stage_recall"], fs["image_to_text_first_stage_recall"]
            st = ts["store"]
            print(f"two-stage over {ts['index'] or 'a temporary gallery of the split'} ({ts['index_type']} index, "
                  f"{st['codec']} re-rank store of {st['bytes_per_image']:,} bytes per image, "
                  f"K'={ts['k_prime']}): text->image by the service's search; image->text read from the "
                  "text->image candidates (no image->text search)")
            print(f"first stage (FAISS top-{fs['k_prime']}) recall: text->image {100 * t2i:.1f}, "
                  f"image->text {100 * i2t:.1f}")
    if "compositional" in result:
        from mmgeo.eval.compositional import format_table as compositional_table

        comp = result["compositional"]
        c = comp["counts"]
        print(f"\ncompositional suite, {result['dataset']}: {c['images']} images, {c['captions']} captions — "
              f"{comp['score']} score; accuracy = true caption scored above its edit (chance 50, ties fail)")
        for what in ("skipped", "discarded", "unavailable"):
            if c.get(what):
                print(f"{what}: {c[what]}")
        print(compositional_table(comp))
    if "partial_queries" in result:
        print_partial(result["partial_queries"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"results written to {args.out}")
    return result


if __name__ == "__main__":
    run_cli(main)
