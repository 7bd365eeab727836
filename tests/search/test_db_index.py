"""The database gallery's index over global vectors (mmgeo.search.db_index): IVFFlat built over the stored rows in
place of HNSW and back, found by a reader on load, searched with its probes (all lists: the exact top k); a new
gallery starts on HNSW again; ``serve index`` and its errors."""

import numpy as np
import pytest

from tests.search.conftest import encode_test_images

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
from mmgeo.search.database import DbGallery, vector_text  # noqa: E402
from mmgeo.search.db_build import build_db_from_embedding  # noqa: E402
from mmgeo.search.db_index import ALL, FOUND, HALF, INDEXES, build_index, default_probes  # noqa: E402

N_IMAGES = 80


@pytest.fixture(scope="module")
def encoded():
    """A tiny model and the first N_IMAGES synthetic test images and their captions, encoded."""
    return encode_test_images(N_IMAGES)


def indexes(db) -> set[str]:
    with db.connection() as conn:
        return {r[0] for r in conn.execute(FOUND, [ALL]).fetchall()}


def test_ivfflat_in_place_of_hnsw_and_back(encoded, pg_url):
    model, split = encoded
    build_db_from_embedding(model, split.images, pg_url, codec="fp16")
    q = split.texts.pooled[:12].float().numpy()  # (12, d_g)
    x = split.images.pooled.float().numpy()  # (N, d_g)
    s_exact = q @ x.T  # (12, N)
    tenth = -np.sort(-s_exact, axis=1)[:, 9:10]  # (12, 1) each caption's 10th best score

    def in_exact_top10(ids):  # (12, 10) -> which ids are among the exact top 10, up to ties and float rounding
        return (ids >= 0) & (np.take_along_axis(s_exact, np.maximum(ids, 0), 1) >= tenth - 1e-5)

    with DbGallery(pg_url) as g:
        assert (g.index_kind, g.manifest["index_type"], g.probes) == ("hnsw", "pgvector-hnsw", None)
        assert build_index(g.db, "ivfflat", lists=4) >= 0
        assert indexes(g.db) == {INDEXES["ivfflat"]}
    with DbGallery(pg_url) as g:  # found on load; all four lists scanned: the exact top 10
        assert (g.index_kind, g.lists, g.probes) == ("ivfflat", 4, default_probes(4)) and default_probes(4) == 2
        assert g.manifest["index_type"] == "pgvector-ivfflat"
        with g.db.connection() as conn, conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            plan = "\n".join(r[0] for r in conn.execute(
                "EXPLAIN SELECT id FROM mmgeo_images ORDER BY embedding <#> %s::vector LIMIT 10", [vector_text(q[0])]))
        assert INDEXES["ivfflat"] in plan
    with DbGallery(pg_url, probes=4, parallel=2) as g:
        scores, ids, _ = g.first_stage(q, [10] * len(q), codes=False)
        assert in_exact_top10(ids).all()
        np.testing.assert_allclose(scores, np.take_along_axis(s_exact, ids, 1), rtol=0, atol=1e-5)
    with DbGallery(pg_url, probes=1) as g:  # one list of four: some caption misses part of its top 10
        _, ids, _ = g.first_stage(q, [10] * len(q), codes=False)
        assert not in_exact_top10(ids).all()
        build_index(g.db, "hnsw", m=8, ef_construction=32)
        assert indexes(g.db) == {INDEXES["hnsw"]}
        build_index(g.db, "ivfflat", lists=3)
    build_db_from_embedding(model, split.images[:20], pg_url, codec="fp16", replace=True)  # a new gallery: HNSW
    with DbGallery(pg_url) as g:
        assert g.index_kind == "hnsw" and g.count == 20


