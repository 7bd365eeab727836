import importlib

import pytest
import torch

from mmgeo.kernels import pair_score, pair_score_naive, pair_score_reference

ps_module = importlib.import_module("mmgeo.kernels.pair_score")


def _inputs(bt=5, bi=4, h=2, t=7, s=9, da=6, de=3, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    q, u, k, v = mk(bt, h, t, da), mk(bt, h, t, de), mk(bi, h, s, da), mk(bi, h, s, de)
    q_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (bt, 1), generator=g)
    k_mask = torch.arange(s)[None] < torch.randint(1, s + 1, (bi, 1), generator=g)
    return q, q_mask, u, k, k_mask, v


def _loop_reference(q, q_mask, u, k, k_mask, v):
    """The docs/design.md §2 formula with explicit loops: the ground truth for both implementations."""
    bt, h, _, da = q.shape
    out = torch.zeros(bt, k.shape[0], dtype=q.dtype)
    for c in range(bt):
        for i in range(k.shape[0]):
            total = 0.0
            for head in range(h):
                qt, kt = q[c, head][q_mask[c]], k[i, head][k_mask[i]]
                a = torch.softmax(qt @ kt.T / da ** 0.5, dim=-1)  # (n, s_real)
                sim = u[c, head][q_mask[c]] @ v[i, head][k_mask[i]].T
                total = total + (a * sim).sum(-1).mean()
            out[c, i] = total / h
    return out


def test_naive_matches_loop_definition():
    args = _inputs()
    torch.testing.assert_close(pair_score_naive(*args), _loop_reference(*args))


@pytest.mark.parametrize("chunk,block", [(1, 1), (50, 50), (10_000, 100), (1 << 26, 1 << 20)])
@pytest.mark.parametrize("big_logits", [False, True])
def test_chunked_matches_naive_forward_and_backward(chunk, block, big_logits):
    """Every block layout, with and without recompute, and logits past the no-shift bound (max shift on)."""
    args = list(_inputs(grad=True))
    if big_logits:
        args[0] = (30 * args[0].detach()).requires_grad_()  # |<q, k>|·scale up to ~100: exp needs the shift
    a = pair_score_naive(*args)
    b = pair_score_reference(*args, chunk_elements=chunk, block_elements=block)
    torch.testing.assert_close(a, b)
    tensors = [args[i] for i in (0, 2, 3, 5)]
    w = torch.randn_like(a)
    ga = torch.autograd.grad((a * w).sum(), tensors)
    gb = torch.autograd.grad((b * w).sum(), tensors)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)


def test_gradcheck_reference_float64():
    args = _inputs(bt=3, bi=2, t=4, s=5, da=3, de=2, grad=True)
    q, qm, u, k, km, v = args
    fn = lambda q, u, k, v: pair_score_reference(q, qm, u, k, km, v, chunk_elements=8, block_elements=8)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, u, k, v))


def test_padding_never_changes_a_score():
    q, qm, u, k, km, v = _inputs()
    base = pair_score_reference(q, qm, u, k, km, v)
    pad = lambda x, n, dim: torch.cat([x, 1e3 * torch.randn(*x.shape[:dim], n, *x.shape[dim + 1:],  # noqa: E731
                                                               dtype=x.dtype)], dim=dim)
    q2, u2, k2, v2 = pad(q, 3, 2), pad(u, 3, 2), pad(k, 4, 2), pad(v, 4, 2)
    qm2 = torch.cat([qm, torch.zeros(qm.shape[0], 3, dtype=torch.bool)], 1)
    km2 = torch.cat([km, torch.zeros(km.shape[0], 4, dtype=torch.bool)], 1)
    torch.testing.assert_close(pair_score_reference(q2, qm2, u2, k2, km2, v2), base)


def test_blocks_respect_the_memory_bound(monkeypatch):
    """No block ever holds more than chunk_elements attention weights (B_t·B_i·H·T·S is never allocated)."""
    seen = []
    real = torch.bmm

    def spy(a, b):
        out = real(a, b)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(ps_module.torch, "bmm", spy)
    args = _inputs(bt=20, bi=30, h=2, t=7, s=9)
    chunk = 2 * 7 * 9 * 5  # room for 5 image columns of 7 tokens
    out = pair_score_reference(*args, chunk_elements=chunk)
    monkeypatch.undo()
    assert out.shape == (20, 30) and max(seen) <= chunk and len(seen) > 20
    torch.testing.assert_close(out, pair_score_naive(*args))


def test_single_caption_and_single_image():
    q, qm, u, k, km, v = _inputs(bt=1, bi=1)
    torch.testing.assert_close(pair_score(q, qm, u, k, km, v), _loop_reference(q, qm, u, k, km, v))


def test_errors_name_the_shapes():
    q, qm, u, k, km, v = _inputs()
    with pytest.raises(ValueError, match=r"q_mask \(B_t, T\)"):
        pair_score(q, qm[:, :3], u, k, km, v)
    with pytest.raises(ValueError, match="share heads"):
        pair_score(q, qm, u, k[:, :1], km, v[:, :1])
    with pytest.raises(TypeError, match="bool"):
        pair_score(q, qm.float(), u, k, km, v)
    empty = qm.clone()
    empty[0] = False
    with pytest.raises(ValueError, match="at least one real token"):
        pair_score(q, empty, u, k, km, v)


@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_inference_with_the_shift_folded_into_the_gemm(spread):
    """No autograd, logits past the no-shift bound, many image blocks: the first block's max is the shift of
    the rest; later images with logits far above it (overflow) or far below (underflow) redo their block."""
    q, qm, u, k, km, v = _inputs(bt=6, bi=12, t=5, s=7, da=4, de=3, dtype=torch.float32)
    q = 20 * q  # |<q, k>|·scale well past SAFE_LOGIT: the shifted path
    k = k.clone()
    k[4:8] *= spread  # images of later blocks with much larger logits than the first block's
    k[8:] /= spread
    with torch.no_grad():
        out = pair_score_reference(q, qm, u, k, km, v, block_elements=2 * 7 * 5 * 2)  # 2 images per block
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, pair_score_naive(q.double(), qm, u.double(), k.double(), km, v.double()).float(),
                               atol=1e-4, rtol=1e-4)
