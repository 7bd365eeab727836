"""The gallery on Citus: the statements of docs/serve.md ("Sharding with Citus") run on the coordinator that
``MMGEO_TEST_CITUS_URL`` names, then the distributed gallery answers as the same gallery on plain PostgreSQL; and
the fan-out first stage a distributed gallery uses (one statement per caption, pipelined) answers as the one-query
form on plain PostgreSQL."""

import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from mmgeo.search.two_stage import search_texts
from tests.search.conftest import encode_test_images

psycopg = pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")
from mmgeo.search.database import Database, DbGallery, remove_images  # noqa: E402
from mmgeo.search.db_build import build_db_from_embedding  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CITUS_URL = os.environ.get("MMGEO_TEST_CITUS_URL")
N_IMAGES = 40


@pytest.fixture(scope="module")
def encoded():
    """A tiny model and the first N_IMAGES synthetic test images and their captions, encoded."""
    return encode_test_images(N_IMAGES)


def citus_statements() -> list[str]:
    """The ```sql block of docs/serve.md's Citus section, as statements (comments dropped)."""
    doc = (ROOT / "docs" / "serve.md").read_text()
    block = re.search(r"### Sharding with Citus.*?```sql\n(.*?)```", doc, re.S).group(1)
    text = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in text.split(";") if s.strip()]


def test_the_docs_name_every_gallery_table():
    got = " ".join(citus_statements())
    for table in ("mmgeo_images", "mmgeo_gallery", "mmgeo_codebooks", "mmgeo_schema_version"):
        assert table in got
    assert "create_distributed_table('mmgeo_images', 'content_sha256')" in got


def test_fan_out_first_stage_answers_as_the_one_query(encoded, pg_url):
    """The per-caption statements (Citus' form) give the ids, scores and rows of the LATERAL query."""
    model, split = encoded
    build_db_from_embedding(model, split.images, pg_url, codec="fp16")
    texts = split.texts[:12]
    with DbGallery(pg_url) as one, DbGallery(pg_url) as fan:
        assert not one.fan_out
        fan.fan_out = True
        q = texts.pooled.float().numpy()
        want = [3, 10, 40, 7] * 3
        for codes in (True, False):
            a, b = one.first_stage(q, want, codes=codes), fan.first_stage(q, want, codes=codes)
            np.testing.assert_array_equal(a[1], b[1])
            np.testing.assert_allclose(a[0], b[0], rtol=0, atol=1e-6)
        for rerank in (True, False):
            for (gi, gs), (wi, ws) in zip(search_texts(model, fan, texts, [5] * 12, [rerank] * 12, k_prime=20),
                                          search_texts(model, one, texts, [5] * 12, [rerank] * 12, k_prime=20)):
                np.testing.assert_array_equal(gi, wi)
                np.testing.assert_allclose(gs, ws, rtol=0, atol=1e-5)


def in_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"


@pytest.mark.skipif(not CITUS_URL, reason="no Citus coordinator: set MMGEO_TEST_CITUS_URL=postgresql://... (a Citus "
                    "cluster with pgvector on every node) to run the docs' statements on it")
def test_citus_statements_distribute_the_gallery(encoded, pg_url):
    """Build in a fresh schema on the coordinator, run the docs' statements, then: the gallery is distributed, its
    searches answer as plain PostgreSQL's, and an add and a removal go through the distributed table."""
    model, split = encoded
    schema = f"mmgeo_citus_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(CITUS_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = in_schema(CITUS_URL, schema)
    try:
        first = split.images[:N_IMAGES - 4]
        build_db_from_embedding(model, first, url, codec="fp16")
        build_db_from_embedding(model, first, pg_url, codec="fp16")
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in citus_statements():
                conn.execute(statement)
            assert conn.execute("SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = "
                                "'mmgeo_images'::regclass").fetchone()[0] > 1
        texts = split.texts[:12]
        with DbGallery(url) as dist, DbGallery(pg_url) as plain:
            assert dist.fan_out and not plain.fan_out and dist.count == N_IMAGES - 4
            for rerank in (True, False):
                for (gi, gs), (wi, ws) in zip(search_texts(model, dist, texts, [5] * 12, [rerank] * 12, 20),
                                              search_texts(model, plain, texts, [5] * 12, [rerank] * 12, 20)):
                    np.testing.assert_array_equal(gi, wi)
                    np.testing.assert_allclose(gs, ws, rtol=0, atol=1e-5)
        assert build_db_from_embedding(model, split.images, url, codec="fp16")["added"] == 4  # the rest, once
        with Database(url) as db:
            assert remove_images(db, [0, N_IMAGES - 1, 10_000]) == [0, N_IMAGES - 1]
        with DbGallery(url) as dist:
            assert dist.count == N_IMAGES - 2
            assert dist.image_record(0) is None and dist.image_record(1) is not None
    finally:
        with psycopg.connect(CITUS_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
