"""Compressed re-rank stores: round-trip error per codec, re-rank from codes = re-rank of the decoded arrays, sizes
in the manifest, and refusal of damaged or foreign codebooks."""

import json
import shutil

import numpy as np
import pytest
import torch

import mmgeo
from mmgeo.kernels.pair_score import SAFE_LOGIT
from mmgeo.layers import PatchSalience
from mmgeo.models import Embedding
from mmgeo.search.build import build_gallery_from_embedding, build_random_gallery
from mmgeo.search.codecs import CODECS, ROLES, Codewords, bytes_per_image, decode
from mmgeo.search.store import Gallery, GalleryError
from mmgeo.search.two_stage import rerank_candidates, rerank_scores, search_text
from tests.conftest import TINY

N, H, L, D = 120, 2, 16, 16  # 120 images x 16 patches: 1,920 vectors per head, enough for 256 PQ codewords
# Relative round-trip error (||x - decode(encode(x))|| / ||x||) of the test vectors (clusters plus 15 % noise): about
# 1.5x what was measured (fp16 2e-4, sq8 0.005, sq4 0.09, pq4 0.08, pq8 0.10-0.11, pq16 0.12, rq8 0.09, rq16 0.12),
# room for other BLAS / k-means rounding, far below what a broken codec gives (~1).
BOUNDS = {"fp16": 1e-3, "sq8": 0.01, "sq4": 0.14, "pq4": 0.13, "pq8": 0.17, "pq16": 0.19, "rq8": 0.14, "rq16": 0.19}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mmgeo.create_model("geo-tiny", **{**TINY, "d_a": D, "d_e": D}).eval()


def clustered(n, seed):
    """(n, H, L, D) vectors around 24 centres per head, like keys of a few kinds of patch."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(H, 24, D, generator=g)
    pick = torch.randint(0, 24, (n, H, L), generator=g)
    x = centres[torch.arange(H)[None, :, None], pick]  # (n, H, L, D)
    return x + 0.15 * torch.randn(n, H, L, D, generator=g)


def embedding(seed=0, mask=None):
    keys = clustered(N, seed)
    values = torch.nn.functional.normalize(clustered(N, seed + 1), dim=-1)
    pooled = torch.nn.functional.normalize(torch.randn(N, 16, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return Embedding(pooled, keys, values, torch.ones(N, L, dtype=torch.bool) if mask is None else mask)


@pytest.fixture(scope="module")
def galleries(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("codecs")
    emb = embedding()
    for name in CODECS:
        build_gallery_from_embedding(model, emb, root / name, index_type="flat", codec=name)
    return root, emb


def decoded_all(g):
    """Every image's keys, values (H, N, L, d) and mask, decoded in one piece (not the block path)."""
    if g.codec == "fp16":
        k, v = (torch.from_numpy(np.array(a, np.float32)).transpose(0, 1) for a in (g.keys, g.values))
        return k, v, torch.from_numpy(np.array(g.mask))
    k, v = (decode(g.quantizers[role], np.array(g.codes[role])) for role in ROLES)
    return k, v, next(g.candidate_blocks(np.arange(len(g)), block=len(g)))[2]


@pytest.mark.parametrize("codec", list(CODECS))
def test_round_trip_error_is_within_the_codecs_bound(galleries, codec):
    root, emb = galleries
    g = Gallery(root / codec)
    k, v, mask = decoded_all(g)
    for got, want in ((k, emb.attn), (v, emb.value)):
        err = float((got.transpose(0, 1) - want).norm() / want.norm())
        assert err <= BOUNDS[codec], f"{codec}: relative error {err:.4f} over its bound {BOUNDS[codec]}"
    assert torch.equal(mask, emb.mask)
    if codec != "fp16":  # the error recorded at build time is the one on its training sample (all images here)
        assert g.store["rel_error"]["keys"] == pytest.approx(
            float(max((k[h] - emb.attn[:, h]).norm() / emb.attn[:, h].norm() for h in range(H))), rel=1e-3)


def test_error_grows_as_the_bytes_shrink(galleries):
    root, emb = galleries
    err = {c: float((decoded_all(Gallery(root / c))[0].transpose(0, 1) - emb.attn).norm() / emb.attn.norm())
           for c in CODECS}
    assert err["fp16"] < err["sq8"] < err["sq4"] and err["sq8"] < err["pq4"] < err["pq8"] < err["pq16"]
    assert err["rq8"] < err["rq16"]


