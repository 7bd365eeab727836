"""Inputs and the error measure of ``benchmarks/gpu_check.py``: random kernel inputs with padding, random embeddings,
and the kernel tests' tolerance criterion."""


def pair_inputs(bt, bi, h, t, s, da, de, dtype, dev, seed=0):
    """q (B_t, H, T, d_a), u (B_t, H, T, d_e), k (B_i, H, S, d_a), v (B_i, H, S, d_e); padded captions, patch holes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dev, dtype)  # noqa: E731
    q, u, k, v = mk(bt, h, t, da), mk(bt, h, t, de), mk(bi, h, s, da), mk(bi, h, s, de)
    q_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (bt, 1), generator=g)  # (B_t, T)
    q_mask[0] = True
    k_mask = torch.rand(bi, s, generator=g) > 0.3  # (B_i, S) holes anywhere
    k_mask[0, :16] = False  # a whole tile of padding first
    k_mask[:, -1] = True
    return (q, u, k, v), (q_mask.to(dev), k_mask.to(dev))


def attn_inputs(b, h, n, m, da, dv, pad, dtype, dev, seed=0):
    """q (B, H, N, d_a), k (B, H, M, d_a), v (B, H, M, d_v); key_padding_mask (B, M), True = padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dev, dtype)  # noqa: E731
    kpm = None
    if pad:
        kpm = torch.rand(b, m, generator=g) < 0.3
        kpm[0, 0], kpm[0, -1] = True, False
        kpm = kpm.to(dev)
    return (mk(b, h, n, da), mk(b, h, m, da), mk(b, h, m, dv)), kpm


def compare(actual, expected, tol: float) -> dict:
    """Max abs / rel error in fp64 and the kernel tests' criterion |err| <= tol·max|ref| + tol·|ref|."""
    a, b = actual.double(), expected.double()
    err, scale = (a - b).abs(), b.abs().max().item()
    ok = bool((err <= tol * max(scale, 1e-6) + tol * b.abs()).all()) and bool(a.isfinite().all())
    return {"max_abs": err.max().item(), "max_rel": err.max().item() / max(scale, 1e-12), "pass": ok}


def random_embedding(n, H, L, da, de, dg, dtype, dev, seed, min_len=None):
    """Embedding: pooled (n, d_g), attn (n, H, L, d_a), value (n, H, L, d_e) unit, mask (n, L)."""
    import torch
    import torch.nn.functional as F

    from mmgeo.models.embedding import Embedding

    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask = torch.arange(L)[None] < torch.randint(min_len or L, L + 1, (n, 1), generator=g)
    return Embedding(F.normalize(mk(n, dg), dim=-1).to(dev), mk(n, H, L, da).to(dev, dtype),
                     F.normalize(mk(n, H, L, de), dim=-1).to(dev, dtype), mask.to(dev))
