"""Past one process: two ``serve run --db`` replicas on one database see each other's writes at once; a service
reading from a streaming standby keeps answering when the primary is killed and the standby promoted
(``tests/pg_standby.py``); the Citus statements of docs/serve.md run on a Citus coordinator when
``MMGEO_TEST_CITUS_URL`` names one. Real PostgreSQL servers and real server processes throughout."""

import contextlib
import io

import pytest
from PIL import Image

from serve.cli import main
from tests.serve.conftest import running_server

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
httpx = pytest.importorskip("httpx")


def png(colour, size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def build(ckpt, url: str, limit: int = 12) -> None:
    assert main(["build", "--ckpt", str(ckpt), "--data", "synthetic", "--limit", str(limit), "--codec", "fp16",
                 "--db", url, "--no-progress"]) == 0


def ids_found(base: str, text: str = "a red circle") -> list[int]:
    r = httpx.post(base + "/search", json={"text": text, "k": 50}, timeout=30)
    assert r.status_code == 200, r.text
    return [x["id"] for x in r.json()["results"]]


@pytest.mark.slow
def test_two_replicas_see_each_others_writes(serve_env, pg_url):
    """An upload through replica A is served by replica B at the next request (/search, /search/image, /images);
    a DELETE through B is gone from A at once. Each replica is its own `python -m serve run --db` process."""
    build(serve_env.ckpt, pg_url)
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(running_server(None, "--db", pg_url, "--allow-writes")) for _ in range(2))
        assert 12 not in ids_found(b)
        up = httpx.post(a + "/images", files={"files": ("new.png", png("purple"), "image/png")}, timeout=30)
        assert up.status_code == 200, up.text
        assert up.json() == {"images": [{"name": "new.png", "id": 12, "added": True}], "count": 13}
        assert httpx.get(b + "/images/12").content == png("purple")
        assert 12 in ids_found(b) and httpx.get(b + "/health").json()["images"] == 13
        same = httpx.post(b + "/search/image", files={"file": ("q.png", png("purple"), "image/png")}, timeout=30)
        assert same.json()["results"][0]["id"] == 12
        assert httpx.delete(b + "/images/12").json() == {"removed": 12, "count": 12}
        assert httpx.get(a + "/images/12").status_code == 404
        assert 12 not in ids_found(a) and httpx.get(a + "/health").json()["images"] == 12
        assert httpx.delete(a + "/images/12").status_code == 404
