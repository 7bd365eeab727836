"""API keys in the gallery's database (``mmgeo_keys``, schema v3: docs/design.md §12), for ``run --db URL
--db-keys`` and ``keys create|list|revoke --db URL``: the same records as a keys file (``serve.auth``), looked up
per request (a revoked key is refused at once by every replica); quotas charged in one statement."""

from __future__ import annotations

import time
from dataclasses import asdict, fields

from mmgeo.search.database import Database, as_database, migrate, schema_version
from serve.auth import AuthError, KeyRecord, KeyStore, over_quota

COLUMNS = [f.name for f in fields(KeyRecord)]
KEYS_SCHEMA = 3  # the schema version that made mmgeo_keys


class DbKeys(KeyStore):
    """Key records in ``mmgeo_keys`` of ``db`` (a ``Database`` or URL). ``create``: migrate the schema first
    (the keys command, run by the tables' owner); the service only reads and charges."""

    def __init__(self, db: Database | str, create: bool = False, **db_kwargs):
        super().__init__()
        self.db, self._own = as_database(db, **db_kwargs)
        if create:
            migrate(self.db)
        with self.db.connection() as conn:
            have = schema_version(conn)
        if have < KEYS_SCHEMA:
            self.close()
            raise ValueError(f"database {self.db.display} has mmgeo schema v{have}, without a keys table (v"
                             f"{KEYS_SCHEMA}): `python -m serve keys create --db URL ...` migrates it")

    def lookup(self, key_id: str) -> KeyRecord | None:
        with self.db.connection() as conn:
            got = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM mmgeo_keys WHERE id = %s",  # noqa: S608
                               [key_id]).fetchone()
        return None if got is None else KeyRecord(**dict(zip(COLUMNS, got)))

    def list(self) -> list[KeyRecord]:
        with self.db.connection() as conn:
            rows = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM mmgeo_keys "  # noqa: S608
                                "ORDER BY collection, created").fetchall()
        return [KeyRecord(**dict(zip(COLUMNS, r))) for r in rows]

    def add(self, record: KeyRecord) -> None:
        row = asdict(record)
        with self.db.connection() as conn:
            conn.execute(f"INSERT INTO mmgeo_keys ({', '.join(COLUMNS)}) "  # noqa: S608
                         f"VALUES ({', '.join(['%s'] * len(COLUMNS))})", [row[c] for c in COLUMNS])

    def revoke(self, key_id: str) -> KeyRecord:
        with self.db.connection() as conn:
            conn.execute("UPDATE mmgeo_keys SET revoked = coalesce(revoked, %s) WHERE id = %s", [time.time(), key_id])
        rec = self.lookup(key_id)
        if rec is None:
            raise ValueError(f"no key with id {key_id!r} in database {self.db.display} (python -m serve keys list)")
        return rec

    def charge(self, key_id: str, nbytes: int, images: int) -> None:
        """One statement: counted only when within both quotas (concurrent uploads cannot pass them together)."""
        with self.db.connection() as conn:
            ok = conn.execute("UPDATE mmgeo_keys SET used_bytes = used_bytes + %s, used_images = used_images + %s "
                              "WHERE id = %s AND (quota_bytes = 0 OR used_bytes + %s <= quota_bytes) "
                              "AND (quota_images = 0 OR used_images + %s <= quota_images) RETURNING id",
                              [nbytes, images, key_id, nbytes, images]).fetchone()
        if ok is None:
            rec = self.lookup(key_id)
            raise AuthError(403, (over_quota(rec, nbytes, images) if rec else None) or "upload quota used",
                            key_id=key_id)

    def close(self) -> None:
        if self._own:
            self.db.close()


def check_service_role(db: Database) -> None:
    """Refuse a connection whose role sees past row-level security (a superuser, or BYPASSRLS): the service must
    not be able to read another collection's rows even through a query without the collection in it."""
    with db.connection() as conn:
        name, bypass = conn.execute("SELECT current_user, rolsuper OR rolbypassrls FROM pg_roles "
                                    "WHERE rolname = current_user").fetchone()
    if bypass:
        raise ValueError(f"the service's database role {name!r} is a superuser or has BYPASSRLS, so row-level "
                         "security would not keep collections apart: connect as a role made for the service "
                         "(docs/serve.md, 'Keys and collections')")


def open_db_collections(keys: DbKeys, ef_search: int | None = None, db_read: str | None = None,
                        parallel: int = 1, probes: int | None = None, **db_kwargs) -> dict:
    """collection -> ``DbGallery`` for every collection a key of ``keys`` names and the database holds a gallery
    of, all over the keys' connection pool (``db_read``: a pool of its own to read through); ValueError when none.
    Each is loaded in its collection (``COLLECTION``)."""
    import logging

    from mmgeo.search.database import DbGallery
    from mmgeo.search.db_connect import COLLECTION
    from mmgeo.search.store import GalleryError

    check_service_role(keys.db)
    reader = as_database(db_read, **db_kwargs)[0] if db_read else None
    galleries, missing = {}, []
    for name in sorted({r.collection for r in keys.list() if r.revoked is None}):
        token = COLLECTION.set(name)
        try:
            galleries[name] = DbGallery(keys.db, ef_search=ef_search, parallel=parallel, probes=probes,
                                        **({"read": reader} if reader else {}))
        except GalleryError:
            missing.append(name)
        finally:
            COLLECTION.reset(token)
    if missing:
        logging.getLogger("serve.app").warning("keys name collections with no gallery in database %s: %s (their "
                                               "keys are refused)", keys.db.display, ", ".join(missing))
    if not galleries:
        raise ValueError(f"no key of database {keys.db.display} opens a collection with a gallery: build one "
                         "(`python -m serve build --db URL --collection NAME`) and make keys for it")
    return galleries
