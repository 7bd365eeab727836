"""Every GPU claim checked and measured by one command, each section bounded in time (docs/design.md §4).

    python -m benchmarks.gpu_check [--out DIR]            # one H200: at most 8 minutes
    python -m benchmarks.gpu_check --dry-run [--out DIR]  # CPU, TRITON_INTERPRET=1, tiny shapes: at most 3 minutes
    python -m benchmarks.gpu_check --sections training    # only these sections (the others: skipped)
    python /path/to/checkout/benchmarks/gpu_check.py ...  # the same from any folder (--out: relative to that folder)

Writes DIR/gpu_check.json and DIR/gpu_check.md (an environment table, then one table per section, to paste
into docs/measurements/gpu.md); prints the markdown to stdout, progress to stderr. Each section runs in its own
process (``python -m benchmarks.gpu_check --section NAME`` from the repository root, writing DIR/.NAME.json; DIR is
made absolute first) with a time budget (``BUDGETS_S``): it skips what would pass its budget (the row says so), is
killed past it plus ``GRACE_S``, and an exception, a crash or a timeout is recorded in its JSON (with a traceback
summary) while the next section runs; a section that wrote no JSON is reported as "failed: no output". Rows are
saved as they come, so a killed section keeps what it measured. Run by path, the script runs itself as that module
from the repository root (this file imports nothing from ``benchmarks`` before ``main``). Sections 1–2 live here,
3–4 in ``benchmarks.gpu_check_model``; the report's markdown in ``benchmarks.gpu_check_report``.

1. correctness (130 s): compiled Triton ``pair_score`` and ``geo_attention``, forward and backward, fp32 / bf16 /
   fp16, every autotune config forced in turn at model shapes, odd lengths with padding masks (first config, then
   the others while time is left), and a batch past one grid axis (65,535 programs); against the plain-PyTorch
   reference in fp64 on the same rounded inputs, with the tolerances of the kernel tests
   (|err| <= tol·max|ref| + tol·|ref|). Per case: max abs / rel error, tolerance, pass.
2. kernel_speed (100 s): ``pair_score`` forward and forward+backward, B in {256, 512, 1024}, T=32, S=197,
   d_a=d_e=64, H=8, bf16: Triton against the naive einsum, the chunked reference and ``torch.compile`` of the
   naive definition (the chunked reference's Python block loop would be unrolled by dynamo), each where it fits
   in memory: time, ratio to Triton, TFLOP/s, time at the exp-unit bound ``EXP_PER_S``; ``geo_attention``
   against SDPA's flash backend at N=8,192, d_a in {32, 64}, d_v=64.
   CUDA events, median of up to ``gpu_check_inputs.REPEATS`` timed calls (q, k zero-padded to d_v for SDPA where
   d_a < d_v).
3. training (150 s): up to 100 steps of ``geo-vitb16-bert`` and ``clip-vitb16-bert`` (random init, bf16 autocast,
   batch 256, random pixels / tokens) and of open_clip ``ViT-B-16`` with ``ClipLoss``: samples/s, peak memory.
   Without bert-base-uncased in the local HF cache the text tower is a random-init BERT-base-sized scratch BERT
   (the row's note says so).
4. evaluation (50 s): exact geometric scores of 5,000 captions × 1,000 images at geo-vitb16-bert shapes through
   ``GeoRetriever.score``; two-stage evaluation (``mmgeo.search``: flat FAISS top-K', re-rank) of 1,000 × 1,000.

The dry run takes the same code path: interpreted kernels (fp32 / fp16 only: bf16 ``tl.dot`` is wrong in the
interpreter, those cases say so; one autotune config, as the kernels define under the interpreter), tiny shapes,
``torch.compile`` with the eager backend, tiny models (2 steps, batch 4), 20 × 10 evaluation. Without --dry-run
and without CUDA the script exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the sections run from here, as ``python -m benchmarks.gpu_check``
T0 = time.monotonic()  # a section's budget counts from its process start (imports included)
SECTIONS = ("correctness", "kernel_speed", "training", "evaluation")
BUDGETS_S = {"correctness": 130, "kernel_speed": 100, "training": 150, "evaluation": 50}
DRY_BUDGETS_S = {"correctness": 60, "kernel_speed": 40, "training": 50, "evaluation": 30}
TOTAL_S, DRY_TOTAL_S = 470, 175  # all sections together, process start-up included
GRACE_S = 15  # past its budget a section is killed
GEO_RESERVE_S = 10  # kernel_speed: seconds the pair_score rows leave for geo_attention's first (Triton) rows
EXP_PER_S = 3.9e12  # exps/s of an H100/H200 SXM's special-function units (FlashAttention-3, Shah et al. 2024)
TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}  # as tests/kernels (fp32 under TF32: 2e-3)


def log(msg: str) -> None:  # harness.logger's format; this file imports benchmarks only once it runs as a module
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Section:
    """Rows of one section, saved after each; ``run`` records an exception or a spent budget and goes on."""

    def __init__(self, name: str, out: Path, budget_s: float):
        self.name, self.path, self.rows = name, out / f".{name}.json", []
        self.t0, self.budget = T0, budget_s

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def save(self, status: str = "running", error: str | None = None) -> None:
        data = {"status": status, "budget_s": self.budget, "seconds": round(time.monotonic() - self.t0, 2),
                "error": error, "results": self.rows}
        self.path.with_suffix(".tmp").write_text(json.dumps(data, indent=1, default=str))
        self.path.with_suffix(".tmp").replace(self.path)

    def run(self, row: dict, fn, need_s: float = 1.0, skip: str | None = None) -> dict:
        if skip is None and self.left() < need_s:
            skip = f"section time budget spent ({self.left():.0f} s left, about {need_s:.0f} s needed)"
        if skip:
            row.update(status="skipped", reason=skip)
        else:
            try:
                row.update(fn() or {})
                row.setdefault("status", "ok")
            except Exception as err:  # noqa: BLE001 - recorded, the next row runs
                from benchmarks.gpu_check_inputs import empty_cache

                row.update(status="error", error=summary(err))
                empty_cache()
        log(f"{self.name}: {row}")
        self.rows.append(row)
        self.save()
        return row


def summary(err: BaseException) -> str:
    tb = traceback.format_exception(type(err), err, err.__traceback__, limit=-3)
    return "".join(tb)[-1500:]


# ------------------------------------------------------------------------------------------------- correctness


def check_case(kernel: str, shape, dtype, dev) -> dict:
    """Triton forward + backward against the fp64 reference on the same inputs: errors per output."""
    import torch

    from benchmarks.gpu_check_inputs import attn_inputs, compare, pair_inputs
    from mmgeo.kernels import geo_attention, geo_attention_reference, pair_score, pair_score_naive

    if kernel == "pair_score":
        leaves, (qm, km) = pair_inputs(*shape, dtype, dev)
        fn = lambda q, u, k, v: pair_score(q, qm, u, k, km, v)  # noqa: E731
        ref_fn = lambda q, u, k, v: pair_score_naive(q, qm, u, k, km, v)  # noqa: E731
        names = ("out", "dq", "du", "dk", "dv")
    else:
        *dims, causal, pad = shape
        leaves, kpm = attn_inputs(*dims, pad, dtype, dev)
        fn = lambda q, k, v: geo_attention(q, k, v, key_padding_mask=kpm, causal=causal)  # noqa: E731
        ref_fn = lambda q, k, v: geo_attention_reference(q, k, v, key_padding_mask=kpm, causal=causal)  # noqa: E731
        names = ("out", "dq", "dk", "dv")
    xs = [x.detach().requires_grad_() for x in leaves]
    out = fn(*xs)
    path = type(out.grad_fn).__name__
    ref_xs = [x.detach().double().requires_grad_() for x in leaves]
    ref = ref_fn(*ref_xs)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev)
    got = (out, *torch.autograd.grad(out, xs, w.to(out.dtype)))
    want = (ref, *torch.autograd.grad(ref, ref_xs, w))
    tol = TOL[str(dtype).split(".")[-1]]
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and dev.type == "cuda":
        tol = 2e-3
    errs = {n: compare(a, b, tol) for n, a, b in zip(names, got, want)}
    return {"path": path, "tol": tol, "max_abs": max(e["max_abs"] for e in errs.values()),
            "max_rel": max(e["max_rel"] for e in errs.values()), "outputs": errs,
            "pass": all(e["pass"] for e in errs.values()) and triton_path(out.grad_fn)}


def triton_path(fn) -> bool:
    """Whether an output came from the Triton autograd Function: directly, or as the concatenation of launches made
    in parts (a batch past one grid axis)."""
    if "Triton" in type(fn).__name__:
        return True
    parts = [f for f, _ in fn.next_functions if f is not None] if type(fn).__name__ == "CatBackward0" else []
    return bool(parts) and all("Triton" in type(f).__name__ for f in parts)


class forced_config:
    """Run the autotuned kernels with their i-th config only (no tuning), restored afterwards."""

    def __init__(self, kernels, i: int):
        self.kernels, self.i = kernels, i

    def __enter__(self):
        self.saved = [(k.configs, k.cache) for k in self.kernels]
        for k in self.kernels:
            k.configs, k.cache = [k.configs[min(self.i, len(k.configs) - 1)]], {}
        return [str(k.configs[0]) for k in self.kernels]

    def __exit__(self, *exc):
        for k, (configs, cache) in zip(self.kernels, self.saved):
            k.configs, k.cache = configs, cache


def section_correctness(sec: Section, dev, dry: bool) -> None:
    import importlib

    import torch

    os.environ["MMGEO_KERNELS"] = "triton"
    ps = importlib.import_module("mmgeo.kernels._pair_score_triton")
    ga = importlib.import_module("mmgeo.kernels._geo_attention_triton")
    kernels = {"pair_score": [ps._pair_fwd_kernel, ps._pair_bwd_q_kernel, ps._pair_bwd_k_kernel],
               "geo_attention": [ga._attn_fwd_kernel, ga._attn_bwd_kv_kernel, ga._attn_bwd_q_kernel]}
    # pair_score (B_t, B_i, H, T, S, d_a, d_e); geo_attention (B, H, N, M, d_a, d_v, causal, padding)
    if dry:
        cases = {"pair_score": {"tiny-padded": (4, 4, 2, 5, 9, 16, 16), "odd-multi-tile": (3, 2, 2, 7, 20, 8, 4)},
                 "geo_attention": {"padding": (2, 2, 20, 23, 8, 12, False, True),
                                   "causal-n-gt-m": (1, 2, 25, 10, 8, 16, True, False)}}
    else:
        cases = {"pair_score": {"model-padded": (24, 20, 8, 32, 197, 64, 64),
                                "odd-lengths": (9, 7, 8, 23, 101, 64, 48)},
                 "geo_attention": {"model-padding": (2, 8, 197, 197, 64, 64, False, True),
                                   "odd-causal-padding": (2, 4, 77, 53, 64, 64, True, True)}}
    big = {"pair_score": (2, 65_537, 1, 4, 8, 16, 16), "geo_attention": (8_193, 8, 16, 16, 16, 16, False, True)}
    for kernel, shape in big.items():  # past one grid axis: B_i (pair_score), B·H (geo_attention) > 65,535
        def go(kernel=kernel, shape=shape):
            with forced_config(kernels[kernel], 0):
                return check_case(kernel, shape, torch.bfloat16, dev)

        sec.run({"kernel": kernel, "case": "grid-axis>65535", "shape": shape, "dtype": "bfloat16", "config": 0}, go,
                need_s=10,
                skip="interpreter: the grid limit is a GPU property, 65,536 programs too slow to interpret"
                if dry else None)
    # each new (dtype, config, shape specialisation) compiles 3 kernels: the model shape with every config and the
    # odd shape with the first config come first, for every dtype; the odd shape's other configs while time is left
    jobs = [(dtype, kernel, i, case) for phase in (0, 1) for dtype in (torch.bfloat16, torch.float16, torch.float32)
            for kernel, ks in kernels.items() for i in range(max(len(k.configs) for k in ks))
            for n, case in enumerate(cases[kernel]) if (phase == 0) == (n == 0 or i == 0)]
    for dtype, kernel, i, case in jobs:
        shape = cases[kernel][case]
        row = {"kernel": kernel, "case": case, "shape": shape, "dtype": str(dtype)[6:], "config": i}

        def go(kernel=kernel, shape=shape, dtype=dtype, i=i):
            with forced_config(kernels[kernel], i) as names:
                return {"config_detail": names, **check_case(kernel, shape, dtype, dev)}

        skip = "interpreter: bf16 tl.dot is wrong there" if dry and dtype == torch.bfloat16 else None
        sec.run(row, go, need_s=6, skip=skip)


# ------------------------------------------------------------------------------------------------ kernel speed


def pair_speed_rows(sec: Section, dev, dry: bool, impls: dict, need_s: float, cache: dict) -> None:
    """pair_score forward and forward+backward of each of ``impls`` at each batch size: one row each."""
    import torch

    from benchmarks.gpu_check_inputs import empty_cache, pair_inputs, timed

    dtype = torch.float32 if dry else torch.bfloat16
    H, T, S, D = (2, 5, 9, 16) if dry else (8, 32, 197, 64)
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 1 << 62
    for B in (4, 8) if dry else (256, 512, 1024):
        if B not in cache:
            leaves, (qm, km) = pair_inputs(B, B, H, T, S, D, D, dtype, dev)  # q, u (B, H, T, D); k, v (B, H, S, D)
            km[:] = True  # the model's images have every patch
            cache[B] = leaves, qm, km
        leaves, qm, km = cache[B]
        for backward in (False, True):
            mult = 3 if backward else 1  # backward counted as 2× forward (FLOPs); it recomputes the exps twice
            for name, fn in impls.items():
                xs = [x.detach().requires_grad_(backward) for x in leaves]

                def call(fn=fn, xs=xs, backward=backward, qm=qm, km=km):
                    if backward:
                        torch.autograd.grad(fn(xs[0], qm, xs[1], xs[2], km, xs[3]).sum(), xs)
                    else:
                        with torch.no_grad():
                            fn(xs[0], qm, xs[1], xs[2], km, xs[3])

                naive_bytes = B * B * H * T * S * 4 * (6 if backward else 3)
                skip = f"naive would allocate ~{naive_bytes / 2**30:.0f} GiB" \
                    if name != "triton" and name != "reference" and naive_bytes > 0.6 * mem else None
                if name == "reference" and B != min(cache):  # its B=512 rows took 22 s of an H200 run's 100 s
                    skip = "the chunked reference is timed at the smallest batch only: its block loop is slow"
                row = {"kernel": "pair_score", "B": B, "shape": f"B_t=B_i={B}, H={H}, T={T}, S={S}, d_a=d_e={D}",
                       "dtype": str(dtype)[6:], "pass": "fwd+bwd" if backward else "fwd", "impl": name,
                       "flop": mult * 2 * B * B * H * T * S * (D + D), "exps": mult * B * B * H * T * S}
                sec.run(row, lambda call=call: {"ms": timed(call, dev)}, need_s=need_s, skip=skip)
            empty_cache()


def speed_ratios(rows: list[dict]) -> None:
    """TFLOP/s, exp bound, and each row's time over Triton's at the same shape and pass (Triton's row: best
    PyTorch time over its own)."""
    for r in rows:
        if "ms" in r:
            r.update(tflops=r["flop"] / r["ms"] / 1e9, exp_bound_ms=r["exps"] / EXP_PER_S * 1e3)
            r["exp_bound_fraction"] = r["exp_bound_ms"] / r["ms"]
    for r in rows:
        same = [x for x in rows if "ms" in x and (x["kernel"], x["shape"], x["pass"]) ==
                (r["kernel"], r["shape"], r["pass"])]
        tri = next((x["ms"] for x in same if x["impl"] == "triton"), None)
        best = min((x["ms"] for x in same if x["impl"] != "triton"), default=None)
        if "ms" in r and tri:
            r["time_over_triton"] = r["ms"] / tri
        if r["impl"] == "triton" and "ms" in r and best:
            r["triton_speedup"] = best / r["ms"]


def section_kernel_speed(sec: Section, dev, dry: bool) -> None:
    """Triton, naive and chunked pair_score; then geo_attention vs SDPA; torch.compile last (its compile time
    must not starve the rest)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.gpu_check_inputs import attn_inputs, empty_cache, timed
    from mmgeo.kernels import geo_attention, pair_score, pair_score_naive, pair_score_reference

    os.environ["MMGEO_KERNELS"] = "triton"
    dtype = torch.float32 if dry else torch.bfloat16
    cache = {}
    pair_speed_rows(sec, dev, dry, {"triton": pair_score, "naive": pair_score_naive,
                                    "reference": pair_score_reference}, 8 + GEO_RESERVE_S, cache)
    B, H, N, DV = (1, 2, 32, 16) if dry else (2, 16, 8192, 64)
    for da in (8, 16) if dry else (32, 64):
        (q, k, v), _ = attn_inputs(B, H, N, N, da, DV, False, dtype, dev)  # q, k (B, H, N, d_a); v (B, H, N, d_v)
        pad = (lambda x, da=da: F.pad(x, (0, DV - da))) if da < DV else (lambda x: x)  # SDPA flash: one head dim

        def sdpa(q, k, v, da=da, pad=pad):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(pad(q), pad(k), v, scale=da ** -0.5)

        for backward in (False, True):
            for name, fn in (("triton", geo_attention), ("sdpa-flash", sdpa)):
                xs = [x.detach().requires_grad_(backward) for x in (q, k, v)]

                def call(fn=fn, xs=xs, backward=backward):
                    if backward:
                        torch.autograd.grad(fn(*xs).sum(), xs)
                    else:
                        with torch.no_grad():
                            fn(*xs)

                # FLOPs: forward 2·B·H·N²·(d_a + d_v), backward 2.5× forward (FlashAttention's count); exps recomputed
                sec.run({"kernel": "geo_attention", "shape": f"B={B}, H={H}, N={N}, d_a={da}, d_v={DV}",
                         "dtype": str(dtype)[6:], "pass": "fwd+bwd" if backward else "fwd", "impl": name,
                         "flop": (3.5 if backward else 1) * 2 * B * H * N * N * (da + DV),
                         "exps": (2 if backward else 1) * B * H * N * N,
                         "note": f"q, k zero-padded to {DV}" if name != "triton" and da < DV else ""},
                        lambda call=call: {"ms": timed(call, dev)}, need_s=5)
        empty_cache()
    # torch.compile of the reference definition (pair_score_naive: one block, what inductor can fuse); the chunked
    # reference's Python loop over blocks would be unrolled by dynamo into thousands of blocks at these sizes.
    backend = "eager" if dry else "inductor"  # the dry run checks tracing only (inductor on CPU: minutes)
    compiled = torch.compile(pair_score_naive, backend=backend)
    pair_speed_rows(sec, dev, dry, {f"compile({backend}) naive": compiled}, 5 if dry else 30, cache)


