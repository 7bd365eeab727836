"""Collections in one PostgreSQL database (schema v3, a real server: tests/pg.py): row-level security keeps them
apart for a role that is not the tables' owner, a superuser or BYPASSRLS, even in a query without the collection in
it; the service over it (``run --db URL --db-keys``) refuses every credential but the right one on every endpoint,
writes included; another collection's id answers as a missing one; upload quotas."""

import itertools

import pytest
from fastapi.testclient import TestClient

from serve.app import Limits, create_app
from serve.cli import main
from tests.serve.test_access import CREDENTIALS, TEXT, assert_same_time
from tests.serve.test_app import png_bytes

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")

LIMITS = Limits(max_text_chars=200, max_k=50, k_prime=10, max_upload_bytes=100_000, max_image_pixels=1_000_000,
                allow_writes=True)
_ROLES = itertools.count()
GRANTS = """GRANT SELECT ON mmgeo_schema_version TO {svc};
GRANT SELECT, INSERT, UPDATE, DELETE ON mmgeo_gallery, mmgeo_codebooks, mmgeo_images TO {svc};
GRANT USAGE ON SEQUENCE mmgeo_image_ids TO {svc};
GRANT SELECT, UPDATE (used_bytes, used_images) ON mmgeo_keys TO {svc}"""  # what docs/serve.md tells operators


def as_role(url: str, role: str) -> str:
    return url.replace("postgresql://postgres:@", f"postgresql://{role}:@", 1)


