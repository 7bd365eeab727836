"""Peak memory of the geometric score: chunked reference vs naive full einsum, side by side.

    python -m benchmarks.score_memory [--batches 64 128 256 512 1024] [--limit-gib 6] [--backward]

Each measurement runs in a fresh subprocess and reports the growth of peak resident memory (CPU,
ru_maxrss) or of peak allocated memory (CUDA) over what the inputs already hold. The naive version,
which allocates B_t·B_i·H·T·S attention weights several times over, is skipped where its predicted
need passes --limit-gib; the chunked one stays bounded by its block size whatever the batch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.harness import ROOT, add_device, add_json, done_in, write_json

WORKER = r"""
import json, resource, sys, time, torch
from mmgeo.kernels.pair_score import pair_score_naive, pair_score_reference
impl, B, H, T, S, d, device, backward = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7], sys.argv[8] == "1"
chunk = int(sys.argv[9])
g = torch.Generator().manual_seed(0)
def t(*shape):
    return torch.randn(*shape, generator=g).to(device).requires_grad_(backward)
q, u, k, v = t(B, H, T, d), t(B, H, T, d), t(B, H, S, d), t(B, H, S, d)
q_mask = (torch.arange(T)[None] < torch.randint(T // 2, T + 1, (B, 1), generator=g)).to(device)
k_mask = torch.ones(B, S, dtype=torch.bool, device=device)
def fn(*args):
    return pair_score_naive(*args) if impl == "naive" else pair_score_reference(*args, chunk_elements=chunk)
def peak():
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
base = peak()
start = time.perf_counter()
with torch.set_grad_enabled(backward):
    s = fn(q, q_mask, u, k, k_mask, v)
    if backward:
        s.sum().backward()
if device == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"extra_bytes": peak() - base, "seconds": time.perf_counter() - start}))
"""


def naive_bytes(B: int, H: int, T: int, S: int, backward: bool) -> int:
    """Weights tensors the naive version keeps alive at once (logits, softmax, attended, products)."""
    return B * B * H * T * S * 4 * (6 if backward else 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--patches", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--limit-gib", type=float, default=6.0, help="skip the naive version above this prediction")
    p.add_argument("--backward", action="store_true", help="measure forward + backward")
    add_device(p)
    p.add_argument("--chunk-elements", type=int, default=1 << 22, help="the chunked version's block bound")
    add_json(p, "the rows")
    a = p.parse_args()
    gib = 1 << 30
    print(f"pair_score peak memory, H={a.heads} T={a.tokens} S={a.patches} d={a.dim}, "
          f"{'forward+backward' if a.backward else 'forward'}, {a.device}; chunked blocks <= {a.chunk_elements:,} "
          f"weights; naive skipped above {a.limit_gib} GiB")
    print(f"{'B_t=B_i':>8} {'weights':>10} {'naive GiB':>10} {'chunked GiB':>12} {'naive/chunked':>14} "
          f"{'naive s':>8} {'chunked s':>10}")
    rows = []
    for B in a.batches:
        row = {"batch": B, "weights": B * B * a.heads * a.tokens * a.patches}
        for impl in ("naive", "chunked"):
            if impl == "naive" and naive_bytes(B, a.heads, a.tokens, a.patches, a.backward) > a.limit_gib * gib:
                row[impl] = None
                continue
            args = [impl, B, a.heads, a.tokens, a.patches, a.dim, a.device, int(a.backward), a.chunk_elements]
            out = subprocess.run([sys.executable, "-c", WORKER, *map(str, args)], cwd=ROOT, capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"{impl} B={B} failed:\n{out.stderr[-2000:]}")
            row[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        n, c = row["naive"], row["chunked"]
        naive_gib = f"{n['extra_bytes'] / gib:.2f}" if n else "skipped"
        naive_s = f"{n['seconds']:.2f}" if n else "-"
        ratio = f"{n['extra_bytes'] / max(c['extra_bytes'], 1):.1f}x" if n else "-"
        print(f"{B:>8} {row['weights'] / 1e9:>9.2f}G {naive_gib:>10} {c['extra_bytes'] / gib:>12.2f} {ratio:>14} "
              f"{naive_s:>8} {c['seconds']:>10.2f}")
    write_json(a.json, rows, indent=2)


if __name__ == "__main__":
    with done_in():
        main()
