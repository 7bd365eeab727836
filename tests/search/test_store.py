"""The gallery directory: build, manifest checks on load, sharded global index, atomic replacement."""

import json
import shutil

import numpy as np
import pytest

from mmgeo.data import ShapesWorld
from mmgeo.search.build import build_gallery, build_gallery_from_embedding, build_random_gallery, folder_items
from mmgeo.search.shards import ShardedIndex
from mmgeo.search.store import Gallery, GalleryError
from mmgeo.search.two_stage import search_text


def synthetic_items(n):
    ds = ShapesWorld("test", 0, image_size=32)
    return ((None, (lambda i=i: ds[i][0])) for i in range(n))


def test_synthetic_build_writes_a_complete_index(gallery_env):
    g = Gallery(gallery_env.idx)
    assert len(g) == 24 and g.manifest["index_type"] == "flat" and g.manifest["skipped"]["count"] == 0
    assert g.keys.dtype == np.float16 and g.values.dtype == np.float16 and isinstance(g.keys, np.memmap)
    assert g.keys.shape == (24, 2, 16, 8) and g.mask.shape == (24, 16) and g.mask.all()
    assert g.model_record["path"] == str(gallery_env.ckpt.resolve()) and len(g.model_record["sha256"]) == 64
    assert all(g.image_path(i).is_file() for i in range(24))  # generated images are kept inside the index
    assert g.meta[3] == {"id": 3, "path": "images/0000003.png", "width": 32, "height": 32}
    assert not list(gallery_env.root.glob(".idx.building-*"))
    emb = gallery_env.model.encode_image([ShapesWorld("test", 0, image_size=32)[i][0] for i in range(3)])
    np.testing.assert_allclose(g.keys[:3].astype(np.float32), emb.attn.numpy(), atol=2e-3, rtol=2e-3)


def test_folder_build_skips_and_counts_bad_files(gallery_env):
    g = Gallery(gallery_env.folder_idx)
    assert len(g) == 5
    skipped = g.manifest["skipped"]
    assert skipped["count"] == 1 and skipped["files"][0]["path"].endswith("corrupt.png")
    assert {m["width"] for m in g.meta} == {40, 48, 56, 64, 72}
    assert g.image_path(0) == (gallery_env.folder / "img0.png").resolve()


def test_gallery_of_encoded_images_stores_what_build_stores(gallery_env, tmp_path):
    """The eval path's gallery (from an Embedding) holds the same arrays and global index as an image build."""
    g = Gallery(gallery_env.idx)
    emb = gallery_env.model.encode_image([ShapesWorld("test", 0, image_size=32)[i][0] for i in range(24)])
    man = build_gallery_from_embedding(gallery_env.model, emb, tmp_path / "e", index_type="flat")
    e = Gallery(tmp_path / "e")
    assert man["count"] == 24 and e.manifest["index_type"] == "flat" and e.meta[5]["path"] == "encoded/5"
    for name in ("keys", "values", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(e, name)), np.asarray(getattr(g, name)), err_msg=name)
    np.testing.assert_allclose(e.index.reconstruct_n(0, 24), g.index.reconstruct_n(0, 24), rtol=1e-6, atol=1e-7)
    e.check_images(emb)
    with pytest.raises(GalleryError, match="image 23 of the index is not image 23"):
        e.check_images(gallery_env.model.encode_image(
            [ShapesWorld("test", 0, image_size=32)[i][0] for i in (*range(23), 30)]))
    with pytest.raises(GalleryError, match="holds 24 images, the encoded set 3"):
        e.check_images(emb[:3])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_load_errors_name_the_problem(gallery_env, tmp_path):
    with pytest.raises(GalleryError, match="no manifest.json"):
        Gallery(tmp_path / "nothing")
    bad = _copy(gallery_env.idx, tmp_path / "v")
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**man, "version": 99}))
    with pytest.raises(GalleryError, match="v99.*rebuild"):
        Gallery(bad)
    miss = _copy(gallery_env.idx, tmp_path / "m")
    (miss / "values.npy").unlink()
    with pytest.raises(GalleryError, match=r"missing \['values.npy'\]"):
        Gallery(miss)


def test_model_mismatch_is_refused(gallery_env, tmp_path):
    import mmgeo
    from tests.conftest import TINY

    g = Gallery(gallery_env.idx)
    g.check_model(gallery_env.model, gallery_env.ckpt)  # the right one passes
    other = mmgeo.create_model("geo-tiny", **{**TINY, "d_a": 4})
    with pytest.raises(GalleryError, match="d_a"):
        g.check_model(other)
    same_shape = mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY), tmp_path / "other.pt")
    with pytest.raises(GalleryError, match="not the one the index was built with"):
        g.check_model(gallery_env.model, same_shape)


