"""Contrastive losses: symmetric InfoNCE, and caption hard negatives on the image->text side (NegCLIP)."""

import pytest
import torch
import torch.nn.functional as F

from mmgeo.training.losses import EditQueries, retrieval_loss, symmetric_infonce


def test_symmetric_infonce_is_the_mean_of_both_directions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 5, generator=g)
    target = torch.arange(5)
    expect = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    torch.testing.assert_close(symmetric_infonce(logits), expect)


def test_negatives_join_the_image_to_text_side_only():
    """With N_neg extra captions, image i's softmax runs over the B captions and every negative; the
    text->image side (B captions over B images) is unchanged."""
    g = torch.Generator().manual_seed(1)
    logits, neg = torch.randn(4, 4, generator=g), torch.randn(6, 4, generator=g)  # (B, B), (N_neg, B)
    out = retrieval_loss({"global": logits}, negative_logits={"global": neg})
    target = torch.arange(4)
    t2i = F.cross_entropy(logits, target)
    i2t = F.cross_entropy(torch.cat([logits, neg]).T, target)  # (B, B + N_neg)
    torch.testing.assert_close(out["loss"], 0.5 * (t2i + i2t))
    assert out["loss"] > retrieval_loss({"global": logits})["loss"]  # negatives only add competitors


def test_true_captions_leave_both_sides_negatives():
    """positives[i, j] (caption i true of image j): caption i's softmax runs without image j, image j's without
    caption i; the negatives still join image j's side; the distillation is left as it was."""
    g = torch.Generator().manual_seed(3)
    logits = {k: torch.randn(4, 4, generator=g, requires_grad=True) for k in ("geometric", "global")}
    neg = {k: torch.randn(3, 4, generator=g) for k in logits}
    positives = torch.zeros(4, 4, dtype=torch.bool)
    positives[0, 2] = positives[3, 1] = True
    out = retrieval_loss(logits, negative_logits=neg, distill_weight=1.0, positives=positives)
    for k, v in logits.items():
        t2i = [F.cross_entropy(v[i, [j for j in range(4) if not positives[i, j]]].unsqueeze(0),
                               torch.tensor([[j for j in range(4) if not positives[i, j]].index(i)])) for i in range(4)]
        image_side = torch.cat([v, neg[k]]).T  # (B, B + N_neg)
        i2t = [F.cross_entropy(image_side[j, [i for i in range(7) if i >= 4 or not positives[i, j]]].unsqueeze(0),
                               torch.tensor([[i for i in range(7) if i >= 4 or not positives[i, j]].index(j)]))
               for j in range(4)]
        torch.testing.assert_close(out[f"loss_{k}"], 0.5 * (sum(t2i) / 4 + sum(i2t) / 4))
    plain = retrieval_loss(logits, negative_logits=neg, distill_weight=1.0)
    torch.testing.assert_close(out["loss_distill"], plain["loss_distill"])
    assert out["loss"] < plain["loss"]  # fewer competitors
    out["loss"].backward()
    assert all(torch.isfinite(v.grad).all() for v in logits.values())


def test_negatives_for_every_score_of_a_geometric_model():
    g = torch.Generator().manual_seed(2)
    logits = {k: torch.randn(3, 3, generator=g) for k in ("geometric", "global")}
    neg = {k: torch.randn(2, 3, generator=g) for k in logits}
    out = retrieval_loss(logits, global_weight=0.5, negative_logits=neg)
    torch.testing.assert_close(out["loss"], out["loss_geometric"] + 0.5 * out["loss_global"])
    with pytest.raises(KeyError):
        retrieval_loss(logits, negative_logits={"global": neg["global"]})  # a score without its negatives


