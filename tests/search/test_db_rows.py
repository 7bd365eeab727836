"""Writers of a database gallery killed for real (SIGKILL, through ``MMGEO_CRASH_AT``: the process kills itself at
that step) at 13 points — migrating, replacing a gallery, inside and after an add's transaction, removing, staging
and merging a build on several processes, between a build's batches and before its manifest — leave the gallery
consistent (every row whole and counted, the manifest's count the rows'), and the same write run again completes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
import psycopg  # noqa: E402

from mmgeo.search.database import (  # noqa: E402
    CRASH_ENV,
    LATEST,
    Database,
    DbGallery,
    Rows,
    add_rows,
    migrate,
    remove_images,
)
from mmgeo.search.db_build import build_db_from_embedding  # noqa: E402
from mmgeo.search.db_parallel import merge_staged, stage_rows  # noqa: E402
from serve.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = 20  # images in the gallery each crash starts from

WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from mmgeo.search.database import Database, DbGallery, create_gallery, migrate, remove_images
    from mmgeo.search.db_parallel import merge_staged, stage_rows
    from tests.search.test_db_rows import random_rows
    mode, url = sys.argv[1], sys.argv[2]
    db = Database(url)
    if mode == "migrate":
        migrate(db)
    elif mode == "create":
        create_gallery(db, DbGallery(db).manifest, {}, replace=True)
    elif mode == "rows":
        from mmgeo.search.database import add_rows
        add_rows(db, random_rows(DbGallery(db), 1, 50))
    elif mode == "remove":
        remove_images(db, [0, 1, 2])
    elif mode == "stage":
        stage_rows(db, list(range(40)), random_rows(DbGallery(db), 2, 40))
    elif mode == "merge":
        merge_staged(db, 40, chunk=10)
    print("done", flush=True)
""")


def random_rows(gallery, seed: int, n: int) -> Rows:
    """``n`` rows of random numbers the gallery can store (its sizes), named ``w{seed}/i``."""
    rng, sizes = np.random.default_rng(seed), gallery.store["row_bytes"]
    pooled = rng.standard_normal((n, gallery.model_record["d_global"])).astype(np.float32)
    return Rows([rng.bytes(32) for _ in range(n)], [{"path": f"w{seed}/{i}"} for i in range(n)], pooled,
                [rng.bytes(sizes["keys"]) for _ in range(n)], [rng.bytes(sizes["values"]) for _ in range(n)],
                [None] * n, [None] * n, [None] * n)


def query(url, sql, params=None):
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else None


def settled(url) -> None:
    """Wait until the server has ended the dead writer's transaction (it notices the closed socket)."""
    deadline = time.time() + 30
    while query(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                     "pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'")[0][0] and time.time() < deadline:
        time.sleep(0.1)


def consistent(url) -> int:
    """The gallery's invariants -> its image count: the manifest row's count is the rows', every row whole, every
    staged row whole."""
    (count,), = query(url, "SELECT image_count FROM mmgeo_gallery")
    (rows, bad), = query(url, "SELECT count(*), count(*) FILTER (WHERE length(key_codes) = 0 OR "
                              "length(value_codes) = 0 OR embedding IS NULL) FROM mmgeo_images")
    assert (count, bad) == (rows, 0)
    if query(url, "SELECT to_regclass('mmgeo_build_rows')")[0][0] is not None:
        assert query(url, "SELECT count(*) FROM mmgeo_build_rows WHERE length(key_codes) = 0")[0][0] == 0
    return count


def crash(url, point: str, *cmd: str) -> None:
    """Run ``cmd`` (a WRITER mode, or ``serve`` CLI arguments) with MMGEO_CRASH_AT=point: it must die by SIGKILL
    there."""
    argv = [sys.executable, "-m", "serve", *cmd] if len(cmd) > 1 else \
        [sys.executable, "-c", WRITER, cmd[0], url]
    env = {**os.environ, "PYTHONPATH": str(ROOT), CRASH_ENV: point}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    assert f"crash at {point}" in proc.stderr
    settled(url)


