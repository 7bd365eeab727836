"""The report of ``benchmarks/gpu_check.py``: its environment record and the markdown tables (one per section)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment(dry: bool, exp_per_s: float) -> dict:
    import torch

    def cmd(*args):
        try:
            return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    dirty = bool(cmd("git", "status", "--porcelain", "--untracked-files=no"))
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU)",
            "driver": cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") if cuda else None,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version,
            "python": sys.version.split()[0], "commit": (cmd("git", "rev-parse", "--short", "HEAD") or "?")
            + ("+dirty" if dirty else ""), "dry_run": dry, "triton_mode": "interpreted" if dry else "compiled",
            "exp_per_s": exp_per_s, "command": " ".join([Path(sys.executable).name, *sys.argv])}


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return "" if x is None else str(x)


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        status = r.get("status", "")
        cells = [fmt(r.get(c)) if c != "status" else status + (f": {r.get('reason') or ''}" if
                 status == "skipped" else f" ({(r.get('error') or '').strip().splitlines()[-1][:120]})"
                 if status == "error" else "") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COLUMNS = {"correctness": ["kernel", "case", "dtype", "config", "pass", "max_abs", "max_rel", "tol", "status"],
           "kernel_speed": ["kernel", "shape", "pass", "impl", "ms", "time_over_triton", "triton_speedup", "tflops",
                            "exp_bound_ms", "exp_bound_fraction", "note", "status"],
           "training": ["model", "batch", "steps", "samples_per_s", "peak_gib", "pair_score_path", "score_inputs",
                        "note", "status"],
           "evaluation": ["what", "captions", "images", "k_prime", "dtype", "device", "pair_score_path", "seconds",
                          "queries_per_s", "build_s", "status"]}


def markdown(report: dict) -> str:
    env = report["environment"]
    out = ["## GPU check" + (" (dry run: CPU, interpreted Triton, tiny shapes; timings meaningless)"
                             if env["dry_run"] else ""), "", table([env], ["gpu", "driver", "cuda", "torch", "triton",
                                                                           "commit", "triton_mode"]), ""]
    for name, sec in report.items():
        if name == "environment":
            continue
        head = f"### {name} ({sec['status']}, {fmt(sec.get('seconds'))} s of {sec.get('budget_s')} s)"
        if name == "correctness":
            ran = [r for r in sec["results"] if r.get("status") == "ok"]
            head += f": {sum(bool(r.get('pass')) for r in ran)} of {len(ran)} cases that ran pass"
        out += [head, "", table(sec["results"], COLUMNS[name]), ""]
        if sec.get("error"):
            out += ["```", sec["error"].strip()[-800:], "```", ""]
    out.append(f"exp bound: exps / {env['exp_per_s']:.2g} per s (`EXP_PER_S`); exp_bound_fraction = bound / measured. "
               f"Command: `{env['command']}`.")
    return "\n".join(out) + "\n"
