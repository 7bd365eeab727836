"""Attention-space sweep (docs/design.md §8, d_a rule of thumb): train the embedded default at several d_a and
compare text->image R@1, parameter count and peak memory.

    python -m experiments.sweep_da [--d-a 8 16 32 64 128] [--steps 200] [--limit 300] [--trainer.batch_size 32 ...]

Each d_a trains in its own subprocess (mmgeo.training.train with configs/synthetic.yaml and overrides), then
scores the synthetic test split exactly (eval.py's protocol; first ``--limit`` images, 5 captions each). Peak memory is
that subprocess's ru_maxrss: the peak resident set of training + evaluation in one fresh process (DataLoader
workers, whose memory does not depend on d_a, are not included; the Python/torch baseline is). Extra
``--a.b value`` arguments are passed to train.py as overrides. Writes docs/measurements/sweep_da.md (with the command,
commit, machine and date) and docs/measurements/sweep_da.png; a rerun replaces the run folders <out-dir>/da<d_a>
(train.py --overwrite: other files there are kept).
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import ROOT, environment, measured_on


def worker(spec: dict) -> dict:
    """One sweep point, in this (fresh) process: train, evaluate exactly, measure."""
    import torch

    import mmgeo.training as training
    from mmgeo.data import build_dataset
    from mmgeo.eval.diagnostics import diagnose
    from mmgeo.eval.metrics import retrieval_metrics
    from mmgeo.eval.retrieval import encode_split, exact_scores
    from mmgeo.models.checkpoint import load_model

    start = time.time()
    ckpt = training.train(spec["train_args"])
    train_s = time.time() - start
    model = load_model(ckpt)
    data = build_dataset("synthetic", "test", image_size=model.cfg.image_size, size=spec["limit"])
    split = encode_split(model, data, progress=False)
    scores = exact_scores(model, split.texts, split.images, model.default_mode, progress=False)
    metrics = retrieval_metrics(scores, split.text_to_image)
    keep = split.text_to_image < 64
    diag = diagnose(model, split.texts[keep], split.images, split.text_to_image[keep], warn=False)
    attn_space = sum(p.numel() for p in model.parameter_groups()["qk"])  # the Q/K maps
    return {"d_a": spec["d_a"], "t2i_R@1": metrics["text_to_image_R@1"], "i2t_R@1": metrics["image_to_text_R@1"],
            "params": sum(p.numel() for p in model.parameters()), "qk_params": attn_space,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "entropy": diag["entropy"]["mean"], "entropy_uniform": diag["entropy"]["uniform"],
            "train_s": round(train_s, 1), "images": len(split.images), "captions": len(split.texts),
            "torch_threads": torch.get_num_threads()}


def run_point(d_a: int, args, overrides: list[str]) -> dict:
    train_args = ["--config", args.config, "--data.val_size", "0", *overrides, "--out_dir", args.out_dir,
                  "--name", f"da{d_a}", "--model_args.d_a", str(d_a),  # the sweep's own settings win
                  "--overwrite"]  # every point is measured anew: a rerun replaces its run folder
    if args.steps:
        train_args += ["--trainer.max_steps", str(args.steps)]
    spec = {"d_a": d_a, "limit": args.limit, "train_args": train_args}
    proc = subprocess.run([sys.executable, "-m", "experiments.sweep_da", "--worker", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"sweep point d_a={d_a} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_report(rows: list[dict], md: Path, png: Path, settings: str, provenance: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["# Attention-space sweep: d_a", "", *([provenance, ""] if provenance else []), settings, "",
             "| d_a | text→image R@1 | image→text R@1 | params | Q/K-map params | peak RSS (MB) | "
             "attention entropy (ln S) | train s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d_a']} | {100 * r['t2i_R@1']:.1f} | {100 * r['i2t_R@1']:.1f} | {r['params']:,} | "
                     f"{r['qk_params']:,} | {r['peak_rss_mb']:.0f} | {r['entropy']:.2f} ({r['entropy_uniform']:.2f}) "
                     f"| {r['train_s']:.0f} |")
    lines += ["", f"![R@1, parameters and peak memory against d_a]({png.name})", ""]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines))
    das = [r["d_a"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=110)
    for ax, key, label, scale in ((axes[0], "t2i_R@1", "text→image R@1 (%)", 100), (axes[1], "params", "parameters", 1),
                                  (axes[2], "peak_rss_mb", "peak RSS (MB)", 1)):
        ax.plot(das, [scale * r[key] for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(das, [str(d) for d in das])
        ax.set_xlabel("d_a")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-a", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="attention-space sizes")
    p.add_argument("--steps", type=int, default=None, help="training steps per point (default: the config's)")
    p.add_argument("--limit", type=int, default=None, help="test images scored (default: all 1,000)")
    p.add_argument("--config", default=str(ROOT / "configs" / "synthetic.yaml"))
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "sweep_da"), help="run folders go here")
    p.add_argument("--md", default=str(ROOT / "docs" / "measurements" / "sweep_da.md"))
    p.add_argument("--png", default=str(ROOT / "docs" / "measurements" / "sweep_da.png"))
    args, overrides = p.parse_known_args(argv)
    if any(d <= 0 for d in args.d_a):
        p.error(f"--d-a values must be positive, got {args.d_a}")
    rows = []
    for d_a in args.d_a:
        rows.append(run_point(d_a, args, overrides))
        r = rows[-1]
        print(f"d_a={d_a}: text->image R@1 {100 * r['t2i_R@1']:.1f}, params {r['params']:,}, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB, {r['train_s']:.0f} s", flush=True)
    settings = (f"Settings: `{Path(args.config).name}`, steps = {args.steps or 'config default'}, test images = "
                f"{rows[0]['images']} ({rows[0]['captions']} captions), exact scoring, extra overrides: "
                f"`{' '.join(overrides) or 'none'}`; {rows[0]['torch_threads']} torch threads. Peak RSS = ru_maxrss of "
                "the process that trained and evaluated that point (Python + torch baseline included, DataLoader "
                "workers not). Attention entropy: mean over heads on 64 test images, ln S in brackets.")
    command = shlex.join(["python", "-m", "experiments.sweep_da", *argv])
    provenance = f"`{command}` — {measured_on(environment())}"
    write_report(rows, Path(args.md), Path(args.png), settings, provenance)
    print(f"written {args.md} and {args.png}")
    return rows


if __name__ == "__main__":
    main()
