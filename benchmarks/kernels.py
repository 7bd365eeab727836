"""Fused Triton kernels against their baselines, side by side: time, achieved TFLOP/s, peak memory (docs/design.md §4).

    python -m benchmarks.kernels [--only pair|attn] [--batches 256 512 1024] [--heads 1 8]
                                 [--seqlens 1024 4096 8192] [--naive-limit-gib 40] [--json rows.json]

pair_score (bf16, T=32, S=197, d_a=d_e=64, B_t=B_i=B): Triton vs the naive einsum (``pair_score_naive``),
the same compiled with ``torch.compile``, and the chunked reference, forward and forward+backward. The
naive versions allocate B²·H·T·S fp32 weights several times over; they are skipped (and the row says
so) where that prediction passes --naive-limit-gib.

geo_attention (bf16, B·N = 16k tokens, 16 heads by default, non-causal and causal): Triton vs
``scaled_dot_product_attention`` and FlexAttention. Those two get q and k zero-padded to d_v when
d_a != d_v (same logits, scale kept at 1/sqrt(d_a)); the row says so.

Timing: CUDA events over enough calls for ~1 s after warm-up (which includes autotuning and compiling);
memory: ``torch.cuda.max_memory_allocated`` during the timed calls minus what was allocated before.
FLOPs: pair_score forward 2·B²·H·T·S·(d_a + d_e), backward counted as 2× forward; attention forward
2·B·H·N²·(d_a + d_v) (half when causal), backward 2.5× forward (FlashAttention's convention).
Needs a CUDA GPU; sized for an 80 GB H100 / 141 GB H200.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from benchmarks.harness import add_json, done_in, write_json

GIB = 1 << 30
DEVICE, DTYPE = "cuda", "bfloat16"  # torch.bfloat16 (torch is imported where it is used: importing this does no work)
if TYPE_CHECKING:
    import torch


def measure(fn, target_s: float = 1.0, max_iters: int = 50) -> dict:
    """Mean milliseconds per call and extra peak memory (GiB) of ``fn`` after warm-up."""
    import torch

    fn()  # warm-up: autotuning, torch.compile, cuDNN / flash selection
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    iters = int(max(1, min(max_iters, target_s / max(once, 1e-6))))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end) / iters, "peak_gib": (torch.cuda.max_memory_allocated() - base) / GIB}


def run_case(fn, inputs, backward: bool) -> dict:
    """Time forward (no grad) or forward + backward (grads w.r.t. ``inputs``) of ``fn()``."""
    import torch

    if not backward:
        def step():
            with torch.no_grad():
                fn()
    else:
        grad_out = None

        def step():
            nonlocal grad_out
            out = fn()
            grad_out = torch.randn_like(out) if grad_out is None else grad_out
            torch.autograd.grad(out, inputs, grad_out)
    try:
        return measure(step)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"skip": "out of memory"}
    except Exception as e:  # one failing baseline (e.g. a compile error) must not end the whole run
        torch.cuda.empty_cache()
        return {"skip": f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"}


def report(title: str, rows: list[dict]) -> None:
    """Print rows of one setting; ratios are against the first (Triton) row."""
    print(f"\n{title}")
    print(f"  {'impl':<30} {'ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'time/triton':>12} {'mem/triton':>11}  note")
    ref = rows[0]
    for r in rows:
        if "skip" in r:
            print(f"  {r['impl']:<30} {'-':>9} {'-':>8} {'-':>9} {'-':>12} {'-':>11}  skipped: {r['skip']}")
            continue
        t_ratio = f"{r['ms'] / ref['ms']:.2f}x" if "ms" in ref else "-"
        m_ratio = f"{r['peak_gib'] / max(ref['peak_gib'], 1e-6):.1f}x" if "peak_gib" in ref else "-"
        print(f"  {r['impl']:<30} {r['ms']:>9.2f} {r['tflops']:>8.1f} {r['peak_gib']:>9.2f} {t_ratio:>12} "
              f"{m_ratio:>11}  {r.get('note', '')}")


def _randn(*shape) -> torch.Tensor:
    import torch

    return torch.randn(*shape, device=DEVICE, dtype=getattr(torch, DTYPE))


def _bind(fn, leaves, q_mask, k_mask):
    q, u, k, v = leaves
    return lambda: fn(q, q_mask, u, k, k_mask, v)


def bench_pair_score(args) -> list[dict]:
    import torch

    from mmgeo.kernels.pair_score import pair_score, pair_score_naive, pair_score_reference

    compiled_naive = torch.compile(pair_score_naive)
    T, S, D = 32, 197, 64
    all_rows = []
    for B in args.batches:
        for H in args.heads:
            torch.manual_seed(0)
            q, u, k, v = _randn(B, H, T, D), _randn(B, H, T, D), _randn(B, H, S, D), _randn(B, H, S, D)
            q_mask = torch.arange(T, device=DEVICE)[None] < torch.randint(8, T + 1, (B, 1), device=DEVICE)
            k_mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)  # ViT-B/16: every patch real
            fwd_flops = 2 * B * B * H * T * S * (D + D)
            for backward in (False, True):
                leaves = [x.requires_grad_(backward) for x in (q, u, k, v)]
                impls = [("triton (fused)", _bind(pair_score, leaves, q_mask, k_mask), None),
                         ("naive einsum", _bind(pair_score_naive, leaves, q_mask, k_mask), "naive"),
                         ("naive + torch.compile", _bind(compiled_naive, leaves, q_mask, k_mask), "naive"),
                         ("chunked reference", _bind(pair_score_reference, leaves, q_mask, k_mask), None)]
                naive_gib = B * B * H * T * S * 4 * (6 if backward else 3) / GIB
                rows = []
                for name, fn, kind in impls:
                    if kind == "naive" and naive_gib > args.naive_limit_gib:
                        r = {"skip": f"~{naive_gib:.0f} GiB of weights > --naive-limit-gib={args.naive_limit_gib}"}
                    else:
                        r = run_case(fn, leaves, backward)
                    if "ms" in r:
                        r["tflops"] = fwd_flops * (3 if backward else 1) / (r["ms"] * 1e-3) / 1e12
                    rows.append({"impl": name, **r})
                mode = "forward+backward" if backward else "forward"
                report(f"pair_score B_t=B_i={B} H={H} T={T} S={S} d_a=d_e={D} bf16, {mode}", rows)
                all_rows += [{"op": "pair_score", "B": B, "H": H, "mode": mode, **r} for r in rows]
    return all_rows


def _attention_impls(leaves, pad: int, causal: bool, scale: float, block_mask, flex, note: str) -> list:
    """(name, call, note) for geo_attention, SDPA and FlexAttention on the same q, k, v."""
    import torch.nn.functional as F

    from mmgeo.kernels.geo_attention import geo_attention

    def padded():
        q, k, v = leaves
        return (F.pad(q, (0, pad)), F.pad(k, (0, pad)), v) if pad else (q, k, v)

    return [("geo_attention (triton)", lambda: geo_attention(*leaves, causal=causal, scale=scale), ""),
            ("SDPA", lambda: F.scaled_dot_product_attention(*padded(), is_causal=causal, scale=scale), note),
            ("FlexAttention (compiled)", lambda: flex(*padded(), block_mask=block_mask, scale=scale), note)]


def _causal(b, h, i, j):
    return j <= i  # FlexAttention mask_mod: top-left aligned, like is_causal


def bench_attention(args) -> list[dict]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    H, tokens = args.attn_heads, args.attn_tokens
    all_rows = []
    for N in args.seqlens:
        B = max(1, tokens // N)
        for da, dv in ((64, 64), (32, 64), (128, 128)):
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v = _randn(B, H, N, da), _randn(B, H, N, da), _randn(B, H, N, dv)
                scale = da ** -0.5
                pad = dv - da if da < dv else 0  # SDPA / Flex: zero-pad q, k to d_v (logits unchanged)
                note = f"q, k zero-padded {da}->{dv}" if pad else ""
                block_mask = create_block_mask(_causal, None, None, N, N, device=DEVICE) if causal else None
                fwd_flops = 2 * B * H * N * N * (da + dv) * (0.5 if causal else 1.0)
                for backward in (False, True):
                    leaves = [x.detach().requires_grad_(backward) for x in (q, k, v)]
                    impls = _attention_impls(leaves, pad, causal, scale, block_mask, flex, note)
                    rows = []
                    for name, fn, extra in impls:
                        r = run_case(fn, leaves, backward)
                        if "ms" in r:
                            r["tflops"] = fwd_flops * (3.5 if backward else 1) / (r["ms"] * 1e-3) / 1e12
                        rows.append({"impl": name, "note": extra, **r})
                    mode = "forward+backward" if backward else "forward"
                    report(f"attention B={B} H={H} N=M={N} d_a={da} d_v={dv} causal={causal} bf16, {mode}", rows)
                    all_rows += [{"op": "attention", "B": B, "N": N, "d_a": da, "d_v": dv, "causal": causal,
                                  "mode": mode, **r} for r in rows]
    return all_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("pair", "attn"), default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--heads", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--attn-tokens", type=int, default=16384, help="attention batch = this // N")
    p.add_argument("--attn-heads", type=int, default=16)
    p.add_argument("--naive-limit-gib", type=float, default=40.0,
                   help="skip the naive pair_score where its predicted weights pass this")
    add_json(p, "every row")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.kernels needs a CUDA GPU (written for an H100 / H200) and found none. "
                         "Without one, check correctness with: TRITON_INTERPRET=1 pytest tests/kernels")
    os.environ["MMGEO_KERNELS"] = "triton"  # fail loudly rather than time the reference by accident
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    if a.only in (None, "pair"):
        rows += bench_pair_score(a)
    if a.only in (None, "attn"):
        rows += bench_attention(a)
    write_json(a.json, rows, indent=2)


if __name__ == "__main__":
    with done_in(lambda msg: print(f"\n{msg}")):
        main()
