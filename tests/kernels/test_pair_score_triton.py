"""The fused Triton pair_score against the references, forward and backward (interpreter on CPU)."""

import importlib
import sys

import pytest
import torch

from mmgeo.kernels import pair_score, pair_score_naive, pair_score_reference
from tests.kernels.tolerance import assert_close_scaled

ps_module = importlib.import_module("mmgeo.kernels.pair_score")

# (B_t, B_i, H, T, S, d_a, d_e): interpreter tiles are 16 × 16
CASES = {
    "padded-multi-tile": (3, 2, 2, 7, 20, 8, 4),  # odd B_t over 2-caption blocks, S = 16 + 4, d_a != d_e
    "long-captions": (2, 3, 1, 20, 9, 16, 8),  # T > tile: each caption takes two token chunks
    "single-caption": (1, 3, 2, 5, 17, 4, 6),
    "single-image": (4, 1, 3, 3, 33, 8, 8),
}
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def _inputs(bt, bi, h, t, s, da, de, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    q, u, k, v = mk(bt, h, t, da), mk(bt, h, t, de), mk(bi, h, s, da), mk(bi, h, s, de)
    q_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (bt, 1), generator=g)  # padded captions
    q_mask[0] = True  # one full caption
    k_mask = torch.rand(bi, s, generator=g) > 0.3  # holes anywhere, not only at the end
    k_mask[0, :16] = False  # a whole tile of padding before the first real patch (where S > 16)
    k_mask[:, -1] = True
    return q, q_mask.to(device), u, k, k_mask.to(device), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference_forward_and_backward(case, dtype, device, force_triton):
    q, qm, u, k, km, v = _inputs(*CASES[case], dtype, device)
    leaves = [x.detach().requires_grad_() for x in (q, u, k, v)]
    out = pair_score(leaves[0], qm, leaves[1], leaves[2], km, leaves[3])
    assert out.dtype == torch.float32 and out.shape == (q.shape[0], k.shape[0])
    assert "PairScoreTriton" in type(out.grad_fn).__name__

    ref_leaves = [x.detach().double().requires_grad_() for x in (q, u, k, v)]  # same rounded inputs, exact math
    ref = pair_score_naive(ref_leaves[0], qm, ref_leaves[1], ref_leaves[2], km, ref_leaves[3])
    assert_close_scaled(out, ref, TOL[dtype], "forward")

    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, leaves, w.float())
    ref_grads = torch.autograd.grad(ref, ref_leaves, w)
    for name, a, b in zip("qukv", grads, ref_grads):
        assert a.dtype == dtype
        assert_close_scaled(a, b, TOL[dtype], f"d{name}")


