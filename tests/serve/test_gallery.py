"""The index directory: build (CLI), manifest checks on load, index types, atomic replacement."""

import json
import shutil

import numpy as np
import pytest
import torch

from mmgeo.gallery import (
    Gallery,
    GalleryError,
    build_faiss,
    build_gallery,
    build_random_gallery,
    choose_index_type,
    folder_items,
)


def test_synthetic_build_writes_a_complete_index(serve_env):
    g = Gallery(serve_env.idx)
    assert len(g) == 24 and g.manifest["index_type"] == "flat" and g.manifest["skipped"]["count"] == 0
    assert g.keys.dtype == np.float16 and g.values.dtype == np.float16 and isinstance(g.keys, np.memmap)
    assert g.keys.shape == (24, 2, 16, 8) and g.mask.shape == (24, 16) and g.mask.all()
    assert g.model_record["path"] == str(serve_env.ckpt.resolve()) and len(g.model_record["sha256"]) == 64
    assert all(g.image_path(i).is_file() for i in range(24))  # generated images are kept inside the index
    assert g.meta[3] == {"id": 3, "path": "images/0000003.png", "width": 32, "height": 32}
    assert not list(serve_env.root.glob(".idx.building-*"))
    # stored keys are the model's own (fp16-rounded)
    from mmgeo.data import ShapesWorld

    emb = serve_env.model.encode_image([ShapesWorld("test", 0, image_size=32)[i][0] for i in range(3)])
    np.testing.assert_allclose(g.keys[:3].astype(np.float32), emb.attn.numpy(), atol=2e-3, rtol=2e-3)


def test_folder_build_skips_and_counts_bad_files(serve_env, capsys):
    g = Gallery(serve_env.folder_idx)
    assert len(g) == 5
    skipped = g.manifest["skipped"]
    assert skipped["count"] == 1 and skipped["files"][0]["path"].endswith("corrupt.png")
    assert {m["width"] for m in g.meta} == {40, 48, 56, 64, 72}
    assert g.image_path(0) == (serve_env.folder / "img0.png").resolve()


def test_cli_reports_skipped_files(serve_env, tmp_path, capsys):
    from serve.cli import main

    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(serve_env.folder),
                 "--out", str(tmp_path / "i"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "indexed 5 image(s)" in out and "skipped 1 unreadable file(s)" in out and "corrupt.png" in out
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--images", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "j")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_load_errors_name_the_problem(serve_env, tmp_path):
    with pytest.raises(GalleryError, match="no manifest.json"):
        Gallery(tmp_path / "nothing")
    bad = _copy(serve_env.idx, tmp_path / "v")
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**man, "version": 99}))
    with pytest.raises(GalleryError, match="v99.*rebuild"):
        Gallery(bad)
    miss = _copy(serve_env.idx, tmp_path / "m")
    (miss / "values.npy").unlink()
    with pytest.raises(GalleryError, match=r"missing \['values.npy'\]"):
        Gallery(miss)


def test_model_mismatch_is_refused(serve_env, tmp_path):
    import mmgeo
    from tests.conftest import TINY

    g = Gallery(serve_env.idx)
    g.check_model(serve_env.model, serve_env.ckpt)  # the right one passes
    other = mmgeo.create_model("geo-tiny", **{**TINY, "d_a": 4})
    with pytest.raises(GalleryError, match="d_a"):
        g.check_model(other)
    same_shape = mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY), tmp_path / "other.pt")
    with pytest.raises(GalleryError, match="not the one the index was built with"):
        g.check_model(serve_env.model, same_shape)


