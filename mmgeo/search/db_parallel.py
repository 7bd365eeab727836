"""A database build over several processes (docs/design.md §11): the ranks of one ``torch.distributed`` group (gloo,
as DDP training uses; started by ``spawn_ranks`` for ``serve build --workers N``, or by torchrun) each encode their
share of the images and COPY them into the staging table ``mmgeo_build_rows``; rank 0 then moves the staged rows
into ``mmgeo_images`` in the images' order, so N processes store the same rows, ids included, as one.

- rank 0 first creates the gallery (or opens the one of this model and codec: ``db_build.open_or_create``) while
  holding ``BUILD_LOCK`` for the whole build (one build of several processes at a time per database)
- batch b (images b·B .. b·B + B - 1) is rank b mod N's; a batch is encoded as one process would encode it, and
  staged in one transaction (``stage_rows``) keyed by each image's position; an image stored already, or staged
  already with the same content SHA-256 by an earlier run of the build, is not encoded again
- ``merge_staged``: ``MERGE_ROWS`` positions per transaction, inserting what is not stored (by content SHA-256, in
  position order, ids from the gallery's sequence), adding to ``image_count`` and deleting those staged rows

Killed anywhere and run again, a build finishes: a staged batch and a merged chunk are each all or nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from mmgeo.search.database import DbGallery
from mmgeo.search.db_connect import crash_point
from mmgeo.search.db_rows import Rows, _gallery_row, stored_hashes, update_manifest, vector_text

BUILD_LOCK = 0x6D6D67656F01  # pg_advisory_lock key held by rank 0 through a build of several processes
MERGE_ROWS = 1024  # staged positions moved into mmgeo_images per transaction
TIMEOUT = timedelta(hours=12)  # how long a rank waits for the others (a barrier) before giving up

STAGE_COPY = ("COPY mmgeo_build_rows (ord, content_sha256, meta, embedding, key_codes, value_codes, mask, patches, "
              "file) FROM STDIN")
MERGE = """INSERT INTO mmgeo_images (id, content_sha256, meta, embedding, key_codes, value_codes, mask, patches, file)
    SELECT nextval('mmgeo_image_ids'), s.content_sha256, s.meta, s.embedding, s.key_codes, s.value_codes, s.mask,
           s.patches, s.file
    FROM (SELECT DISTINCT ON (n.content_sha256) n.* FROM mmgeo_build_rows n
          WHERE n.ord >= %s AND n.ord < %s
            AND NOT EXISTS (SELECT 1 FROM mmgeo_images i WHERE i.content_sha256 = n.content_sha256)
          ORDER BY n.content_sha256, n.ord) s
    ORDER BY s.ord
    ON CONFLICT DO NOTHING
    RETURNING content_sha256"""


def staged(db, ords: Sequence[int]) -> dict[int, bytes]:
    """position -> content SHA-256 of the staged rows at these positions."""
    if not ords:
        return {}
    with db.connection() as conn:
        got = conn.execute("SELECT ord, content_sha256 FROM mmgeo_build_rows WHERE ord = ANY(%s::integer[])",
                           [list(ords)]).fetchall()
    return {int(o): bytes(h) for o, h in got}


def stage_rows(db, ords: Sequence[int], rows: Rows, rank: int = 0) -> None:
    """Stage encoded images at these positions in one transaction (replacing what an earlier run left there)."""
    with db.connection() as conn, conn.transaction():
        conn.execute("DELETE FROM mmgeo_build_rows WHERE ord = ANY(%s::integer[])", [list(ords)])
        with conn.cursor().copy(STAGE_COPY) as copy:
            for i, o in enumerate(ords):
                if i == len(ords) // 2:
                    crash_point("stage.copy-half", rank)
                copy.write_row((o, rows.sha256[i], json.dumps(rows.meta[i]), vector_text(rows.pooled[i]),
                                rows.key_codes[i], rows.value_codes[i], rows.mask[i], rows.patches[i], rows.files[i]))
        crash_point("stage.commit", rank)


def merge_staged(db, end: int, chunk: int = MERGE_ROWS) -> set[bytes]:
    """Move the staged rows of positions 0..end-1 into the gallery in position order, ``chunk`` positions per
    transaction -> the content hashes stored now."""
    added: set[bytes] = set()
    with db.connection() as conn:
        for a in range(0, end, chunk):
            with conn.transaction():
                _gallery_row(conn, lock=True)  # as add_rows: one inserter at a time, ids in order, an exact count
                new = [bytes(r[0]) for r in conn.execute(MERGE, [a, a + chunk]).fetchall()]
                conn.execute("UPDATE mmgeo_gallery SET image_count = image_count + %s WHERE id = 1", [len(new)])
                conn.execute("DELETE FROM mmgeo_build_rows WHERE ord >= %s AND ord < %s", [a, a + chunk])
                crash_point("merge.commit", 0)
            added |= set(new)
            crash_point("merge.between", 0)
    return added


def rank_batches(total: int, batch_size: int, rank: int, world: int) -> list[range]:
    """The positions of each batch this rank encodes: batch b is rank b mod world's."""
    return [range(a, min(a + batch_size, total)) for a in range(rank * batch_size, total, world * batch_size)]