def test_an_index_at_half_precision(encoded, pg_url):
    """``half_dims``: IVFFlat or HNSW over ``embedding::halfvec(d)``, found on load; the planner uses it for the
    batch and the caption-by-caption statements; with every list scanned the first stage is the exact top 10 with
    full-precision scores (the over-fetched rows re-sorted by the full vectors)."""
    from mmgeo.search import database

    model, split = encoded
    build_db_from_embedding(model, split.images, pg_url, codec="fp16", replace=True)
    q = split.texts.pooled[:12].float().numpy()  # (12, d_g)
    s_exact = q @ split.images.pooled.float().numpy().T  # (12, N)
    tenth = -np.sort(-s_exact, axis=1)[:, 9:10]
    d = q.shape[1]
    for kind, params in (("ivfflat", {"lists": 4}), ("hnsw", {"m": 8, "ef_construction": 64})):
        with DbGallery(pg_url) as g:
            build_index(g.db, kind, half_dims=d, **params)
            assert indexes(g.db) == {INDEXES[kind] + HALF}
        with DbGallery(pg_url, probes=4, ef_search=400, parallel=2) as g:
            assert (g.index_kind, g.half, g.manifest["index_type"]) == (kind, True, f"pgvector-{kind}-halfvec")
            with g.db.connection() as conn, conn.transaction():
                conn.execute("SET LOCAL enable_seqscan = off")
                text = vector_text(q[0])
                plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + database.FAN_OUT_HALF.format(
                    codes="", take=12, limit=10, dims=d), [text, text]))
            assert INDEXES[kind] + HALF in plan
            scores, ids, rows = g.first_stage(q, [10] * len(q))  # FIRST_STAGE_HALF, with the rows' codes
            each = list(g.each_first_stage(q, [10] * len(q)))  # FAN_OUT_HALF
            for i, (_, got_ids, got) in enumerate(each):  # the same rows' keys, matched by id (ties may swap)
                a, b = np.argsort(got_ids, kind="stable"), np.argsort(ids[i], kind="stable")
                np.testing.assert_array_equal(got_ids[a], ids[i][b])
                np.testing.assert_array_equal(got.keys[a], rows.keys[i * 10:i * 10 + 10][b])
        for got_ids, got_scores in [(ids, scores), (np.stack([e[1] for e in each]), np.stack([e[0] for e in each]))]:
            assert (np.take_along_axis(s_exact, got_ids, 1) >= tenth - 1e-5).all()
            np.testing.assert_allclose(got_scores, np.take_along_axis(s_exact, got_ids, 1), rtol=0, atol=1e-5)
            assert (np.diff(got_scores, axis=1) <= 1e-6).all()  # best first
    with DbGallery(pg_url) as g:
        build_index(g.db, "hnsw")
        assert indexes(g.db) == {INDEXES["hnsw"]}
    with DbGallery(pg_url) as g:
        assert not g.half


def test_search_settings_held_by_the_session_follow_each_search(encoded, pg_url):
    """Outside a transaction a caption is one statement under ``hnsw.ef_search`` / ``ivfflat.probes`` SET for the
    connection's session (``session_rows``): each call's own probes hold (4 lists of 4: the exact top 10; 1: not),
    a session reset behind the service's back is found and that search done again with SET LOCAL, and a search in
    a transaction (a collection's) sets them for the transaction alone."""
    from mmgeo.search import database

    model, split = encoded
    build_db_from_embedding(model, split.images, pg_url, codec="fp16", replace=True)
    q = split.texts.pooled[:12].float().numpy()  # (12, d_g)
    s_exact = q @ split.images.pooled.float().numpy().T  # (12, N)
    tenth = -np.sort(-s_exact, axis=1)[:, 9:10]

    with DbGallery(pg_url) as g:
        build_index(g.db, "ivfflat", lists=4)

    def exact(conn, probes) -> bool:  # every caption has 10 rows, all among its exact top 10 (up to float rounding)
        got: dict[int, list[int]] = {}
        for r in database.fan_out_rows(conn, q, [10] * len(q), 40, False, False, probes):
            got.setdefault(r[0] - 1, []).append(r[1])  # a list scanned alone may hold fewer than 10 rows
        return all(len(got.get(c, [])) == 10 and bool((s_exact[c, got[c]] >= tenth[c] - 1e-5).all())
                   for c in range(len(q)))

    def session_probes(conn) -> int:
        return int(conn.execute("SELECT current_setting('ivfflat.probes')").fetchone()[0])

    with DbGallery(pg_url) as g, g.db.connection() as conn:
        conn.execute("SET enable_seqscan = off")  # the index even over 80 rows (else an exact scan and sort)
        assert exact(conn, 4) and database._SESSION[conn] == (40, 4) and session_probes(conn) == 4
        assert not exact(conn, 1) and session_probes(conn) == 1
        assert exact(conn, 4)
        conn.execute("RESET ALL")  # the session's settings gone, unknown to the service
        conn.execute("SET enable_seqscan = off")
        assert exact(conn, 4) and conn not in database._SESSION  # found, searched again with SET LOCAL
        assert session_probes(conn) == 1  # pgvector's default: the retry changed nothing for the session
        assert exact(conn, 4) and database._SESSION[conn] == (40, 4)  # SET again on the next search
        with conn.transaction():
            assert not exact(conn, 1)
        assert session_probes(conn) == 4