def test_index_type_by_size_and_by_choice():
    assert [choose_index_type(n) for n in (10, 9_999, 10_000, 999_999, 1_000_000)] == \
        ["flat", "flat", "hnsw", "hnsw", "ivfpq"]
    x = np.random.default_rng(0).standard_normal((2_000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for kind, min_hit in (("flat", 1.0), ("hnsw", 0.9), ("ivfpq", 0.3)):
        index = build_faiss(x, kind)
        _, ids = index.search(x[:50], 1)
        assert (ids[:, 0] == np.arange(50)).mean() >= min_hit, kind
    with pytest.raises(ValueError, match="index_type must be one of"):
        choose_index_type(5, "annoy")


def test_random_gallery_loads_and_serves_search(serve_env, tmp_path):
    from mmgeo.gallery import search_text

    man = build_random_gallery(tmp_path / "r", 300, 2, 16, 8, 8, 16, index_type="hnsw")
    g = Gallery(tmp_path / "r")
    assert man["count"] == 300 and g.manifest["index_type"] == "hnsw"
    g.check_model(serve_env.model)  # same dims, no checkpoint recorded
    ids, scores = search_text(serve_env.model, g, serve_env.model.encode_text(["a red circle"]), 10, True, 50)
    assert len(ids) == 10 and np.all(np.diff(scores) <= 1e-6)


def test_failed_build_keeps_the_old_index(serve_env, tmp_path):
    target = _copy(serve_env.folder_idx, tmp_path / "live")
    before = (target / "manifest.json").read_text()
    items, n = folder_items(serve_env.folder)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_gallery(serve_env.model, items, n, target, fail_after_encode=True, progress=False)
    assert (target / "manifest.json").read_text() == before and len(Gallery(target)) == 5
    assert not list(tmp_path.glob(".live.building-*")), "the temp dir is removed"
    with pytest.raises(RuntimeError):  # no old index: none appears
        build_gallery(serve_env.model, items, n, tmp_path / "fresh", fail_after_encode=True, progress=False)
    assert not (tmp_path / "fresh").exists()
    # a successful rebuild replaces it
    items, n = folder_items(serve_env.folder)
    build_gallery(serve_env.model, items, 3, target, progress=False)  # corrupt.png, img0.png, img1.jpg
    assert len(Gallery(target)) == 2 and Gallery(target).manifest["skipped"]["count"] == 1


def test_run_refuses_a_missing_index(tmp_path, capsys):
    from serve.cli import main

    assert main(["run", "--index", str(tmp_path / "none")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sharded_pair(serve_env, tmp_path_factory):
    """The first 30 test images indexed twice: unsharded flat, and in shards of 7 (7, 7, 7, 7, 2)."""
    from serve.cli import main

    root = tmp_path_factory.mktemp("sharded")
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "30", "--no-progress",
              "--batch-size", "8"]
    assert main([*common, "--out", str(root / "one"), "--index-type", "flat"]) == 0
    assert main([*common, "--out", str(root / "shards"), "--shard-size", "7"]) == 0
    return Gallery(root / "one"), Gallery(root / "shards")


def test_sharded_gallery_searches_exactly_like_one_flat_index(serve_env, sharded_pair):
    from mmgeo.data import ShapesWorld
    from mmgeo.gallery import search_text
    from mmgeo.shards import ShardedIndex

    one, sh = sharded_pair
    assert one.manifest["version"] == 1 and "shards" not in one.manifest and (one.root / "global.faiss").is_file()
    assert sh.manifest["version"] == 2 and sh.manifest["index_type"] == "flat"
    assert not (sh.root / "global.faiss").exists() and (sh.root / "global.shards" / "shards.json").is_file()
    assert sh.manifest["shards"] == {"dir": "global.shards", "count": 5, "shard_size": 7}
    assert isinstance(sh.index, ShardedIndex) and sh.index.counts == [7, 7, 7, 7, 2] and len(sh) == 30
    np.testing.assert_array_equal(np.asarray(sh.keys), np.asarray(one.keys))  # same images, same encoding
    captions = [ShapesWorld("test", 0, image_size=32)[i][1][0] for i in range(0, 30, 3)] + ["a red circle"]
    texts = serve_env.model.encode_text(captions)
    for i in range(len(captions)):
        for rerank, k, k_prime in ((False, 10, 100), (True, 10, 100), (True, 5, 8), (False, 30, 100)):
            got = search_text(serve_env.model, sh, texts[i:i + 1], k, rerank, k_prime)
            want = search_text(serve_env.model, one, texts[i:i + 1], k, rerank, k_prime)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


def test_sharded_gallery_serves_over_http(serve_env, sharded_pair):
    from fastapi.testclient import TestClient

    from serve.app import create_app

    one, sh = sharded_pair
    png = (sh.root / "images" / "0000004.png").read_bytes()
    out = {}
    for g in (one, sh):
        with TestClient(create_app(g.root)) as c:
            assert c.get("/health").json()["images"] == 30
            out[g.root.name] = (c.post("/search", json={"text": "a big red circle", "k": 6}).json(),
                                c.post("/search/image", files={"file": ("q.png", png, "image/png")},
                                       params={"k": 6}).json())
    assert out["one"] == out["shards"] and out["shards"][1]["results"][0]["id"] == 4


def test_sharded_gallery_load_errors(sharded_pair, tmp_path):
    _, sh = sharded_pair
    bad = _copy(sh.root, tmp_path / "v1")
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**man, "version": 1}))
    with pytest.raises(GalleryError, match="v1 but lists shards"):
        Gallery(bad)
    miss = _copy(sh.root, tmp_path / "m")
    (miss / "global.shards" / "shard-00003.faiss").unlink()
    with pytest.raises(GalleryError, match=r"shard-00003.faiss is missing; rebuild"):
        Gallery(miss)
    flat_missing = _copy(sharded_pair[0].root, tmp_path / "f")
    (flat_missing / "global.faiss").unlink()
    with pytest.raises(GalleryError, match=r"missing \['global.faiss'\]"):
        Gallery(flat_missing)


def test_rerank_scores_are_the_models_geometric_scores(tiny_model):
    """The serving re-rank (head-major GEMMs over all candidates) gives model.score's numbers, padding included."""
    from mmgeo.gallery import rerank_scores
    from mmgeo.models import Embedding

    g = torch.Generator().manual_seed(0)
    text = tiny_model.encode_text(["a red circle", "a small blue square on the left of a big green triangle"])
    K, H, S = 7, tiny_model.cfg.num_heads, 16
    keys = torch.randn(K, H, S, tiny_model.cfg.d_a, generator=g)
    values = torch.nn.functional.normalize(torch.randn(K, H, S, tiny_model.cfg.d_e, generator=g), dim=-1)
    mask = torch.ones(K, S, dtype=torch.bool)
    mask[2, 10:] = False  # an image with padding patches
    want = tiny_model.score(text, Embedding(torch.zeros(K, 1), keys, values, mask))  # (2, K)
    for i in range(2):  # caption 0 is padded in the batch, caption 1 is not
        got = rerank_scores(text.attn[i], text.mask[i], text.value[i], keys.transpose(0, 1).contiguous(),
                            values.transpose(0, 1).contiguous(), mask)
        torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-6)
