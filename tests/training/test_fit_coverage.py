"""fit_coverage: the salience learns and lifts each caption's own image among its candidates; the written model
scores s + β·cov with it, the input model is left as it was, and bad input ends in one line."""

import subprocess
import sys

import pytest
import torch

import mmgeo
from mmgeo.data import ShapesWorld
from mmgeo.eval.retrieval import encode_split
from mmgeo.kernels import pair_score
from mmgeo.kernels.coverage import coverage
from mmgeo.models.checkpoint import load_model
from mmgeo.training.config import CoverageConfig
from mmgeo.training.fit_coverage import candidate_terms, fit_salience, main, with_coverage
from tests.conftest import TINY


@pytest.fixture(scope="module")
def encoded():
    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **TINY).eval()
    return model, encode_split(model, ShapesWorld("train", image_size=32, size=24), progress=False)


def test_fit_lowers_the_loss_and_the_written_model_scores_with_it(encoded):
    model, split = encoded
    lines = []
    salience, record = fit_salience(model, split.texts, split.images, split.text_to_image,
                                    CoverageConfig(candidates=5, steps=60, lr=0.1, fit_weight=1.0), log=lines.append)
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert losses[-1] < losses[0] - 1e-3, lines
    assert record["own_first_after_at_fit_weight"] >= record["own_first_before"]
    assert salience.proj.weight.abs().sum() > 0
    out = with_coverage(model, salience, 0.2)
    t, i = split.texts[:7], split.images
    s = pair_score(t.attn, t.mask, t.value, i.attn, i.mask, i.value)
    cov = coverage(t.attn, t.mask, t.value, i.attn, i.mask, i.value, salience(i.attn))
    torch.testing.assert_close(out.score(t, i), s + 0.2 * cov)
    assert model.coverage_term is None  # the input model is unchanged


def test_candidates_are_the_best_by_s_among_the_global_shortlist(encoded):
    """With a shortlist, a caption's candidates are its top images by s among those its global score ranks first (as
    search re-ranks), with pair_score's s; a shortlist of every image is the search over all of them."""
    model, split = encoded
    t, i = split.texts, split.images
    s_all = pair_score(t.attn, t.mask, t.value, i.attn, i.mask, i.value)  # (Q, N)
    short = (t.pooled @ i.pooled.T).topk(8, dim=1).indices  # (Q, 8)
    ids, s, explained = candidate_terms(t, i, 5, shortlist=8)
    want = s_all.gather(1, short).topk(5, dim=1)
    torch.testing.assert_close(s, want.values, rtol=1e-5, atol=1e-6)
    assert all(set(a.tolist()) <= set(b.tolist()) for a, b in zip(ids, short))  # from the shortlist
    torch.testing.assert_close(s_all.gather(1, ids), want.values, rtol=1e-5, atol=1e-6)  # its best by s, up to ties
    assert not torch.equal(ids, s_all.topk(5, dim=1).indices)  # the shortlist is not every image here
    every = candidate_terms(t, i, 5, shortlist=0)
    assert torch.equal(every[0], s_all.topk(5, dim=1).indices)
    for a, b in zip(every, candidate_terms(t, i, 5, shortlist=len(i.mask))):
        torch.testing.assert_close(a, b)
    assert explained.shape == (len(t.mask), 5, i.mask.shape[1])


def test_cli_writes_a_new_model_and_never_overwrites(tmp_path, capsys):
    torch.manual_seed(0)
    ckpt = mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY), tmp_path / "model.pt")
    before = ckpt.read_bytes()
    out = tmp_path / "model_coverage.pt"
    assert main(["--ckpt", str(ckpt), "--out", str(out), "--images", "12", "--candidates", "4", "--steps", "5"]) == 0
    assert load_model(out).coverage_term[0] == 0.05 and ckpt.read_bytes() == before
    assert main(["--ckpt", str(ckpt), "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err


def test_cli_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mmgeo.training.fit_coverage", "--ckpt", str(tmp_path / "no.pt"),
                          "--out", str(tmp_path / "out.pt")], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
