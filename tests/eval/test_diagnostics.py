"""mmgeo.eval.diagnostics on hand-built inputs: known values and the troubleshooting warnings (docs/design.md §8)."""

import json
import math

import pytest
import torch

from mmgeo.eval.diagnostics import (
    attention_entropy,
    diagnose,
    diagnose_tensors,
    head_redundancy,
    scalars,
    spectrum,
)

N, H, T, S, D = 3, 2, 4, 9, 8


def _masks():
    q_mask = torch.ones(N, T, dtype=torch.bool)
    q_mask[0, 2:] = False  # a short caption: padding must not count
    return q_mask, torch.ones(N, S, dtype=torch.bool)


def test_entropy_uniform_is_ln_s_and_one_hot_is_zero():
    q_mask, _ = _masks()
    uniform = torch.full((N, H, T, S), 1 / S)
    torch.testing.assert_close(attention_entropy(uniform, q_mask), torch.full((H,), math.log(S)))
    one_hot = torch.zeros(N, H, T, S)
    one_hot[..., 3] = 1
    torch.testing.assert_close(attention_entropy(one_hot, q_mask), torch.zeros(H))
    mixed = torch.cat([uniform[:, :1], one_hot[:, :1]], dim=1)  # head 0 uniform, head 1 one-hot
    torch.testing.assert_close(attention_entropy(mixed, q_mask), torch.tensor([math.log(S), 0.0]))


def test_head_redundancy_identical_and_different_heads():
    q_mask, _ = _masks()
    a = torch.rand(N, 1, T, S).softmax(-1)
    red = head_redundancy(a.expand(N, H, T, S), q_mask)
    torch.testing.assert_close(red, torch.ones(H, H))
    b = torch.zeros(N, H, T, S)
    b[:, 0, :, 0] = 1
    b[:, 1, :, 5] = 1  # two heads looking at different patches
    assert head_redundancy(b, q_mask)[0, 1] < 0


def test_spectrum_effective_rank():
    assert spectrum(torch.eye(6))["effective_rank"] == pytest.approx(6)
    rank_one = torch.outer(torch.randn(6), torch.randn(10))
    assert spectrum(rank_one)["effective_rank"] == pytest.approx(1, abs=1e-6)
    assert spectrum(rank_one)["top_share"] == pytest.approx(1)


def _qk(logit_scale=1.0):
    torch.manual_seed(0)
    q, k = torch.randn(N, H, T, D), torch.randn(N, H, S, D)
    return q * logit_scale, k


def test_warnings_fire_on_thresholds():
    q_mask, k_mask = _masks()
    with pytest.warns(UserWarning, match="near-uniform"):
        diagnose_tensors(torch.zeros(N, H, T, D), q_mask, torch.randn(N, H, S, D), k_mask)
    q, k = _qk(logit_scale=500.0)  # logits in the thousands
    with pytest.warns(UserWarning) as record:
        r = diagnose_tensors(q, q_mask, k, k_mask, weights={"query": torch.outer(torch.randn(8), torch.randn(16))})
    text = " ".join(str(w.message) for w in record)
    assert "logit explosion" in text and "collapsed" in text and "collinear" in text
    assert len(r["warnings"]) == len(record)
    q1 = torch.randn(N, 1, T, D) * 20
    k1 = torch.randn(N, 1, S, D)
    with pytest.warns(UserWarning, match="heads alike"):
        diagnose_tensors(q1.expand(N, H, T, D), q_mask, k1.expand(N, H, S, D), k_mask)


def test_healthy_inputs_raise_nothing(recwarn):
    q_mask, k_mask = _masks()
    q, k = _qk(logit_scale=2.0)
    r = diagnose_tensors(q, q_mask, k, k_mask, weights={"query": torch.linalg.qr(torch.randn(16, 8)).Q.T}, warn=True)
    assert r["warnings"] == [] and len(recwarn) == 0
    assert COLLAPSE < r["entropy"]["mean"] < math.log(S)
    lo = float((q @ k.transpose(-1, -2) / math.sqrt(D))[q_mask[:, None, :, None].expand(N, H, T, S)].min())
    assert r["logits"]["min"] == pytest.approx(lo, rel=1e-5)


COLLAPSE = 0.5 * math.log(2)


def test_sharp_attention_of_a_healthy_run_is_not_a_logit_explosion():
    """Trained models level off at |logit| 40-75: sharp attention, no explosion warning; past the limit, one."""
    from mmgeo.eval.diagnostics import LOGIT_LIMIT

    q_mask, k_mask = _masks()
    q, k = _qk()
    real = q_mask[:, None, :, None].expand(N, H, T, S)  # the logits of real tokens, what the report reads
    peak = float((q @ k.transpose(-1, -2) / math.sqrt(D))[real].abs().max())
    for top, explodes in ((75.0, False), (1.5 * LOGIT_LIMIT, True)):
        r = diagnose_tensors(q * top / peak, q_mask, k, k_mask, warn=False)
        assert max(abs(r["logits"]["min"]), abs(r["logits"]["max"])) == pytest.approx(top, rel=1e-5)
        assert any("logit explosion" in w for w in r["warnings"]) == explodes


def test_diagnose_model_is_json_and_scalars(tiny_model):
    texts = tiny_model.encode_text(["a red circle", "a big blue square in the top left", "a green triangle"])
    images = tiny_model.encode_image(torch.randn(2, 3, 32, 32))
    r = diagnose(tiny_model, texts, images, torch.tensor([0, 1, 1]), warn=False)
    json.dumps(r)
    assert set(r["spectrum"]) == {"query", "key"}
    assert r["entropy"]["uniform"] == pytest.approx(math.log(16))  # 32 px / patch 8 -> 4×4 grid
    s = scalars(r)  # flat floats for the logger
    assert {"diag/entropy_head0", "diag/entropy_head1", "diag/erank_query", "diag/erank_key"} <= s.keys()
    assert set(tiny_model.qk_maps()) == {"query", "key"}
    with pytest.raises(ValueError, match="one image index"):
        diagnose(tiny_model, texts, images, torch.tensor([0, 1, 5]))


def test_nonfinite_cause_names_each_finding(tiny_model):
    from mmgeo.eval.diagnostics import nonfinite_cause

    tok = tiny_model.tokenize(["a red circle", "a small blue square on the left"])
    pixels = torch.zeros(2, 3, tiny_model.cfg.image_size, tiny_model.cfg.image_size)
    args = (tok["input_ids"], tok["attention_mask"])
    assert nonfinite_cause(tiny_model, *args, pixels).startswith("inputs, weights, features and attention logits")
    poisoned = pixels.index_fill(0, torch.tensor([1]), float("nan"))  # image 1 all-NaN
    assert "non-finite pixel values (1 of 2" in nonfinite_cause(tiny_model, *args, poisoned)
    with torch.no_grad():
        tiny_model.query_mlp.fc2.weight.mul_(1e4)
        tiny_model.key_head.proj.weight.mul_(1e4)
    assert nonfinite_cause(tiny_model, *args, pixels).startswith("attention logits explode")
    with torch.no_grad():
        tiny_model.text_value.weight[0, 0] = float("inf")
    assert nonfinite_cause(tiny_model, *args, pixels).startswith("weights are non-finite (text_value.weight)")
