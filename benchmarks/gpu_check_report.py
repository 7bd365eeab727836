"""The report of ``benchmarks/gpu_check.py``: its environment record and the markdown tables (one per section)."""

from __future__ import annotations

import subprocess

from benchmarks import harness


def environment(dry: bool, exp_per_s: float) -> dict:
    """``harness.environment`` (machine, CPU, Python, commit, command) and the GPU stack."""
    import torch

    def cmd(*args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU)",
            "driver": cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") if cuda else None,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version, **harness.environment(),
            "dry_run": dry, "triton_mode": "interpreted" if dry else "compiled", "exp_per_s": exp_per_s}


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return "" if x is None else str(x)


def status_cell(r: dict) -> str:
    status = r.get("status", "")
    if status == "skipped":
        return f"{status}: {r.get('reason') or ''}"
    if status == "error":
        return f"{status} ({((r.get('error') or '').strip().splitlines() or [''])[-1][:120]})"
    return status


def table(rows: list[dict], cols: list[str]) -> str:
    return harness.markdown_table(cols, ([fmt(r.get(c)) if c != "status" else status_cell(r) for c in cols]
                                         for r in rows))


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
        status, rows = sec.get("status") or "failed: no output", sec.get("results") or []
        head = f"### {name} ({status}, {fmt(sec.get('seconds'))} s of {sec.get('budget_s')} s)"
        if name == "correctness":
            ran = [r for r in rows if r.get("status") == "ok"]
            head += f": {sum(bool(r.get('pass')) for r in ran)} of {len(ran)} cases that ran pass"
        out += [head, "", table(rows, COLUMNS[name]), ""]
        if sec.get("error"):
            out += ["```", sec["error"].strip()[-800:], "```", ""]
    out.append(f"exp bound: exps / {env['exp_per_s']:.2g} per s (`EXP_PER_S`); exp_bound_fraction = bound / measured. "
               f"Command: `{env['command']}`.")
    return "\n".join(out) + "\n"
