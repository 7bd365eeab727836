"""``eval.py --mode two-stage`` measures the service's search: over a built gallery (``--index``) it ranks like
``search_texts`` called directly; over a flat gallery with every image a candidate it ranks like exact scoring;
``rank_captions`` (evaluation) is ``search_texts`` (the service) for every caption."""

import json

import numpy as np
import pytest
import torch

import eval as eval_app
from mmgeo.data import build_dataset
from mmgeo.eval.metrics import image_to_text_ranks, retrieval_metrics, text_to_image_ranks
from mmgeo.eval.retrieval import encode_split, exact_scores
from mmgeo.eval.two_stage import CANDIDATE_OFFSET, CaptionRanking, evaluate_split, rank_captions
from mmgeo.models import Embedding
from mmgeo.search.build import build_gallery_from_embedding
from mmgeo.search.store import Gallery
from mmgeo.search.two_stage import search_texts

N, K_PRIME = 24, 5


@pytest.fixture(scope="module")
def split(gallery_env):
    ds = build_dataset("synthetic", "test", image_size=gallery_env.model.cfg.image_size, size=N)
    return encode_split(gallery_env.model, ds, progress=False)


@pytest.fixture(scope="module")
def built(gallery_env, tmp_path_factory):
    """Galleries of the first N test images by `python -m serve build`: flat, HNSW, and flat in shards of 7."""
    from serve.cli import main

    root = tmp_path_factory.mktemp("built")
    common = ["build", "--ckpt", str(gallery_env.ckpt), "--data", "synthetic", "--split", "test", "--limit", str(N),
              "--no-progress", "--batch-size", "8"]
    for name, extra in (("flat", ["--index-type", "flat"]), ("hnsw", ["--index-type", "hnsw"]),
                        ("shards", ["--shard-size", "7"])):
        assert main([*common, "--out", str(root / name), *extra]) == 0
    return root


def near_tie_rows(scores: torch.Tensor, owner: torch.Tensor, tol: float) -> torch.Tensor:
    """(N_t,) True where another image scores within ``tol`` of the caption's own image: its rank may flip."""
    true = scores.gather(1, owner[:, None])  # (N_t, 1)
    close = (scores - true).abs() <= tol  # (N_t, N_i)
    return close.sum(1) > 1


def near_tie_columns(scores: torch.Tensor, owner: torch.Tensor, tol: float) -> torch.Tensor:
    """(N_i,) True where another image's caption scores within ``tol`` of the image's best own caption."""
    own = owner[:, None] == torch.arange(scores.shape[1])[None]  # (N_t, N_i)
    best = scores.masked_fill(~own, float("-inf")).amax(0)  # (N_i,)
    return (((scores - best).abs() <= tol) & ~own).any(0)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "shards"])
def test_index_ranks_are_the_services_search(gallery_env, split, built, kind, tmp_path, capsys):
    out = tmp_path / "r.json"
    eval_app.main(["--index", str(built / kind), "--split", "test", "--k-prime", str(K_PRIME), "--out", str(out)])
    result = json.loads(out.read_text())
    gallery = Gallery(built / kind)
    assert result["mode"] == "two-stage" and result["model"] == str(gallery_env.ckpt.resolve())
    assert result["two_stage"] == {"index": str(built / kind), "index_type": gallery.manifest["index_type"],
                                   "k_prime": K_PRIME, "store": gallery.manifest["store"]}
    assert result["two_stage"]["store"]["codec"] == "fp16"
    assert result["counts"] == {"images": N, "captions": 5 * N}
    assert "service's search" in result["measured"]["text_to_image"]
    assert "read from the text->image candidates" in result["measured"]["image_to_text"]
    assert "no image->text search" in capsys.readouterr().out

    scores, record = evaluate_split(gallery_env.model, split, K_PRIME, gallery=gallery, progress=False)
    assert record["two_stage"] == result["two_stage"] and record["first_stage"] == result["first_stage"]
    assert retrieval_metrics(scores, split.text_to_image) == result["metrics"]
    ranks = text_to_image_ranks(scores, split.text_to_image)  # (N_t,)
    owner, hits = split.text_to_image.numpy(), 0
    for i in range(len(split.texts)):  # the service's answer for each caption, one query at a time
        ids, s = search_texts(gallery_env.model, gallery, split.texts[i:i + 1], [K_PRIME], [True], K_PRIME)[0]
        if owner[i] in ids:
            hits += 1
            assert ranks[i] == int((s >= s[ids == owner[i]]).sum()), i  # ties count against, as in the metrics
        else:
            assert ranks[i] > len(ids), i
    assert hits > 0, "no caption found its image: the test compared nothing"
    assert result["first_stage"]["text_to_image_first_stage_recall"] == hits / len(split.texts)
    assert result["metrics"]["text_to_image_R@1"] == float((ranks == 1).double().mean())


