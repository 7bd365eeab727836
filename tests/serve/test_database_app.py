"""The service over a gallery in PostgreSQL (``--db``) against a real server (tests/pg.py): the same /search,
/explain and /images answers as over an index directory of the same images and codec; ``serve add`` / ``remove``;
POST /images and DELETE /images/{id}; hostile ids and oversize uploads refused; the database down is a 503."""

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from serve.app import Limits, create_app
from serve.cli import main

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")

LIMITS = Limits(max_text_chars=200, max_k=50, k_prime=10, max_upload_bytes=100_000, max_image_pixels=1_000_000)
QUERIES = ["a red circle", "a big blue square on the left", "two green triangles", "a small yellow star"]


def png(colour, size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def both(serve_env, tmp_path_factory, pg_server):
    """A folder index and a database gallery of the same 24 synthetic images, both rq8, built by the CLI."""
    from tests.pg import fresh_database

    url = fresh_database(pg_server)
    out = tmp_path_factory.mktemp("dbapp") / "idx"
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "24", "--codec", "rq8",
              "--no-progress"]
    assert main([*common, "--out", str(out)]) == 0
    assert main([*common, "--db", url]) == 0
    return out, url


def test_same_answers_as_the_index_directory(serve_env, both):
    out, url = both
    with TestClient(create_app(out, limits=LIMITS)) as f, TestClient(create_app(db=url, limits=LIMITS)) as d:
        for q in QUERIES:
            for rerank in (True, False):
                body = {"text": q, "k": 8, "rerank": rerank}
                a, b = f.post("/search", json=body), d.post("/search", json=body)
                assert a.status_code == b.status_code == 200
                assert [r["id"] for r in a.json()["results"]] == [r["id"] for r in b.json()["results"]]
                np.testing.assert_allclose([r["score"] for r in a.json()["results"]],
                                           [r["score"] for r in b.json()["results"]], atol=1e-5)
        for i in (0, 7, 23):
            a, b = f.get(f"/images/{i}"), d.get(f"/images/{i}")
            assert a.status_code == b.status_code == 200 and b.headers["content-type"] == "image/png"
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(a.content))),
                                  np.asarray(Image.open(io.BytesIO(b.content))))
            a, b = (c.get("/explain", params={"id": i, "text": "a red circle"}) for c in (f, d))
            assert a.status_code == b.status_code == 200 and a.content == b.content
        up = {"file": ("q.png", png("red"), "image/png")}
        a, b = f.post("/search/image", files=up, params={"k": 5}), d.post("/search/image", files=up, params={"k": 5})
        assert [r["id"] for r in a.json()["results"]] == [r["id"] for r in b.json()["results"]]
        h = d.get("/health").json()
        assert h["images"] == 24 and h["codec"] == "rq8" and h["index_type"] == "pgvector-hnsw"


@pytest.mark.parametrize("raw,status", [("24", 404), ("99999", 404), ("-1", 400), ("1;DROP TABLE mmgeo_images", 400),
                                        ("1 OR 1=1", 400), ("%27", 400), ("1.0", 400)])
def test_bad_image_ids(both, raw, status):
    with TestClient(create_app(db=both[1], limits=LIMITS)) as d:
        assert d.get(f"/images/{raw}").status_code == status
        assert d.get("/explain", params={"id": raw, "text": "a red circle"}).status_code == status
        assert d.get("/health").json()["images"] == 24


def test_cli_add_and_remove(serve_env, pg_url, capsys):
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "20", "--codec", "fp16",
                 "--db", pg_url, "--no-progress"]) == 0
    assert main(["add", "--db", pg_url, "--images", str(serve_env.folder), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "added 5 image(s), 0 already there, skipped 1 unreadable file(s); 25 in the gallery" in out
    assert main(["add", "--db", pg_url, "--images", str(serve_env.folder), "--no-progress"]) == 0
    assert "added 0 image(s), 5 already there" in capsys.readouterr().out
    assert main(["remove", "--db", pg_url, "--ids", "20", "21", "777"]) == 0
    assert "removed 2 image(s); 23 in the gallery; not in the gallery: 777" in capsys.readouterr().out
    assert main(["remove", "--db", pg_url, "--ids", "3;DROP TABLE mmgeo_images"]) == 2
    assert "non-negative integers" in capsys.readouterr().err
    with TestClient(create_app(db=pg_url, limits=LIMITS)) as d:
        assert d.get("/images/20").status_code == 404 and d.get("/images/22").status_code == 200
        assert d.get("/health").json()["images"] == 23


def test_cli_refuses_what_does_not_fit(serve_env, pg_url, tmp_path, capsys):
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "20", "--codec", "fp16",
                 "--db", pg_url, "--no-progress"]) == 0
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "20", "--codec", "sq8",
                 "--db", pg_url, "--no-progress"]) == 2
    assert "fp16, not sq8" in capsys.readouterr().err
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--db", "mysql://x"]) == 2
    assert "postgresql://" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # one gallery or the other (argparse's usage error)
        main(["run", "--index", str(tmp_path), "--db", pg_url])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert main(["add", "--db", f"local:{serve_env.folder}", "--images", str(serve_env.folder)]) == 2
    assert "no PostgreSQL data" in capsys.readouterr().err


