"""The gallery in PostgreSQL + pgvector (mmgeo.search.database, db_build) against a real server started from the
pgserver wheel (tests/pg.py): the same answers as an index directory with the same codec, live adds and removals,
idempotent re-adds, all-or-nothing writes under SIGKILL, parameters only, and refused damaged codebooks."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mmgeo
from mmgeo.search.build import build_gallery_from_embedding, folder_items
from mmgeo.search.store import Gallery, GalleryError
from mmgeo.search.two_stage import search_texts
from tests.conftest import TINY
from tests.search.conftest import write_folder

database = pytest.importorskip("mmgeo.search.database")
psycopg = pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
from psycopg import sql  # noqa: E402

from mmgeo.search.database import (  # noqa: E402
    Database,
    DbGallery,
    Rows,
    add_rows,
    display_url,
    migrate,
    parse_db,
    parse_ids,
    remove_images,
)
from mmgeo.search.db_build import add_items, build_db_from_embedding, encode_codes, encoded_sha256  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N_IMAGES = 120  # x 16 patches: 1,920 real patches per head, enough for rq8's 256 codewords


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mmgeo.create_model("geo-tiny", **TINY).eval()


@pytest.fixture(scope="module")
def split(model):
    """The first N_IMAGES synthetic test images and their captions, encoded."""
    from mmgeo.data import ShapesWorld
    from mmgeo.eval.retrieval import encode_split

    ds = ShapesWorld("test", 0, image_size=model.cfg.image_size)
    with torch.inference_mode():
        return encode_split(model, torch.utils.data.Subset(ds, range(N_IMAGES)), batch_size=64, progress=False)


def query(conn_url, sql, params=None):
    with psycopg.connect(conn_url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else None


def consistent(url) -> int:
    """The gallery's invariants -> its image count: the stored count is the rows', every row complete."""
    (count,), = query(url, "SELECT image_count FROM mmgeo_gallery")
    (rows, bad), = query(url, "SELECT count(*), count(*) FILTER (WHERE length(key_codes) = 0 OR "
                              "length(value_codes) = 0) FROM mmgeo_images")
    assert (count, bad) == (rows, 0)
    return count


# ------------------------------------------------------------------------------------------------ engine

def test_parse_db_and_display_url():
    assert parse_db("postgresql://u:secret@h:5432/db") == ("url", "postgresql://u:secret@h:5432/db")
    assert parse_db("local:pgdata") == ("local", "pgdata")
    for bad in ("", "local:", "mysql://x", "pgdata", "sqlite:///x"):
        with pytest.raises(ValueError, match="--db"):
            parse_db(bad)
    assert display_url("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    assert "secret" not in display_url("postgres://me:secret@127.0.0.1:5/x?sslmode=require")


def test_local_refuses_a_folder_of_other_files(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.png").write_bytes(b"x")
    with pytest.raises(ValueError, match="no PostgreSQL data"):
        Database(f"local:{tmp_path / 'photos'}")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Database(f"local:{tmp_path / 'f'}")


def test_sessions_run_without_jit_and_keep_the_urls_own_options(pg_url, monkeypatch):
    """JIT is off for the gallery's sessions (``SESSION_SETTINGS``), and what the URL's ``options`` or PGOPTIONS set
    is kept beside the service's statement_timeout, winning where both set one (it was dropped before)."""
    def settings(url):
        with Database(url, statement_timeout=3.0) as db, db.connection() as conn:
            return [conn.execute(f"SHOW {s}").fetchone()[0] for s in ("jit", "search_path", "statement_timeout")]

    monkeypatch.delenv("PGOPTIONS", raising=False)
    assert settings(pg_url) == ["off", '"$user", public', "3s"]
    own = "options=-c%20search_path%3Delsewhere%2Cpublic%20-c%20statement_timeout%3D7000"
    assert settings(f"{pg_url}{'&' if '?' in pg_url else '?'}{own}") == ["off", "elsewhere,public", "7s"]
    monkeypatch.setenv("PGOPTIONS", "-c search_path=from_env")
    assert settings(pg_url) == ["off", "from_env", "3s"]


def test_a_gallery_in_another_schema_is_read_from_it(model, split, pg_url):
    """One gallery per schema (docs/serve.md): built through a URL whose ``options`` set the search_path, it is the
    one a reader with the service's statement_timeout opens, not the empty ``public`` schema."""
    query(pg_url, "CREATE SCHEMA other")
    url = f"{pg_url}{'&' if '?' in pg_url else '?'}options=-csearch_path%3Dother"
    assert build_db_from_embedding(model, split.images, url, codec="fp16")["added"] == N_IMAGES
    assert query(pg_url, "SELECT to_regclass('public.mmgeo_images') IS NULL") == [(True,)]
    with DbGallery(url, statement_timeout=10.0) as db:
        assert db.count == N_IMAGES


