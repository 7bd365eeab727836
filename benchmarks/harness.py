"""What the benchmark scripts share (``python -m benchmarks.NAME``; ``experiments`` uses it too).

- progress lines on stderr: ``logger``; a command's duration: ``done_in``;
- what a measurement ran on: ``environment`` (machine, CPU, Python, commit, command, date) and its one-line form
  ``measured_on``, ``commit``, ``cpu_model``, ``gemm_peak`` (this CPU's fp32 GEMM rate, for arithmetic floors);
- timing: ``alternate`` (every variant once per round, in turn, so a slow spell of a shared machine falls on all of
  them alike), ``median`` of what was measured, ``elapsed_ms``;
- the common command-line flags: ``add_json``, ``add_out``, ``add_report_to``, ``add_device``, ``add_checkpoint``
  (--ckpt --data --split --limit), ``add_compare``;
- another commit measured in a child process: ``checkout_of`` (a directory as is, else a temporary git worktree)
  and ``run_in_checkout`` (a file of this tree run with its imports resolved in that checkout);
- writing the report: ``write_json``, ``markdown_table``, and a marked section of a markdown file (``--report-to``):
  ``check_markers`` before the long work, ``report_to`` after it.

Importing this module does no work: no torch, nothing measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]  # the repository root: ``python -m benchmarks.X`` runs from here
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------- progress
def logger(name: str, clock: bool = False) -> Callable[[str], None]:
    """``log(msg)`` printing ``[name] msg`` (``[name HH:MM:SS] msg`` with ``clock``) to stderr, flushed."""
    def log(msg: str) -> None:
        stamp = f" {time.strftime('%H:%M:%S')}" if clock else ""
        print(f"[{name}{stamp}] {msg}", file=sys.stderr, flush=True)

    return log


@contextlib.contextmanager
def done_in(say: Callable[[str], None] = print) -> Iterator[None]:
    """``with done_in(): main()`` says ``done in N s`` once the block ends."""
    start = time.time()
    yield
    say(f"done in {time.time() - start:.0f} s")


# ------------------------------------------------------------------------------------------------ environment
def git(args: list[str], cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def commit(checkout: Path = ROOT, short: bool = True) -> str:
    """HEAD of a checkout, with "+dirty" when a tracked file differs from it ("unknown" outside git)."""
    try:
        head = git(["rev-parse", *(["--short"] if short else []), "HEAD"], checkout)
        dirty = git(["status", "--porcelain", "--untracked-files=no"], checkout)
    except (subprocess.CalledProcessError, OSError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    """How this process was started: ``python -m benchmarks.X ARGS`` (or ``python FILE ARGS``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *head, *sys.argv[1:]])


