"""Command line: ``build`` an index from a checkpoint and images, ``run`` the HTTP service over one; with ``--db``
the gallery lives in PostgreSQL + pgvector (``mmgeo.search.database``), where ``add`` and ``remove`` change it live."""

from __future__ import annotations

import argparse
import signal
import sys

from mmgeo.config import CliParser, call_cli
from mmgeo.search.codecs import CODECS, TRAIN_IMAGES
from mmgeo.search.database import DEFAULT_CODEC, display_url
from mmgeo.search.db_connect import COLLECTION
from mmgeo.search.faiss_index import INDEX_TYPES
from serve.keys_cli import (
    add_collection_option,
    add_keys_parser,
    add_run_options,
    app_keys,
    auth_settings,
    enter_collection,
    keys_command,
)

DB_HELP = ("a PostgreSQL database with pgvector: a postgresql:// URL, or local:DIR to start an embedded one whose "
           "data folder is DIR (the pgserver wheel: pip install -e '.[db]')")


def parse(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python -m serve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode images into an index directory (atomic: temp dir, then rename)")
    b.add_argument("--ckpt", required=True, help="model checkpoint (model.pt from train.py)")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="folder of image files (searched recursively)")
    src.add_argument("--data", choices=["synthetic"], help="embedded dataset (images are copied into the index)")
    src.add_argument("--shards", metavar="PATTERN", help="WebDataset tar shards, brace-expanded (DIR/{00000..00009}"
                     ".tar; pipe:CMD), read in order as eval.py --data webdataset reads them (images copied in)")
    b.add_argument("--split", default="test", help="split of --data")
    b.add_argument("--limit", type=int, default=None, help="index at most this many images")
    b.add_argument("--seed", type=int, default=0, help="seed of --data synthetic")
    where = b.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="index directory to write: new, empty or an index (replaced "
                       "atomically when complete); refused if it holds anything else or overlaps --images")
    where.add_argument("--db", metavar="URL", help=DB_HELP + "; a gallery of the same model and codec there is "
                       "completed (images already stored are skipped), another is refused unless --replace")
    b.add_argument("--index-type", default="auto", choices=INDEX_TYPES,
                   help="FAISS index: auto = flat below 10k images, HNSW below 1M, IVF-PQ above (per shard if sharded)")
    b.add_argument("--shard-size", type=int, default=100_000,
                   help="over this many images the global index is written as memory-mapped shards of this size, "
                        "searched shard by shard and merged (docs/serve.md)")
    b.add_argument("--codec", default=None, choices=list(CODECS),
                   help="how each image's keys/values (the re-rank store) are kept (default: fp16 in a folder, "
                        f"{DEFAULT_CODEC} in a database): "
                        + "; ".join(f"{c.name}: {c.help}" for c in CODECS.values())
                        + " (docs/serve.md compares them)")
    b.add_argument("--codec-train-images", type=int, default=TRAIN_IMAGES,
                   help="images (evenly spaced) whose keys/values train the codec's quantizers")
    b.add_argument("--keep-patches", type=int, default=None, metavar="N",
                   help="store only N patches per image, those the --prune-queries attend to most (docs/serve.md: "
                        "half the patches cost about half a point of R@1 on the synthetic test split)")
    b.add_argument("--prune-queries", default=None, metavar="FILE",
                   help="text file of sample captions, one per line, like the queries the service will get")
    b.add_argument("--replace", action="store_true", help="with --db: replace a gallery of another model or codec")
    b.add_argument("--keep-files", action="store_true", help="with --db: keep every image file in the database too "
                   "(service replicas on other machines can serve them)")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--workers", type=int, default=1, metavar="N",
                   help="with --db: encode on N processes (a gloo process group, as DDP training), each its share "
                        "of the batches, staged by COPY; the rows are those one process stores (torchrun "
                        "--nproc_per_node N -m serve build ... starts them instead)")
    b.add_argument("--no-progress", action="store_true")
    a = sub.add_parser("add", help="add images to a database gallery (each batch one transaction; images already "
                       "stored, by content SHA-256, are skipped)")
    a.add_argument("--db", required=True, metavar="URL", help=DB_HELP)
    a.add_argument("--images", required=True, help="folder of image files (searched recursively)")
    a.add_argument("--ckpt", default=None, help="checkpoint (default: the one recorded in the gallery)")
    a.add_argument("--keep-files", action="store_true", help="keep the image files in the database too")
    a.add_argument("--batch-size", type=int, default=64)
    a.add_argument("--no-progress", action="store_true")
    d = sub.add_parser("remove", help="remove images from a database gallery by id (one transaction)")
    d.add_argument("--db", required=True, metavar="URL", help=DB_HELP)
    d.add_argument("--ids", required=True, nargs="+", metavar="ID", help="image ids (non-negative integers)")
    x = sub.add_parser("index", help="rebuild a database's index over global vectors (HNSW or IVFFlat) over the "
                       "rows it holds, in place of the current one; searches go on meanwhile, writes wait")
    x.add_argument("--db", required=True, metavar="URL", help=DB_HELP)
    x.add_argument("--kind", required=True, choices=["hnsw", "ivfflat"], help="hnsw: the default a gallery is built "
                   "with; ivfflat: higher recall for captions at a million images and more (docs/serve.md)")
    x.add_argument("--lists", type=int, default=None, help="ivfflat: k-means lists (rows / 125: the "
                   "best of 1,000 / 4,000 / 8,000 at 1M rows, with --work-mem 13GB; docs/serve.md)")
    x.add_argument("--m", type=int, default=16, help="hnsw: links per node (pgvector's default 16)")
    x.add_argument("--ef-construction", type=int, default=64, help="hnsw: candidate list of the build (default 64)")
    x.add_argument("--half", action="store_true", help="index the vectors at half precision (halfvec): half the "
                   "index to read a caption; the first stage fetches 20%% more and keeps the best by the full vectors")
    x.add_argument("--work-mem", default="2GB", help="maintenance_work_mem of the build (default 2GB)")
    x.add_argument("--collection", dest="db_collection", default=None, metavar="NAME", help="a collection whose "
                   "gallery to check and count (the index is the table's: it serves every collection)")
    for c in (b, a, d):
        add_collection_option(c)
    r = sub.add_parser("run", help="serve an index over HTTP")
    gallery = r.add_mutually_exclusive_group(required=True)
    gallery.add_argument("--index", help="index directory from `build`")
    gallery.add_argument("--db", metavar="URL", help=DB_HELP + " holding a gallery from `build --db`")
    r.add_argument("--db-read", metavar="URL", default=None, help="with --db: read (search, images, health) "
                   "through this URL instead, e.g. a streaming standby, or a libpq multi-host URL with "
                   "target_session_attrs=prefer-standby; writes and --allow-writes go to --db (docs/serve.md)")
    r.add_argument("--allow-writes", action="store_true", help="with --db: POST /images and DELETE /images/{id} "
                   "change the gallery (with --db-keys: write keys only; without keys, anyone who reaches it)")
    r.add_argument("--ef-search", type=int, default=None, help="with --db: HNSW's candidate list (default 2 x "
                   "--k-prime, within 40..1000)")
    r.add_argument("--db-parallel", type=int, default=None, metavar="N", help="with --db: captions of a "
                   "micro-batch searched at once, each on its own connection, each re-ranked as its rows arrive "
                   "(default 2: the database works on as many cores)")
    r.add_argument("--probes", type=int, default=None, metavar="P", help="with --db over an IVFFlat index (`serve "
                   "index --kind ivfflat`): lists scanned per caption (default: the square root of its lists)")
    add_run_options(r, gallery)
    r.add_argument("--ckpt", default=None, help="checkpoint (default: the one recorded in the index)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on; a network one needs keys or --no-auth")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--k-prime", type=int, default=100, help="first-stage candidates re-ranked geometrically")
    r.add_argument("--torch-threads", type=int, default=1, help="torch / FAISS threads (1 = steady latency)")
    r.add_argument("--batch-wait-ms", type=float, default=None, help="how long a micro-batch waits for more "
                   "queries after its first (default: Limits.batch_wait_ms)")
    r.add_argument("--batch-workers", type=int, default=None, help="micro-batches in flight at once "
                   "(default: Limits.batch_workers)")
    r.add_argument("--batch-size", type=int, default=None, help="most queries in one micro-batch "
                   "(default: Limits.batch_size)")
    r.add_argument("--workers", type=int, default=1, help="server processes behind the port (uvicorn workers; each "
                   "loads the model and index, the keys/values files are memory-mapped and shared)")
    add_keys_parser(sub)
    return p.parse_args(argv)


def positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def build_db(args) -> int:
    """``build --db``: a gallery in PostgreSQL (created, or completed when it holds one of this model and codec)."""
    import mmgeo
    from mmgeo.search.database import Database, parse_db
    from mmgeo.search.db_build import build_db_gallery

    parse_db(args.db)
    if args.keep_patches is not None or args.prune_queries is not None:
        raise ValueError("--keep-patches is not available with --db yet: build the gallery with all patches")
    positive("--batch-size", args.batch_size)
    positive("--workers", args.workers)
    from mmgeo.search.db_parallel import launched_rank

    if args.workers > 1 or launched_rank():
        return build_db_ranks(args)
    model = mmgeo.load_model(args.ckpt)
    items, total = image_items(args, model)
    if total == 0:
        print(f"error: no image files found in {args.images}", file=sys.stderr)
        return 2
    with Database(args.db) as db:
        out = build_db_gallery(model, items, total, db, ckpt=args.ckpt, codec=args.codec or DEFAULT_CODEC,
                               train_images=args.codec_train_images, batch_size=args.batch_size,
                               progress=not args.no_progress, replace=args.replace, keep_files=args.keep_files)
        store = out["manifest"]["store"]
        print(f"added {len(out['added'])} image(s) to the gallery in {db.display} (pgvector HNSW; re-rank store "
              f"{store['codec']}: {store['bytes_per_image']:,} bytes per image + {store['codebook_bytes']:,} of "
              f"codebooks); {len(out['existing'])} already there; {out['count']} in all; skipped "
              f"{len(out['skipped'])} unreadable file(s)")
    for s in out["skipped"][:10]:
        print(f"  skipped {s['path']}: {s['error']}")
    return 0