def sql(url: str, *statements, collection: str | None = None):
    """Run statements in one transaction (in ``collection`` when given) -> the last one's rows."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        if collection is not None:
            conn.execute("SELECT set_config('mmgeo.collection', %s, true)", [collection])
        cur = None
        for s in statements:
            cur = conn.execute(s)
        return cur.fetchall() if cur is not None and cur.description else None


@pytest.fixture(scope="module")
def two(serve_env, pg_server):
    """A database owned by a plain role holding collections "a" (24 images) and "b" (the first 8 of the same),
    built by the CLI as that owner; a service role with the documented grants; keys for both collections."""
    from tests.pg import fresh_database

    n = next(_ROLES)
    owner, svc = f"mmgeo_owner_{n}", f"mmgeo_service_{n}"
    admin = fresh_database(pg_server)
    name = admin.split("/")[3].split("?")[0]
    sql(pg_server, f"CREATE ROLE {owner} LOGIN", f"CREATE ROLE {svc} LOGIN")
    sql(pg_server, f"ALTER DATABASE {name} OWNER TO {owner}")
    sql(admin, "CREATE EXTENSION vector", f"ALTER SCHEMA public OWNER TO {owner}")
    owner_url, svc_url = as_role(admin, owner), as_role(admin, svc)
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--codec", "fp16", "--no-progress",
              "--db", owner_url]
    assert main([*common, "--limit", "24", "--collection", "a"]) == 0
    assert main([*common, "--limit", "8", "--collection", "b"]) == 0
    from serve.cli import parse
    from serve.keys_cli import keys_command

    tokens = {}
    for key, coll, scope, extra in (("a_read", "a", "read", []), ("a_write", "a", "write", []),
                                    ("a_revoked", "a", "read", []), ("b_read", "b", "read", []),
                                    ("b_write", "b", "write", ["--quota-images", "1"])):
        tokens[key] = create_key(owner_url, coll, scope, extra)
        if key == "a_revoked":
            keys_command(parse(["keys", "revoke", "--db", owner_url, tokens[key].split("_")[1]]))
    sql(owner_url, *GRANTS.format(svc=svc).split(";\n"))
    return {"admin": admin, "owner": owner_url, "service": svc_url, "tokens": tokens, "svc": svc}


def create_key(url, collection, scope, extra) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["keys", "create", "--db", url, "--collection", collection, "--scope", scope, "--rate", "0",
                     *extra]) == 0
    return out.getvalue().splitlines()[0]


def test_row_level_security_without_a_where(two):
    """As the service's role, queries that name no collection see only the transaction's collection."""
    svc = two["service"]
    role = sql(svc, "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user")
    assert role == [(False, False)]
    assert sql(svc, "SELECT tableowner = current_user FROM pg_tables WHERE tablename = 'mmgeo_images'") == [(False,)]
    for coll, count in (("a", 24), ("b", 8), ("nobody", 0), (None, 0)):  # unset: 'default', which holds nothing
        got = sql(svc, "SELECT count(*), count(DISTINCT collection), min(collection) FROM mmgeo_images",
                  collection=coll)[0]
        assert got[0] == count and got[1] == (1 if count else 0) and got[2] == (coll if count else None)
        assert sql(svc, "SELECT count(*) FROM mmgeo_gallery", collection=coll)[0][0] == (1 if count else 0)
        assert sql(svc, "SELECT count(*) FROM mmgeo_codebooks", collection=coll)[0][0] == 0  # fp16: none
    # the same file in both collections: two rows, two ids; from "b" an "a" id is not there
    assert sql(svc, "SELECT count(*) FROM mmgeo_images WHERE id = 3", collection="b") == [(0,)]
    import psycopg

    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        sql(svc, "UPDATE mmgeo_images SET collection = 'a' WHERE id = 24", collection="b")  # cannot move a row out
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        sql(svc, "INSERT INTO mmgeo_gallery (collection, manifest) VALUES ('a', '{}')", collection="b")
    assert sql(two["admin"], "SELECT count(*) FROM mmgeo_images") == [(32,)]  # the superuser sees past it


def test_the_service_refuses_a_role_that_bypasses_security(two):
    from serve.db_keys import DbKeys

    with pytest.raises(ValueError, match="superuser or has BYPASSRLS"):
        create_app(db=two["admin"], keys=DbKeys(two["admin"]), limits=LIMITS)


@pytest.fixture(scope="module")
def client(two):
    from serve.db_keys import DbKeys

    with TestClient(create_app(db=two["service"], keys=DbKeys(two["service"]), limits=LIMITS)) as c:
        yield c


ENDPOINTS = {"POST /search": "a_read", "POST /search/image": "a_read", "GET /images/{id}": "a_read",
             "GET /explain": "a_read", "POST /images": "a_write", "DELETE /images/{id}": "a_write"}


def call(client, endpoint, headers):
    if endpoint == "POST /images":
        return client.post("/images", files=[("files", ("new.png", png_bytes((48, 40), "purple"), "image/png"))],
                           headers=headers)
    if endpoint == "DELETE /images/{id}":
        return client.delete("/images/5", headers=headers)
    from tests.serve.test_access import call as read_call

    return read_call(client, endpoint, headers)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("cred,status", CREDENTIALS)
def test_only_the_right_key_passes(two, client, endpoint, cred, status):
    tokens, right = two["tokens"], ENDPOINTS[endpoint]
    if cred == "scope_below" and right == "a_read":
        cred, status = "other_read", 403  # no scope below read
    token = {"none": None, "malformed": "mmgeo_123_notakey", "revoked": tokens["a_revoked"],
             "other_read": tokens["b_read"], "other_write": tokens["b_write"], "scope_below": tokens["a_read"],
             "right": tokens[right]}[cred]
    headers = {"X-Collection": "a", **({"Authorization": f"Bearer {token}"} if token else {})}
    r = call(client, endpoint, headers)
    assert r.status_code == status, (endpoint, cred, r.text)
    if status != 200:
        assert set(r.json()) == {"error"}
    elif endpoint == "POST /images":
        assert r.json()["count"] == 25 or r.json()["images"][0]["added"] is False
    assert all(t.split("_", 2)[2] not in r.text for t in tokens.values())


@pytest.mark.slow  # ~7 s: 400 requests to the database
def test_searches_and_ids_stay_in_their_collection(two, client):
    tokens = two["tokens"]
    b = {"Authorization": f"Bearer {tokens['b_read']}"}
    r = client.post("/search", json={"text": TEXT, "k": 50}, headers=b)
    assert r.status_code == 200 and {x["id"] for x in r.json()["results"]} == set(range(24, 32))
    assert client.get("/health", headers=b).json()["images"] == 8
    other, missing = client.get("/images/3", headers=b), client.get("/images/99999", headers=b)
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"].replace(" 3:", " N:") == missing.json()["error"].replace(" 99999:", " N:")
    assert_same_time(client, "/images/3", "/images/99999", b)
    w = {"Authorization": f"Bearer {tokens['b_write']}"}
    assert client.delete("/images/3", headers=w).status_code == 404  # "a"'s image: not there for "b"
    assert sql(two["admin"], "SELECT count(*) FROM mmgeo_images WHERE id = 3") == [(1,)]


def test_a_split_first_stage_stays_in_its_collection(two):
    """A micro-batch's first stage split over connections (``parallel``) searches every part in the batch's
    collection, whose rows alone the service's role sees."""
    import numpy as np

    from mmgeo.search.database import DbGallery
    from mmgeo.search.db_connect import COLLECTION

    b_ids = {r[0] for r in sql(two["admin"], "SELECT id FROM mmgeo_images WHERE collection = 'b'")}
    token = COLLECTION.set("b")
    try:
        with DbGallery(two["service"], parallel=3) as g:
            q = np.random.default_rng(0).standard_normal((5, g.model_record["d_global"])).astype(np.float32)
            _, ids, _ = g.first_stage(q, [50] * 5, codes=False)
    finally:
        COLLECTION.reset(token)
    assert len(b_ids) >= 8 and all(set(r[r >= 0].tolist()) == b_ids for r in ids)


def test_upload_quota_of_a_write_key(two, client):
    w = {"Authorization": f"Bearer {two['tokens']['b_write']}"}  # one image in all
    first = client.post("/images", files=[("files", ("x.png", png_bytes((30, 30), "orange"), "image/png"))], headers=w)
    assert first.status_code == 200 and first.json()["count"] == 9, first.text
    again = client.post("/images", files=[("files", ("y.png", png_bytes((30, 30), "teal"), "image/png"))], headers=w)
    assert again.status_code == 403 and "quota is 1 images, 1 used" in again.json()["error"]
    assert sql(two["admin"], "SELECT count(*) FROM mmgeo_images WHERE collection = 'b'") == [(9,)]
