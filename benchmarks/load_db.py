"""The database side of ``benchmarks.load_search --db``: the load test's gallery in PostgreSQL + pgvector, and what
the first stage finds there.

- ``prepare_db``: the rows of the load test's folder gallery (its global vectors and its codec's codes, codebooks
  included) loaded into a database gallery, so that both backends serve the same images; ``--db-count`` above the
  folder's count adds random unit global vectors (drawn as the folder's are) whose codes cycle through the folder's.
  The rows go in through ``database.add_rows`` in batches with the HNSW index dropped (timed: bulk insert rate),
  then the index is built (timed), then the last ``LIVE_ROWS`` rows go in with the index in place (timed: the
  insert rate of ``serve add`` on a gallery of that size). Reused while its manifest's ``bench`` record matches.
- ``first_stage_recall``: recall@K' of the first stage (``DbGallery.first_stage``, HNSW) against exact inner
  products, per ``hnsw.ef_search``, for the load test's queries.
- ``model_recall``: the same for global vectors of a trained model (images and captions of the synthetic set),
  in a table of their own: random unit vectors are the hardest case for HNSW, trained ones are what a gallery holds.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used: importing a benchmark does no work
    import numpy as np


BATCH = 5_000  # rows per add_rows transaction in the bulk load
LIVE_ROWS = 2_000  # rows added last, a batch of LIVE_BATCH at a time, with the HNSW index in place
LIVE_BATCH = 100
MAINTENANCE_WORK_MEM = "2GB"  # the HNSW build holds its graph in memory up to this (1M x 128-d: ~1 GB)


def folder_vectors(folder: Path) -> np.ndarray:
    """The (N, d) global vectors of an unsharded index folder (its FAISS index keeps them)."""
    import faiss

    index = faiss.read_index(str(folder / "global.faiss"))
    return index.reconstruct_n(0, index.ntotal)


def bench_record(folder_manifest: dict, count: int, m: int, efc: int) -> dict:
    return {"source_sha256": folder_manifest["model"]["sha256"], "source_count": folder_manifest["count"],
            "codec": folder_manifest["store"]["codec"], "count": count, "m": m, "ef_construction": efc}


def existing(db, want: dict) -> dict | None:
    """The stored gallery's ``bench`` record when it is the one wanted and complete, else None."""
    from mmgeo.search.database import DbGallery
    from mmgeo.search.store import GalleryError

    try:
        g = DbGallery(db)
    except GalleryError:
        return None
    rec = g.manifest.get("bench", {})
    return rec if {k: rec.get(k) for k in want} == want and g.count == want["count"] and "hnsw_build_s" in rec \
        else None


def pooled_cache(workdir: Path, fman: dict, count: int) -> Path:
    """Where the database's ``count`` global vectors are kept (named by the folder's model and count)."""
    return workdir / f"pooled-{fman['model']['sha256'][:12]}-{fman['count']}-{count}.npy"