def build_db_ranks(args) -> int:
    """``build --db --workers N`` (or under torchrun): the build on several processes; rank 0 reports."""
    from serve.build_ranks import build_db_ranks as run_ranks

    out = run_ranks(args, image_items)
    if out is not None:
        store = out["manifest"]["store"]
        print(f"added {len(out['added'])} image(s) to the gallery in {display_url(args.db)} on "
              f"{out['workers']} process(es) (re-rank store {store['codec']}); {len(out['existing'])} already "
              f"there; {out['count']} in all; skipped {len(out['skipped'])} unreadable file(s)")
        for s in out["skipped"][:10]:
            print(f"  skipped {s['path']}: {s['error']}")
    return 0


def image_items(args, model):
    """(items, total) of ``--images``, ``--data`` or ``--shards`` (limited by ``--limit``): ``(path, loader)``
    pairs."""
    from mmgeo.search.build import folder_items

    if args.images:
        items, total = folder_items(args.images)
    else:
        from mmgeo.data import build_dataset

        if args.shards:  # bad samples are skipped (and counted, one log line) as eval.py skips them
            ds = build_dataset("webdataset", args.split, shards=args.shards, size=args.limit)
        else:
            ds = build_dataset(args.data, args.split, seed=args.seed, image_size=model.cfg.image_size)
        total = len(ds)
        items = [(None, (lambda i=i: ds[i][0])) for i in range(total)]
    if args.limit is not None:
        total = min(total, args.limit)
    return items, total