def build_ranked(model, items: Sequence, total: int, db, rank: int, world: int, create: Callable[[], DbGallery],
                 batch_size: int = 64, keep_files: bool = False, progress: bool = False) -> dict | None:
    """This rank's part of a build of ``items[:total]`` over the process group (``torch.distributed``, initialised).
    ``create()`` (rank 0 only) opens or creates the gallery. -> on rank 0 ``db_build.build_db_gallery``'s summary,
    elsewhere None."""
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from mmgeo.search.db_build import _ids_of, encode_codes, read_item

    lock = None
    try:
        if rank == 0:
            lock = take_build_lock(db)
            gallery = create()
            with db.connection() as conn:  # positions an earlier, longer list left staged
                conn.execute("DELETE FROM mmgeo_build_rows WHERE ord >= %s", [total])
        dist.barrier()
        if rank != 0:
            gallery = DbGallery(db)
        gallery.check_model(model)
        records, skipped = [], []  # (position, path, content SHA-256); unreadable files
        batches = rank_batches(total, batch_size, rank, world)
        bar = tqdm(total=sum(len(b) for b in batches), desc=f"encode (rank {rank})", unit="img",
                   disable=not progress or rank != 0)
        for positions in batches:
            batch = []
            for o in positions:
                path, source = items[o]
                try:
                    sha, meta, im, data = read_item(path, source, keep_files)
                except Exception as err:  # noqa: BLE001 - any unreadable file is skipped and counted
                    skipped.append((o, {"path": str(path), "error": f"{type(err).__name__}: {err}"}))
                    continue
                records.append((o, None if path is None else str(path), sha))
                batch.append((o, sha, meta, im, data))
            have, done = stored_hashes(db, [b[1] for b in batch]), staged(db, [b[0] for b in batch])
            todo = [b for b in batch if b[1] not in have and done.get(b[0]) != b[1]]
            if todo:
                crash_point("build.encode", rank)
                emb = model.encode_image([b[3] for b in todo])
                keys, values, mask = encode_codes(gallery, emb)
                rows = Rows([b[1] for b in todo], [b[2] for b in todo], emb.pooled.float().cpu().numpy(), keys,
                            values, mask, [None] * len(todo), [b[4] for b in todo])
                stage_rows(db, [b[0] for b in todo], rows, rank)
            bar.update(len(positions))
        bar.close()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((records, skipped), gathered, dst=0)  # also the barrier: every rank has staged
        if rank != 0:
            return None
        crash_point("merge.start", 0)
        added = merge_staged(db, total)
        records = sorted(r for part, _ in gathered for r in part)
        skipped = [s for _, s in sorted(s for _, part in gathered for s in part)]
        ids = _ids_of(gallery, sorted({r[2] for r in records}))
        out, first = {"added": [], "existing": [], "skipped": skipped}, set()
        for _, path, sha in records:
            fresh = sha in added and sha not in first
            first.add(sha)
            out["added" if fresh else "existing"].append((path, ids[sha]))
        crash_point("build.manifest", 0)
        update_manifest(db, {"skipped": {"count": len(skipped), "files": skipped[:1000]}})
        out["count"] = gallery.count
        out["manifest"] = DbGallery(db).manifest
        return out
    finally:
        if lock is not None:
            lock.close()


def take_build_lock(db):
    """A connection holding ``BUILD_LOCK`` (closed: released); refused when another build holds it."""
    psycopg = db.psycopg
    conn = psycopg.connect(db.conninfo, **db.kwargs)
    if not conn.execute("SELECT pg_try_advisory_lock(%s)", [BUILD_LOCK]).fetchone()[0]:
        conn.close()
        raise ValueError(f"another build on several processes is writing the gallery in {db.display}; wait for it "
                         "to end (or stop it) and run this one again")
    return conn


# ------------------------------------------------------------------------------------------------ process group

def join_group(rank: int, world: int, init_method: str | None = None) -> None:
    """Join the gloo process group of a build (``init_method`` None: torchrun's environment variables)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method or "env://", rank=rank, world_size=world,
                            timeout=TIMEOUT)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world) when this process was started by torchrun with a world of several processes, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ["RANK"]), world) if world > 1 and "RANK" in os.environ else None


def _rank_main(rank: int, world: int, folder: str, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    from mmgeo.config import is_user_error

    # OMP_NUM_THREADS when set (as torchrun sets it), else the cores shared out among the ranks
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // world))
    join_group(rank, world, f"file://{folder}/group")
    try:
        out = fn(rank, world, *args)
        if rank == 0:
            Path(folder, "result.json").write_text(json.dumps(out))
        dist.barrier()
    except Exception as err:
        if is_user_error(err):  # reported by the parent as the one line it is
            Path(folder, f"error.{rank}").write_text(str(err))
        raise
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable, world: int, *args) -> dict:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes (``torch.multiprocessing``, spawned: a picklable
    module-level ``fn``) in one gloo group -> what rank 0 returned (JSON-able). A rank that fails or is killed
    ends the others: its user error again (ValueError), else a ``RuntimeError`` naming it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mmgeo-build-") as folder:
        try:
            mp.start_processes(_rank_main, args=(world, folder, fn, args), nprocs=world, join=True,
                               start_method="spawn")
        except mp.ProcessRaisedException as err:
            told = sorted(Path(folder).glob("error.*"))
            if told:
                raise ValueError(told[0].read_text()) from None
            raise RuntimeError(f"build process {err.error_index} of {world} failed: "
                               f"{str(err).strip().splitlines()[-1]}") from err
        except mp.ProcessExitedException as err:
            raise RuntimeError(f"build process {err.error_index} of {world} ended ({err}); the others were "
                               "stopped: run the same command again to finish (what is stored or staged is "
                               "kept)") from err
        return json.loads(Path(folder, "result.json").read_text())
