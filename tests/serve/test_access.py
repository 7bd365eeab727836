"""Keys and collections over HTTP (serve.access): every endpoint refuses every credential but the right one; another
collection's id answers as a missing id does, in body and in time; rates; keys never in answers or logs."""

import logging
import statistics
import time

import pytest
from fastapi.testclient import TestClient

from serve.app import create_app
from serve.auth import FileKeys, new_key
from tests.serve.test_app import LIMITS, png_bytes

TEXT = "a red circle"


@pytest.fixture(scope="module")
def keyed(serve_env, tmp_path_factory):
    """Collections "a" (24 synthetic images) and "b" (the folder's 5) behind a keys file; -> (client, tokens)."""
    store = FileKeys(tmp_path_factory.mktemp("keys") / "keys.json", create=True)
    tokens = {}
    for name, coll, scope, rate in (("a_read", "a", "read", 0), ("a_admin", "a", "admin", 0),
                                    ("a_revoked", "a", "read", 0), ("b_read", "b", "read", 0),
                                    ("b_write", "b", "write", 0), ("a_slow", "a", "read", 6)):
        tokens[name], rec = new_key(coll, scope, name=name, rate=rate)
        store.add(rec)
        if name == "a_revoked":
            store.revoke(rec.id)
    app = create_app(collections={"a": serve_env.idx, "b": serve_env.folder_idx}, keys=FileKeys(store.path),
                     limits=LIMITS)
    with TestClient(app) as c:
        yield c, tokens


def call(client, endpoint: str, headers: dict):
    """One request of ``endpoint`` (collection "a"'s image 3 where an id is needed)."""
    if endpoint == "POST /search":
        return client.post("/search", json={"text": TEXT, "k": 3}, headers=headers)
    if endpoint == "POST /search/image":
        return client.post("/search/image", files={"file": ("q.png", png_bytes(), "image/png")}, headers=headers)
    if endpoint == "GET /images/{id}":
        return client.get("/images/3", headers=headers)
    if endpoint == "GET /explain":
        return client.get("/explain", params={"id": 3, "text": TEXT}, headers=headers)
    return client.get("/metrics", headers=headers)


ENDPOINTS = {"POST /search": "a_read", "POST /search/image": "a_read", "GET /images/{id}": "a_read",
             "GET /explain": "a_read", "GET /metrics": "a_admin"}  # endpoint -> its right key
# (credential, status): X-Collection names "a" in every request; the scope-below case exists where the endpoint
# needs more than read (a read key on /metrics); the folder backend has no write endpoints (the database matrix)
CREDENTIALS = [("none", 401), ("malformed", 401), ("revoked", 401), ("other_read", 403), ("other_write", 403),
               ("scope_below", 403), ("right", 200)]


def auth_headers(cred: str, right: str, tokens: dict) -> dict:
    token = {"none": None, "malformed": "mmgeo_123_notakey", "revoked": tokens["a_revoked"],
             "other_read": tokens["b_read"], "other_write": tokens["b_write"], "scope_below": tokens["a_read"],
             "right": tokens[right]}[cred]
    return {"X-Collection": "a", **({"Authorization": f"Bearer {token}"} if token else {})}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("cred,status", CREDENTIALS)
def test_only_the_right_key_passes(keyed, endpoint, cred, status, caplog):
    client, tokens = keyed
    if cred == "scope_below" and ENDPOINTS[endpoint] == "a_read":
        cred, status = "other_read", 403  # no scope below read: the cell is the other collection's read key again
    with caplog.at_level(logging.WARNING, logger="serve.app"):
        r = call(client, endpoint, auth_headers(cred, ENDPOINTS[endpoint], tokens))
    assert r.status_code == status, (endpoint, cred, r.text)
    if status != 200:
        assert set(r.json()) == {"error"} and r.headers["content-type"] == "application/json"
        assert ("www-authenticate" in r.headers) == (status == 401)
        refused = [m for m in caplog.messages if m.startswith("refused")]
        assert len(refused) == 1 and f": {status} " in refused[0]
    for token in tokens.values():  # no key, nor its secret, in an answer or the log
        secret = token.split("_", 2)[2]  # mmgeo_<id>_<secret>; the secret itself may hold "_"
        assert secret not in r.text and secret not in caplog.text and secret not in str(r.headers)
    sent = r.request.headers.get("authorization", "").removeprefix("Bearer ")
    if cred in ("revoked", "other_read", "other_write", "scope_below") and status != 200:
        assert f"(key id {sent.split('_')[1]})" in caplog.text  # the key's id, not the key