def add(args) -> int:
    """``add --db URL --images DIR``: encode the folder's images into the gallery, skipping those it holds."""
    import mmgeo
    from mmgeo.search.build import folder_items
    from mmgeo.search.database import DbGallery
    from mmgeo.search.db_build import add_items

    positive("--batch-size", args.batch_size)
    items, total = folder_items(args.images)
    if total == 0:
        print(f"error: no image files found in {args.images}", file=sys.stderr)
        return 2
    with DbGallery(args.db) as gallery:
        ckpt = args.ckpt or gallery.model_record.get("path")
        if not ckpt:
            raise ValueError(f"the gallery in {gallery.root} records no checkpoint path; pass --ckpt")
        model = mmgeo.load_model(ckpt)
        gallery.check_model(model, ckpt)
        out = add_items(model, gallery, items, total, args.batch_size, not args.no_progress, args.keep_files)
    print(f"added {len(out['added'])} image(s), {len(out['existing'])} already there, skipped "
          f"{len(out['skipped'])} unreadable file(s); {out['count']} in the gallery")
    for path, i in out["added"][:20]:
        print(f"  {i}\t{path}")
    for s in out["skipped"][:10]:
        print(f"  skipped {s['path']}: {s['error']}")
    return 0


def remove(args) -> int:
    """``remove --db URL --ids ...``: delete those images (one transaction); unknown ids are reported."""
    from mmgeo.search.database import DbGallery, parse_ids, remove_images

    ids = parse_ids(args.ids)
    with DbGallery(args.db) as gallery:
        gone = remove_images(gallery.db, ids)
        count = gallery.count
    missing = sorted(set(ids) - set(gone))
    print(f"removed {len(gone)} image(s); {count} in the gallery"
          + (f"; not in the gallery: {' '.join(map(str, missing[:50]))}" if missing else ""))
    return 0


def index(args) -> int:
    """``index --db URL --kind hnsw|ivfflat``: build that index over the stored rows and swap it in."""
    from mmgeo.search.database import DbGallery
    from mmgeo.search.db_index import build_index, check_params, default_probes

    check_params(args.kind, args.lists, args.m, args.ef_construction)
    with DbGallery(args.db) as gallery:  # a gallery must be there (and of a schema this mmgeo reads)
        count, was = gallery.count, gallery.manifest["index_type"].removeprefix("pgvector-")
        half_dims = gallery.model_record["d_global"] if args.half else None
        seconds = build_index(gallery.db, args.kind, args.lists, args.m, args.ef_construction, args.work_mem,
                              half_dims)
    how = f"{args.lists} lists; `serve run` scans {default_probes(args.lists)} by default (--probes)" \
        if args.kind == "ivfflat" else f"m {args.m}, ef_construction {args.ef_construction}"
    print(f"built the {args.kind}{'-halfvec' if args.half else ''} index over {count:,} images in {seconds:.0f} s "
          f"({how}), in place of {was}; restart the services that read this database")
    return 0


def build(args) -> int:
    import mmgeo
    from mmgeo.search.build import build_gallery, check_out
    from mmgeo.search.pruning import read_captions

    if args.db:
        return build_db(args)
    if args.workers != 1:
        raise ValueError("--workers goes with --db (a folder build runs in one process)")
    if args.replace or args.keep_files:
        raise ValueError("--replace and --keep-files go with --db (a folder build always replaces the index)")
    args.codec = args.codec or "fp16"
    if args.shard_size < 1:
        raise ValueError(f"--shard-size must be at least 1, got {args.shard_size}")
    check_out(args.out, args.images)  # before loading the model; build_gallery checks again
    captions = read_captions(args.prune_queries) if args.prune_queries else None
    if (args.keep_patches is None) != (captions is None):
        raise ValueError("--keep-patches N and --prune-queries FILE go together: the patches kept are those the "
                         "sample captions attend to most")
    model = mmgeo.load_model(args.ckpt)
    queries = model.encode_text(captions) if captions else None
    items, total = image_items(args, model)
    if total == 0:
        print(f"error: no image files found in {args.images}", file=sys.stderr)
        return 2
    man = build_gallery(model, items, total, args.out, ckpt=args.ckpt, index_type=args.index_type,
                        batch_size=args.batch_size, progress=not args.no_progress, shard_size=args.shard_size,
                        codec=args.codec, train_images=args.codec_train_images, keep_patches=args.keep_patches,
                        prune_queries=queries)
    shards = f", {man['shards']['count']} shards" if "shards" in man else ""
    store = man["store"]
    print(f"indexed {man['count']} image(s) into {args.out} ({man['index_type']}{shards}; re-rank store "
          f"{store['codec']}: {store['bytes_per_image']:,} bytes per image + {store['codebook_bytes']:,} of "
          f"codebooks); skipped {man['skipped']['count']} unreadable file(s)")
    for s in man["skipped"]["files"][:10]:
        print(f"  skipped {s['path']}: {s['error']}")
    if store.get("patches"):
        p = store["patches"]
        print(f"  pruned: {p['kept']} of {p['of']} patches per image kept, by the {p['criterion']} of "
              f"{p['queries']} sample caption(s)")
    return 0


