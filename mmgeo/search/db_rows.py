"""Rows and writes of the database gallery (docs/design.md §11), each write one transaction: ``create_gallery``
(manifest + codebooks), ``add_rows`` (COPY into a temporary table, then insert what is not stored yet, by content
SHA-256), ``remove_images``; the encoders that feed them are in ``mmgeo.search.db_build``.

Ids, vectors, metadata and codes reach SQL only as parameters or COPY data; the only SQL composed from values is the
column's dimension and the HNSW parameters when a gallery is created, integers checked here and quoted by
``psycopg.sql.Literal``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mmgeo.search.codecs import ROLES
from mmgeo.search.db_connect import COLLECTION, Database, crash_point, migrate
from mmgeo.search.db_index import ALL as ALL_INDEXES
from mmgeo.search.store import GalleryError

FORMAT = "mmgeo-gallery-db"
VERSION = 1
DEFAULT_CODEC = "rq8"
HNSW = {"m": 16, "ef_construction": 64}  # pgvector's defaults
BUILD = "build one with `python -m serve build --db URL`"


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
            if COLLECTION.get() is None:  # the database's one gallery: ids start again at 0
                conn.execute("TRUNCATE mmgeo_images, mmgeo_codebooks, mmgeo_gallery RESTART IDENTITY")
            else:  # this collection's rows only (row-level security; TRUNCATE would ignore it)
                for table in ("mmgeo_images", "mmgeo_codebooks", "mmgeo_gallery"):
                    conn.execute(f"DELETE FROM {table} WHERE collection = mmgeo_collection()")  # noqa: S608
        # a new gallery starts on HNSW (an IVFFlat index's lists are of the rows it was built over)
        for name in ALL_INDEXES:  # one a statement (Citus)
            conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("ALTER TABLE mmgeo_images ALTER COLUMN embedding TYPE vector({})").format(
            sql.Literal(d)))
        conn.execute(sql.SQL("CREATE INDEX mmgeo_images_embedding_hnsw ON mmgeo_images USING hnsw "
                             "(embedding vector_ip_ops) WITH (m = {}, ef_construction = {})").format(
            sql.Literal(m), sql.Literal(efc)))
        conn.execute("INSERT INTO mmgeo_gallery (manifest) VALUES (%s::jsonb)", [json.dumps(manifest)])
        for (role, head), data in sorted(codebooks.items()):
            conn.execute("INSERT INTO mmgeo_codebooks (role, head, data, sha256) VALUES (%s, %s, %s, %s)",
                         [role, head, data, hashlib.sha256(data).hexdigest()])
        crash_point("create.commit")


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
    ON CONFLICT DO NOTHING
    RETURNING content_sha256"""
IDS = "SELECT n.ord, i.id FROM mmgeo_new n JOIN mmgeo_images i USING (content_sha256) ORDER BY n.ord"


def add_rows(db: Database, rows: Rows, on_step: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Add a batch of images in one transaction -> (each row's id, whether this call stored it). A row whose content
    SHA-256 is stored already (or repeats an earlier row of the batch) is not stored again: it gets the stored id.
    Ids are given in row order from the gallery's sequence; writers take the gallery row's lock only to insert,
    so two writers copy their batches at once and insert one after the other. ``on_step(name)`` is called before
    each step ("copy", "insert", "count", "commit"): a test kills a writer there; ``crash_point("add.NAME")`` too,
    and at "add.copy-half" (in the middle of the COPY) and "add.done" (committed, not returned yet)."""

    def step(name: str) -> None:
        if on_step is not None:
            on_step(name)
        crash_point(f"add.{name}")

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
                    if i == n // 2:
                        step("copy-half")
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
    crash_point("add.done")
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
        crash_point("remove.count")
        conn.execute("UPDATE mmgeo_gallery SET image_count = image_count - %s WHERE id = 1", [len(gone)])
        crash_point("remove.commit")
    return sorted(gone)


def stored_hashes(db: Database, hashes: Sequence[bytes]) -> set[bytes]:
    """Which of these content hashes the gallery holds already (a build skips them before encoding)."""
    if not hashes:
        return set()
    with db.connection() as conn:
        rows = conn.execute("SELECT content_sha256 FROM mmgeo_images WHERE content_sha256 = ANY(%s::bytea[])",
                            [list(hashes)]).fetchall()
    return {bytes(r[0]) for r in rows}