def test_distillation_is_the_kl_from_the_geometric_to_the_global_softmax():
    """Both directions, the teacher detached: the geometric logits get no gradient from the distillation term."""
    g = torch.Generator().manual_seed(3)
    geo = torch.randn(4, 4, generator=g, requires_grad=True)
    glob = torch.randn(4, 4, generator=g, requires_grad=True)
    neg = {"geometric": torch.randn(2, 4, generator=g), "global": torch.randn(2, 4, generator=g)}
    out = retrieval_loss({"geometric": geo, "global": glob}, negative_logits=neg, distill_weight=0.7)

    def kl(teacher, student):  # rows: sum_j p_j (log p_j - log q_j), mean over rows
        p = teacher.softmax(1)
        return (p * (p.log() - student.log_softmax(1))).sum(1).mean()

    expect = 0.5 * (kl(geo, glob) + kl(torch.cat([geo, neg["geometric"]]).T, torch.cat([glob, neg["global"]]).T))
    torch.testing.assert_close(out["loss_distill"], expect)
    torch.testing.assert_close(out["loss"], out["loss_geometric"] + out["loss_global"] + 0.7 * expect)
    (grad_geo,) = torch.autograd.grad(out["loss_distill"], geo, allow_unused=True)
    assert grad_geo is None  # teacher detached
    assert "loss_distill" not in retrieval_loss({"geometric": geo, "global": glob})  # off by default


def test_distillation_vanishes_when_the_two_scores_agree():
    from mmgeo.training.losses import distillation

    logits = torch.randn(5, 5, generator=torch.Generator().manual_seed(4))
    side = {"geometric": logits, "global": logits.clone()}
    assert float(distillation(side, {k: v.T for k, v in side.items()})) == pytest.approx(0.0, abs=1e-6)


def test_negative_query_is_minus_log_one_minus_the_source_probability():
    from mmgeo.training.losses import negative_query

    torch.manual_seed(0)
    neg = {"geometric": torch.randn(5, 4), "global": torch.randn(5, 4)}  # 5 edits against 4 images
    source = torch.tensor([0, 0, 1, 3, 2])
    want = {k: -torch.log1p(-F.softmax(v, 1)[torch.arange(5), source]).mean() for k, v in neg.items()}
    torch.testing.assert_close(negative_query(neg, source, 0.5), want["geometric"] + 0.5 * want["global"])
    torch.testing.assert_close(negative_query({"global": neg["global"]}, source, 0.5), want["global"])


def test_negative_query_pushes_the_source_image_down_and_the_others_up():
    from mmgeo.training.losses import negative_query

    logits = torch.randn(3, 4, requires_grad=True)
    source = torch.tensor([2, 0, 1])
    negative_query({"global": logits}, source, 1.0).backward()
    g = logits.grad  # descent moves each logit by -g
    rows = torch.arange(3)
    assert (g[rows, source] > 0).all()  # the source image's score goes down
    others = torch.ones_like(g, dtype=torch.bool)
    others[rows, source] = False
    assert (g[others] < 0).all() and torch.allclose(g.sum(1), torch.zeros(3), atol=1e-6)


def test_retrieval_loss_adds_the_negative_query_term_only_when_weighted():
    torch.manual_seed(1)
    logits = {"geometric": torch.randn(4, 4), "global": torch.randn(4, 4)}
    neg = {"geometric": torch.randn(6, 4), "global": torch.randn(6, 4)}
    source = torch.tensor([0, 0, 1, 2, 3, 3])
    base = retrieval_loss(logits, 0.5, neg)
    off = retrieval_loss(logits, 0.5, neg, edits=EditQueries(source, negative_weight=0.0))
    on = retrieval_loss(logits, 0.5, neg, edits=EditQueries(source, negative_weight=2.0))
    assert "loss_negative_query" not in off and torch.equal(off["loss"], base["loss"])
    torch.testing.assert_close(on["loss"], base["loss"] + 2.0 * on["loss_negative_query"])