def test_pgvector_hnsw_inner_product_works(pg_url):
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v vector(3))")
        conn.execute("INSERT INTO t SELECT i, ARRAY[cos(i), sin(i), 0.5]::vector FROM generate_series(0, 199) i")
        conn.execute("CREATE INDEX ON t USING hnsw (v vector_ip_ops)")
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN SELECT id FROM t ORDER BY v <#> '[1,0,0]' LIMIT 3"))
        assert "t_v_idx" in plan
        got = [r[0] for r in conn.execute("SELECT id FROM t ORDER BY v <#> '[1,0,0]' LIMIT 1")]
    assert got == [0]  # cos(0) = 1: the largest inner product with [1, 0, 0]


def test_migrations_apply_once_in_order(pg_url):
    assert migrate(pg_url) == list(range(1, database.LATEST + 1))
    assert migrate(pg_url) == []
    rows = query(pg_url, "SELECT version, name FROM mmgeo_schema_version ORDER BY version")
    assert rows == [(v, n) for v, n, _ in database.migration_files()]
    with pytest.raises(GalleryError, match="holds no gallery"):
        DbGallery(pg_url)


def test_a_reader_refuses_a_database_without_the_schema(pg_url):
    with pytest.raises(GalleryError, match="schema v0"):
        DbGallery(pg_url)


# ------------------------------------------------------------------------------------------------ same answers

@pytest.mark.parametrize("codec", ["rq8", "fp16"])
def test_same_top_k_and_scores_as_the_index_directory(model, split, pg_url, tmp_path, codec):
    """Same images, same codec: the database gallery answers every caption of the split as the FAISS folder does
    (ids and scores), through the table scan the planner picks for a small table and through the HNSW index."""
    build_gallery_from_embedding(model, split.images, tmp_path / "idx", index_type="flat", codec=codec)
    folder = Gallery(tmp_path / "idx")
    assert build_db_from_embedding(model, split.images, pg_url, codec=codec)["added"] == N_IMAGES
    texts = split.texts[:60]
    want = search_texts(model, folder, texts, [10] * 60, [True] * 60, k_prime=50)
    with DbGallery(pg_url) as db:
        assert db.count == N_IMAGES and db.codec == codec
        for rerank in (True, False):
            got = search_texts(model, db, texts, [10] * 60, [rerank] * 60, k_prime=50)
            ref = want if rerank else search_texts(model, folder, texts, [10] * 60, [False] * 60, k_prime=50)
            for (gi, gs), (wi, ws) in zip(got, ref):
                np.testing.assert_array_equal(gi, wi)
                np.testing.assert_allclose(gs, ws, rtol=0, atol=1e-5)
    with psycopg.connect(pg_url, autocommit=True) as conn:  # every later connection: no table scans
        name = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute(sql.SQL("ALTER DATABASE {} SET enable_seqscan = off").format(sql.Identifier(name)))
    with DbGallery(pg_url, ef_search=1000) as db:  # new connections: the planner must use the HNSW index now
        with db.db.connection() as conn:
            plan = "\n".join(r[0] for r in conn.execute(
                "EXPLAIN " + database.FIRST_STAGE.format(codes=database.CODE_COLUMNS),
                [[database.vector_text(np.ones(16))], [50]]))
            plan += "\n".join(r[0] for r in conn.execute("EXPLAIN " + database.FAN_OUT.format(
                codes=database.CODE_COLUMNS, limit=50), [database.vector_text(np.ones(16))] * 2))  # one caption's
        assert plan.count("mmgeo_images_embedding_hnsw") == 2
        got = search_texts(model, db, texts, [10] * 60, [True] * 60, k_prime=50)
    for (gi, gs), (wi, ws) in zip(got, want):  # a candidate list over all 120 images: HNSW's top 50 is exact
        np.testing.assert_array_equal(gi, wi)
        np.testing.assert_allclose(gs, ws, rtol=0, atol=1e-5)


