"""A gallery in PostgreSQL + pgvector (docs/design.md §11): the same re-rank as an index directory, over rows that
live updates, other processes and other machines can share.

- connections and the versioned schema: ``mmgeo.search.db_connect`` (``Database``, ``migrate``)
- rows and writes, each one transaction: ``mmgeo.search.db_rows`` (``create_gallery``, ``add_rows``,
  ``remove_images``); the encoders that feed them: ``mmgeo.search.db_build``
- here, ``DbGallery``: the reader. ``first_stage`` is one SQL query for a batch of captions that returns each one's
  K' nearest ids by global score (pgvector HNSW, inner product) **and** their stored codes;
  ``two_stage.search_texts`` re-ranks those rows with ``rerank_candidates``, unchanged (``CandidateRows`` is a
  ``store.RerankStore``)

The names of both modules are re-exported here, so ``from mmgeo.search.database import ...`` reaches all of them.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from mmgeo.search.codecs import ROLES, CodebookError, Codewords, load_quantizers, unpack_mask
from mmgeo.search.db_connect import (  # noqa: F401  (re-exported)
    CRASH_ENV,
    LATEST,
    MIGRATION_LOCK,
    MIGRATIONS,
    NEEDS_DB,
    READABLE,
    Database,
    DatabaseError,
    as_database,
    connection_url,
    crash_point,
    display_url,
    migrate,
    migration_files,
    parse_db,
    schema_version,
    start_local,
)
from mmgeo.search.db_index import current_index, default_probes, rows_for
from mmgeo.search.db_rows import (  # noqa: F401  (re-exported)
    BUILD,
    COPY,
    DEFAULT_CODEC,
    FORMAT,
    HNSW,
    IDS,
    INSERT,
    STAGE,
    VERSION,
    Rows,
    _gallery_row,
    add_rows,
    create_gallery,
    pack_bits,
    parse_ids,
    remove_images,
    row_bytes,
    stored_hashes,
    update_manifest,
    vector_text,
)
from mmgeo.search.pruning import unpack_patches
from mmgeo.search.store import GalleryError, RerankStore

EF_SEARCH_MAX = 1000  # pgvector's upper bound of hnsw.ef_search
EF_FACTOR = 2  # hnsw.ef_search = EF_FACTOR · K' (at least 40, pgvector's default), at most EF_SEARCH_MAX


# ------------------------------------------------------------------------------------------------ reading

class CandidateRows(RerankStore):
    """Stored rows a query returned (row r = position r), read by the re-rank like an index directory's store."""

    def __init__(self, gallery: DbGallery, n: int, positions: np.ndarray, key_codes: list, value_codes: list,
                 masks: list, patches: list):
        self.model_record, self.store, self.codec = gallery.model_record, gallery.store, gallery.codec
        self.num_patches, self.count = gallery.num_patches, n
        self.quantizers, self.codewords = gallery.quantizers, gallery.codewords
        H, L, S = self.model_record["num_heads"], self.num_patches, self.model_record["num_patches"]
        pos = np.asarray(positions, dtype=np.int64)

        def table(col: list, width: int, fill: int = 0) -> np.ndarray:
            out = np.full((n, width), fill, np.uint8)
            if len(col):
                blob = b"".join(fill.to_bytes(1, "little") * width if c is None else c for c in col)
                if len(blob) != len(col) * width:
                    raise GalleryError(f"database {gallery.db.display}: a stored row is not {width} bytes wide; the "
                                       "gallery is damaged — rebuild it")
                out[pos] = np.frombuffer(blob, np.uint8).reshape(len(col), width)
            return out

        sizes = self.store["row_bytes"]
        if self.codec == "fp16":
            self.keys, self.values = (table(c, sizes[r]).view(np.float16).reshape(n, H, L, -1)
                                      for c, r in ((key_codes, "keys"), (value_codes, "values")))
            self.mask = unpack_mask(table(masks, -(-L // 8), 0xFF), L) if n else np.ones((0, L), bool)
        else:
            self.codes = {r: table(c, sizes[r]).reshape(n, H, L, -1)
                          for c, r in ((key_codes, "keys"), (value_codes, "values"))}
            self.mask_bits = None if all(m is None for m in masks) else table(masks, -(-L // 8), 0xFF)
        self.patch_bits = None if L == S else table(patches, -(-S // 8))


class GlobalIndex:
    """``search(q, k)`` like a FAISS index (global scores, ids padded with -1) over the gallery's rows, for queries
    that need no re-rank (``POST /search/image``)."""

    def __init__(self, gallery: DbGallery):
        self.gallery = gallery

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids, _ = self.gallery.first_stage(q, [k] * len(q), codes=False)
        return scores, ids


FIRST_STAGE = """SELECT q.n, c.id, c.score{codes}
    FROM unnest(%s::text[]::vector[], %s::integer[]) WITH ORDINALITY AS q(v, lim, n)
    CROSS JOIN LATERAL (
        SELECT i.id, -(i.embedding <#> q.v) AS score, i.key_codes, i.value_codes, i.mask, i.patches
        FROM mmgeo_images i ORDER BY i.embedding <#> q.v LIMIT q.lim) c"""
# over an index at half precision (db_index): rows_for(lim) rows by that order, the best lim by the full vectors
FIRST_STAGE_HALF = """SELECT q.n, c.id, c.score{codes}
    FROM unnest(%s::text[]::vector[], %s::integer[], %s::integer[]) WITH ORDINALITY AS q(v, lim, take, n)
    CROSS JOIN LATERAL (SELECT h.* FROM (
        SELECT i.id, -(i.embedding <#> q.v) AS score, i.key_codes, i.value_codes, i.mask, i.patches
        FROM mmgeo_images i ORDER BY i.embedding::halfvec({dims}) <#> q.v::halfvec({dims}) LIMIT q.take) h
        ORDER BY h.score DESC LIMIT q.lim) c"""
CODE_COLUMNS = ", c.key_codes, c.value_codes, c.mask, c.patches"
# a distributed mmgeo_images (Citus, docs/serve.md): one statement per caption, which Citus runs on every shard
FAN_OUT = """SELECT c.id, c.score{codes} FROM (
    SELECT i.id, -(i.embedding <#> %s::vector) AS score, i.key_codes, i.value_codes, i.mask, i.patches
    FROM mmgeo_images i ORDER BY i.embedding <#> %s::vector LIMIT {limit}) c"""
FAN_OUT_HALF = """SELECT c.id, c.score{codes} FROM (
    SELECT i.id, -(i.embedding <#> %s::vector) AS score, i.key_codes, i.value_codes, i.mask, i.patches
    FROM mmgeo_images i ORDER BY i.embedding::halfvec({dims}) <#> %s::halfvec({dims}) LIMIT {take}) c
    ORDER BY c.score DESC LIMIT {limit}"""
# the session's search settings, read after its captions' statements in the same pipeline (``session_rows``)
SESSION_CHECK = "SELECT current_setting('hnsw.ef_search')::integer, current_setting('ivfflat.probes')::integer"
DISTRIBUTED = "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'mmgeo_images'::regclass)"


def distributed(conn) -> bool:
    """Whether ``mmgeo_images`` is a Citus distributed table (Citus' catalogue exists and lists it)."""
    if conn.execute("SELECT to_regclass('pg_catalog.pg_dist_partition')").fetchone()[0] is None:
        return False
    return bool(conn.execute(DISTRIBUTED).fetchone()[0])


def fan_out_rows(conn, q: np.ndarray, want: Sequence[int], ef: int, codes: bool, citus: bool,
                 probes: int | None = None, half_dims: int | None = None) -> list[tuple]:
    """The first stage as one ``ORDER BY ... LIMIT`` per caption, all in one pipeline (one round trip) -> rows as
    ``FIRST_STAGE`` returns them (caption number from 1 first). On Citus, ``SET LOCAL`` reaches the shards.
    ``half_dims``: the index is over the vectors at half precision (``FAN_OUT_HALF``). On a connection outside any
    transaction (autocommit, no collection's), the settings are the session's (``session_rows``)."""
    from psycopg.pq import TransactionStatus

    if not citus and conn.info.transaction_status == TransactionStatus.IDLE:
        rows = session_rows(conn, q, want, ef, codes, probes, half_dims)
        if rows is not None:
            return rows
    with conn.pipeline(), conn.transaction():
        if citus:
            conn.execute("SET LOCAL citus.propagate_set_commands TO 'local'")
        conn.execute(_statement(SET_EF, int(ef)))
        if probes:
            conn.execute(_statement(SET_PROBES, int(probes)))
        curs = _caption_searches(conn, q, want, codes, half_dims)
    return [(i + 1, *r) for i, cur in enumerate(curs) for r in cur.fetchall()]


def _caption_searches(conn, q: np.ndarray, want: Sequence[int], codes: bool, half_dims: int | None) -> list:
    """Each caption's ``FAN_OUT`` (``FAN_OUT_HALF``) statement sent on ``conn`` -> their cursors, in caption order."""
    curs = []
    for v, w in zip(q, want):
        text = vector_text(v)
        cur = conn.cursor(binary=True)
        cur.execute(_statement(FAN_OUT if half_dims is None else FAN_OUT_HALF, int(w), codes, half_dims), [text, text])
        curs.append(cur)
    return curs


_SESSION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> (ef_search, probes) SET on it


def session_rows(conn, q: np.ndarray, want: Sequence[int], ef: int, codes: bool, probes: int | None,
                 half_dims: int | None) -> list[tuple] | None:
    """``fan_out_rows`` with ``hnsw.ef_search`` and ``ivfflat.probes`` SET for the connection's session when they
    change, not in a transaction of each search: a caption is then one statement, not five (BEGIN, SET LOCAL ×2,
    the search, COMMIT; docs/measurements/serving.md). The same pipeline reads the settings back after the
    captions' statements; others than those set (a session reset behind the service's back, e.g. by a pooler
    between) -> None, and the caller searches again with SET LOCAL."""
    need = (int(ef), int(probes or 1))
    with conn.pipeline():
        if _SESSION.get(conn) != need:
            conn.execute(_statement(SET_SESSION_EF, need[0]))
            conn.execute(_statement(SET_SESSION_PROBES, need[1]))
        curs = _caption_searches(conn, q, want, codes, half_dims)
        check = conn.execute(SESSION_CHECK)
    if check.fetchone() != need:
        _SESSION.pop(conn, None)
        return None
    _SESSION[conn] = need
    return [(i + 1, *r) for i, cur in enumerate(curs) for r in cur.fetchall()]


SET_EF, SET_PROBES = "SET LOCAL hnsw.ef_search = {limit}", "SET LOCAL ivfflat.probes = {limit}"
SET_SESSION_EF, SET_SESSION_PROBES = "SET hnsw.ef_search = {limit}", "SET ivfflat.probes = {limit}"


@functools.lru_cache(maxsize=512)
def _statement(template: str, limit: int, codes: bool = False, half_dims: int | None = None):
    """``template`` composed (``FAN_OUT``, ``FAN_OUT_HALF``, ``FIRST_STAGE``, ``FIRST_STAGE_HALF``, ``SET_EF``,
    ``SET_PROBES``, ``SET_SESSION_EF``, ``SET_SESSION_PROBES``: the placeholders it has of these values), once per
    value: a first stage composes no SQL."""
    from psycopg import sql

    return sql.SQL(template).format(codes=sql.SQL(CODE_COLUMNS if codes else ""), limit=sql.Literal(int(limit)),
                                    take=sql.Literal(rows_for(int(limit), True)), dims=sql.Literal(int(half_dims or 0)))


class DbGallery(RerankStore):
    """A gallery in a database (``Database`` or URL), read like ``store.Gallery``: ``check_model``,
    ``check_images``, ``count``, ``image_keys`` / ``image_mask`` / ``image_patches``, ``index.search`` (global
    only), and ``first_stage`` for ``two_stage.search_texts``. Its codebooks are checked on load (size and SHA-256
    against the manifest's records and the stored hash) as an index directory's are. ``ef_search``: HNSW's
    candidate list (default ``EF_FACTOR`` · the number of rows asked for, within 40..``EF_SEARCH_MAX``). ``read``:
    another database (URL) to read through, e.g. a streaming standby's; writes (``db_rows``) go to ``db``.
    ``parallel``: connections searching at once: the captions of ``each_first_stage``, or the parts of a batch's
    ``first_stage`` (the database walks its index on as many cores). The index may be over the vectors at half
    precision (``half``, ``db_index``). ``probes``: ``ivfflat.probes`` when the table's index is IVFFlat (default
    √lists, ``db_index``); the index is found on load (``index_kind``, ``lists``), so restart a reader after
    ``python -m serve index`` changes it."""

    def __init__(self, db: Database | str, ef_search: int | None = None, read: Database | str | None = None,
                 parallel: int = 1, probes: int | None = None, **db_kwargs):
        if parallel < 1:
            raise ValueError(f"parallel={parallel}: give 1 or more connections per batch")
        if probes is not None and probes < 1:
            raise ValueError(f"probes={probes}: give 1 or more IVFFlat lists to scan")
        self.db, self._own = as_database(db, **db_kwargs)
        self.reader, self._own_reader = self.db, False
        self.ef_search, self.parallel, self.probes = ef_search, parallel, probes
        from concurrent.futures import ThreadPoolExecutor

        # the connections that search at once (``each_first_stage``, a split ``first_stage``); threads start on use
        self._threads = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="mmgeo-db")
        self.root = self.db.display  # where it is, for messages and evaluation records
        try:
            if read is not None:
                self.reader, self._own_reader = as_database(read, **db_kwargs)
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        with self.reader.connection() as conn:
            have = schema_version(conn)
            if not READABLE <= have <= LATEST:
                raise GalleryError(f"database {self.db.display} has mmgeo schema v{have}, this mmgeo reads "
                                   f"v{READABLE}..v{LATEST}; " + (
                                       BUILD if have == 0 else "migrate it by `python -m serve build --db URL` of "
                                       "this mmgeo" if have < READABLE else "upgrade mmgeo"))
            got = _gallery_row(conn)
            if got is None:
                raise GalleryError(f"database {self.db.display} holds no gallery; {BUILD}")
            books = {(r, int(h)): (bytes(d), s) for r, h, d, s in
                     conn.execute("SELECT role, head, data, sha256 FROM mmgeo_codebooks").fetchall()}
            self.citus = self.fan_out = distributed(conn)
            self.index_kind, self.lists, self.half = current_index(conn)
        kind = f"pgvector-{self.index_kind}" + ("-halfvec" if self.half else "")
        self.manifest = m = {**got[0], "index_type": kind}  # the index there now
        if self.index_kind == "ivfflat" and self.probes is None:
            self.probes = default_probes(self.lists)
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise GalleryError(f"database {self.db.display} holds gallery format {m.get('format')!r} "
                               f"v{m.get('version')}; this mmgeo reads {FORMAT!r} v{VERSION}")
        self.model_record = r = m["model"]
        self.store = m["store"]
        self.codec = self.store["codec"]
        self.num_patches = L = self.store.get("patches", {}).get("kept", r["num_patches"])
        self.dims = {"keys": r["d_a"], "values": r["d_e"]}
        if row_bytes(self.store, r, L) != self.store["row_bytes"]:
            raise GalleryError(f"database {self.db.display}: the manifest's row sizes do not fit its model and codec; "
                               "the gallery is damaged — rebuild it")
        self.quantizers = self.codewords = None
        if self.codec != "fp16":
            def read(rec):
                data, stored_sha = books.get((rec["role"], rec["head"]), (None, None))
                where = f"codebook {rec['role']}.{rec['head']} of database {self.db.display}"
                if data is not None and stored_sha != hashlib.sha256(data).hexdigest():
                    raise CodebookError(f"{where} does not match its stored SHA-256: damaged — rebuild the gallery")
                return data, where

            try:
                self.quantizers = load_quantizers(Path("."), self.store, r["num_heads"], self.dims, read=read)
            except CodebookError as err:
                raise GalleryError(str(err)) from err
            self.codewords = {role: Codewords.of(self.quantizers[role]) for role in ROLES}
        self.index = GlobalIndex(self)

    @property
    def count(self) -> int:
        """Images in the gallery now (kept by every write, in its transaction)."""
        with self.reader.connection() as conn:
            return int(conn.execute("SELECT image_count FROM mmgeo_gallery WHERE id = 1").fetchone()[0])

    def close(self) -> None:
        if getattr(self, "_threads", None) is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
        if self._own:
            self.db.close()
        if self._own_reader:
            self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ef_for(self, k: int) -> int:
        """``hnsw.ef_search`` for a caption that wants ``k`` rows (``rows_for`` them by a half-precision index)."""
        return int(min(EF_SEARCH_MAX, max(40, self.ef_search or EF_FACTOR * rows_for(k, self.half))))

    def first_stage(self, q: np.ndarray, want: Sequence[int], codes: bool = True
                    ) -> tuple[np.ndarray, np.ndarray, CandidateRows | None]:
        """The first stage of a batch of B captions in one round trip: for caption i its ``want[i]`` nearest images
        by inner product of global vectors (HNSW, ``hnsw.ef_search`` from the largest ``want``) and, when
        ``codes``, their stored rows -> (scores (B, W) float32, ids (B, W) int64 padded with -1, ``CandidateRows``
        whose row i·W + j is ids[i, j]'s), W = max(want)."""
        q = self._check(q)
        B, W = len(q), max(want) if len(want) else 0
        scores, ids = np.full((B, W), -np.inf, np.float32), np.full((B, W), -1, np.int64)
        if B == 0 or W == 0:
            return scores, ids, (CandidateRows(self, 0, np.zeros(0, np.int64), [], [], [], []) if codes else None)
        ef, parts = self.ef_for(W), np.array_split(np.arange(B), min(B, self.parallel))
        if len(parts) == 1:
            rows = self._rows(q, want, ef, codes)
        else:  # each part on its own connection at once: the database walks its index on as many cores
            later = [self._threads.submit(contextvars.copy_context().run, self._rows, q[p], [want[i] for i in p],
                                          ef, codes) for p in parts[1:]]  # in this collection (db_connect.COLLECTION)
            first = self._rows(q[parts[0]], [want[i] for i in parts[0]], ef, codes)
            rows = first + [(r[0] + int(p[0]), *r[1:]) for p, f in zip(parts[1:], later) for r in f.result()]
        if rows:
            n = np.fromiter((r[0] - 1 for r in rows), np.int64, len(rows))
            s = np.fromiter((r[2] for r in rows), np.float64, len(rows))
            order = np.lexsort((-s, n))  # per caption, best first (as each LATERAL returned them, made sure)
            rank = np.empty(len(rows), np.int64)
            starts = np.searchsorted(n[order], np.arange(B))
            rank[order] = np.arange(len(rows)) - np.repeat(starts, np.bincount(n, minlength=B))
            scores[n, rank] = s
            ids[n, rank] = np.fromiter((r[1] for r in rows), np.int64, len(rows))
            pos = n * W + rank
        else:
            pos = np.zeros(0, np.int64)
        if not codes:
            return scores, ids, None
        cols = list(zip(*rows)) if rows else [[]] * 7
        return scores, ids, CandidateRows(self, B * W, pos, *(list(c) for c in cols[3:7]))

    def each_first_stage(self, q: np.ndarray, want: Sequence[int]
                         ) -> Iterator[tuple[np.ndarray, np.ndarray, CandidateRows]]:
        """``first_stage`` caption by caption, each in its own round trip (``FAN_OUT``'s one statement, with
        ``hnsw.ef_search`` from its own ``want``), ``parallel`` of them at once on their own connections -> for
        caption i, in order, as soon as its answer is in: (scores (n,) float32, ids (n,) int64, ``CandidateRows``
        whose row j is ids[j]'s), n <= want[i]. The caller re-ranks caption i while the database searches the next
        ones (``two_stage.search_texts``)."""
        q = self._check(q)
        probes = self.probes if self.index_kind == "ivfflat" else None

        def caption(v: np.ndarray, w: int) -> list[tuple]:
            with self.reader.connection() as conn:
                return fan_out_rows(conn, v[None], [w], self.ef_for(w), True, self.citus, probes, self._half_dims)

        found = [self._threads.submit(contextvars.copy_context().run, caption, v, int(w))  # in this collection
                 for v, w in zip(q, want)]
        try:
            for f in found:
                rows = f.result()
                cols = list(zip(*rows)) if rows else [[]] * 7
                yield (np.array(cols[2], np.float32), np.array(cols[1], np.int64),
                       CandidateRows(self, len(rows), np.arange(len(rows)), *(list(c) for c in cols[3:7])))
        finally:  # a consumer that stops early leaves no search queued
            for f in found:
                f.cancel()

    @property
    def _half_dims(self) -> int | None:
        return int(self.model_record["d_global"]) if self.half else None

    def _check(self, q: np.ndarray) -> np.ndarray:
        q = np.asarray(q, dtype=np.float32)
        if len(q) and q.shape[1] != self.model_record["d_global"]:
            raise ValueError(f"query vectors are {q.shape[1]}-d; the gallery's are {self.model_record['d_global']}-d")
        return q

    def _rows(self, q: np.ndarray, want: Sequence[int], ef: int, codes: bool) -> list[tuple]:
        """``FIRST_STAGE``'s rows for captions ``q`` (numbered from 1) in one round trip on one connection."""
        with self.reader.connection() as conn:
            probes = self.probes if self.index_kind == "ivfflat" else None
            if self.fan_out:
                return fan_out_rows(conn, q, want, ef, codes, self.citus, probes, self._half_dims)
            with conn.pipeline(), conn.transaction():  # one round trip: BEGIN, SET LOCAL, the query, COMMIT
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(ef)])
                if probes:
                    conn.execute("SELECT set_config('ivfflat.probes', %s, true)", [str(probes)])
                cur = conn.cursor(binary=True)
                texts, want = [vector_text(v) for v in q], [int(w) for w in want]
                cur.execute(_statement(FIRST_STAGE_HALF if self.half else FIRST_STAGE, 0, codes, self._half_dims),
                            [texts, want, *([[rows_for(w, True) for w in want]] if self.half else [])])
            return cur.fetchall()

    def rows(self, ids: Sequence[int]) -> tuple[CandidateRows, np.ndarray]:
        """The stored rows of ``ids`` (row r = ids[r]) and whether each exists."""
        ids = np.asarray(parse_ids([int(i) for i in ids]), dtype=np.int64)
        with self.reader.connection() as conn:
            got = conn.cursor(binary=True).execute(
                "SELECT id, key_codes, value_codes, mask, patches FROM mmgeo_images WHERE id = ANY(%s::bigint[])",
                [ids.tolist()]).fetchall()
        where = {int(r[0]): i for i, r in enumerate(got)}
        found = np.array([int(i) in where for i in ids], dtype=bool)
        pos = np.array([r for r, i in enumerate(ids) if int(i) in where], dtype=np.int64)
        order = [where[int(i)] for i in ids if int(i) in where]
        cols = [[got[o][c] for o in order] for c in range(1, 5)]
        return CandidateRows(self, len(ids), pos, *cols), found

    def _one(self, image_id: int) -> CandidateRows:
        rows, found = self.rows([image_id])
        if not found[0]:
            raise GalleryError(f"unknown image id {image_id}")
        return rows

    def image_keys(self, image_id: int) -> torch.Tensor:
        return self._one(image_id).image_keys(0)

    def image_mask(self, image_id: int) -> torch.Tensor:
        return self._one(image_id).image_mask(0)

    def image_patches(self, image_id: int) -> torch.Tensor:
        rows = self._one(image_id)
        if rows.patch_bits is None:
            return torch.arange(self.model_record["num_patches"])
        return torch.from_numpy(unpack_patches(rows.patch_bits[0], self.model_record["num_patches"]))

    def image_record(self, image_id: int) -> dict | None:
        """An image's metadata and whether the gallery keeps its file, or None when the id is not stored."""
        with self.reader.connection() as conn:
            got = conn.execute("SELECT meta, file IS NOT NULL FROM mmgeo_images WHERE id = %s",
                               [int(image_id)]).fetchone()
        return None if got is None else {**got[0], "id": int(image_id), "stored_file": bool(got[1])}

    def image_file(self, image_id: int) -> bytes | None:
        """The image file the gallery keeps for ``image_id`` (generated or uploaded images), else None."""
        with self.reader.connection() as conn:
            got = conn.cursor(binary=True).execute("SELECT file FROM mmgeo_images WHERE id = %s",
                                                   [int(image_id)]).fetchone()
        return None if got is None or got[0] is None else bytes(got[0])

    def image_path(self, image_id: int) -> Path | None:
        """The file an image's metadata points to (None: unknown id, or the gallery keeps the file itself)."""
        rec = self.image_record(image_id)
        return None if rec is None or rec.get("stored_file") or not rec.get("path") else Path(rec["path"])
