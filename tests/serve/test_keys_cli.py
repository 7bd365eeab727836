"""``python -m serve keys create|list|revoke`` over a keys file, and ``run``'s refusal of a network address without
keys (``serve.keys_cli``); the key records themselves (``serve.auth``)."""

import json

import pytest

from serve.auth import KEY_RE, AuthError, FileKeys, KeyRecord, RateLimiter, new_key
from serve.cli import main, parse, run_settings


def create(path, capsys, *args) -> str:
    assert main(["keys", "create", "--keys", str(path), *args]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_create_list_revoke(tmp_path, capsys):
    path = tmp_path / "keys.json"
    token = create(path, capsys, "--collection", "family", "--scope", "read", "--name", "phone")
    assert KEY_RE.fullmatch(token)
    key_id, secret = token.split("_")[1], token.split("_", 2)[2]
    stored = path.read_text()
    assert secret not in stored and json.loads(stored)["keys"][0]["id"] == key_id
    assert oct(path.stat().st_mode)[-3:] == "600"
    assert FileKeys(path).verify(token).collection == "family"
    assert main(["keys", "list", "--keys", str(path)]) == 0
    listed = capsys.readouterr().out
    assert key_id in listed and "family" in listed and "valid" in listed and secret not in listed
    assert main(["keys", "revoke", "--keys", str(path), key_id]) == 0
    assert f"revoked key {key_id}" in capsys.readouterr().out
    with pytest.raises(AuthError, match="not valid") as err:
        FileKeys(path).verify(token)
    assert err.value.status == 401 and secret not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["--collection", "Bad Name", "--scope", "read"], "collection name 'Bad Name' is not valid"),
    (["--collection", "a", "--scope", "read", "--rate", "-1"], "--rate must be 0 (unlimited) or more"),
])
def test_create_refuses_bad_input(tmp_path, capsys, argv, message):
    assert main(["keys", "create", "--keys", str(tmp_path / "k.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_revoke_an_unknown_id_and_a_missing_file(tmp_path, capsys):
    path = tmp_path / "keys.json"
    create(path, capsys, "--collection", "a", "--scope", "read")
    assert main(["keys", "revoke", "--keys", str(path), "0123456789ab"]) == 2
    assert "no key with id '0123456789ab'" in capsys.readouterr().err
    assert main(["keys", "list", "--keys", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_wrong_secret_and_an_unknown_id_are_refused_alike(tmp_path):
    token, rec = new_key("a", "read")
    store = FileKeys(tmp_path / "k.json", create=True)
    store.add(rec)
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    unknown = "mmgeo_0123456789ab_" + token.split("_", 2)[2]
    msgs = set()
    for bad in (wrong, unknown):
        with pytest.raises(AuthError) as err:
            store.verify(bad)
        msgs.add((err.value.status, err.value.message))
    assert len(msgs) == 1 and repr(rec).count("hash") == 0


def test_upload_quotas_are_counted_and_kept(tmp_path):
    _, rec = new_key("a", "write", quota_bytes=100, quota_images=3)
    store = FileKeys(tmp_path / "k.json", create=True)
    store.add(rec)
    store.charge(rec.id, 60, 1)
    with pytest.raises(AuthError, match="quota is 100 bytes, 60 used") as err:
        store.charge(rec.id, 41, 1)
    assert err.value.status == 403
    store.charge(rec.id, 40, 2)
    with pytest.raises(AuthError, match="quota is 3 images, 3 used"):
        store.charge(rec.id, 0, 1)
    again = FileKeys(store.path).records[rec.id]
    assert (again.used_bytes, again.used_images) == (100, 3)


def test_rate_limiter_refills():
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    rec = KeyRecord(id="0" * 12, collection="a", scope="read", salt="", hash="", rate=60)  # 1/s, burst 10
    for _ in range(10):
        limiter.take(rec)
    with pytest.raises(AuthError) as err:
        limiter.take(rec)
    assert err.value.status == 429 and err.value.retry_after == 1
    now[0] = 1.0
    limiter.take(rec)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "::", "myhost.example"])
def test_a_network_address_needs_keys_or_no_auth(serve_env, capsys, host):
    assert main(["run", "--index", str(serve_env.idx), "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --host") and "--keys FILE" in err and "--no-auth" in err
    assert run_settings(parse(["run", "--index", str(serve_env.idx), "--host", host, "--no-auth"]))["auth"] == \
        "DISABLED (--no-auth)"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_may_run_without_keys(serve_env, host):
    assert run_settings(parse(["run", "--index", str(serve_env.idx), "--host", host]))["auth"] == "none"


@pytest.mark.parametrize("argv,message", [
    (["--gallery", "a"], "expected NAME=DIR"),
    (["--gallery", "a=x", "--gallery", "a=y"], "collection 'a' is given twice"),
    (["--gallery", "A=x"], "collection name 'A' is not valid"),
    (["--index", "x", "--keys", "none.json"], "no such file"),
    (["--db", "local:x", "--keys", "k.json"], "with --db the keys live in the database"),
    (["--index", "x", "--db-keys"], "--db-keys goes with --db"),
])
def test_bad_run_options(argv, message, capsys):
    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_auth_is_shown_at_health(serve_env, caplog):
    from fastapi.testclient import TestClient

    from serve.cli import _app

    settings = run_settings(parse(["run", "--index", str(serve_env.idx), "--host", "0.0.0.0", "--no-auth"]))
    with caplog.at_level("WARNING", logger="serve.app"):
        app = _app(settings)
    assert "without API keys (--no-auth)" in caplog.text
    with TestClient(app) as c:
        h = c.get("/health").json()
        assert h["auth"] == "DISABLED (--no-auth)" and h["images"] == 24


def test_several_collections_need_keys(serve_env):
    from serve.app import create_app

    with pytest.raises(ValueError, match="2 collections need keys"):
        create_app(collections={"a": serve_env.idx, "b": serve_env.folder_idx})


@pytest.mark.slow  # a server process (~10 s)
def test_a_served_index_with_keys(serve_env, tmp_path, capsys):
    """``serve run --keys FILE`` as users start it: /health open and bare, a search needs the key."""
    import urllib.error
    import urllib.request

    from tests.serve.conftest import running_server

    path = tmp_path / "keys.json"
    token = create(path, capsys, "--collection", "default", "--scope", "read")
    with running_server(serve_env.idx, "--keys", str(path)) as url:
        assert json.loads(urllib.request.urlopen(url + "/health").read()) == {"status": "ok", "auth": "keys"}
        body = json.dumps({"text": "a red circle", "k": 3}).encode()
        ask = urllib.request.Request(url + "/search", data=body, headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(ask)
        assert err.value.code == 401
        ask.add_header("Authorization", f"Bearer {token}")
        assert len(json.loads(urllib.request.urlopen(ask).read())["results"]) == 3
