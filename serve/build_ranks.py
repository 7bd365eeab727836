"""``serve build --db URL --workers N`` and ``torchrun -m serve build --db URL``: a database build over several
processes (``mmgeo.search.db_parallel``), each rank rebuilding the model and the image list from the arguments."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def build_rank(rank: int, world: int, settings: dict, items_of: Callable) -> dict | None:
    """One rank of the build ``settings`` (``build``'s arguments) describes, its images ``items_of(args, model)``
    (``serve.cli.image_items``) -> rank 0's summary (JSON-able)."""
    import mmgeo
    from mmgeo.search.database import DEFAULT_CODEC, Database
    from mmgeo.search.db_build import open_or_create, sampler
    from mmgeo.search.db_parallel import build_ranked
    from serve.keys_cli import enter_collection

    args = argparse.Namespace(**settings)
    enter_collection(args)  # --collection: this process's writes go to its rows, as the parent's would
    model = mmgeo.load_model(args.ckpt)
    items, total = items_of(args, model)
    items = list(items)[:total]
    with Database(args.db) as db:
        def create():
            return open_or_create(model, db, args.ckpt, args.codec or DEFAULT_CODEC, args.codec_train_images,
                                  args.replace, sampler(model, items, args.codec_train_images, args.batch_size))

        out = build_ranked(model, items, total, db, rank, world, create, batch_size=args.batch_size,
                           keep_files=args.keep_files, progress=not args.no_progress)
    return None if out is None else {**out, "workers": world, "added": [list(a) for a in out["added"]],
                                     "existing": [list(e) for e in out["existing"]]}


def build_db_ranks(args, items_of: Callable) -> dict | None:
    """Run the build on ``args.workers`` new processes, or as this process's rank when torchrun started it ->
    the summary (None on ranks other than 0). ``items_of``: a module-level function (pickled by name)."""
    from mmgeo.search.db_parallel import join_group, launched_rank, spawn_ranks

    settings = vars(args)
    launched = launched_rank()
    if launched is None:
        return spawn_ranks(build_rank, args.workers, settings, items_of)
    rank, world = launched
    if args.workers not in (1, world):
        raise ValueError(f"--workers {args.workers} under torchrun's {world} processes: leave --workers out, "
                         "torchrun's --nproc_per_node sets them")
    import torch.distributed as dist

    join_group(rank, world)
    try:
        return build_rank(rank, world, settings, items_of)
    finally:
        dist.destroy_process_group()