@pytest.fixture
def base(gallery_env, pg_url):
    """A gallery of BASE synthetic images (fp16) built with gallery_env's checkpoint -> its URL."""
    from mmgeo.data import ShapesWorld

    ds = ShapesWorld("test", 1, image_size=gallery_env.model.cfg.image_size)
    emb = gallery_env.model.encode_image([ds[i][0] for i in range(BASE)])
    build_db_from_embedding(gallery_env.model, emb, pg_url, ckpt=gallery_env.ckpt, codec="fp16")
    return pg_url


def test_a_killed_migration_is_finished_by_the_next(pg_url):
    crash(pg_url, f"migrate.{LATEST}", "migrate")  # the last migration's statements ran, not committed
    assert query(pg_url, "SELECT max(version) FROM mmgeo_schema_version") == [(LATEST - 1,)]
    assert query(pg_url, "SELECT to_regclass('mmgeo_keys')") == [(None,)]  # the last migration's table
    assert migrate(pg_url) == [LATEST]


@pytest.mark.slow
def test_writers_killed_at_each_step_leave_the_gallery_consistent(gallery_env, base):
    url, db = base, Database(base)
    manifest = DbGallery(db).manifest
    # replacing the gallery: killed before the commit, the old one is whole
    crash(url, "create.commit", "create")
    assert consistent(url) == BASE and DbGallery(db).manifest == manifest
    # an add of 50 images, killed in the COPY, before the insert, before the commit, after the commit
    for point in ("add.copy-half", "add.insert", "add.commit"):
        crash(url, point, "rows")
        assert consistent(url) == BASE, point
    crash(url, "add.done", "rows")
    assert consistent(url) == BASE + 50
    add_rows(db, random_rows(DbGallery(db), 1, 50))  # run again: a no-op, every image is there
    assert consistent(url) == BASE + 50
    # a removal, killed after the DELETE and before the commit: nothing removed; run again: removed
    for point in ("remove.count", "remove.commit"):
        crash(url, point, "remove")
        assert consistent(url) == BASE + 50 and len(DbGallery(db).rows([0, 1, 2])[1].nonzero()[0]) == 3
    assert remove_images(db, [0, 1, 2]) == [0, 1, 2] and consistent(url) == BASE + 47
    # a build on several processes: a batch killed in its staging COPY leaves nothing staged
    crash(url, "stage.copy-half", "stage")
    assert query(url, "SELECT count(*) FROM mmgeo_build_rows") == [(0,)]
    stage_rows(db, list(range(40)), random_rows(DbGallery(db), 2, 40))
    # its merge (chunks of 10) killed inside a chunk's transaction, then after the first chunk's commit
    crash(url, "merge.commit", "merge")
    assert consistent(url) == BASE + 47 and query(url, "SELECT count(*) FROM mmgeo_build_rows") == [(40,)]
    crash(url, "merge.between", "merge")
    assert consistent(url) == BASE + 57 and query(url, "SELECT count(*) FROM mmgeo_build_rows") == [(30,)]
    assert len(merge_staged(db, 40, chunk=10)) == 30
    assert consistent(url) == BASE + 87 and query(url, "SELECT count(*) FROM mmgeo_build_rows") == [(0,)]
    paths = [r[0] for r in query(url, "SELECT meta->>'path' FROM mmgeo_images WHERE meta->>'path' LIKE 'w2/%' "
                                      "ORDER BY id")]
    assert paths == [f"w2/{i}" for i in range(40)]  # in their build order
    # the CLI: `add` killed between two batches keeps the first; `build` killed before its manifest update
    folder = gallery_env.folder
    crash(url, "build.between", "add", "--db", url, "--images", str(folder), "--batch-size", "2", "--no-progress")
    assert consistent(url) == BASE + 89
    crash(url, "build.manifest", "build", "--db", url, "--images", str(folder), "--ckpt", str(gallery_env.ckpt),
          "--codec", "fp16", "--no-progress")
    assert consistent(url) == BASE + 92 and DbGallery(db).manifest["skipped"]["count"] == 0
    assert main(["build", "--db", url, "--images", str(folder), "--ckpt", str(gallery_env.ckpt), "--codec", "fp16",
                 "--no-progress"]) == 0
    assert consistent(url) == BASE + 92 and DbGallery(db).manifest["skipped"]["count"] == 1  # the corrupt file
    # the gallery still answers
    _, ids, _ = DbGallery(db).first_stage(np.ones((1, 16), np.float32), [200])
    assert (ids >= 0).sum() == BASE + 92
    db.close()