@pytest.mark.parametrize("codec", list(CODECS))
def test_manifest_sizes_are_the_bytes_on_disk(galleries, codec):
    root, _ = galleries
    g = Gallery(root / codec)
    store = g.manifest["store"]
    assert store["codec"] == codec and g.manifest["version"] == (1 if codec == "fp16" else 3)
    if codec == "fp16":
        on_disk = sum(np.load(root / codec / f, mmap_mode="r").nbytes for f in ("keys.npy", "values.npy", "mask.npy"))
    else:
        on_disk = sum(g.codes[r].nbytes for r in ROLES)  # every patch is real: no mask file
        assert not (root / codec / "mask.bits.npy").exists() and not (root / codec / "keys.npy").exists()
        assert store["codebook_bytes"] == sum((root / codec / q["file"]).stat().st_size for q in store["quantizers"])
    assert store["bytes_per_image"] * N == on_disk
    assert store["bytes_per_image"] == bytes_per_image(codec, H, L, D, D, store["mask"])
    fp16 = bytes_per_image("fp16", H, L, D, D, "bool")
    ratio = {"fp16": 1, "sq8": 2, "sq4": 4, "pq4": 8, "rq8": 16, "pq8": 16, "pq16": 32, "rq16": 32}[codec]
    assert store["bytes_per_image"] <= fp16 / ratio


@pytest.mark.parametrize("with_coverage", [False, True])
@pytest.mark.parametrize("codec", ["fp16", "sq8", "pq8", "pq16", "rq8", "rq16"])
def test_rerank_from_codes_equals_rerank_of_the_decoded_arrays(model, galleries, codec, with_coverage):
    """The block path (read, decode, score, drop) gives the numbers of the same function over all decoded keys; so
    does the coverage term, whose salience logits come from look-up tables for PQ / RQ codes."""
    root, _ = galleries
    g = Gallery(root / codec)
    keys, values, mask = decoded_all(g)
    text = model.encode_text(["a red circle", "a small blue square on the left of a big green triangle"])
    ids = np.array([5, 77, 3, 119, 0, 42, 8, 64, 100, 31, 2])
    term = None
    if with_coverage:
        salience = PatchSalience(H, D)
        torch.nn.init.normal_(salience.proj.weight, std=0.3, generator=torch.Generator().manual_seed(0))
        term = (0.5, salience)
    for i in range(2):
        want = rerank_scores(text.attn[i], text.mask[i], text.value[i], keys[:, ids], values[:, ids], mask[ids], term)
        if with_coverage:  # the term moved the scores: the comparison covers it
            assert (want - rerank_scores(text.attn[i], text.mask[i], text.value[i], keys[:, ids], values[:, ids],
                                         mask[ids])).abs().max() > 1e-3
        for block in (1, 4, None):
            got = rerank_candidates(text.attn[i], text.mask[i], text.value[i], g, ids, block, term)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec", ["sq8", "pq4", "pq8", "rq8", "rq16"])
def test_codeword_sums_decode_as_faiss_does(galleries, codec):
    """PQ and RQ codes are sums of codewords (one embedding_bag over the stacked tables, and the look-up tables
    of the re-rank); both equal FAISS's own sa_decode, head by head. SQ is not such a code."""
    g = Gallery(galleries[0] / codec)
    assert g.scores_from_codes == (codec != "sq8")
    for role in ROLES:
        words = Codewords.of(g.quantizers[role])
        assert (words is None) == (codec == "sq8")
        codes = np.array(g.codes[role][[3, 0, 119, 57]])  # (4, H, L, cs)
        got = g._decode(role, codes)  # (H, 4, L, d)
        for h in range(H):
            want = g.quantizers[role][h].sa_decode(codes[:, h].reshape(-1, codes.shape[-1]))
            torch.testing.assert_close(got[h].reshape(-1, got.shape[-1]), torch.from_numpy(want), rtol=1e-5,
                                       atol=1e-6)
        if words is not None:  # a dot product with a code = the sum of its M look-up table entries
            assert (got.norm(dim=-1).amax((1, 2)) <= words.max_norm * (1 + 1e-6)).all()  # the softmax-shift bound
            x = torch.randn(H, 3, got.shape[-1])  # (H, n, d)
            lut = words.lut(x)  # (H·M·256, n)
            rows = words.indices(codes)  # (H, 4, L, M)
            dots = torch.nn.functional.embedding_bag(rows.view(-1, rows.shape[-1]), lut, mode="sum")
            want = torch.einsum("hkld,hnd->hkln", got, x).reshape(-1, 3)
            torch.testing.assert_close(dots, want, rtol=1e-4, atol=1e-5)


