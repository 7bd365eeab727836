"""Hostile input to the service over a database gallery (``--db``, ``--allow-writes``) against a real PostgreSQL: ids
that are not ids, SQL-looking text in captions, file names and ids, control characters in metadata, and uploads
over the size limits get a 4xx with a JSON body (or are stored verbatim as data), never a 500; the gallery is
unchanged by what is refused."""

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from serve.app import Limits, create_app
from serve.cli import main

psycopg = pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")

LIMITS = Limits(max_text_chars=200, max_k=50, k_prime=10, max_upload_bytes=100_000, max_image_pixels=1_000_000,
                allow_writes=True, max_upload_files=3)
SQLISH = "x'); DROP TABLE mmgeo_images; --"


def png(colour, size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def serve(ckpt, url):
    assert main(["build", "--ckpt", str(ckpt), "--data", "synthetic", "--limit", "20", "--codec", "fp16", "--db", url,
                 "--no-progress"]) == 0
    return TestClient(create_app(db=url, limits=LIMITS), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def reader(serve_env, pg_server):
    """One gallery for the tests that must not change it."""
    from tests.pg import fresh_database

    with serve(serve_env.ckpt, fresh_database(pg_server)) as c:
        yield c


@pytest.fixture
def client(serve_env, pg_url):
    with serve(serve_env.ckpt, pg_url) as c:
        yield c


def png_of(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def rows(client) -> int:
    return client.get("/health").json()["images"]


@pytest.mark.parametrize("raw", ["9" * 25, "1;DROP TABLE mmgeo_images", "1 OR 1=1", "0x10", "1e3", "+1", " 1",
                                 "%F0%9F%98%80", "1.0", "-0", "00000000000000000001"])
def test_ids_that_are_not_ids_are_4xx(reader, raw):
    for r in (reader.get(f"/images/{raw}"), reader.delete(f"/images/{raw}"),
              reader.get("/explain", params={"id": raw, "text": "a red circle"})):
        assert 400 <= r.status_code < 500 and "error" in r.json(), (raw, r.status_code, r.text)
    assert rows(reader) == 20


def test_sql_looking_text_is_only_text(reader):
    for text in (SQLISH, "' OR '1'='1", "a red circle; DELETE FROM mmgeo_images", "\\x00\\'"):
        r = reader.post("/search", json={"text": text, "k": 5})
        assert r.status_code == 200 and len(r.json()["results"]) == 5
    assert reader.post("/search", json={"text": "a red circle", "k": "5; DROP TABLE x"}).status_code == 422
    assert rows(reader) == 20


def test_sql_looking_and_odd_file_names_are_stored_as_data(client):
    names = [f"{SQLISH}.png", "\u202egnp.exe"]
    files = [("files", (n, png(c, (20 + i, 20)), "image/png")) for i, (n, c) in enumerate(zip(names, ["red", "blue"]))]
    r = client.post("/images", files=files)
    assert r.status_code == 200, r.text
    got = r.json()["images"]
    assert [g["added"] for g in got] == [True] * 2 and r.json()["count"] == 22
    assert got[0]["name"] == f"{SQLISH}.png" and got[1]["name"] == "gnp.exe"  # no right-to-left override
    for g in got:
        assert client.get(f"/images/{g['id']}").status_code == 200
    r = client.post("/images", files={"files": ("n" * 5000 + ".png", png("green"), "image/png")})
    assert r.status_code == 400 or (r.status_code == 200 and len(r.json()["images"][0]["name"]) <= 200), r.text
    count = rows(client)
    # raw multipart: a NUL and an escape sequence in the file name (jsonb cannot hold a NUL: once a 500)
    body = (b"--B\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a\x00b\x1b[31m.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + png("white") + b"\r\n--B--\r\n")
    r = client.post("/images", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert r.json()["images"][0]["name"] == "ab[31m.png"
    assert rows(client) == count + (r.status_code == 200)


def test_oversize_uploads_are_413_and_change_nothing(client):
    big = bytes(150_000)  # over max_upload_bytes: refused by the route, within the guard's multipart headroom
    r = client.post("/images", files={"files": ("big.png", big, "image/png")})
    assert r.status_code == 413 and "error" in r.json()
    huge = bytes(400_000)  # far over: refused by the body guard before it is read
    r = client.post("/images", files={"files": ("huge.png", huge, "image/png")})
    assert r.status_code == 413 and "error" in r.json()
    noise = [np.random.default_rng(i).integers(0, 255, (120, 120, 3), dtype=np.uint8) for i in range(3)]
    parts = [("files", (f"{i}.png", png_of(a), "image/png")) for i, a in enumerate(noise)]  # ~43 kB each
    assert sum(len(p[1][1]) for p in parts) > LIMITS.max_upload_bytes > len(parts[0][1][1])
    assert client.post("/images", files=parts).status_code == 413
    assert client.post("/images", files={"files": ("e.png", b"", "image/png")}).status_code == 400
    assert rows(client) == 20


def test_upload_names_lose_control_and_format_characters():
    from mmgeo.search.db_build import clean_name

    assert clean_name("a\x00b\x1b[31m.png") == "ab[31m.png"
    assert clean_name("\u202egnp.exe") == "gnp.exe" and clean_name("\x00\x07") == "upload"
    assert clean_name(f"{SQLISH}.png") == f"{SQLISH}.png"  # data, not something to clean
