"""Patch pruning of the re-rank store: the attention-mass criterion against its definition, pruned galleries (fp16
and coded) that score exactly the kept patches, their sizes, heatmaps on the full grid, and refusals."""

import json
import shutil

import numpy as np
import pytest
import torch

from mmgeo.models import Embedding
from mmgeo.search.build import build_gallery_from_embedding
from mmgeo.search.codecs import bytes_per_image
from mmgeo.search.pruning import PATCHES_FILE, attention_mass, kept_patches, query_tokens
from mmgeo.search.store import Gallery, GalleryError
from mmgeo.search.two_stage import rerank_candidates, rerank_scores
from tests.search.test_codecs import D, H, L, N, embedding, model  # noqa: F401 - model is a fixture

KEEP = 6


def captions(n=5, T=7, seed=3):
    """Encoded-caption stand-ins: random queries, the last caption two tokens shorter (padding)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[n - 1:, -2:] = False
    u = torch.nn.functional.normalize(torch.randn(n, H, T, D, generator=g), dim=-1)
    return Embedding(torch.zeros(n, 16), torch.randn(n, H, T, D, generator=g), u, mask)


@pytest.fixture(scope="module")
def pruned(model, tmp_path_factory):  # noqa: F811 - the imported fixture
    root = tmp_path_factory.mktemp("pruned")
    emb, queries = embedding(), captions()
    for codec in ("fp16", "rq8"):
        build_gallery_from_embedding(model, emb, root / codec, index_type="flat", codec=codec, keep_patches=KEEP,
                                     prune_queries=queries)
    return root, emb, queries


def test_attention_mass_is_the_softmax_weight_each_patch_receives():
    emb, queries = embedding(), captions()
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[::4, 12:] = False  # some images with padding patches
    got = attention_mass(query_tokens(queries), emb.attn.numpy(), mask.numpy(), chunk=7)  # memmap-like arrays
    want = torch.zeros(N, L)
    for c in range(len(queries)):
        q = queries.attn[c][:, queries.mask[c]]  # (H, n, D)
        for i in range(N):
            logits = torch.einsum("hnd,hsd->hns", q, emb.attn[i]) / D ** 0.5
            want[i] += logits.masked_fill(~mask[i], float("-inf")).softmax(-1).sum((0, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[::4, 12:] == 0).all()  # padding receives nothing
    idx = kept_patches(got, KEEP)
    assert (idx.diff(dim=1) > 0).all()  # grid order
    heaviest = got.topk(KEEP, dim=1).values.sum(1)
    torch.testing.assert_close(got.gather(1, idx).sum(1), heaviest)


@pytest.mark.parametrize("codec", ["fp16", "rq8"])
def test_a_pruned_store_scores_exactly_its_kept_patches(model, pruned, codec):  # noqa: F811
    root, emb, queries = pruned
    g = Gallery(root / codec)
    man = json.loads((root / codec / "manifest.json").read_text())
    assert man["version"] == 4 and man["store"]["patches"] == {
        "kept": KEEP, "of": L, "criterion": "attention mass", "queries": len(queries), "bytes_per_image": 2}
    assert g.num_patches == KEEP and man["store"]["bytes_per_image"] == bytes_per_image(
        codec, H, KEEP, D, D, "bool" if codec == "fp16" else "all") + 2  # + L/8 bytes of kept-patch bits
    mass = attention_mass(query_tokens(queries), emb.attn.half(), emb.mask)  # (N, L): the build reads fp16 keys
    want_idx = torch.stack([g.image_patches(i) for i in range(N)])  # (N, KEEP) as stored
    for i in range(N):  # the heaviest KEEP patches, up to near-ties
        dropped = torch.ones(L, dtype=torch.bool).index_fill_(0, want_idx[i], False)
        assert mass[i, want_idx[i]].min() >= mass[i, dropped].max() - 1e-4 and g.image_mask(i).shape == (KEEP,)
    g.check_images(emb)  # compares each image's stored keys with its kept patches
    text = captions(1, T=5, seed=11)
    ids = np.array([3, 0, 57, 119, 8])
    if codec == "fp16":  # the unpruned keys/values of the kept patches, through the same scoring function
        keys = torch.stack([emb.attn[i][:, want_idx[i]] for i in ids], 1).half().float()  # (H, K, KEEP, D)
        values = torch.stack([emb.value[i][:, want_idx[i]] for i in ids], 1).half().float()
        want = rerank_scores(text.attn[0], text.mask[0], text.value[0], keys, values, torch.ones(5, KEEP, dtype=bool))
        tol = 1e-5
    else:  # the decoded codes of the kept patches
        blocks = list(g.candidate_blocks(ids))
        want = torch.cat([rerank_scores(text.attn[0], text.mask[0], text.value[0], *b) for b in blocks])
        tol = 1e-5
    got = rerank_candidates(text.attn[0], text.mask[0], text.value[0], g, ids)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_heatmaps_of_a_pruned_store_cover_the_whole_grid(model, pruned):  # noqa: F811
    from serve.explain import explain_png

    root, _, _ = pruned
    png = explain_png(model, Gallery(root / "rq8"), 5, "a red circle on the left")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_pruning_needs_a_patch_count_below_the_grid_and_sample_queries(model, tmp_path):  # noqa: F811
    emb, queries = embedding(), captions()
    for keep, q, msg in [(L, queries, "between 1 and 15"), (0, queries, "between 1 and 15"),
                         (KEEP, None, "sample captions"), (None, queries, "pass keep_patches too"),
                         (KEEP, captions(0), "sample captions")]:
        with pytest.raises(ValueError, match=msg):
            build_gallery_from_embedding(model, emb, tmp_path / "x", keep_patches=keep, prune_queries=q)
    assert not (tmp_path / "x").exists()


def test_damaged_or_missing_patch_bits_and_an_old_version_are_refused(pruned, tmp_path):
    root, _, _ = pruned
    bad = tmp_path / "bad"
    shutil.copytree(root / "fp16", bad)
    np.save(bad / PATCHES_FILE, np.zeros((N - 1, 2), np.uint8))
    with pytest.raises(GalleryError, match="patches.bits.npy has shape"):
        Gallery(bad)
    np.save(bad / PATCHES_FILE, np.zeros((N, 2), np.uint8))  # right shape, no patch marked
    with pytest.raises(GalleryError, match="marks 0 patches of image 4"):
        Gallery(bad).image_patches(4)
    (bad / PATCHES_FILE).unlink()
    with pytest.raises(GalleryError, match="missing.*patches.bits.npy"):
        Gallery(bad)
    shutil.rmtree(bad)
    shutil.copytree(root / "rq8", bad)
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**man, "version": 3}))
    with pytest.raises(GalleryError, match="pruned re-rank store"):
        Gallery(bad)
    for rec in ({"kept": L}, {**man["store"]["patches"], "of": 36}, {"of": L}, "six"):
        (bad / "manifest.json").write_text(json.dumps({**man, "store": {**man["store"], "patches": rec}}))
        with pytest.raises(GalleryError, match="does not fit the model's 16 patches"):
            Gallery(bad)