def test_flat_with_every_image_a_candidate_is_exact_scoring(gallery_env, split, tmp_path):
    model = gallery_env.model
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(gallery_env.ckpt), "--limit", str(N), "--mode", "two-stage", "--index-type", "flat",
                   "--k-prime", str(N), "--out", str(out)])
    result = json.loads(out.read_text())
    assert {k: v for k, v in result["two_stage"].items() if k != "store"} == {"index": None, "index_type": "flat",
                                                                             "k_prime": N}
    assert result["two_stage"]["store"]["codec"] == "fp16"
    scores, record = evaluate_split(model, split, N, "flat", progress=False)
    assert retrieval_metrics(scores, split.text_to_image) == result["metrics"]
    assert record["first_stage"]["text_to_image_first_stage_recall"] == 1.0
    im = split.images  # the gallery stores keys/values in fp16: exact scoring of those is what re-ranking computes
    stored = Embedding(im.pooled, im.attn.half().float(), im.value.half().float(), im.mask)
    exact = exact_scores(model, split.texts, stored, "geometric", progress=False)  # (N_t, N_i)
    owner = split.text_to_image
    ties = near_tie_rows(exact, owner, 1e-5)
    assert ties.float().mean() < 0.1
    got, want = text_to_image_ranks(scores, owner), text_to_image_ranks(exact, owner)
    assert torch.equal(got[~ties], want[~ties])
    i2t_ties = near_tie_columns(exact, owner, 1e-5)
    got, want = image_to_text_ranks(scores, owner), image_to_text_ranks(exact, owner)
    assert i2t_ties.float().mean() < 0.2 and torch.equal(got[~i2t_ties], want[~i2t_ties])
    fp32 = exact_scores(model, split.texts, split.images, "geometric", progress=False)  # what --mode exact scores
    fp16_ties = near_tie_rows(fp32, owner, 2e-3)  # fp16 storage may flip only near-ties
    t2i = text_to_image_ranks(scores, owner)
    assert torch.equal(text_to_image_ranks(fp32, owner)[~fp16_ties], t2i[~fp16_ties])


def test_a_coded_index_and_a_coded_temporary_gallery_rank_alike(gallery_env, tmp_path, capsys):
    """`serve build --codec sq8` evaluated through --index and `eval.py --mode two-stage --codec sq8` (a temporary
    gallery) re-rank from the same codes: same metrics; the JSON and the printout name the codec."""
    from serve.cli import main

    assert main(["build", "--ckpt", str(gallery_env.ckpt), "--data", "synthetic", "--split", "test", "--limit",
                 str(N), "--no-progress", "--batch-size", "256", "--codec", "sq8", "--out", str(tmp_path / "i")]) == 0
    assert "re-rank store sq8: 512 bytes per image" in capsys.readouterr().out  # 2 heads x 16 patches x 16 dims
    eval_app.main(["--index", str(tmp_path / "i"), "--k-prime", str(K_PRIME), "--out", str(tmp_path / "a.json")])
    eval_app.main(["--ckpt", str(gallery_env.ckpt), "--limit", str(N), "--mode", "two-stage", "--codec", "sq8",
                   "--k-prime", str(K_PRIME), "--out", str(tmp_path / "b.json")])
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["metrics"] == b["metrics"]
    for r in (a, b):
        assert r["two_stage"]["store"]["codec"] == "sq8" and r["two_stage"]["store"]["bytes_per_image"] == 512
        assert "decoded from sq8 codes" in r["measured"]["text_to_image"]
    assert "sq8 re-rank store of 512 bytes per image" in capsys.readouterr().out
    for argv, msg in ((["--index", str(tmp_path / "i"), "--codec", "pq8"], "an --index gallery has its own codec"),
                      (["--ckpt", str(gallery_env.ckpt), "--codec", "pq8"], "--codec applies to --mode two-stage")):
        with pytest.raises(SystemExit):
            eval_app.main(argv)
        assert msg in capsys.readouterr().err


def test_two_stage_reranks_only_the_first_stage_candidates(gallery_env, split):
    scores, _ = evaluate_split(gallery_env.model, split, 3, "flat", progress=False)
    glob = exact_scores(gallery_env.model, split.texts, split.images, "global", progress=False)  # (N_t, N_i)
    for row in range(len(split.texts)):
        top = scores[row].topk(3).indices
        assert set(top.tolist()) == set(glob[row].topk(3).indices.tolist())
        rest = np.setdiff1d(np.arange(N), top.numpy())
        order = scores[row, rest].argsort(descending=True)
        torch.testing.assert_close(glob[row, rest][order], glob[row, rest].sort(descending=True).values)