def test_a_first_stage_split_over_connections_answers_as_one(model, split, pg_url):
    """``parallel``: a batch's captions searched in parts, each on its own connection at once, give the scores, ids
    and candidate rows of the one query (ragged ``want`` included), and a batch smaller than the parts works."""
    build_db_from_embedding(model, split.images, pg_url, codec="rq8")
    q = split.texts.pooled[:7].float().numpy()  # (7, d_g)
    want = [5, 40, 1, 17, 40, 3, 9]
    with DbGallery(pg_url) as one, DbGallery(pg_url, parallel=3) as three:
        s1, i1, r1 = one.first_stage(q, want)
        s3, i3, r3 = three.first_stage(q, want)
        np.testing.assert_array_equal(i3, i1)
        np.testing.assert_allclose(s3, s1, rtol=0, atol=1e-6)  # the same SQL per caption: the same order
        for role in ("keys", "values"):
            np.testing.assert_array_equal(r3.codes[role], r1.codes[role])
        assert r1.codes["keys"].any()  # real rows, not only the padding
        _, i_small, _ = three.first_stage(q[:2], want[:2], codes=False)
        np.testing.assert_array_equal(i_small, i1[:2, :40])
    with pytest.raises(ValueError, match="parallel=0"):
        DbGallery(pg_url, parallel=0)


def test_caption_by_caption_first_stage_answers_as_the_batch(model, split, pg_url):
    """``each_first_stage``: each caption in its own round trip, ``parallel`` at once, yields in order what the
    batch query gives that caption (ids, scores, codes); the two-stage answers do not depend on ``parallel``; a
    consumer that stops early leaves the gallery serving."""
    build_db_from_embedding(model, split.images, pg_url, codec="rq8", replace=True)
    texts = split.texts[:7]
    q = texts.pooled.float().numpy()  # (7, d_g)
    want = [5, 40, 1, 17, 40, 3, 9]
    with DbGallery(pg_url) as one, DbGallery(pg_url, parallel=3) as three:
        s, ids, rows = one.first_stage(q, want)
        for g in (one, three):
            got = list(g.each_first_stage(q, want))
            assert len(got) == len(q)
            for i, (si, ii, ri) in enumerate(got):  # matched by id: rows of equal scores may come in either order
                assert len(ii) == want[i] and ri.count == want[i]
                a, b = np.argsort(ii, kind="stable"), np.argsort(ids[i, :want[i]], kind="stable")
                np.testing.assert_array_equal(ii[a], ids[i, :want[i]][b])
                np.testing.assert_allclose(si, s[i, :want[i]], rtol=0, atol=1e-6)
                for role in ("keys", "values"):
                    np.testing.assert_array_equal(ri.codes[role][a], rows.codes[role][i * 40:i * 40 + want[i]][b])
        a = search_texts(model, one, texts, [10] * 7, [True, False] * 3 + [True], k_prime=40)
        b = search_texts(model, three, texts, [10] * 7, [True, False] * 3 + [True], k_prime=40)
        for (ai, as_), (bi, bs) in zip(a, b):
            np.testing.assert_array_equal(bi, ai)
            np.testing.assert_allclose(bs, as_, rtol=0, atol=1e-6)
        stream = three.each_first_stage(q, want)
        next(stream)
        stream.close()  # the searches still queued are dropped, the running ones give their connections back
        np.testing.assert_array_equal(np.sort(next(three.each_first_stage(q[:1], [5]))[1]), np.sort(ids[0, :5]))


def test_evaluation_gives_the_same_recall_over_both_galleries(model, split, pg_url, tmp_path):
    from mmgeo.eval.metrics import retrieval_metrics
    from mmgeo.eval.two_stage import evaluate_split

    build_gallery_from_embedding(model, split.images, tmp_path / "idx", index_type="flat", codec="rq8")
    build_db_from_embedding(model, split.images, pg_url, codec="rq8")
    with DbGallery(pg_url) as db:
        results = [evaluate_split(model, split, k_prime=20, gallery=g, progress=False)
                   for g in (Gallery(tmp_path / "idx"), db)]
    (a, rec_a), (b, rec_b) = results
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert retrieval_metrics(a, split.text_to_image) == retrieval_metrics(b, split.text_to_image)
    assert rec_b["two_stage"]["index_type"] == "pgvector-hnsw" and "secret" not in rec_b["two_stage"]["index"]


def test_check_images_and_model(model, split, pg_url):
    build_db_from_embedding(model, split.images, pg_url, codec="fp16")
    with DbGallery(pg_url) as db:
        db.check_images(split.images)
        db.check_model(model)
        with pytest.raises(GalleryError, match="not image"):
            db.check_images(split.images[torch.arange(N_IMAGES).roll(1)])
        other = mmgeo.create_model("geo-tiny", **{**TINY, "d_global": 32})
        with pytest.raises(GalleryError, match="does not match"):
            db.check_model(other)


# ------------------------------------------------------------------------------------------------ live updates

