"""geo_attention: the Triton kernels against the reference, and the reference against PyTorch's SDPA."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from mmgeo.kernels import geo_attention, geo_attention_reference
from tests.kernels.tolerance import assert_close_scaled

ga_module = importlib.import_module("mmgeo.kernels.geo_attention")

# (B, H, N, M, d_a, d_v, causal, padding): interpreter tiles are 16 × 16
CASES = {
    "padding": (2, 2, 20, 23, 8, 12, False, True),
    "causal-padding-empty-row": (1, 3, 33, 17, 16, 8, True, True),  # key 0 padded: causal row 0 sees nothing
    "causal-da32-dv64": (2, 1, 19, 40, 32, 64, True, False),  # N < M
    "causal-n-gt-m": (1, 2, 25, 10, 8, 16, True, False),  # rows past M attend every key
    "fully-padded-batch": (2, 1, 9, 18, 16, 16, False, "all-of-batch-1"),  # every key padded -> output 0
}
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def _inputs(b, h, n, m, da, dv, pad, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = mk(b, h, n, da), mk(b, h, m, da), mk(b, h, m, dv)
    kpm = None
    if pad:
        kpm = torch.rand(b, m, generator=g) < 0.3  # True = padding, anywhere
        kpm[0, 0] = True
        kpm[0, -1] = False
        if pad == "all-of-batch-1":
            kpm[1] = True
        kpm = kpm.to(device)
    return q, k, v, kpm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference_forward_and_backward(case, dtype, device, force_triton):
    b, h, n, m, da, dv, causal, pad = CASES[case]
    q, k, v, kpm = _inputs(b, h, n, m, da, dv, pad, dtype, device)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = geo_attention(*leaves, key_padding_mask=kpm, causal=causal)
    assert out.dtype == dtype and out.shape == (b, h, n, dv)
    assert "GeoAttentionTriton" in type(out.grad_fn).__name__

    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = geo_attention_reference(*ref_leaves, key_padding_mask=kpm, causal=causal)
    assert_close_scaled(out, ref, TOL[dtype], "forward")
    assert torch.isfinite(out).all()

    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    for name, a, b_ in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype and a.shape == b_.shape
        assert_close_scaled(a, b_, TOL[dtype], f"d{name}")
    if case == "fully-padded-batch":
        assert out[1].abs().max() == 0 and grads[0][1].abs().max() == 0


def test_reference_matches_sdpa_when_dims_agree():
    q, k, v, _ = _inputs(2, 2, 12, 12, 8, 8, False, torch.float64, "cpu")
    kpm = torch.zeros(2, 12, dtype=torch.bool)
    kpm[0, 3], kpm[1, 7:] = True, True  # key 0 stays real: no empty rows (SDPA gives NaN there, we give 0)
    for causal in (False, True):
        mask = ~kpm[:, None, None, :]  # SDPA: True = attend
        if causal:
            mask = mask & torch.ones(12, 12, dtype=torch.bool).tril()
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(geo_attention_reference(q, k, v, kpm, causal=causal), expected)
    expected = F.scaled_dot_product_attention(q[:, :, :7], k, v, is_causal=True)  # N < M: top-left aligned
    torch.testing.assert_close(geo_attention_reference(q[:, :, :7], k, v, causal=True), expected)


def test_gradcheck_reference_float64_causal_padding_and_empty_rows():
    q, k, v, kpm = _inputs(2, 1, 5, 6, 3, 4, True, torch.float64, "cpu")
    leaves = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v: geo_attention_reference(q, k, v, kpm, causal=True), leaves)


def test_reference_backend_and_bad_value(monkeypatch):
    calls = []
    real = ga_module.geo_attention_reference
    monkeypatch.setattr(ga_module, "geo_attention_reference", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _ = _inputs(1, 1, 4, 5, 8, 4, False, torch.float32, "cpu")
    monkeypatch.setenv("MMGEO_KERNELS", "reference")
    ga_module.geo_attention(q, k, v)
    assert calls == [1]
    monkeypatch.setenv("MMGEO_KERNELS", "fast")
    with pytest.raises(ValueError, match="auto, triton, reference"):
        ga_module.geo_attention(q, k, v)


def test_errors_name_the_shapes():
    q, k, v, _ = _inputs(1, 2, 4, 5, 8, 4, False, torch.float32, "cpu")
    with pytest.raises(ValueError, match="share"):
        geo_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, M\)=\(1, 5\)"):
        geo_attention(q, k, v, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        geo_attention(q, k, v, key_padding_mask=torch.zeros(1, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(64, 64), (32, 64), (64, 128), (128, 128)])
def test_cuda_bf16_matches_reference(dims, causal, monkeypatch):
    monkeypatch.setenv("MMGEO_KERNELS", "auto")
    da, dv = dims
    g = torch.Generator().manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g).to("cuda", torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 4, 300, da), mk(2, 4, 300, da), mk(2, 4, 300, dv)
    kpm = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    kpm[1, 250:] = True
    out = geo_attention(q, k, v, key_padding_mask=kpm, causal=causal)
    assert "GeoAttentionTriton" in type(out.grad_fn).__name__
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = geo_attention_reference(*ref_in, key_padding_mask=kpm, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_in, do.float())
    assert_close_scaled(out.float(), ref, 2e-2, "forward")
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_close_scaled(a.float(), b, 3e-2, f"d{name}")


def test_batch_beyond_one_grid_axis_is_launched_in_parts(device, force_triton, monkeypatch):
    """B·H past the CUDA grid-axis limit (patched down to 4 here, H = 2): the same output and gradients."""
    q, k, v, kpm = _inputs(5, 2, 20, 23, 8, 12, True, torch.float32, device)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    whole = geo_attention(*leaves, key_padding_mask=kpm)
    whole_grads = torch.autograd.grad(whole.sum(), leaves)
    monkeypatch.setattr(importlib.import_module("mmgeo.kernels.geo_attention"), "MAX_GRID_Y", 4)  # 2 per launch
    parts = geo_attention(*leaves, key_padding_mask=kpm)
    launches = [type(f).__name__ for f, _ in parts.grad_fn.next_functions]  # the concatenated parts
    assert launches == ["_GeoAttentionTritonBackward"] * 3
    torch.testing.assert_close(parts, whole)
    for a, b in zip(torch.autograd.grad(parts.sum(), leaves), whole_grads):
        torch.testing.assert_close(a, b)