SETTINGS_ENV = "MMGEO_SERVE_SETTINGS"


def _app(settings: dict):
    """The app of one server process, from the ``run`` settings (threads set first; what is loaded is then moved
    out of the garbage collector's reach, ``gc.freeze``)."""
    import gc

    import faiss
    import torch

    from serve.app import DB_PARALLEL, Limits, create_app

    torch.set_num_threads(settings["torch_threads"])
    faiss.omp_set_num_threads(settings["torch_threads"])
    given = {k: settings[k] for k in ("batch_wait_ms", "batch_workers", "batch_size") if settings[k] is not None}
    given["allow_writes"] = bool(settings.get("allow_writes"))
    app = create_app(settings["index"], ckpt=settings["ckpt"], limits=Limits(k_prime=settings["k_prime"], **given),
                     db=settings.get("db"), ef_search=settings.get("ef_search"), db_read=settings.get("db_read"),
                     collections=settings.get("collections"), keys=app_keys(settings),
                     auth=settings.get("auth", "none"), db_probes=settings.get("db_probes"),
                     db_parallel=settings.get("db_parallel") or DB_PARALLEL)
    # what torch, transformers, FastAPI and the model allocated is left out of every later collection, whose full
    # passes over it stalled all requests in flight (docs/serve.md, "Tail latency")
    gc.collect()
    gc.freeze()
    return app


def run_settings(args) -> dict:
    """What ``_app`` needs of ``run``'s arguments (JSON-able: passed to worker processes in ``SETTINGS_ENV``)."""
    if args.db_read and not args.db:
        raise ValueError("--db-read URL goes with --db URL (reads through one, writes through the other)")
    for name in ("db_parallel", "probes"):
        if getattr(args, name) is not None:
            positive(f"--{name.replace('_', '-')}", getattr(args, name))
    keep = ("index", "db", "db_read", "ef_search", "db_parallel", "allow_writes", "ckpt", "k_prime", "batch_wait_ms",
            "batch_workers", "batch_size", "torch_threads")
    return {"db_probes": args.probes, **{k: getattr(args, k) for k in keep}, **auth_settings(args)}


def app_from_env():
    """uvicorn factory for ``--workers`` > 1: each worker process builds its app from the settings env var."""
    import json
    import os

    return _app(json.loads(os.environ[SETTINGS_ENV]))


def run(args) -> int:
    import json
    import os

    import uvicorn

    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.db and args.db.startswith("local:"):
        # uvicorn re-raises SIGTERM once it has shut down: exit through SystemExit instead, so that the embedded
        # PostgreSQL this process started is stopped (at exit) rather than left running
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    settings = run_settings(args)
    app = _app(settings)  # in this process too: a bad index or checkpoint fails here, with its message
    if args.workers == 1:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        return 0
    os.environ[SETTINGS_ENV] = json.dumps(settings)
    uvicorn.run("serve.cli:app_from_env", factory=True, workers=args.workers, host=args.host, port=args.port,
                log_level="warning")
    return 0


def command(argv: list[str]) -> int:
    args = parse(argv)
    token = enter_collection(args)
    try:
        return {"build": build, "add": add, "remove": remove, "index": index, "run": run,
                "keys": keys_command}[args.command](args)
    finally:
        if token is not None:
            COLLECTION.reset(token)


def main(argv=None) -> int:
    """The exit status of the command line ``argv``: a user's mistake is one line ``error: ...`` on stderr and
    status 2 (``mmgeo.config.call_cli``; ``--debug`` or MMGEO_DEBUG=1 shows the traceback)."""
    return call_cli(command, argv)