def test_add_remove_and_idempotent_re_add(model, split, pg_url, tmp_path):
    first = split.images[:40]
    assert build_db_from_embedding(model, first, pg_url, codec="fp16") == {"added": 40, "existing": 0, "count": 40}
    assert build_db_from_embedding(model, first, pg_url, codec="fp16") == {"added": 0, "existing": 40, "count": 40}
    folder = write_folder(tmp_path / "photos")
    items, n = folder_items(folder)
    with DbGallery(pg_url) as db:
        out = add_items(model, db, items, n)
        assert len(out["added"]) == 5 and len(out["skipped"]) == 1 and out["count"] == 45
        assert [i for _, i in out["added"]] == list(range(40, 45))  # ids in file order after the first 40
        again = add_items(model, db, items, n)
        assert again["added"] == [] and sorted(again["existing"]) == sorted(out["added"]) and again["count"] == 45
        path, new_id = out["added"][0]
        loader = next(src for p, src in items if str(p) == path)
        assert db.image_path(new_id) == Path(path).resolve()
        rec = db.image_record(new_id)
        assert rec["width"] > 0 and not rec["stored_file"]
        # the new image is found by its own global vector, and is gone once removed
        emb = model.encode_image([loader()])
        _, ids, _ = db.first_stage(emb.pooled.numpy(), [1], codes=False)
        assert ids[0, 0] == new_id
        assert remove_images(db.db, [new_id, 41, 999]) == sorted([new_id, 41])
        assert db.count == 43 and db.image_record(new_id) is None and consistent(pg_url) == 43
        _, ids, _ = db.first_stage(emb.pooled.numpy(), [45], codes=False)
        assert new_id not in ids and 41 not in ids and (ids >= 0).sum() == 43
        # removed, then added again: a new id (ids are never reused)
        back = add_items(model, db, [(path, loader)])
        assert back["added"][0][1] == 45


def test_generated_images_are_kept_in_the_gallery(model, pg_url):
    from mmgeo.data import ShapesWorld

    ds = ShapesWorld("test", 0, image_size=model.cfg.image_size)
    build_db_from_embedding(model, model.encode_image([ds[i][0] for i in range(20)]), pg_url, codec="fp16")
    with DbGallery(pg_url) as db:
        out = add_items(model, db, [(None, ds[20][0]), (None, ds[21][0]), (None, ds[20][0])])
        (_, a), (_, b) = out["added"]
        assert out["existing"] == [(None, a)]  # the same picture twice in one batch: stored once
        png = db.image_file(a)
        assert png.startswith(b"\x89PNG") and db.image_path(a) is None
        import io

        from PIL import Image

        assert Image.open(io.BytesIO(png)).size == ds[20][0].size


def test_concurrent_writers_store_each_image_once(model, split, pg_url):
    build_db_from_embedding(model, split.images[:20], pg_url, codec="fp16")
    with DbGallery(pg_url) as db:
        batches = [split.images[20:70], split.images[45:100]]  # overlapping: 45..69 in both
        rows = []
        for emb in batches:
            keys, values, mask = encode_codes(db, emb)
            rows.append(Rows([encoded_sha256(emb, i) for i in range(len(emb))], [{"path": "x"}] * len(emb),
                             emb.pooled.numpy(), keys, values, mask, [None] * len(emb), [None] * len(emb)))
        results = [None, None]

        def write(i):
            with Database(pg_url) as own:
                results[i] = add_rows(own, rows[i])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert consistent(pg_url) == 100
        (ids0, new0), (ids1, new1) = results
        assert int(new0.sum() + new1.sum()) == 80
        np.testing.assert_array_equal(ids0[25:], ids1[:25])  # the shared images got one id each
        assert len(set(ids0) | set(ids1)) == 80


# ------------------------------------------------------------------------------------------------ crashes

WRITER = textwrap.dedent("""
    import sys, time, numpy as np
    from mmgeo.search.database import Database, DbGallery, Rows, add_rows
    url, stop_at, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    db = Database(url)
    g = DbGallery(db)
    rng = np.random.default_rng(seed)
    n, sizes = 50, g.store["row_bytes"]
    pooled = rng.standard_normal((n, g.model_record["d_global"])).astype(np.float32)
    rows = Rows([rng.bytes(32) for _ in range(n)], [{"path": f"w{seed}/{i}"} for i in range(n)], pooled,
                [rng.bytes(sizes["keys"]) for _ in range(n)], [rng.bytes(sizes["values"]) for _ in range(n)],
                [None] * n, [None] * n, [None] * n)
    def step(name):
        if name == stop_at:
            print("at", name, flush=True)
            time.sleep(60)
    add_rows(db, rows, step)
    print("done", flush=True)
""")