def test_bad_parameters_are_refused_before_any_work(encoded, pg_url):
    from mmgeo.search.db_index import check_params

    for kind, lists, m, efc, match in (("ivfflat", None, 16, 64, "needs --lists"), ("ivfflat", 0, 16, 64, "1..32768"),
                                       ("hnsw", None, 1, 64, "m must be"), ("ivf", 4, 16, 64, "kind must be")):
        with pytest.raises(ValueError, match=match):
            check_params(kind, lists, m, efc)
    with pytest.raises(ValueError, match="probes=0"):
        DbGallery(pg_url, probes=0)


def test_an_index_too_big_for_its_memory_says_how_much_to_give(encoded, pg_url):
    from mmgeo.search.db_index import work_mem_advice

    model, split = encoded
    build_db_from_embedding(model, split.images[:20], pg_url, codec="fp16", replace=True)
    advice = r"memory required is \d+ MB.*--work-mem \d+GB or fewer"
    with DbGallery(pg_url) as g, pytest.raises(ValueError, match=advice):
        build_index(g.db, "ivfflat", lists=30000, work_mem="1MB")  # k-means samples 50 rows a list
    with DbGallery(pg_url) as g:
        assert indexes(g.db) == {INDEXES["hnsw"]}  # the failed build left the old index
    assert work_mem_advice("memory required is 12563 MB, maintenance_work_mem is 4096 MB", "ivfflat").endswith(
        "build it again with --work-mem 13GB or fewer --lists")
    assert work_mem_advice("out of memory", "hnsw").endswith("build it again with a larger --work-mem")


def test_serve_index_command(encoded, pg_url, capsys):
    from serve.cli import main

    model, split = encoded
    build_db_from_embedding(model, split.images, pg_url, codec="fp16", replace=True)
    assert main(["index", "--db", pg_url, "--kind", "ivfflat", "--lists", "5"]) == 0
    out = capsys.readouterr().out
    assert f"ivfflat index over {N_IMAGES} images" in out and "scans 3 by default" in out and "in place of hnsw" in out
    assert main(["index", "--db", pg_url, "--kind", "ivfflat"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: IVFFlat needs --lists") and "\n" not in err
    assert main(["index", "--db", pg_url, "--kind", "hnsw", "--half"]) == 0
    assert "built the hnsw-halfvec index" in capsys.readouterr().out
    assert main(["index", "--db", pg_url, "--kind", "hnsw"]) == 0
    assert "in place of hnsw-halfvec" in capsys.readouterr().out


def test_serve_index_over_a_database_of_named_collections(encoded, pg_url, capsys):
    """The index is the table's: ``serve index --collection NAME`` rebuilds it from a database whose galleries are
    all in named collections (the collection only says which gallery to check and count)."""
    from mmgeo.search.db_connect import COLLECTION
    from serve.cli import main

    model, split = encoded
    token = COLLECTION.set("a")
    try:
        build_db_from_embedding(model, split.images, pg_url, codec="fp16")
    finally:
        COLLECTION.reset(token)
    assert main(["index", "--db", pg_url, "--collection", "a", "--kind", "ivfflat", "--lists", "3"]) == 0
    assert f"over {N_IMAGES} images" in capsys.readouterr().out
    assert COLLECTION.get() is None  # the command's collection ends with it (a caller's thread is not left in it)
    token = COLLECTION.set("a")
    try:
        with DbGallery(pg_url) as g:
            assert (g.index_kind, g.lists) == ("ivfflat", 3)
    finally:
        COLLECTION.reset(token)
