"""Inputs, timing and the error measure of ``benchmarks/gpu_check.py``: random kernel inputs with padding, random
embeddings, the tests' tiny model, median timing of a call, and the kernel tests' tolerance criterion."""

import statistics
import time

REPEATS = 5  # timed calls per measurement (after one warm-up)
TINY = dict(text_hidden=32, text_layers=1, text_heads=2, image_embed_dim=32, image_depth=1, image_heads=2,
            image_size=32, patch_size=8, key_hidden=16, query_hidden=32, num_heads=2, d_a=8, d_e=8, d_global=16)


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


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn, dev, budget_s: float = 5.0) -> float:
    """Median milliseconds of ``fn()`` over up to REPEATS calls after one warm-up (autotune, compile)."""
    import torch

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    times = []
    while len(times) < REPEATS and (sum(times) / 1e3 < budget_s or not times):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