def test_the_key_implies_its_collection(keyed, serve_env):
    client, tokens = keyed
    a = client.get("/images/0", headers={"Authorization": f"Bearer {tokens['a_read']}"})
    b = client.get("/images/0", headers={"Authorization": f"Bearer {tokens['b_read']}"})
    assert a.status_code == b.status_code == 200 and a.content != b.content
    assert b.content == (serve_env.folder / "img0.png").read_bytes()
    r = client.post("/search", json={"text": TEXT, "k": 50}, headers={"Authorization": f"Bearer {tokens['b_read']}"})
    assert r.status_code == 200 and {x["id"] for x in r.json()["results"]} <= set(range(5))


def test_health_and_the_page_need_no_key_and_reveal_nothing(keyed):
    client, tokens = keyed
    assert client.get("/health").json() == {"status": "ok", "auth": "keys"}
    full = client.get("/health", headers={"Authorization": f"Bearer {tokens['b_read']}"}).json()
    assert full["images"] == 5 and full["auth"] == "keys"
    assert client.get("/health", headers={"Authorization": "Bearer mmgeo_x"}).status_code == 401
    assert client.get("/").status_code == 200 and "Authorization" in client.get("/").text
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/nowhere").status_code == 401  # even a 404 needs a key


def test_another_collections_id_answers_as_a_missing_one(keyed):
    """Image 20 exists in "a", not in "b": with b's key it answers as 999 (in no collection) does — same status,
    same body but for the number — and in the same time (``assert_same_time``)."""
    client, tokens = keyed
    h = {"Authorization": f"Bearer {tokens['b_read']}"}
    other, missing = client.get("/images/20", headers=h), client.get("/images/999", headers=h)
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"].replace("20", "N") == missing.json()["error"].replace("999", "N")
    other, missing = (client.get("/explain", params={"id": i, "text": TEXT}, headers=h) for i in (20, 999))
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"].replace("20", "N") == missing.json()["error"].replace("999", "N")
    assert_same_time(client, "/images/20", "/images/999", h)


def assert_same_time(client, url_a: str, url_b: str, headers: dict, tries: int = 100) -> None:
    """GET ``url_a`` and ``url_b`` in ``tries`` rounds of A B B A: each round's gap is (A₁ + A₂ − B₁ − B₂)/2, which
    cancels what the order alone costs (the first GET of a pair measures tens of µs slower, whichever it is); the
    median gap is within 4 robust standard errors (1.4826·MAD/√n·1.2533) plus 50 µs of scheduler noise."""
    gaps = []
    for _ in range(tries):
        times = []
        for url in (url_a, url_b, url_b, url_a):
            t0 = time.perf_counter()
            client.get(url, headers=headers)
            times.append(time.perf_counter() - t0)
        gaps.append((times[0] + times[3] - times[1] - times[2]) / 2)
    med = statistics.median(gaps)
    se = 1.2533 * 1.4826 * statistics.median(abs(d - med) for d in gaps) / len(gaps) ** 0.5
    assert abs(med) <= 4 * se + 50e-6, f"median gap {med * 1e6:.0f} µs, standard error {se * 1e6:.0f} µs"


def test_a_key_past_its_rate_gets_429_with_retry_after(keyed):
    client, tokens = keyed
    h = {"Authorization": f"Bearer {tokens['a_slow']}"}  # 6 a minute: a burst of 5
    got = [client.get("/images/0", headers=h) for _ in range(6)]
    assert [r.status_code for r in got] == [200] * 5 + [429]
    assert int(got[-1].headers["retry-after"]) >= 1 and "6 requests a minute" in got[-1].json()["error"]
    assert client.get("/images/0", headers={"Authorization": f"Bearer {tokens['a_read']}"}).status_code == 200


def test_metrics_labels_hold_no_key(keyed):
    client, tokens = keyed
    text = client.get("/metrics", headers={"Authorization": f"Bearer {tokens['a_admin']}"}).text
    assert 'endpoint="unmatched",status="401"' in text
    assert not any(t.split("_", 1)[1] in text for t in tokens.values())