def test_random_gallery_loads_and_serves_search(gallery_env, tmp_path):
    man = build_random_gallery(tmp_path / "r", 300, 2, 16, 8, 8, 16, index_type="hnsw")
    g = Gallery(tmp_path / "r")
    assert man["count"] == 300 and g.manifest["index_type"] == "hnsw"
    g.check_model(gallery_env.model)  # same dims, no checkpoint recorded
    ids, scores = search_text(gallery_env.model, g, gallery_env.model.encode_text(["a red circle"]), 10, True, 50)
    assert len(ids) == 10 and np.all(np.diff(scores) <= 1e-6)


def test_failed_build_keeps_the_old_index(gallery_env, tmp_path):
    target = _copy(gallery_env.folder_idx, tmp_path / "live")
    before = (target / "manifest.json").read_text()
    items, n = folder_items(gallery_env.folder)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_gallery(gallery_env.model, items, n, target, fail_after_encode=True, progress=False)
    assert (target / "manifest.json").read_text() == before and len(Gallery(target)) == 5
    assert not list(tmp_path.glob(".live.building-*")), "the temp dir is removed"
    with pytest.raises(RuntimeError):  # no old index: none appears
        build_gallery(gallery_env.model, items, n, tmp_path / "fresh", fail_after_encode=True, progress=False)
    assert not (tmp_path / "fresh").exists()
    items, n = folder_items(gallery_env.folder)  # a successful rebuild replaces it
    build_gallery(gallery_env.model, items, 3, target, progress=False)  # corrupt.png, img0.png, img1.jpg
    assert len(Gallery(target)) == 2 and Gallery(target).manifest["skipped"]["count"] == 1


@pytest.fixture(scope="module")
def sharded_pair(gallery_env, tmp_path_factory):
    """The first 30 test images indexed twice: unsharded flat, and in shards of 7 (7, 7, 7, 7, 2)."""
    root = tmp_path_factory.mktemp("sharded")
    model = gallery_env.model
    build_gallery(model, synthetic_items(30), 30, root / "one", index_type="flat", batch_size=8, progress=False)
    build_gallery(model, synthetic_items(30), 30, root / "shards", shard_size=7, batch_size=8, progress=False)
    return Gallery(root / "one"), Gallery(root / "shards")


def test_sharded_gallery_searches_exactly_like_one_flat_index(gallery_env, sharded_pair):
    one, sh = sharded_pair
    assert one.manifest["version"] == 1 and "shards" not in one.manifest and (one.root / "global.faiss").is_file()
    assert sh.manifest["version"] == 2 and sh.manifest["index_type"] == "flat"
    assert not (sh.root / "global.faiss").exists() and (sh.root / "global.shards" / "shards.json").is_file()
    assert sh.manifest["shards"] == {"dir": "global.shards", "count": 5, "shard_size": 7}
    assert isinstance(sh.index, ShardedIndex) and sh.index.counts == [7, 7, 7, 7, 2] and len(sh) == 30
    np.testing.assert_array_equal(np.asarray(sh.keys), np.asarray(one.keys))  # same images, same encoding
    captions = [ShapesWorld("test", 0, image_size=32)[i][1][0] for i in range(0, 30, 3)] + ["a red circle"]
    texts = gallery_env.model.encode_text(captions)
    for i in range(len(captions)):
        for rerank, k, k_prime in ((False, 10, 100), (True, 10, 100), (True, 5, 8), (False, 30, 100)):
            got = search_text(gallery_env.model, sh, texts[i:i + 1], k, rerank, k_prime)
            want = search_text(gallery_env.model, one, texts[i:i + 1], k, rerank, k_prime)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


def test_sharded_gallery_load_errors(sharded_pair, tmp_path):
    one, sh = sharded_pair
    bad = _copy(sh.root, tmp_path / "v1")
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**man, "version": 1}))
    with pytest.raises(GalleryError, match="v1 but lists shards"):
        Gallery(bad)
    miss = _copy(sh.root, tmp_path / "m")
    (miss / "global.shards" / "shard-00003.faiss").unlink()
    with pytest.raises(GalleryError, match=r"shard-00003.faiss is missing; rebuild"):
        Gallery(miss)
    flat_missing = _copy(one.root, tmp_path / "f")
    (flat_missing / "global.faiss").unlink()
    with pytest.raises(GalleryError, match=r"missing \['global.faiss'\]"):
        Gallery(flat_missing)