def test_upload_and_delete(serve_env, pg_url):
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "20", "--codec", "fp16",
                 "--db", pg_url, "--no-progress"]) == 0
    with TestClient(create_app(db=pg_url, limits=LIMITS)) as ro:  # writes are off by default
        assert ro.post("/images", files={"files": ("a.png", png("red"), "image/png")}).status_code in (404, 405)
        assert ro.delete("/images/3").status_code in (404, 405)
    limits = Limits(**{**LIMITS.__dict__, "allow_writes": True, "max_upload_files": 3})
    with TestClient(create_app(db=pg_url, limits=limits)) as d:
        r = d.post("/images", files=[("files", ("a.png", png("red"), "image/png")),
                                     ("files", ("b.png", png("blue", (30, 30)), "image/png"))])
        assert r.status_code == 200, r.text
        assert r.json() == {"images": [{"name": "a.png", "id": 20, "added": True},
                                       {"name": "b.png", "id": 21, "added": True}], "count": 22}
        again = d.post("/images", files={"files": ("renamed.png", png("red"), "image/png")}).json()
        assert again == {"images": [{"name": "renamed.png", "id": 20, "added": False}], "count": 22}
        got = d.get("/images/21")
        assert got.status_code == 200 and got.content == png("blue", (30, 30))
        found = d.post("/search/image", files={"file": ("q.png", png("blue", (30, 30)), "image/png")}).json()
        assert found["results"][0]["id"] == 21
        assert d.get("/explain", params={"id": 21, "text": "a blue square"}).status_code == 200
        assert d.delete("/images/21").json() == {"removed": 21, "count": 21}
        assert d.delete("/images/21").status_code == 404 and d.get("/images/21").status_code == 404
        for raw in ("abc", "1;DROP TABLE mmgeo_images", "-5"):
            assert d.delete(f"/images/{raw}").status_code == 400
        too_many = [("files", (f"{i}.png", png("red", (10 + i, 10)), "image/png")) for i in range(4)]
        assert d.post("/images", files=too_many).status_code == 422
        assert d.post("/images", files={"files": ("x.png", b"not an image", "image/png")}).status_code == 400
        big = np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(big).save(buf, "PNG")
        assert d.post("/images", files={"files": ("big.png", buf.getvalue(), "image/png")}).status_code == 413
        assert d.get("/health").json()["images"] == 21


def test_writes_need_a_database_gallery(serve_env):
    with pytest.raises(ValueError, match="needs a gallery in a database"):
        create_app(serve_env.idx, limits=Limits(allow_writes=True))


def test_database_down_is_a_503_and_the_service_recovers(serve_env, tmp_path):
    """Stop the database under a running app: /search and /health answer 503 with Retry-After within the pool's
    timeouts (never a hang or a 500); started again, the same app answers 200 by itself."""
    import time
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pgserver = pytest.importorskip("pgserver", reason="starts its own PostgreSQL from the pgserver wheel")
    srv = pgserver.get_server(tmp_path / "pg", cleanup_mode="delete")
    url = srv.get_uri()
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "20", "--codec", "fp16",
                 "--db", url, "--no-progress"]) == 0
    body = {"text": "a red circle", "k": 3}
    with TestClient(create_app(db=url, limits=LIMITS), raise_server_exceptions=False) as d:
        assert d.post("/search", json=body).status_code == 200
        pgserver.pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=srv.pgdata, user=srv.system_user)
        for path in ("/search", "/health", "/images/3"):
            start = time.monotonic()
            r = d.post(path, json=body) if path == "/search" else d.get(path)
            assert r.status_code == 503 and r.headers["retry-after"].isdigit(), (path, r.status_code, r.text)
            assert "unavailable" in r.json()["error"] and time.monotonic() - start < 15
        srv.ensure_postgres_running()
        deadline = time.monotonic() + 60
        while (r := d.post("/search", json=body)).status_code != 200 and time.monotonic() < deadline:
            assert r.status_code == 503
            time.sleep(0.5)
        assert r.status_code == 200 and len(r.json()["results"]) == 3