def environment(checkout: Path = ROOT) -> dict:
    """The machine, CPU, Python, commit, command and date of a measurement (a report's provenance)."""
    return {"machine": f"{platform.system()} {platform.machine()}", "cpu": cpu_model(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "commit": commit(checkout), "command": command_line(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def measured_on(env: dict) -> str:
    """"Commit C, machine: CPU (N CPUs), YYYY-MM-DD." from ``environment()``: what a report written into the
    measurement log (docs/measurements/) says beside its command."""
    date = env.get("date") or time.strftime("%Y-%m-%d", time.gmtime())
    return f"Commit {env['commit']}, machine: {env['cpu']} ({env['cpus']} CPUs), {date}."


def gemm_peak(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """This CPU's fp32 GEMM rate (GFLOP/s): best of ``repeats`` square ``size`` matmuls on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best / 1e9


# ----------------------------------------------------------------------------------------------------- timing
def alternate(names: Iterable[str], rounds: int, run: Callable[[str, int], T], rotate: bool = False
              ) -> dict[str, list[T]]:
    """``run(name, round)`` for every name, in turn, ``rounds`` times; ``rotate``: who goes first moves on by one
    name each round (round r begins with name r + 1, modulo their number). -> each name's results in round order."""
    names = list(names)
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[(r + 1) % len(names):] + names[:(r + 1) % len(names)] if rotate else names
        for name in order:
            out[name].append(run(name, r))
    return out


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when there is none)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def elapsed_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn``."""
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


# ------------------------------------------------------------------------------------------------------ flags
def add_json(p: argparse.ArgumentParser, what: str = "the results") -> None:
    p.add_argument("--json", metavar="PATH", default=None, help=f"also write {what} here")


def add_out(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument("--out", default=default, help=f"output folder ({what})")


def add_report_to(p: argparse.ArgumentParser, section: str, what: str = "the table") -> None:
    start, end = markers(section)
    p.add_argument("--report-to", default=None, metavar="MARKDOWN",
                   help=f"also replace the section of this markdown file between the lines `{start}` and `{end}` "
                        f"with {what}")


def add_device(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    p.add_argument("--device", default=default, help=f"torch device (default {default})")


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    """--ckpt (required), --data, --split, --limit: a trained model and the split it is measured on."""
    p.add_argument("--ckpt", required=True, help="geometric model.pt (e.g. the default run's runs/synthetic)")
    p.add_argument("--data", default="synthetic")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=None, help="only the first N images of each split")


def add_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", metavar="REF", help="commit, tag, branch or checkout directory to compare against")


# --------------------------------------------------------------------------------- another commit, measured
@contextlib.contextmanager
def checkout_of(ref: str | None, log: Callable[[str], None] | None = None) -> Iterator[Path | None]:
    """The checkout of ``ref``: None for None, a directory as it is (it must hold train.py), else a
    ``git worktree add --detach`` of the commit, tag or branch in the temporary folder, removed afterwards."""
    if ref is None:
        yield None
        return
    if Path(ref).is_dir():
        if not (Path(ref) / "train.py").is_file():
            raise SystemExit(f"--compare {ref}: directory has no train.py, so it is not a checkout of this project")
        yield Path(ref).resolve()
        return
    try:
        git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"])
    except subprocess.CalledProcessError:
        raise SystemExit(f"--compare {ref}: neither a directory nor a commit, tag or branch of {ROOT}") from None
    path = Path(tempfile.gettempdir()) / f"mmgeo-checkout-{uuid.uuid4().hex[:8]}"
    if log:
        log(f"git worktree add --detach {path} {ref}")
    git(["worktree", "add", "--detach", str(path), ref])
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


# ``python -c`` puts its working directory first on sys.path; the file is then run as __main__ by path (runpy does not
# add the file's folder to sys.path), and sys.argv becomes [file, *args]
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"


def run_in_checkout(script: Path, args: list[str], checkout: Path, **kwargs) -> subprocess.CompletedProcess:
    """Run ``script`` (a file of this tree that imports nothing from ``benchmarks``) in a child process whose
    imports (mmgeo, train) resolve in ``checkout``: the child's working directory is the checkout, which
    ``python -c`` puts first on its sys.path. No bytecode is written into the checkout. ``kwargs`` go to
    ``subprocess.run``."""
    env = {**os.environ, **kwargs.pop("env", {}), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", _RUN_FILE, str(script), *args], cwd=checkout, env=env, **kwargs)


# ----------------------------------------------------------------------------------------------------- report
def write_json(path: str | Path | None, data, indent: int | None = 1) -> None:
    """``data`` as JSON at ``path`` (nothing when ``path`` is None: a --json not given)."""
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=indent, default=str))


def markdown_table(header: list[str], rows: Iterable[Iterable], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` right-aligned (``---:``), anything else left
    (missing letters: left)."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    rule = "|" + "".join("---:|" if align[i:i + 1] == "r" else "---|" for i in range(len(header)))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def check_markers(path: Path, name: str) -> str:
    """The file's text, or a SystemExit naming the markers it lacks (check before the long work, not after)."""
    start, end = markers(name)
    if not path.is_file():
        raise SystemExit(f"--report-to {path}: no such file")
    doc = path.read_text()
    if start not in doc or end not in doc or doc.index(start) > doc.index(end):
        raise SystemExit(f"--report-to {path}: it has no section marked by the lines `{start}` and `{end}`; add "
                         "both where the table belongs, then rerun")
    return doc


def report_to(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``name``'s markers in ``path`` by ``text``; everything outside them is kept."""
    start, end = markers(name)
    head, rest = check_markers(path, name).split(start, 1)
    path.write_text(f"{head}{start}\n{text.rstrip()}\n{end}{rest.split(end, 1)[1]}")