def test_blocks_bound_the_decoded_candidates(galleries, monkeypatch):
    root, _ = galleries
    g = Gallery(root / "pq8")
    monkeypatch.setattr("mmgeo.search.store.BLOCK_IMAGES", 7)
    sizes = [k.shape[1] for k, _, _ in g.candidate_blocks(np.arange(100))]
    assert sizes == [7] * 14 + [2]
    g.model_record = {**g.model_record, "num_heads": 8, "num_patches": 196, "d_a": 128, "d_e": 128}
    g.num_patches = 196  # the patches stored per image (all of them: not pruned)
    monkeypatch.setattr("mmgeo.search.store.BLOCK_IMAGES", 256)
    assert g.block_size() == 5  # geo-vitb16-bert: 1.6 MB of fp32 keys + values a candidate, 8 MB a block


def test_padding_masks_are_packed_bits(model, tmp_path):
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[::3, 10:] = False  # every third image has 6 padding patches
    emb = embedding(mask=mask)
    build_gallery_from_embedding(model, emb, tmp_path / "i", index_type="flat", codec="sq8")
    g = Gallery(tmp_path / "i")
    assert g.store["mask"] == "packed" and (tmp_path / "i" / "mask.bits.npy").is_file()
    assert g.store["bytes_per_image"] == H * L * 2 * D + 2  # 16 patches -> 2 bytes of bits
    got = torch.cat([m for _, _, m in g.candidate_blocks(np.arange(N), block=13)])
    assert torch.equal(got, mask) and torch.equal(g.image_mask(3), mask[3])


@pytest.mark.parametrize("key_scale", [1.0, 200.0])  # 200: logits past SAFE_LOGIT, the softmax must shift
def test_scores_from_codes_with_padding_and_large_logits(model, tmp_path, key_scale):
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[::3, 10:] = False
    emb = embedding(mask=mask)
    emb = Embedding(emb.pooled, emb.attn * key_scale, emb.value, emb.mask)
    build_gallery_from_embedding(model, emb, tmp_path / "i", index_type="flat", codec="rq8")
    g = Gallery(tmp_path / "i")
    assert g.scores_from_codes and g.store["mask"] == "packed"
    keys, values, got_mask = decoded_all(g)
    assert torch.equal(got_mask, mask)
    text = model.encode_text(["a small blue square on the left of a big green triangle"])
    ids = np.array([0, 1, 3, 6, 7, 119, 60, 33])  # padded and full images
    want = rerank_scores(text.attn[0], text.mask[0], text.value[0], keys[:, ids], values[:, ids], mask[ids])
    q = text.attn[0][:, text.mask[0]] / D ** 0.5  # (H, n, D) scaled queries
    big = float(torch.einsum("hnd,hkld->hnkl", q, keys[:, ids]).abs().max()) >= SAFE_LOGIT
    assert big == (key_scale > 1) and torch.isfinite(want).all()
    for block in (1, 3, None):
        got = rerank_candidates(text.attn[0], text.mask[0], text.value[0], g, ids, block)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_search_check_images_and_explain_keys_work_on_a_coded_index(model, galleries):
    root, emb = galleries
    g = Gallery(root / "pq8")
    g.check_images(emb)  # within twice the recorded error
    with pytest.raises(GalleryError, match="is not image"):
        g.check_images(emb[torch.arange(N).roll(1)])
    text = Embedding(emb.pooled[7:8], emb.attn[7:8, :, :4], emb.value[7:8, :, :4], torch.ones(1, 4, dtype=torch.bool))
    ids, scores = search_text(model, g, text, k=5)
    assert len(ids) == 5 and np.all(np.diff(scores) <= 0)
    assert g.image_keys(7).shape == (H, L, D)


def test_the_same_build_gives_the_same_codes(model, galleries, tmp_path):
    root, emb = galleries
    build_gallery_from_embedding(model, emb, tmp_path / "again", index_type="flat", codec="pq8")
    a, b = (json.loads((p / "manifest.json").read_text())["store"] for p in (root / "pq8", tmp_path / "again"))
    assert [q["sha256"] for q in a["quantizers"]] == [q["sha256"] for q in b["quantizers"]]
    for role in ROLES:
        assert np.array_equal(np.load(root / "pq8" / f"{role}.codes.npy"),
                              np.load(tmp_path / "again" / f"{role}.codes.npy"))


def test_a_truncated_codebook_is_refused(galleries, tmp_path):
    root, _ = galleries
    shutil.copytree(root / "pq8", tmp_path / "i")
    book = tmp_path / "i" / "codebooks" / "values.1.faiss"
    book.write_bytes(book.read_bytes()[:-100])
    with pytest.raises(GalleryError, match=r"codebook .*values\.1\.faiss is not the one this index was built with"):
        Gallery(tmp_path / "i")