def run_writer(url, stop_at, seed):
    return subprocess.Popen([sys.executable, "-c", WRITER, url, stop_at, str(seed)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_killed_writer_leaves_no_half_batch(model, split, pg_url):
    """SIGKILL a writer at each step of its transaction: the gallery keeps what it had, every row complete and
    counted; the same batch written afterwards is stored whole."""
    build_db_from_embedding(model, split.images[:20], pg_url, codec="fp16")
    for seed, stop_at in enumerate(("copy", "insert", "count", "commit")):
        proc = run_writer(pg_url, stop_at, seed)
        try:
            assert proc.stdout.readline().strip() == f"at {stop_at}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
        deadline = time.time() + 30  # the server ends the dead client's transaction when it sees the socket close
        while query(pg_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'mmgeo' AND "
                            "state LIKE 'idle in transaction%'")[0][0] and time.time() < deadline:
            time.sleep(0.1)
        assert consistent(pg_url) == 20, f"killed at {stop_at}"
        assert query(pg_url, "SELECT count(*) FROM mmgeo_images WHERE meta->>'path' LIKE %s", [f"w{seed}/%"]) == [(0,)]
    proc = run_writer(pg_url, "never", 0)
    assert proc.stdout.read().strip() == "done" and proc.wait(60) == 0
    assert consistent(pg_url) == 70
    with DbGallery(pg_url) as db:
        db.first_stage(np.ones((1, 16), np.float32), [70])  # still searchable


# ------------------------------------------------------------------------------------------------ hostile input

SQLISH = ["1; DROP TABLE mmgeo_images", "1 OR 1=1", "-1", "1.5", "", " 1", "0x10", "١", "9" * 19]


@pytest.mark.parametrize("raw", SQLISH + [True, None, 2**63, -3])
def test_malformed_ids_are_refused(raw):
    with pytest.raises(ValueError, match="image id"):
        parse_ids([raw])


def test_sql_looking_strings_are_data(model, split, pg_url, tmp_path):
    build_db_from_embedding(model, split.images[:20], pg_url, codec="fp16")
    with DbGallery(pg_url) as db:
        with pytest.raises(ValueError):
            remove_images(db.db, ["0; DELETE FROM mmgeo_images"])
        assert db.count == 20
        name = "x'); DROP TABLE mmgeo_images; --.png"
        folder = tmp_path / "hostile"
        folder.mkdir()
        from PIL import Image

        Image.new("RGB", (20, 20), "red").save(folder / name)
        (path, i), = add_items(model, db, *folder_items(folder))["added"]
        assert db.image_record(i)["name"] == name and db.image_path(i).name == name
        assert db.count == 21 and consistent(pg_url) == 21


# ------------------------------------------------------------------------------------------------ codebooks

def test_damaged_or_foreign_codebooks_are_refused(model, split, pg_url):
    build_db_from_embedding(model, split.images, pg_url, codec="rq8")
    DbGallery(pg_url).close()
    query(pg_url, "UPDATE mmgeo_codebooks SET data = data || '\\x00'::bytea WHERE role = 'keys' AND head = 0")
    with pytest.raises(GalleryError, match="SHA-256"):
        DbGallery(pg_url)
    # bytes and their stored hash changed together (another gallery's codebook): the manifest's record refuses it
    query(pg_url, "UPDATE mmgeo_codebooks SET sha256 = encode(sha256(data), 'hex') WHERE role = 'keys' AND head = 0")
    with pytest.raises(GalleryError, match="not the one this index was built with"):
        DbGallery(pg_url)
    query(pg_url, "DELETE FROM mmgeo_codebooks WHERE role = 'values' AND head = 1")
    with pytest.raises(GalleryError, match="missing|SHA-256|not the one"):
        DbGallery(pg_url)


def test_build_refuses_a_gallery_of_another_codec_unless_replaced(model, split, pg_url):
    build_db_from_embedding(model, split.images[:40], pg_url, codec="fp16")
    with pytest.raises(GalleryError, match="fp16, not rq8"):
        build_db_from_embedding(model, split.images, pg_url, codec="rq8")
    out = build_db_from_embedding(model, split.images, pg_url, codec="rq8", replace=True)
    assert out == {"added": N_IMAGES, "existing": 0, "count": N_IMAGES}
    with DbGallery(pg_url) as db:
        assert db.codec == "rq8" and db.rows([0])[1].all()  # ids start again at 0
    manifest = json.loads(json.dumps(query(pg_url, "SELECT manifest FROM mmgeo_gallery")[0][0]))
    assert manifest["store"]["codebook_bytes"] > 0 and manifest["index_type"] == "pgvector-hnsw"
