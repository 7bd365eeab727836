"""``python -m serve build``: reports skipped files, refuses bad input, sharded indexes serve like one index."""

import pytest

from mmgeo.search.store import Gallery


def test_cli_reports_skipped_files(serve_env, tmp_path, capsys):
    from serve.cli import main

    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(serve_env.folder),
                 "--out", str(tmp_path / "i"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "indexed 5 image(s)" in out and "skipped 1 unreadable file(s)" in out and "corrupt.png" in out
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "j")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_run_refuses_a_missing_index(tmp_path, capsys):
    from serve.cli import main

    assert main(["run", "--index", str(tmp_path / "none")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sharded_pair(serve_env, tmp_path_factory):
    """The first 30 test images indexed twice by the CLI: unsharded flat, and in shards of 7 (7, 7, 7, 7, 2)."""
    from serve.cli import main

    root = tmp_path_factory.mktemp("sharded")
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "30", "--no-progress",
              "--batch-size", "8"]
    assert main([*common, "--out", str(root / "one"), "--index-type", "flat"]) == 0
    assert main([*common, "--out", str(root / "shards"), "--shard-size", "7"]) == 0
    return Gallery(root / "one"), Gallery(root / "shards")


def test_sharded_gallery_serves_over_http(serve_env, sharded_pair):
    from fastapi.testclient import TestClient

    from serve.app import create_app

    one, sh = sharded_pair
    assert sh.manifest["shards"] == {"dir": "global.shards", "count": 5, "shard_size": 7}
    assert "shards" not in one.manifest and one.manifest["index_type"] == "flat"
    png = (sh.root / "images" / "0000004.png").read_bytes()
    out = {}
    for g in (one, sh):
        with TestClient(create_app(g.root)) as c:
            assert c.get("/health").json()["images"] == 30
            out[g.root.name] = (c.post("/search", json={"text": "a big red circle", "k": 6}).json(),
                                c.post("/search/image", files={"file": ("q.png", png, "image/png")},
                                       params={"k": 6}).json())
    assert out["one"] == out["shards"] and out["shards"][1]["results"][0]["id"] == 4
