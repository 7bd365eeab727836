"""coverage: the blocked form equals the loop definition (forward and backward), the one-caption re-rank form
equals a row of it, and it scores an image whose salient patches the caption all explains above a denser one."""

import pytest
import torch

from mmgeo.kernels import coverage as coverage_module
from mmgeo.kernels.coverage import candidate_coverage, coverage, coverage_naive
from tests.kernels.test_pair_score import _inputs as score_inputs
from tests.kernels.tolerance import assert_close_scaled


def _inputs(bt=4, bi=3, h=2, t=6, s=7, da=5, de=4, dtype=torch.float64, seed=0, grad=False):
    """pair_score's test inputs (q, q_mask, u, k, k_mask, v) and a salience (bi, s) in (0, 1)."""
    salience = torch.rand(bi, s, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype).requires_grad_(grad)
    return (*score_inputs(bt, bi, h, t, s, da, de, dtype, seed, grad), salience)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_blocked_equals_loop_definition(dtype, tol, monkeypatch):
    args = _inputs(dtype=dtype)
    want = coverage_naive(*args)
    assert_close_scaled(coverage(*args), want, tol, "one block")
    monkeypatch.setattr(coverage_module, "BLOCK_ELEMENTS", 1)  # one caption per block
    assert_close_scaled(coverage(*args), want, tol, "a block per caption")


def test_backward_equals_loop_definition():
    args = _inputs(grad=True)
    weights = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((f(*args) * weights).sum(), [args[i] for i in (0, 2, 3, 5, 6)])
             for f in (coverage, coverage_naive)]
    for name, got, want in zip(("q", "u", "k", "v", "salience"), *grads):
        assert want.abs().max() > 0, f"no gradient reaches {name}: the comparison would check nothing"
        assert_close_scaled(got, want, 1e-10, f"d/d{name}")


def test_candidate_form_is_a_row_of_the_pair_form():
    q, q_mask, u, k, k_mask, v, salience = _inputs(dtype=torch.float32)
    want = coverage(q, q_mask, u, k, k_mask, v, salience)
    for b in range(q.shape[0]):
        got = candidate_coverage(q[b][:, q_mask[b]], u[b][:, q_mask[b]], k.transpose(0, 1), v.transpose(0, 1),
                                 k_mask, salience)
        assert_close_scaled(got, want[b], 1e-5, f"caption {b}")


def test_an_unexplained_salient_patch_lowers_coverage():
    """Two words, each looking at one object and agreeing with it: all of A's salient patches are explained (1.0);
    B holds the same two objects and a third no word looks at (2/3); background patches carry no salience."""
    eye = torch.eye(4, dtype=torch.float64) * 20  # sharp attention: token t looks at patch t
    q = eye[None, None, :2]  # (1, 1, 2, 4): tokens look at patches 0 and 1
    u = torch.eye(4, dtype=torch.float64)[None, None, :2]  # and agree with what is there
    k = eye[None, None].expand(2, 1, 4, 4)  # (2, 1, 4, 4)
    v = torch.eye(4, dtype=torch.float64)[None, None].expand(2, 1, 4, 4)
    salience = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # B: a third object
    got = coverage(q, torch.ones(1, 2, dtype=torch.bool), u, k, torch.ones(2, 4, dtype=torch.bool), v, salience,
                   scale=1.0)
    torch.testing.assert_close(got, torch.tensor([[1.0, 2 / 3]], dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("logit_scale", [1.0, 40.0])  # 40: logits past SAFE_LOGIT, the shifted (folded) path
def test_one_pass_equals_the_score_and_the_coverage(dtype, tol, logit_scale):
    """score_and_coverage gives pair_score_reference's s and coverage's cov, in one block and in many: blocks of
    whole captions (one caption per block at the smallest), images split across blocks, padding patches."""
    from mmgeo.kernels.coverage import score_and_coverage
    from mmgeo.kernels.pair_score import pair_score_reference

    q, q_mask, u, k, k_mask, v, salience = _inputs(bt=7, bi=9, t=8, s=6, dtype=dtype, seed=3)
    q = q * logit_scale
    assert not bool(k_mask.all()) and len(set(q_mask.sum(1).tolist())) > 1  # padding on both sides
    want_s, want_cov = pair_score_reference(q, q_mask, u, k, k_mask, v), coverage(q, q_mask, u, k, k_mask, v, salience)
    for block in (1 << 20, 2 * 6 * 8, 1):  # everything at once; about a caption × an image; the least possible
        s, cov = score_and_coverage(q, q_mask, u, k, k_mask, v, salience, block_elements=block)
        assert_close_scaled(s, want_s, tol, f"s, block {block}")
        assert_close_scaled(cov, want_cov, tol, f"cov, block {block}")
    none = score_and_coverage(q[:0], q_mask[:0], u[:0], k, k_mask, v, salience)  # no captions: empty, not an error
    assert [tuple(x.shape) for x in none] == [(0, 9), (0, 9)]


def test_one_pass_redoes_a_block_whose_folded_shift_overflows():
    """An image whose logits pass the first image block's max by more than fp32 can hold (2^128) is scored with its
    own exact max, not left at inf / nan."""
    from mmgeo.kernels.coverage import score_and_coverage
    from mmgeo.kernels.pair_score import pair_score_reference

    q, q_mask, u, k, k_mask, v, salience = _inputs(bt=2, bi=4, dtype=torch.float32, seed=5)
    q = q * 30
    k = k.clone()
    k[3] *= 60  # the last image: logits far beyond those of the first block's images
    s, cov = score_and_coverage(q, q_mask, u, k, k_mask, v, salience, block_elements=2 * 7 * 6)  # an image a block
    assert bool(torch.isfinite(s).all()) and bool(torch.isfinite(cov).all())
    assert_close_scaled(s, pair_score_reference(q, q_mask, u, k, k_mask, v), 1e-5, "s")
    assert_close_scaled(cov, coverage(q, q_mask, u, k, k_mask, v, salience), 1e-5, "cov")
