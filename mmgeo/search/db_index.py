"""The database gallery's index over global vectors (the first stage): pgvector's HNSW, built with the gallery, or
IVFFlat, built over the rows stored and swapped in by ``python -m serve index`` (docs/serve.md, "Past a million
images: IVFFlat"). Either can index the vectors at half precision (``half``: ``embedding::halfvec(d)``, pgvector's
half-precision indexing): half the index pages to read, and the first stage then fetches ``OVERFETCH`` times the
rows by that order and keeps the best by the full vectors.

Why two: a caption lies away from every image (the modality gap), and a one-object caption's images are scattered
over an HNSW graph walked from image to image; at a million rows its recall@100 levels off under 0.98 whatever the
graph's size, where IVFFlat, which scans the lists nearest the caption itself, reaches 0.99
(docs/measurements/serving.md, "Database gallery of a trained model's scenes"). Limits: IVFFlat's lists are the
k-means centroids of the rows it was built over; rows added later join their nearest list, so rebuild it when the
gallery has grown or changed much. The index is the table's, so it serves every collection of the database.
"""

from __future__ import annotations

import math
import re
import time

from mmgeo.search.db_connect import Database

INDEXES = {"hnsw": "mmgeo_images_embedding_hnsw", "ivfflat": "mmgeo_images_embedding_ivfflat"}
HALF = "_half"  # the name's suffix of an index over the vectors at half precision
ALL = [name + end for name in INDEXES.values() for end in ("", HALF)]
NEW = "mmgeo_images_embedding_new"  # the index being built, renamed once the old one is dropped
# rows fetched by the half-precision order per row kept (re-sorted by the full vectors): at 1M rows, IVFFlat 4,000
# lists, 40 probes, recall@100 0.990 with the half order alone, 0.991 with 1.2x re-sorted; full precision 0.992
OVERFETCH = 1.2
WORK_MEM = "2GB"  # maintenance_work_mem of a build (IVFFlat's k-means over 1M x 128-d with 4,000 lists: 3.2 GB)
CREATE = "CREATE INDEX {name} ON mmgeo_images USING {method} "
COLUMN = "(embedding vector_ip_ops)"
HALF_COLUMN = "((embedding::halfvec({dims})) halfvec_ip_ops)"
IVFFLAT = " WITH (lists = {lists})"
HNSW = " WITH (m = {m}, ef_construction = {efc})"
FOUND = """SELECT c.relname, c.reloptions FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = 'mmgeo_images'::regclass AND c.relname = ANY(%s)"""


def default_probes(lists: int) -> int:
    """``ivfflat.probes`` when none is given: √lists, pgvector's suggested start (4,000 lists: 64; at 1M rows 60 probes
    measured recall@100 0.994, 40 probes 0.991 at a lower p99)."""
    return max(1, math.ceil(math.sqrt(lists)))


def current_index(conn) -> tuple[str, int | None, bool]:
    """("hnsw" | "ivfflat" | "none", IVFFlat's lists or None, whether at half precision) of ``mmgeo_images``' index
    over global vectors (an IVFFlat one first, should there be two)."""
    found = {name: opts or [] for name, opts in conn.execute(FOUND, [ALL]).fetchall()}
    for kind in ("ivfflat", "hnsw"):
        for half in (False, True):
            opts = found.get(INDEXES[kind] + (HALF if half else ""))
            if opts is not None:
                lists = int(dict(o.split("=", 1) for o in opts).get("lists", 100)) if kind == "ivfflat" else None
                return kind, lists, half  # 100: pgvector's default lists
    return "none", None, False


def rows_for(want: int, half: bool) -> int:
    """Rows the first stage fetches by the index's order to keep ``want``."""
    return math.ceil(OVERFETCH * want) if half else want


def check_params(kind: str, lists: int | None, m: int, ef_construction: int) -> None:
    if kind not in INDEXES:
        raise ValueError(f"index kind must be one of {sorted(INDEXES)}, got {kind!r}")
    if kind == "ivfflat" and (lists is None or not 1 <= lists <= 32_768):
        raise ValueError(f"IVFFlat needs --lists in 1..32768 (pgvector's range), got {lists}; rows / 125 was "
                         "the best of those measured at 1M rows (docs/serve.md)")
    if kind == "hnsw":
        for name, v in (("m", m), ("ef_construction", ef_construction)):
            if not 2 <= v <= 1000:
                raise ValueError(f"HNSW {name} must be in 2..1000, got {v}")


def build_index(db: Database, kind: str, lists: int | None = None, m: int = 16, ef_construction: int = 64,
                work_mem: str = WORK_MEM, half_dims: int | None = None) -> float:
    """Build ``kind``'s index over the rows stored and put it in place of the current one, in one transaction:
    searches go on over the old index while the new one is built (a build blocks writes), the swap at the end is
    brief, and an interrupted build leaves the old index as it was. ``half_dims``: index the vectors (of this many
    dimensions) at half precision. -> seconds the build took."""
    from psycopg import errors, sql

    check_params(kind, lists, m, ef_construction)
    half = half_dims is not None
    create = sql.SQL(CREATE + (HALF_COLUMN if half else COLUMN) + (IVFFLAT if kind == "ivfflat" else HNSW)).format(
        name=sql.Identifier(NEW), method=sql.SQL("ivfflat" if kind == "ivfflat" else "hnsw"),
        dims=sql.Literal(int(half_dims or 0)), lists=sql.Literal(int(lists or 0)), m=sql.Literal(int(m)),
        efc=sql.Literal(int(ef_construction)))
    with db.connection() as conn, conn.transaction():
        conn.execute("SELECT set_config('maintenance_work_mem', %s, true)", [work_mem])
        t = time.perf_counter()
        try:
            conn.execute(create)
        except errors.ProgramLimitExceeded as err:  # IVFFlat's k-means or HNSW's graph does not fit
            raise ValueError(work_mem_advice(str(err).strip(), kind)) from err
        seconds = time.perf_counter() - t
        for name in ALL:
            conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("ALTER INDEX {} RENAME TO {}").format(
            sql.Identifier(NEW), sql.Identifier(INDEXES[kind] + ("" if half_dims is None else HALF))))
    return seconds


def work_mem_advice(message: str, kind: str) -> str:
    """PostgreSQL's "memory required is N MB, maintenance_work_mem is M MB" with what to run instead: ``--work-mem``
    of the whole gigabytes that hold N MB (IVFFlat's k-means sample grows with its lists)."""
    need = re.search(r"memory required is (\d+) MB", message)
    fix = f"--work-mem {-(-int(need[1]) // 1024)}GB" if need else "a larger --work-mem"
    return f"{message}: build it again with {fix}" + (" or fewer --lists" if kind == "ivfflat" else "")
