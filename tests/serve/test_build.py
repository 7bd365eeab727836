"""``python -m serve build``: reports skipped files, refuses bad input, sharded indexes serve like one index."""

import json
import os
import shutil

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


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_build_refuses_a_folder_that_is_not_an_index(serve_env, tmp_path, capsys):
    from mmgeo.search.build import build_gallery, folder_items
    from serve.cli import main

    docs = tmp_path / "my_documents"
    (docs / "drafts").mkdir(parents=True)
    (docs / "thesis.txt").write_text("four years of work")
    (docs / "notes.md").write_bytes(b"\x00\x01 binary-ish")
    (docs / "drafts" / "v1.txt").write_text("v1")
    before = _snapshot(docs)
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(serve_env.folder), "--out", str(docs),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "2 files, 1 folder, not an mmgeo index (no manifest.json)" in err
    assert "new or empty folder" in err
    (docs / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    items, n = folder_items(serve_env.folder)
    with pytest.raises(ValueError, match="format 'something-else'"):  # Python callers get the same refusal
        build_gallery(serve_env.model, items, n, docs, progress=False)
    (docs / "manifest.json").unlink()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        build_gallery(serve_env.model, items, n, tmp_path / "a_file", progress=False)
    (tmp_path / "link").symlink_to(serve_env.folder_idx)  # an index through a link: replacing the link is refused
    with pytest.raises(ValueError, match="symbolic link"):
        build_gallery(serve_env.model, items, n, tmp_path / "link", progress=False)
    assert _snapshot(docs) == before and sorted(os.listdir(tmp_path)) == ["a_file", "link", "my_documents"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(serve_env.folder), "--out",
                 str(tmp_path / "empty"), "--no-progress"]) == 0
    assert len(Gallery(tmp_path / "empty")) == 5


@pytest.mark.parametrize("where", ["same", "inside", "containing", "symlink"])
def test_build_refuses_an_index_folder_overlapping_the_images(serve_env, tmp_path, capsys, where):
    from mmgeo.search.build import build_gallery, folder_items
    from serve.cli import main

    photos = tmp_path / "photos"
    shutil.copytree(serve_env.folder, photos)
    images, out, word = photos, photos, "is the image folder"
    if where == "inside":
        out, word = photos / "index", "is inside the image folder"
    elif where == "containing":
        (photos / "sub").mkdir()
        for p in list(photos.glob("img*")):
            p.rename(photos / "sub" / p.name)
        images, word = photos / "sub", "contains the image folder"
    elif where == "symlink":  # the same folder through a link
        (tmp_path / "link").symlink_to(photos)
        images = tmp_path / "link"
    before = _snapshot(tmp_path)
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(images), "--out", str(out),
                 "--no-progress"]) == 2
    assert word in capsys.readouterr().err
    items, n = folder_items(images)
    with pytest.raises(ValueError, match=word):
        build_gallery(serve_env.model, items, n, out, progress=False)
    assert _snapshot(tmp_path) == before and not list(tmp_path.rglob(".*building*"))


def test_rebuild_replaces_the_index_and_removes_the_old_one(serve_env, tmp_path):
    from mmgeo.search.build import build_gallery, folder_items

    target = tmp_path / "live"
    shutil.copytree(serve_env.idx, target)  # 24 synthetic images, with images/ inside
    assert len(Gallery(target)) == 24
    items, n = folder_items(serve_env.folder)
    build_gallery(serve_env.model, items, n, target, progress=False)
    g = Gallery(target)
    assert len(g) == 5 and not (target / "images").exists(), "nothing of the old index is left in the new one"
    assert os.listdir(tmp_path) == ["live"], "the old index and every temp file are removed"


def test_cli_prunes_patches_by_sample_captions_and_serves_the_result(serve_env, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from serve.app import create_app
    from serve.cli import main

    S = (serve_env.model.cfg.image_size // serve_env.model.cfg.patch_size) ** 2
    queries = tmp_path / "queries.txt"
    queries.write_text("a big red circle\n\n  a small blue square on the left  \n")
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "12", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "p"), "--keep-patches", str(S // 2),
                 "--prune-queries", str(queries)]) == 0
    assert f"pruned: {S // 2} of {S} patches per image kept, by the attention mass of 2 sample caption(s)" \
        in capsys.readouterr().out
    g = Gallery(tmp_path / "p")
    assert g.num_patches == S // 2 and g.manifest["version"] == 4
    with TestClient(create_app(g.root)) as c:
        assert len(c.post("/search", json={"text": "a big red circle", "k": 5}).json()["results"]) == 5
        assert c.get("/explain", params={"id": 3, "text": "a red circle"}).headers["content-type"] == "image/png"
    for extra, msg in [(["--keep-patches", "2"], "go together"), (["--prune-queries", str(queries)], "go together"),
                       (["--keep-patches", "2", "--prune-queries", str(tmp_path / "none.txt")], "no such file"),
                       (["--keep-patches", str(S), "--prune-queries", str(queries)], f"between 1 and {S - 1}")]:
        assert main([*common, "--out", str(tmp_path / "q"), *extra]) == 2
        assert msg in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert main([*common, "--out", str(tmp_path / "q"), "--keep-patches", "2", "--prune-queries",
                 str(tmp_path / "blank.txt")]) == 2
    assert "holds no caption" in capsys.readouterr().err and not (tmp_path / "q").exists()