def test_negative_query_of_a_single_image_is_zero_not_infinite():
    from mmgeo.training.losses import negative_query

    logits = torch.randn(3, 1, requires_grad=True)  # 3 edits, one image: no other image to rank it below
    loss = negative_query({"global": logits}, torch.zeros(3, dtype=torch.long), 1.0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_edit_query_is_minus_log_the_probability_of_the_images_each_edit_is_true_of():
    from mmgeo.training.losses import edit_query

    torch.manual_seed(2)
    neg = {"geometric": torch.randn(4, 5), "global": torch.randn(4, 5)}  # 4 edits against 5 images
    truth = torch.tensor([[0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    want = {k: -torch.stack([F.softmax(v[0], 0)[[1, 3]].sum().log(), F.softmax(v[2], 0)[0].log()]).mean()
            for k, v in neg.items()}  # rows 1 and 3 are true of no image: left out, not averaged in
    torch.testing.assert_close(edit_query(neg, truth), want["geometric"])  # the geometric score alone
    torch.testing.assert_close(edit_query({"global": neg["global"]}, truth), want["global"])  # a global-only model
    none = torch.zeros(4, 5, requires_grad=True)
    loss = edit_query({"global": none}, torch.zeros(4, 5, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(none.grad, torch.zeros_like(none))


def test_edit_query_raises_the_true_images_above_the_rest():
    from mmgeo.training.losses import edit_query

    logits = torch.randn(2, 4, requires_grad=True)
    truth = torch.tensor([[0, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    edit_query({"global": logits}, truth).backward()
    g = logits.grad  # descent moves each logit by -g
    assert (g[truth] < 0).all() and (g[~truth] > 0).all()


def test_retrieval_loss_adds_the_edit_query_term_only_when_weighted():
    torch.manual_seed(3)
    logits = {"geometric": torch.randn(4, 4), "global": torch.randn(4, 4)}
    neg = {"geometric": torch.randn(3, 4), "global": torch.randn(3, 4)}
    truth = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    base = retrieval_loss(logits, 0.5, neg)
    source = torch.tensor([0, 1, 3])
    off = retrieval_loss(logits, 0.5, neg, edits=EditQueries(source, edit_weight=0.0, truth=truth))
    on = retrieval_loss(logits, 0.5, neg, edits=EditQueries(source, edit_weight=2.0, truth=truth))
    assert "loss_edit_query" not in off and torch.equal(off["loss"], base["loss"])
    torch.testing.assert_close(on["loss"], base["loss"] + 2.0 * on["loss_edit_query"])


def test_negative_query_takes_only_the_rows_asked_for():
    from mmgeo.training.losses import negative_query

    torch.manual_seed(5)
    neg = {"global": torch.randn(4, 3)}
    source, rows = torch.tensor([0, 1, 2, 0]), torch.tensor([True, False, False, True])
    torch.testing.assert_close(negative_query(neg, source, 1.0, rows),
                               negative_query({"global": neg["global"][rows]}, source[rows], 1.0))
    assert negative_query(neg, source, 1.0, torch.zeros(4, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("which, rows", [("all", None), ("sub_captions", [True, False, True]),
                                         ("true_of_another", [False, True, False])])
def test_the_config_picks_the_edits_negative_query_takes(which, rows):
    from mmgeo.training.config import LossConfig
    from mmgeo.training.module import edit_queries

    batch = {"negative_source": torch.tensor([0, 1, 2]), "partial": torch.tensor([True, False, True]),
             "negative_truth": torch.tensor([[False, False, False], [True, False, False], [False, False, False]])}
    edits = edit_queries(batch, LossConfig(negative_query_weight=1.0, negative_query_rows=which))
    assert edits.negative_weight == 1.0 and edits.edit_weight == 0.0
    assert (edits.rows if rows is None else edits.rows.tolist()) == rows
    assert edit_queries(batch, LossConfig()) is None  # both terms off
    if rows is not None:  # never all edits in silence when the batch lacks what picks them
        with pytest.raises(RuntimeError, match="does not say"):
            edit_queries({"negative_source": batch["negative_source"]},
                         LossConfig(negative_query_weight=1.0, negative_query_rows=which))
    with pytest.raises(RuntimeError, match="does not say"):  # nor leaves the edit query out in silence
        edit_queries({"negative_source": batch["negative_source"]}, LossConfig(edit_query_weight=1.0))
    with pytest.raises(ValueError, match="negative_query_rows"):
        LossConfig(negative_query_rows="some")
    with pytest.raises(ValueError, match="edit_truth"):
        LossConfig(edit_truth="exact")