def test_a_codebook_from_another_index_is_refused(model, galleries, tmp_path):
    root, _ = galleries
    build_gallery_from_embedding(model, embedding(seed=5), tmp_path / "other", index_type="flat", codec="pq8")
    shutil.copytree(root / "pq8", tmp_path / "i")
    shutil.copy(tmp_path / "other" / "codebooks" / "keys.0.faiss", tmp_path / "i" / "codebooks" / "keys.0.faiss")
    with pytest.raises(GalleryError, match="copied from another index"):
        Gallery(tmp_path / "i")
    # a manifest edited to the foreign file's checksum still meets the dimension check when the shapes differ
    shutil.copy(root / "pq16" / "codebooks" / "keys.0.faiss", tmp_path / "i" / "codebooks" / "keys.0.faiss")
    man = json.loads((tmp_path / "i" / "manifest.json").read_text())
    rec = man["store"]["quantizers"][0]
    other = json.loads((root / "pq16" / "manifest.json").read_text())["store"]["quantizers"][0]
    rec.update(bytes=other["bytes"], sha256=other["sha256"])
    (tmp_path / "i" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(GalleryError, match=r"codes d=16 in 1 bytes .* manifest says d=16 in 2"):
        Gallery(tmp_path / "i")


def test_missing_codebook_and_codes_of_the_wrong_shape_are_refused(galleries, tmp_path):
    root, _ = galleries
    shutil.copytree(root / "rq8", tmp_path / "a")
    (tmp_path / "a" / "codebooks" / "keys.1.faiss").unlink()
    with pytest.raises(GalleryError, match=r"keys\.1\.faiss is missing"):
        Gallery(tmp_path / "a")
    shutil.copytree(root / "rq8", tmp_path / "b")
    np.save(tmp_path / "b" / "values.codes.npy", np.load(tmp_path / "b" / "values.codes.npy")[:-1])
    with pytest.raises(GalleryError, match=r"values\.codes\.npy has shape \(119, 2, 16, 2\), manifest says \(120"):
        Gallery(tmp_path / "b")


def test_bad_codec_requests_fail_before_any_encoding(model, tmp_path):
    emb = embedding()
    with pytest.raises(ValueError, match="unknown codec 'pq3'; choose one of fp16, sq8"):
        build_gallery_from_embedding(model, emb, tmp_path / "a", codec="pq3")
    small = mmgeo.create_model("geo-tiny", **TINY).eval()  # d_a = 8: not a multiple of 16
    with pytest.raises(ValueError, match="codec pq16 codes 16 dimensions per byte; d = 8"):
        build_gallery_from_embedding(small, emb, tmp_path / "b", codec="pq16")
    with pytest.raises(ValueError, match="codec pq8 needs at least 256 patches per head .* use fp16, sq8 or sq4"):
        build_gallery_from_embedding(model, emb[:10], tmp_path / "c", codec="pq8")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_random_galleries_take_a_codec(tmp_path):
    build_random_gallery(tmp_path / "r", count=64, num_heads=H, num_patches=L, d_a=D, d_e=D, d_global=16,
                         index_type="flat", codec="pq8")
    g = Gallery(tmp_path / "r")
    assert g.codec == "pq8" and g.store["bytes_per_image"] == H * L * (2 + 2)


def test_an_index_from_before_the_store_record_reads_as_fp16(galleries, tmp_path):
    root, emb = galleries
    shutil.copytree(root / "fp16", tmp_path / "old")
    man = json.loads((tmp_path / "old" / "manifest.json").read_text())
    del man["store"]
    man["dtype"] = "float16"  # what v1 manifests said before
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(man))
    g = Gallery(tmp_path / "old")
    assert g.codec == "fp16" and g.store == Gallery(root / "fp16").store
    assert torch.equal(g.image_mask(3), emb.mask[3])


def test_a_sharded_index_takes_a_codec(model, tmp_path):
    emb = embedding()
    build_gallery_from_embedding(model, emb, tmp_path / "s", index_type="flat", shard_size=50, codec="sq8")
    g = Gallery(tmp_path / "s")
    assert g.manifest["version"] == 3 and g.manifest["shards"]["count"] == 3 and g.codec == "sq8"
    text = Embedding(emb.pooled[99:100], emb.attn[99:100, :, :4], emb.value[99:100, :, :4],
                     torch.ones(1, 4, dtype=torch.bool))
    ids, _ = search_text(model, g, text, k=3, rerank=False)
    assert ids[0] == 99  # its own global vector, found in the last shard