# ------------------------------------------------------------------------------------------------------- driver


def run_sections(out: Path, dry: bool, sections: tuple[str, ...] = SECTIONS) -> dict:
    """Each of ``sections`` in its own process, in turn, within the total budget; the others are reported skipped."""
    out = out.resolve()  # the sections run from the repository root
    budgets, total = (DRY_BUDGETS_S, DRY_TOTAL_S) if dry else (BUDGETS_S, TOTAL_S)
    t0, report = time.monotonic(), {}
    for name in SECTIONS:
        budget = min(budgets[name], total - (time.monotonic() - t0) - 5)
        part = out / f".{name}.json"
        part.unlink(missing_ok=True)
        if name not in sections or budget < 10:
            why = "not selected (--sections)" if name not in sections else "total time budget spent"
            report[name] = {"status": "skipped", "budget_s": budget, "error": why, "results": []}
            continue
        log(f"section {name}: budget {budget:.0f} s")
        args = [sys.executable, "-m", "benchmarks.gpu_check", "--section", name, "--budget-s", str(budget),
                "--out", str(out)]
        status = None
        proc = subprocess.Popen(args + (["--dry-run"] if dry else []), cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget + GRACE_S)
            status = None if rc == 0 else f"crashed (exit code {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section and what it started (compile workers)
            proc.wait()
            status = f"timeout: killed after {budget + GRACE_S:.0f} s"
        if part.exists():
            data = json.loads(part.read_text())
            if status:
                data.update(status=status, error=data.get("error") or status)
        else:  # it died before its first row, or wrote nowhere to be found: a status all the same
            data = {"status": "failed: no output", "budget_s": budget, "results": [],
                    "error": status or f"the section's process ended without writing {part}"}
        if name == "kernel_speed":
            speed_ratios(data["results"])
        report[name] = data
        part.unlink(missing_ok=True)
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--out", default=".", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="NAME",
                   help=f"run only these sections, the others are reported skipped (default: {' '.join(SECTIONS)})")
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # one section, in a child process
    p.add_argument("--budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # a lent GPU machine reaches no hub: without this, ``from_pretrained`` retries the network for minutes and the
    # training section is killed before its first row (seen on the first H200 run); the sections inherit it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run on CPU", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # the sections run from the repository root: they get it absolute
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        sec = Section(args.section, out, args.budget_s - 3)
        dev = torch.device("cpu" if args.dry_run else "cuda")
        try:
            if args.section in ("training", "evaluation"):
                from benchmarks import gpu_check_model as sections
            else:
                sections = sys.modules[__name__]
            getattr(sections, f"section_{args.section}")(sec, dev, args.dry_run)
            sec.save("ok")
        except Exception as err:  # noqa: BLE001 - recorded in the JSON
            sec.save("error", summary(err))
        return 0
    from benchmarks.gpu_check_report import environment, markdown

    report = {"environment": environment(args.dry_run, EXP_PER_S),
              **run_sections(out, args.dry_run, tuple(args.sections))}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out / "gpu_check.md").write_text(md)
    print(md)
    log(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


def main_by_path(argv: list[str]) -> int:
    """``python .../benchmarks/gpu_check.py ARGS`` from any folder: ``python -m benchmarks.gpu_check ARGS`` from the
    repository root, with --out made absolute against the folder it was started in (the last --out wins)."""
    out = Path(parse(argv).out).resolve()
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *argv, "--out", str(out)], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main() if __package__ else main_by_path(sys.argv[1:]))