def test_backward_image_splits_sum_to_the_same_gradients(device, force_triton, monkeypatch):
    """Several image splits in the caption-side backward (partial sums added afterwards) change nothing."""
    tri = importlib.import_module("mmgeo.kernels._pair_score_triton")
    q, qm, u, k, km, v = _inputs(2, 5, 2, 7, 20, 8, 4, torch.float32, device)
    out, lse, o = tri.pair_score_fwd(q, qm, u, k, km, v, 8 ** -0.5, store_stats=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
    one = tri.pair_score_bwd(grad, q, qm, u, k, km, v, lse, o, 8 ** -0.5, splits=1)
    three = tri.pair_score_bwd(grad, q, qm, u, k, km, v, lse, o, 8 ** -0.5, splits=3)
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_frozen_image_side_gets_no_gradient(device, force_triton):
    q, qm, u, k, km, v = _inputs(*CASES["single-caption"], torch.float32, device)
    q.requires_grad_()
    out = pair_score(q, qm, u, k, km, v)
    (dq,) = torch.autograd.grad(out.sum(), q)
    ref_q = q.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(pair_score_naive(ref_q, qm, u.double(), k.double(), km, v.double()).sum(), ref_q)
    assert_close_scaled(dq, expected, 1e-4, "dq")


def test_mixed_dtypes_promote_and_grads_keep_each_dtype(device, force_triton):
    """Under autocast q/k may come in fp16 and u/v in fp32: the kernel runs in the promoted dtype."""
    q, qm, u, k, km, v = _inputs(*CASES["single-image"], torch.float32, device)
    q16 = q.half().requires_grad_()
    u.requires_grad_()
    out = pair_score(q16, qm, u, k, km, v)
    dq, du = torch.autograd.grad(out.sum(), (q16, u))
    assert dq.dtype == torch.float16 and du.dtype == torch.float32
    expected = pair_score_naive(q16.double(), qm, u.double(), k.double(), km, v.double())
    assert_close_scaled(out, expected, 1e-4, "forward")


def test_no_grad_forward_skips_the_saved_statistics(device, force_triton):
    q, qm, u, k, km, v = _inputs(*CASES["padded-multi-tile"], torch.float32, device)
    with torch.no_grad():
        out = pair_score(q, qm, u, k, km, v, scale=0.5)
    torch.testing.assert_close(out, pair_score_reference(q, qm, u, k, km, v, scale=0.5), atol=1e-5, rtol=1e-5)


def test_gradcheck_naive_reference_float64_with_patch_holes():
    q, qm, u, k, km, v = _inputs(2, 2, 2, 4, 18, 3, 2, torch.float64, "cpu")
    leaves = [x.requires_grad_() for x in (q, u, k, v)]
    assert torch.autograd.gradcheck(lambda q, u, k, v: pair_score_naive(q, qm, u, k, km, v), leaves)


def test_reference_backend_uses_the_reference(monkeypatch):
    calls = []
    real = ps_module.pair_score_reference
    monkeypatch.setattr(ps_module, "pair_score_reference", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("MMGEO_KERNELS", "reference")
    q, qm, u, k, km, v = _inputs(*CASES["single-image"], torch.float32, "cpu")
    ps_module.pair_score(q, qm, u, k, km, v)
    assert calls == [1]
    monkeypatch.setenv("MMGEO_KERNELS", "auto")  # CPU tensors: auto means the reference too
    ps_module.pair_score(q, qm, u, k, km, v)
    assert calls == [1, 1]


def test_bad_backend_value_raises(monkeypatch):
    monkeypatch.setenv("MMGEO_KERNELS", "cuda-please")
    q, qm, u, k, km, v = _inputs(*CASES["single-image"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="auto, triton, reference"):
        pair_score(q, qm, u, k, km, v)


def test_forced_triton_rejects_bf16_under_the_interpreter(force_triton):
    from mmgeo.kernels._common import interpreting

    if not interpreting():
        pytest.skip("only the interpreter refuses bf16")
    q, qm, u, k, km, v = _inputs(*CASES["single-image"], torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="MMGEO_KERNELS=reference"):
        pair_score(q, qm, u, k, km, v)


def test_importing_the_package_does_not_import_triton():
    import subprocess

    code = "import sys, mmgeo.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_auto_dispatch_matches_reference_at_model_shapes(dtype, monkeypatch):
    """Compiled kernels at the shapes the model trains with (T = 32, S = 197, H = 8, d = 64)."""
    monkeypatch.setenv("MMGEO_KERNELS", "auto")
    g = torch.Generator().manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g).to("cuda", dtype).requires_grad_()  # noqa: E731
    q, u, k, v = mk(24, 8, 32, 64), mk(24, 8, 32, 64), mk(20, 8, 197, 64), mk(20, 8, 197, 64)
    qm = (torch.arange(32)[None] < torch.randint(4, 33, (24, 1), generator=g)).cuda()
    km = torch.ones(20, 197, dtype=torch.bool, device="cuda")
    km[::3, 150:] = False
    out = pair_score(q, qm, u, k, km, v)
    assert "PairScoreTriton" in type(out.grad_fn).__name__
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, u, k, v))
    ref_in = [x.detach().float().requires_grad_() for x in (q, u, k, v)]
    ref = pair_score_reference(ref_in[0], qm, ref_in[1], ref_in[2], km, ref_in[3])
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-3}[dtype]  # fp32 may run TF32
    assert_close_scaled(out, ref, tol, "forward")
    for name, a, b in zip("qukv", grads, ref_grads):
        assert_close_scaled(a.float(), b, tol, f"d{name}")


def test_images_beyond_one_grid_axis_are_launched_in_parts(device, force_triton, monkeypatch):
    """B_i past the CUDA grid-axis limit (patched down to 2 here): the same scores and gradients as one launch."""
    q, qm, u, k, km, v = _inputs(3, 5, 2, 7, 20, 8, 4, torch.float32, device)
    leaves = [x.detach().requires_grad_() for x in (q, u, k, v)]
    whole = pair_score(leaves[0], qm, leaves[1], leaves[2], km, leaves[3])
    whole_grads = torch.autograd.grad(whole.sum(), leaves)
    monkeypatch.setattr(ps_module, "MAX_GRID_Y", 2)  # 5 images -> launches of 2, 2, 1
    parts = pair_score(leaves[0], qm, leaves[1], leaves[2], km, leaves[3])
    launches = [type(f).__name__ for f, _ in parts.grad_fn.next_functions]  # the concatenated parts
    assert launches == ["_PairScoreTritonBackward"] * 3
    torch.testing.assert_close(parts, whole)
    for a, b in zip(torch.autograd.grad(parts.sum(), leaves), whole_grads):
        torch.testing.assert_close(a, b)