def test_index_errors_name_the_problem(gallery_env, built, tmp_path):
    import mmgeo
    from tests.conftest import TINY

    with pytest.raises(SystemExit, match=r"holds 24 images, synthetic test \(--limit 10\) has 10"):
        eval_app.main(["--index", str(built / "flat"), "--limit", "10"])
    with pytest.raises(SystemExit, match="not built from this split.*image 0 of the index is not image 0"):
        eval_app.main(["--index", str(built / "flat"), "--seed", "3"])
    other = mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY), tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="not the one the index was built with"):
        eval_app.main(["--index", str(built / "flat"), "--ckpt", str(other)])
    with pytest.raises(SystemExit, match="no manifest.json"):
        eval_app.main(["--index", str(tmp_path / "none")])
    for bad in (["--mode", "exact"], ["--index-type", "hnsw"]):
        with pytest.raises(SystemExit) as err:
            eval_app.main(["--index", str(built / "flat"), *bad])
        assert err.value.code == 2


def test_two_stage_over_a_pruned_temporary_gallery(gallery_env, tmp_path, capsys):
    """--keep-patches with sample captions prunes the temporary gallery: the record says so, and the flags are
    refused alone, with --index, outside two-stage, or with a file of no captions."""
    S = (gallery_env.model.cfg.image_size // gallery_env.model.cfg.patch_size) ** 2
    sample = tmp_path / "sample.txt"
    sample.write_text("a big red circle\na small blue square on the left\n")
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(gallery_env.ckpt), "--split", "test", "--limit", str(N), "--mode", "two-stage",
                   "--k-prime", str(K_PRIME), "--keep-patches", str(S // 2), "--prune-queries", str(sample),
                   "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["two_stage"]["store"]["patches"] == {"kept": S // 2, "of": S, "criterion": "attention mass",
                                                       "queries": 2, "bytes_per_image": -(-S // 8)}
    assert f"of {S // 2} of {S} patches an image" in result["measured"]["text_to_image"]
    assert 0 <= result["metrics"]["text_to_image_R@1"] <= 1
    (tmp_path / "blank.txt").write_text("\n")
    common = ["--ckpt", str(gallery_env.ckpt), "--split", "test", "--limit", str(N)]
    for extra, msg in [(["--mode", "two-stage", "--keep-patches", "2"], "go together"),
                       (["--keep-patches", "2", "--prune-queries", str(sample)], "applies to --mode two-stage"),
                       (["--index", str(gallery_env.idx), "--keep-patches", "2", "--prune-queries", str(sample)],
                        "an --index gallery keeps"),
                       (["--mode", "two-stage", "--keep-patches", "2", "--prune-queries", str(tmp_path / "blank.txt")],
                        "holds no caption")]:
        with pytest.raises(SystemExit):
            eval_app.main([*common, *extra])
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivfpq"])
def test_rank_captions_is_the_services_search_for_every_caption(ranked, index_type, tmp_path):
    model, g, texts, _ = ranked
    emb = Embedding(torch.from_numpy(g.index.reconstruct_n(0, len(g))), torch.from_numpy(np.array(g.keys)).float(),
                    torch.from_numpy(np.array(g.values)).float(), torch.from_numpy(np.array(g.mask)))
    build_gallery_from_embedding(model, emb, tmp_path / "i", index_type=index_type)
    other = Gallery(tmp_path / "i")
    assert other.manifest["index_type"] == index_type
    ranking = rank_captions(model, other, texts, k_prime=6, batch_size=5, progress=False)
    assert len(ranking.ids) == len(texts) and ranking.k_prime == 6
    for i in range(len(texts)):
        ids, scores = search_texts(model, other, texts[i:i + 1], [6], [True], 6)[0]
        np.testing.assert_array_equal(ranking.ids[i], ids)
        np.testing.assert_array_equal(ranking.scores[i], scores)
        assert 0 < len(ids) <= 6


def test_score_matrix_puts_the_reranked_candidates_first(ranked):
    """Candidates keep their re-ranked order on top; every other image keeps its global score, below them."""
    model, g, texts, exact = ranked
    glob = texts.pooled @ torch.from_numpy(g.index.reconstruct_n(0, len(g))).T  # (N_t, N_i)
    ranking = rank_captions(model, g, texts, k_prime=3, progress=False)
    scores = ranking.score_matrix(glob)
    for row in range(len(texts)):
        cand = torch.from_numpy(ranking.ids[row])
        others = torch.ones(len(g), dtype=torch.bool)
        others[cand] = False
        torch.testing.assert_close(scores[row, cand], torch.from_numpy(exact[row][cand.numpy()]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores[row, others] + CANDIDATE_OFFSET, glob[row, others])
        assert set(cand.tolist()) == set(glob[row].topk(3).indices.tolist())  # the first stage's top 3
        assert scores[row, others].max() < scores[row, cand].min()
        assert torch.equal(scores[row].argsort(descending=True, stable=True)[:3], cand)


def test_first_stage_recall_counts_captions_and_images():
    owners = torch.tensor([0, 0, 1, 1, 2])
    ranking_ids = [np.array([0, 2]), np.array([1]), np.array([2, 0]), np.array([0]), np.array([2])]
    got = CaptionRanking(ranking_ids, [np.zeros(len(i)) for i in ranking_ids], 2).first_stage_recall(owners)
    assert got == {"text_to_image_first_stage_recall": 2 / 5, "image_to_text_first_stage_recall": 2 / 3}
