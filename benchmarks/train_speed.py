"""Training speed of a config: steps/s and samples/s, a per-step breakdown, and a side-by-side comparison.

    python -m benchmarks.train_speed [--config configs/synthetic.yaml] [--steps 40] [--warmup 10]
                                     [--compare REF] [--repeats 2] [--json out.json] [-- --a.b value ...]
    python -m benchmarks.train_speed --compare 82ea04e --steps 30 --repeats 1   # this tree vs a commit
    python -m benchmarks.train_speed --tiny --steps 3 --warmup 1                # smoke run, seconds

Each measurement is a child process (this venv's python, ``benchmarks/train_speed_child.py``) whose working
directory, first on its sys.path, is the checkout measured, so it imports that checkout's mmgeo (mmgeo.training;
train.py itself in checkouts from before that package).
It runs mmgeo.training.train(argv, callbacks=[timer]) for warmup + steps steps (temp out_dir, unique --name; the
config path is read relative to that checkout) with the config's validation as it would happen, then times the
pieces of a step by hand on a few batches: data (__getitem__ with rendering + preprocess), collate (tokenisation),
text / image tower, score + loss (every term of the training step's, `RetrievalModule.loss_terms`), backward,
the optimiser's step (AdamW, or MuonAdamW with `optim.name: muon`).
The arithmetic floor: one more step (forward, loss, backward) runs under torch.profiler, whose FLOP count of the
matrix products (mm, addmm, bmm, baddbmm, conv2d) is the step's GEMM work; at this CPU's fp32 GEMM peak (best of
five 2048^3 matmuls on the children's thread count, measured once after the runs) that work alone takes
"GEMMs alone at peak" ms, so batch / that is the most samples/s any implementation of the same step reaches here.
A lower bound: attention inside fused SDPA kernels and convolution backward are not in the profiler's count.
"in-step CPU time" is the process's CPU seconds per step (all its threads; steadier than wall time on a shared host).
"Lightning/logging overhead" = Lightning's in-step time minus the forward, loss, backward and optimiser parts.
Steady state: the steps after --warmup; period = batch start to next batch start, validation time removed;
data wait = period - in-step (the loader and the loop between batches). --compare REF (commit, tag, branch or
a checkout directory) runs ref, current, ref, current, ... (--repeats each) and reports medians and the
current/ref ratio. Before them, --warmup-runs runs of the ref (1 by default with --compare) go unrecorded: on the
2-core machines the first run of a comparison (the ref's) was its checkout's slowest in every comparison looked at,
which favoured the current checkout. Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    ROOT,
    add_compare,
    add_json,
    alternate,
    checkout_of,
    commit,
    done_in,
    environment,
    gemm_peak,
    logger,
    markdown_table,
    median,
    run_in_checkout,
    write_json,
)

CHILD = Path(__file__).resolve().with_name("train_speed_child.py")  # runs in the checkout measured
ROWS = [("samples_per_s", "samples/s"), ("steps_per_s", "steps/s"), ("startup_s", "startup, process to 1st batch (s)"),
        ("in_step_ms", "Lightning in-step (ms/step)"), ("period_ms", "period batch to batch (ms/step)"),
        ("data_wait_ms", "data wait = period - in-step (ms/step)"), ("val_s", "validation (s per run)"),
        ("val_runs", "validation runs"), ("diag_s", "attention diagnostics (s per run)"),
        ("data_ms", "data: __getitem__ + preprocess (ms/step)"), ("collate_ms", "collate / tokenise (ms/step)"),
        ("text_fwd_ms", "text tower forward (ms/step)"), ("image_fwd_ms", "image tower forward (ms/step)"),
        ("loss_ms", "score + loss (ms/step)"), ("backward_ms", "backward (ms/step)"),
        ("optimizer_ms", "optimiser step + zero_grad (ms/step)"),
        ("overhead_ms", "Lightning/logging overhead (ms/step)"), ("cpu_ms", "in-step CPU time, all threads (ms/step)"),
        ("gemm_gflop", "GEMM work (GFLOP/step, profiler count)"), ("gemm_floor_ms", "GEMMs alone at peak (ms/step)"),
        ("ceiling_samples_per_s", "samples/s if a step were its GEMMs at peak")]
TINY = ["--data.train_size", "64", "--data.val_size", "8", "--trainer.batch_size", "16"]
log = logger("train_speed")


def measure(checkout: Path, args: argparse.Namespace, overrides: list[str], tmp: Path) -> dict:
    out_dir = Path(tempfile.mkdtemp(dir=tmp))
    spec = {"checkout": str(checkout), "config": args.config, "overrides": overrides, "steps": args.steps,
            "warmup": args.warmup, "batches": args.batches, "out_dir": str(out_dir), "launch": time.time()}
    (out_dir / "spec.json").write_text(json.dumps(spec))
    with open(out_dir / "log.txt", "w") as logf:
        rc = run_in_checkout(CHILD, [str(out_dir / "spec.json")], checkout, stdout=logf,
                             stderr=subprocess.STDOUT).returncode
    if rc or not (out_dir / "result.json").is_file():
        raise SystemExit(f"measurement of {checkout} failed (exit {rc}); its output ends:\n"
                         + (out_dir / "log.txt").read_text()[-3000:])
    res = json.loads((out_dir / "result.json").read_text())
    for piece, err in res["breakdown_errors"].items():
        log(f"  breakdown {piece}: n/a ({err})")
    return res


def fmt(v: float | None) -> str:
    if v is None or isinstance(v, int):
        return "n/a" if v is None else str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def main() -> None:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/synthetic.yaml", help="relative to each checkout measured")
    p.add_argument("--steps", type=int, default=None, help="steady-state steps measured (default 40; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before them, not measured (default 10; --tiny 1)")
    add_compare(p)
    p.add_argument("--repeats", type=int, default=None, help="runs per checkout, interleaved (default 2; --tiny 1)")
    p.add_argument("--batches", type=int, default=None, help="batches timed for the breakdown (default 3; --tiny 1)")
    p.add_argument("--warmup-runs", type=int, default=None, help="runs of the first checkout before the measured "
                   "ones, not recorded (default 1 with --compare, else 0; --tiny 0)")
    p.add_argument("--tiny", action="store_true", help="smoke size: " + " ".join(TINY))
    add_json(p)
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    for name, tiny, full in (("steps", 3, 40), ("warmup", 1, 10), ("batches", 1, 3), ("repeats", 1, 2)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.tiny else full)
    if a.warmup_runs is None:
        a.warmup_runs = 0 if a.tiny or a.compare is None else 1
    if a.steps < 2 or a.warmup < 0 or a.repeats < 1 or a.batches < 1 or a.warmup_runs < 0:
        raise SystemExit("need --steps >= 2 (periods between batch starts), --warmup >= 0, --repeats >= 1, "
                         "--batches >= 1, --warmup-runs >= 0")
    overrides = (TINY if a.tiny else []) + overrides
    with checkout_of(a.compare, log) as ref, tempfile.TemporaryDirectory(prefix="train_speed-") as tmp:
        checkouts = {"current": ROOT} if ref is None else {"ref": ref, "current": ROOT}
        commits = {k: commit(v, short=False) for k, v in checkouts.items()}  # before the worktree goes

        def run(label: str, r: int) -> dict:
            log(f"repeat {r + 1}/{a.repeats} {label} ({checkouts[label]}): {a.warmup}+{a.steps} steps + breakdown")
            res = measure(checkouts[label], a, overrides, Path(tmp))
            log(f"  {res['samples_per_s']:.1f} samples/s")
            return res

        opener = next(iter(checkouts))  # the ref, or the only checkout
        for i in range(a.warmup_runs):  # the first run of a comparison measured its checkout's slowest
            log(f"warm-up run {i + 1}/{a.warmup_runs} {opener}, not recorded")
            measure(checkouts[opener], a, overrides, Path(tmp))
        runs = alternate(checkouts, a.repeats, run)
    peak = gemm_peak(runs["current"][0]["threads"])  # after the runs: the children are gone, the cores are free
    for res in (r for rs in runs.values() for r in rs):
        if res.get("gemm_gflop"):
            res["gemm_floor_ms"] = res["gemm_gflop"] / peak * 1e3
            res["ceiling_samples_per_s"] = res["batch_size"] / res["gemm_floor_ms"] * 1e3
    med = {k: {key: median(r.get(key) for r in runs[k]) for key, _ in ROWS} for k in checkouts}
    ratio = {key: med["current"][key] / med["ref"][key] for key, _ in ROWS
             if "ref" in med and med["ref"][key] and med["current"][key] is not None}
    first = runs["current"][0]
    env = environment()
    result = {"command": env["command"], "config": a.config, "overrides": overrides,
              "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "warmup_runs": a.warmup_runs,
              "batch_size": first["batch_size"],
              "torch": first["torch"], "threads": first["threads"], "cpu": env["cpu"], "cpus": env["cpus"],
              "environment": env,
              "checkouts": {k: {"path": str(v), "commit": commits[k], "runs": runs[k], "median": med[k]}
                            for k, v in checkouts.items()},
              "ratio": ratio, "ratio_samples_per_s": ratio.get("samples_per_s"), "gemm_peak_gflops": peak}
    cols = list(checkouts)
    head = [f"{k} `{commits[k][:7]}{'+dirty' if commits[k].endswith('+dirty') else ''}`" for k in cols]
    print(f"\ntrain speed of {a.config}, {a.warmup}+{a.steps} steps, batch {first['batch_size']}, median of "
          f"{a.repeats} run(s); torch {first['torch']}, {first['threads']} threads, {env['cpu']}\n")
    print(markdown_table(["quantity", *head, *(["current/ref"] if "ref" in cols else [])],
                         ([name, *(fmt(med[k][key]) for k in cols), *([fmt(ratio.get(key))] if "ref" in cols else [])]
                          for key, name in ROWS)))
    print(f"\nfp32 GEMM peak here: {peak:.0f} GFLOP/s on {first['threads']} thread(s) (best of five 2048^3 matmuls); "
          "'GEMMs alone at peak' = the step's profiled GEMM work at that rate, a floor no implementation of the "
          "same step goes under on this CPU")
    if a.json:
        write_json(a.json, result, indent=2)
        print(f"\njson: {a.json}")
    else:
        print("\n" + json.dumps({"commits": commits, "median": med, "ratio": ratio}, separators=(",", ":")))


if __name__ == "__main__":
    with done_in(log):
        main()