def scene_vectors(ckpt: str, start: int, stop: int, batch: int = 512) -> np.ndarray:
    """(stop - start, d_g) global vectors of synthetic train scenes ``start``..``stop`` by the model ``ckpt``, drawn
    in a worker process while the model encodes (a progress bar on stderr)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import mmgeo

    model = mmgeo.load_model(ckpt).eval()
    scenes = Scenes(model.cfg.image_size, start, stop)
    out = []
    with torch.inference_mode(), tqdm(total=stop - start, desc="encode scenes", unit="img") as bar:
        for images in DataLoader(scenes, batch_size=batch, num_workers=1, collate_fn=list):
            out.append(model.encode_image(images).pooled.float().numpy())
            bar.update(len(images))
    return np.concatenate(out)


class Scenes:
    """Synthetic train scenes ``start``..``stop`` as a map-style dataset of PIL images (scene i is the same image
    whatever the split's size)."""

    def __init__(self, image_size: int, start: int, stop: int):
        from mmgeo.data import ShapesWorld

        self.world, self.start, self.stop = ShapesWorld("train", 0, image_size=image_size, size=stop), start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        return self.world[self.start + i][0]


def pooled_for(folder: Path, count: int, cache: Path, scenes_ckpt: str | None = None) -> np.ndarray:
    """The global vectors of the database's ``count`` rows: the folder's, then, past them, random unit ones (seed 1)
    or (``scenes_ckpt``: the model of a folder of its scenes) that model's vectors of the next scenes."""
    import numpy as np
    if cache.is_file():
        return np.load(cache, mmap_mode="r")
    base = folder_vectors(folder)
    extra = max(0, count - len(base))
    parts = [base[:count]]
    if extra and scenes_ckpt:
        parts.append(scene_vectors(scenes_ckpt, len(base), count))
    else:
        rng = np.random.default_rng(1)
        for a in range(0, extra, 100_000):
            x = rng.standard_normal((min(100_000, extra - a), base.shape[1]), dtype=np.float32)
            parts.append(x / np.linalg.norm(x, axis=1, keepdims=True))
    pooled = np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
    np.save(cache, pooled)
    return pooled


def prepare_db(spec: str, folder: Path, count: int, m: int, efc: int, workdir: Path, log=print,
               scenes: bool = False) -> dict:
    """Load (or reuse) the database gallery of ``count`` rows at ``spec`` from the folder gallery ``folder``;
    -> its ``bench`` record (insert rates, HNSW build seconds, disk bytes)."""
    import numpy as np

    from mmgeo.search.database import Database, Rows, add_rows, create_gallery, row_bytes, update_manifest
    from mmgeo.search.db_build import manifest_of

    fman = json.loads((folder / "manifest.json").read_text())
    if "shards" in fman:
        raise SystemExit("--db loads an unsharded folder gallery: use --count of at most 100,000")
    want = bench_record(fman, count, m, efc)
    cache = pooled_cache(workdir, fman, count)
    with Database(spec, pool_size=2, pool_timeout=60, connect_timeout=10) as db:
        if (rec := existing(db, want)) is not None:
            log(f"reusing the database gallery in {db.display}: {count:,} rows, HNSW m={m} ef_construction={efc}")
            return rec
        rec_model, store = fman["model"], json.loads(json.dumps(fman["store"]))
        if store["codec"] == "fp16":
            raise SystemExit("--db needs a coded store (--codec rq8, the database's default)")
        books = {(r["role"], r["head"]): (folder / r["file"]).read_bytes() for r in store["quantizers"]}
        for r in store["quantizers"]:
            r["file"] = f"mmgeo_codebooks/{r['role']}.{r['head']}"
        store["row_bytes"] = row_bytes(store, rec_model, rec_model["num_patches"])
        manifest = {**manifest_of(rec_model, store), "hnsw": {"m": m, "ef_construction": efc}}
        log(f"loading {count:,} rows into {db.display} (HNSW m={m}, ef_construction={efc}) ...")
        create_gallery(db, manifest, books, replace=True)
        with db.connection() as conn:
            conn.execute("DROP INDEX mmgeo_images_embedding_hnsw")
        pooled = pooled_for(folder, count, cache, fman["model"]["path"] if scenes else None)
        codes = {r: np.load(folder / f"{r}.codes.npy", mmap_mode="r") for r in ("keys", "values")}
        n_src = len(codes["keys"])

        def rows(a: int, b: int) -> Rows:
            src = [i % n_src for i in range(a, b)]
            return Rows([hashlib.sha256(b"mmgeo-bench\0%d" % i).digest() for i in range(a, b)],
                        [{"path": f"{'scenes' if scenes else 'random'}/{i}.png", "width": 0, "height": 0}
                             for i in range(a, b)],
                        np.asarray(pooled[a:b]), *([codes[r][j].tobytes() for j in src] for r in ("keys", "values")),
                        [None] * (b - a), [None] * (b - a), [None] * (b - a))

        bulk = max(0, count - LIVE_ROWS)
        t = time.perf_counter()
        for a in range(0, bulk, BATCH):
            done = min(bulk, a + BATCH)
            add_rows(db, rows(a, done))
            if a // BATCH % 20 == 0:
                log(f"  {done:,} rows, {done / (time.perf_counter() - t):,.0f} images/s")
        bulk_s = time.perf_counter() - t
        with db.connection() as conn:
            from psycopg import sql

            conn.execute(f"SET maintenance_work_mem = '{MAINTENANCE_WORK_MEM}'")
            t = time.perf_counter()
            conn.execute(sql.SQL("CREATE INDEX mmgeo_images_embedding_hnsw ON mmgeo_images USING hnsw "
                                 "(embedding vector_ip_ops) WITH (m = {}, ef_construction = {})").format(
                sql.Literal(m), sql.Literal(efc)))
            build_s = time.perf_counter() - t
            log(f"  HNSW index built in {build_s:.0f} s")
        t = time.perf_counter()
        for a in range(bulk, count, LIVE_BATCH):
            add_rows(db, rows(a, min(count, a + LIVE_BATCH)))
        live_s = time.perf_counter() - t
        with db.connection() as conn:
            conn.execute("VACUUM ANALYZE mmgeo_images")
            table, index, database = conn.execute(
                "SELECT pg_total_relation_size('mmgeo_images'), pg_relation_size('mmgeo_images_embedding_hnsw'), "
                "pg_database_size(current_database())").fetchone()
        rec = {**want, "bulk_rows": bulk, "bulk_insert_images_per_s": bulk / bulk_s if bulk else None,
               "hnsw_build_s": build_s, "live_rows": count - bulk,
               "live_insert_images_per_s": (count - bulk) / live_s if count > bulk else None,
               "table_bytes_per_image": table / count, "hnsw_bytes_per_image": index / count,
               "database_bytes": database, "maintenance_work_mem": MAINTENANCE_WORK_MEM}
        update_manifest(db, {"bench": rec})
        log(f"  bulk insert {fmt_rate(rec['bulk_insert_images_per_s'])} images/s, HNSW build {build_s:.0f} s, "
            f"live insert {fmt_rate(rec['live_insert_images_per_s'])} images/s, {table / count:,.0f} bytes/image "
            f"(HNSW {index / count:,.0f})")
        return rec


def ensure_ivfflat(spec: str, lists: int, half: bool = False, log=print, work_mem: str = "4GB") -> float | None:
    """The database's index made IVFFlat of ``lists`` lists (``serve index``'s build, with ``work_mem`` of
    ``maintenance_work_mem``; ``half``: over the vectors at half precision) unless it is one already; -> the build's
    seconds, or None when reused."""
    from mmgeo.search.database import DbGallery
    from mmgeo.search.db_index import build_index

    what = f"IVFFlat{'-halfvec' if half else ''} index of {lists} lists"
    with DbGallery(spec) as g:
        if (g.index_kind, g.lists, g.half) == ("ivfflat", lists, half):
            log(f"reusing the {what}")
            return None
        log(f"building an {what} over {g.count:,} rows in place of {g.manifest['index_type']} ...")
        seconds = build_index(g.db, "ivfflat", lists=lists, work_mem=work_mem,
                              half_dims=g.model_record["d_global"] if half else None)
    log(f"  IVFFlat index built in {seconds:.0f} s")
    return seconds


def fmt_rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def exact_top(q: np.ndarray, x: np.ndarray, k: int, chunk: int = 200_000) -> list[set]:
    """Each query's ``k`` best rows of ``x`` by inner product (sets of row numbers)."""
    import numpy as np
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.zeros((len(q), 0), np.int64)
    for a in range(0, len(x), chunk):
        s = q @ np.asarray(x[a:a + chunk]).T
        s_all, i_all = np.concatenate([best_s, s], 1), np.concatenate(
            [best_i, np.broadcast_to(np.arange(a, a + s.shape[1]), s.shape)], 1)
        top = np.argpartition(-s_all, min(k, s_all.shape[1] - 1), axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(s_all, top, 1), np.take_along_axis(i_all, top, 1)
    return [set(r.tolist()) for r in best_i]


def first_stage_recall(spec: str, pooled: np.ndarray, q: np.ndarray, k: int, efs: list[int],
                       setting: str = "ef_search") -> dict[int, float]:
    """Recall@k of ``DbGallery.first_stage`` (ids = row numbers) against exact, for each ``hnsw.ef_search`` (or
    each ``ivfflat.probes``: ``setting="probes"``)."""
    import numpy as np

    from mmgeo.search.database import DbGallery

    exact = exact_top(q, pooled, k)
    out = {}
    for ef in efs:
        with DbGallery(spec, **{setting: ef}) as g:
            got = []
            for a in range(0, len(q), 16):
                _, ids, _ = g.first_stage(q[a:a + 16], [k] * len(q[a:a + 16]), codes=False)
                got += [set(r[r >= 0].tolist()) for r in ids]
        out[ef] = float(np.mean([len(g_ & e) / k for g_, e in zip(got, exact)]))
    return out


def model_vectors(ckpt: str, images: int, captions: int, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """Global vectors of ``images`` synthetic train images and of ``captions`` val captions, by a trained model."""
    import numpy as np
    if cache.is_file():
        z = np.load(cache)
        return z["x"], z["q"]
    import torch

    import mmgeo
    from mmgeo.data import ShapesWorld

    model = mmgeo.load_model(ckpt)
    size = model.cfg.image_size
    train, val = ShapesWorld("train", 0, image_size=size), ShapesWorld("val", 0, image_size=size)
    with torch.no_grad():
        x = np.concatenate([model.encode_image([train[i][0] for i in range(a, min(images, a + 256))])
                            .pooled.float().numpy() for a in range(0, min(images, len(train)), 256)])
        texts = [c for i in range(captions) for c in val[i][1][:1]]
        q = np.concatenate([model.encode_text(texts[a:a + 256]).pooled.float().numpy()
                            for a in range(0, len(texts), 256)])
    np.savez(cache, x=x, q=q)
    return x, q


def model_recall(spec: str, x: np.ndarray, q: np.ndarray, k: int, m: int, efc: int, efs: list[int]) -> dict:
    """Recall@k of pgvector's HNSW (m, ef_construction) over ``x`` for queries ``q``, in schema mmgeo_recall."""
    import numpy as np
    from psycopg import sql

    from mmgeo.search.database import Database, vector_text

    exact = exact_top(q, x, k)
    with Database(spec, pool_size=1, pool_timeout=60) as db, db.connection() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("DROP SCHEMA IF EXISTS mmgeo_recall CASCADE")
        conn.execute("CREATE SCHEMA mmgeo_recall")
        conn.execute(sql.SQL("CREATE TABLE mmgeo_recall.v (id integer, v vector({}))").format(
            sql.Literal(x.shape[1])))
        with conn.cursor().copy("COPY mmgeo_recall.v (id, v) FROM STDIN") as copy:
            for i, v in enumerate(x):
                copy.write_row((i, vector_text(v)))
        conn.execute(f"SET maintenance_work_mem = '{MAINTENANCE_WORK_MEM}'")
        t = time.perf_counter()
        conn.execute(sql.SQL("CREATE INDEX ON mmgeo_recall.v USING hnsw (v vector_ip_ops) WITH (m = {}, "
                             "ef_construction = {})").format(sql.Literal(m), sql.Literal(efc)))
        build_s = time.perf_counter() - t
        out = {"images": len(x), "queries": len(q), "m": m, "ef_construction": efc, "build_s": build_s,
               "recall": {}}
        for ef in efs:
            got = []
            with conn.transaction():
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(ef)])
                for v in q:
                    got.append({r[0] for r in conn.execute(
                        "SELECT id FROM mmgeo_recall.v ORDER BY v <#> %s::vector LIMIT %s",
                        [vector_text(v), k]).fetchall()})
            out["recall"][ef] = float(np.mean([len(g & e) / k for g, e in zip(got, exact)]))
        conn.execute("DROP SCHEMA mmgeo_recall CASCADE")
    return out
