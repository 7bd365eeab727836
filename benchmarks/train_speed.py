"""Training speed of a config: steps/s and samples/s, a per-step breakdown, and a side-by-side comparison.

    python benchmarks/train_speed.py [--config configs/synthetic.yaml] [--steps 40] [--warmup 10]
                                     [--compare REF] [--repeats 2] [--json out.json] [-- --a.b value ...]
    python benchmarks/train_speed.py --compare 82ea04e --steps 30 --repeats 1   # this tree vs a commit
    python benchmarks/train_speed.py --tiny --steps 3 --warmup 1                # smoke run, seconds

Each measurement is a child process (this venv's python) whose cwd and sys.path[0] are the checkout measured,
so it imports that checkout's mmgeo (mmgeo.training; train.py itself in checkouts from before that package).
It runs mmgeo.training.train(argv, callbacks=[timer]) for warmup + steps steps (temp out_dir, unique --name; the
config path is read relative to that checkout) with the config's validation as it would happen, then times the
pieces of a step by hand on a few batches: data (__getitem__ with rendering + preprocess), collate (tokenisation),
text / image tower, score + loss, backward, AdamW step.
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
current/ref ratio. Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("text_fwd", "image_fwd", "loss", "backward", "optimizer")  # Lightning's in-step work
PIECES = ("data", "collate", *PARTS)
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
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::conv2d")  # ops the profiler counts FLOPs of
TINY = ["--data.train_size", "64", "--data.val_size", "8", "--trainer.batch_size", "16"]


def log(msg: str) -> None:
    print(f"[train_speed] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- child process
def training_api(checkout: Path) -> types.SimpleNamespace:
    """The measured checkout's training entry points: mmgeo.training, or for a checkout from before that package
    (a --compare REF), its train.py module, where they all lived. Looked up on disk: an editable install of this
    project would otherwise find a subpackage the measured checkout lacks in the installed one."""
    if not (checkout / "mmgeo" / "training").is_dir():
        old = importlib.import_module("train")
        return types.SimpleNamespace(
            modules=[old], main=old.main, TrainConfig=old.TrainConfig, RetrievalModule=old.RetrievalModule,
            build_loader=old.build_loader, load_config=getattr(old, "load_config", None),
            ValidationRecall=getattr(old, "ValidationRecall", None),
            AttentionDiagnostics=getattr(old, "AttentionDiagnostics", None),
            train_split=lambda cfg, module: old.open_split(cfg.data, "train", cfg.data.train_size))
    training = importlib.import_module("mmgeo.training")
    from mmgeo.data.pairs import open_split

    return types.SimpleNamespace(
        modules=[training], main=training.train, TrainConfig=training.TrainConfig,
        RetrievalModule=training.RetrievalModule, build_loader=training.build_loader, load_config=None,
        ValidationRecall=training.ValidationRecall, AttentionDiagnostics=training.AttentionDiagnostics,
        train_split=lambda cfg, module: open_split(cfg.data, "train", cfg.data.train_size,
                                                   module.model.cfg.image_size))


def child(spec: dict) -> dict:
    """One measurement inside the checkout ``spec["checkout"]`` (cwd and sys.path[0] set by the parent)."""
    sys.path[0] = spec["checkout"]
    import lightning as L
    import torch

    import mmgeo

    train = training_api(Path(spec["checkout"]))
    for mod in (*train.modules, mmgeo):
        if not Path(mod.__file__).resolve().is_relative_to(Path(spec["checkout"]).resolve()):
            raise RuntimeError(f"{mod.__name__} imported from {mod.__file__}, not from {spec['checkout']}")
    spans: list[tuple[str, float, float]] = []  # (kind, start, end) of validation / diagnostics runs
    for kind, cls_name in (("val", "ValidationRecall"), ("diag", "AttentionDiagnostics")):
        cls = getattr(train, cls_name)
        if cls is not None and hasattr(cls, "_run"):
            def timed(self, *a, _fn=cls._run, _kind=kind, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(self, *a, **k)
                finally:
                    spans.append((_kind, t0, time.perf_counter()))
            cls._run = timed

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.cpu: list[float] = []  # process CPU seconds in each step (all threads)
            self.first_wall, self.batch_size, self.threads = 0.0, 0, 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if not self.starts:
                self.first_wall, self.threads = time.time(), torch.get_num_threads()
                cfg = getattr(module, "cfg", None)
                self.batch_size = cfg.trainer.batch_size if cfg is not None else len(batch["pixels"])
            self.starts.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())
            self.cpu[-1] = time.process_time() - self.cpu[-1]

    timer, n, w = Timer(), spec["warmup"] + spec["steps"], spec["warmup"]
    argv = ["--config", spec["config"], *spec["overrides"], "--out_dir", spec["out_dir"],
            "--name", f"speed-{uuid.uuid4().hex[:8]}", "--trainer.max_steps", str(n)]
    train.main(argv, callbacks=[timer])
    s, e = timer.starts, timer.ends
    if len(s) < n:
        raise RuntimeError(f"only {len(s)} of {n} steps ran (too little data for that many steps?)")

    def overlap(a: float, b: float) -> float:
        return sum(max(0.0, min(b, y) - max(a, x)) for _, x, y in spans)

    periods = [s[i + 1] - s[i] - overlap(s[i], s[i + 1]) for i in range(w, n - 1)]
    in_step = statistics.fmean(e[i] - s[i] - overlap(s[i], e[i]) for i in range(w, n - 1))
    period = statistics.fmean(periods)
    cpu = [timer.cpu[i] for i in range(w, n - 1) if not overlap(s[i], e[i])]  # steps without validation inside
    runs = {k: [b - a for kind, a, b in spans if kind == k] for k in ("val", "diag")}
    out = {"steps_per_s": 1 / period, "samples_per_s": timer.batch_size / period, "batch_size": timer.batch_size,
           "startup_s": timer.first_wall - spec["launch"], "in_step_ms": 1e3 * in_step, "period_ms": 1e3 * period,
           "data_wait_ms": 1e3 * (period - in_step), "val_runs": len(runs["val"]),
           "val_s": statistics.fmean(runs["val"]) if runs["val"] else None,
           "diag_s": statistics.fmean(runs["diag"]) if runs["diag"] else None,
           "cpu_ms": 1e3 * statistics.fmean(cpu) if cpu else None, "torch": torch.__version__,
           "threads": timer.threads}
    if train.ValidationRecall is None:
        out["val_runs"] = None
    times, errors, gflop = breakdown(train, spec, spec["batches"])
    out.update({f"{k}_ms": v for k, v in times.items()}, breakdown_errors=errors, gemm_gflop=gflop)
    if all(times[p] is not None for p in PARTS):
        out["overhead_ms"] = out["in_step_ms"] - sum(times[p] for p in PARTS)
    return out


def breakdown(train, spec: dict, batches: int) -> tuple[dict[str, float | None], dict[str, str], float | None]:
    """Median ms of each piece of a step over ``batches`` batches (after one untimed), built as training does, and
    the GFLOP of one more step's matrix products (forward, loss, backward) as torch.profiler counts them."""
    import torch

    times: dict[str, list[float]] = {p: [] for p in PIECES}
    errors: dict[str, str] = {}
    state: dict = {}

    def piece(name: str, fn, record: bool):
        if name in errors:
            return
        try:
            t0 = time.perf_counter()
            state[name] = fn()
            if record:
                times[name].append(1e3 * (time.perf_counter() - t0))
        except Exception as err:  # an older / newer checkout lacks this piece: "n/a"
            errors[name] = f"{type(err).__name__}: {err}"[:300]
            state.pop(name, None)

    try:
        load = train.load_config or importlib.import_module("mmgeo.config").load_config
        cfg = load(train.TrainConfig, spec["config"], spec["overrides"])
        moved = (Path(spec["checkout"]) / "mmgeo" / "training" / "losses.py").is_file()  # older checkouts: mmgeo/
        losses = importlib.import_module("mmgeo.training.losses" if moved else "mmgeo.losses")
        torch.manual_seed(cfg.trainer.seed)
        module = train.RetrievalModule(cfg)
        model = module.model.train()
        loader = train.build_loader(cfg, module, train.train_split(cfg, module))
        keys = iter(loader.batch_sampler)
        opt = module.configure_optimizers()
        opt = opt["optimizer"] if isinstance(opt, dict) else opt[0] if isinstance(opt, (list, tuple)) else opt
    except Exception as err:
        return {p: None for p in PIECES}, {"setup": f"{type(err).__name__}: {err}"[:300]}, None
    for b in range(batches + 1):
        rec, batch_keys = b > 0, next(keys, None)
        if batch_keys is None:  # fewer batches in an epoch than asked for
            break
        piece("data", lambda ks=batch_keys: [loader.dataset[k] for k in ks], rec)
        piece("collate", lambda: loader.collate_fn(state["data"]), rec)
        piece("text_fwd", lambda: model.forward_text(state["collate"]["input_ids"], state["collate"]["attention_mask"]),
              rec)
        piece("image_fwd", lambda: model.forward_image(state["collate"]["pixels"]), rec)
        piece("loss", lambda: _loss(losses, model, state, cfg), rec)
        piece("backward", lambda: state["loss"].backward(), rec)
        piece("optimizer", lambda: (opt.step(), opt.zero_grad(set_to_none=True)), rec)
    gflop, batch_keys = None, next(keys, None)
    if batch_keys is not None and not errors:
        batch = loader.collate_fn([loader.dataset[k] for k in batch_keys])

        def step() -> None:
            state["text_fwd"] = model.forward_text(batch["input_ids"], batch["attention_mask"])
            state["image_fwd"], state["collate"] = model.forward_image(batch["pixels"]), batch
            _loss(losses, model, state, cfg).backward()
        gflop = gemm_gflop(step)
        opt.zero_grad(set_to_none=True)
    return ({p: statistics.median(times[p]) if times[p] and p not in errors else None for p in PIECES}, errors,
            gflop)


def gemm_gflop(fn) -> float:
    """GFLOP of the matrix products (``GEMM_OPS``) that ``fn()`` runs, as torch.profiler counts them."""
    from torch.profiler import profile

    with profile(with_flops=True) as prof:
        fn()
    return sum(e.flops for e in prof.key_averages() if e.key in GEMM_OPS) / 1e9


def _loss(losses, model, state: dict, cfg):
    """The training step's loss; caption negatives (rows past ``num_captions``) go in as train.py passes them."""
    text, image, batch = state["text_fwd"], state["image_fwd"], state["collate"]
    args = (cfg.loss.global_weight, cfg.loss.local_loss)
    B = int(batch["num_captions"]) if "num_captions" in batch else len(text)
    if B < len(text):
        return losses.contrastive_loss(model, text[:B], image, *args, text[B:])["loss"]
    return losses.contrastive_loss(model, text, image, *args)["loss"]


# ---------------------------------------------------------------------------------------------- parent process
def git(args: list[str], cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def describe(checkout: Path) -> str:
    """HEAD of a checkout, with "+dirty" when its tree has uncommitted changes ("unknown" outside git)."""
    try:
        return git(["rev-parse", "HEAD"], checkout) + ("+dirty" if git(["status", "--porcelain"], checkout) else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def materialise(ref: str) -> tuple[Path, bool]:
    """(checkout dir, whether it is a worktree made here): a directory as is, else ``git worktree add`` of REF."""
    if Path(ref).is_dir():
        if not (Path(ref) / "train.py").is_file():
            raise SystemExit(f"--compare {ref}: directory has no train.py, so it is not a checkout of this project")
        return Path(ref).resolve(), False
    try:
        git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], ROOT)
    except subprocess.CalledProcessError:
        raise SystemExit(f"--compare {ref}: neither a directory nor a commit, tag or branch of {ROOT}") from None
    path = Path(tempfile.gettempdir()) / f"train_speed-{uuid.uuid4().hex[:8]}"
    log(f"git worktree add --detach {path} {ref}")
    git(["worktree", "add", "--detach", str(path), ref], ROOT)
    return path, True


def measure(checkout: Path, args: argparse.Namespace, overrides: list[str], tmp: Path) -> dict:
    out_dir = Path(tempfile.mkdtemp(dir=tmp))
    spec = {"checkout": str(checkout), "config": args.config, "overrides": overrides, "steps": args.steps,
            "warmup": args.warmup, "batches": args.batches, "out_dir": str(out_dir), "launch": time.time()}
    (out_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # nothing written into the checkout
    with open(out_dir / "log.txt", "w") as logf:
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(out_dir / "spec.json")],
                            cwd=checkout, env=env, stdout=logf, stderr=subprocess.STDOUT).returncode
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


def median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    from cpu_score import gemm_peak  # this script's folder is sys.path[0] in the parent

    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/synthetic.yaml", help="relative to each checkout measured")
    p.add_argument("--steps", type=int, default=None, help="steady-state steps measured (default 40; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before them, not measured (default 10; --tiny 1)")
    p.add_argument("--compare", metavar="REF", help="commit, tag, branch or checkout directory to compare against")
    p.add_argument("--repeats", type=int, default=None, help="runs per checkout, interleaved (default 2; --tiny 1)")
    p.add_argument("--batches", type=int, default=None, help="batches timed for the breakdown (default 3; --tiny 1)")
    p.add_argument("--tiny", action="store_true", help="smoke size: " + " ".join(TINY))
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    for name, tiny, full in (("steps", 3, 40), ("warmup", 1, 10), ("batches", 1, 3), ("repeats", 1, 2)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.tiny else full)
    if a.steps < 2 or a.warmup < 0 or a.repeats < 1 or a.batches < 1:
        raise SystemExit("need --steps >= 2 (periods between batch starts), --warmup >= 0, --repeats >= 1, "
                         "--batches >= 1")
    overrides = (TINY if a.tiny else []) + overrides
    checkouts, made = {"current": ROOT}, None
    if a.compare:
        checkouts = {"ref": None, "current": ROOT}
        checkouts["ref"], is_new = materialise(a.compare)
        made = checkouts["ref"] if is_new else None
    runs: dict[str, list[dict]] = {k: [] for k in checkouts}
    commits = {k: describe(v) for k, v in checkouts.items()}  # before the worktree goes
    try:
        with tempfile.TemporaryDirectory(prefix="train_speed-") as tmp:
            for r in range(a.repeats):
                for label, checkout in checkouts.items():
                    log(f"repeat {r + 1}/{a.repeats} {label} ({checkout}): {a.warmup}+{a.steps} steps + breakdown")
                    runs[label].append(measure(checkout, a, overrides, Path(tmp)))
                    log(f"  {runs[label][-1]['samples_per_s']:.1f} samples/s")
    finally:
        if made is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(made)], cwd=ROOT, capture_output=True)
    peak = gemm_peak(runs["current"][0]["threads"])  # after the runs: the children are gone, the cores are free
    for run in (r for rs in runs.values() for r in rs):
        if run.get("gemm_gflop"):
            run["gemm_floor_ms"] = run["gemm_gflop"] / peak * 1e3
            run["ceiling_samples_per_s"] = run["batch_size"] / run["gemm_floor_ms"] * 1e3
    med = {k: {key: median(runs[k], key) for key, _ in ROWS} for k in checkouts}
    ratio = {key: med["current"][key] / med["ref"][key] for key, _ in ROWS
             if "ref" in med and med["ref"][key] and med["current"][key] is not None}
    first = runs["current"][0]
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "config": a.config, "overrides": overrides,
              "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "batch_size": first["batch_size"],
              "torch": first["torch"], "threads": first["threads"], "cpu": cpu_model(), "cpus": os.cpu_count(),
              "checkouts": {k: {"path": str(v), "commit": commits[k], "runs": runs[k], "median": med[k]}
                            for k, v in checkouts.items()},
              "ratio": ratio, "ratio_samples_per_s": ratio.get("samples_per_s"), "gemm_peak_gflops": peak}
    cols = list(checkouts)
    head = [f"{k} `{commits[k][:7]}{'+dirty' if commits[k].endswith('+dirty') else ''}`" for k in cols]
    print(f"\ntrain speed of {a.config}, {a.warmup}+{a.steps} steps, batch {first['batch_size']}, median of "
          f"{a.repeats} run(s); torch {first['torch']}, {first['threads']} threads, {cpu_model()}\n")
    print("| quantity | " + " | ".join(head) + (" | current/ref |" if "ref" in cols else " |"))
    print("|---" * (len(cols) + 1 + ("ref" in cols)) + "|")
    for key, name in ROWS:
        cells = [fmt(med[k][key]) for k in cols] + ([fmt(ratio.get(key))] if "ref" in cols else [])
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nfp32 GEMM peak here: {peak:.0f} GFLOP/s on {first['threads']} thread(s) (best of five 2048^3 matmuls); "
          "'GEMMs alone at peak' = the step's profiled GEMM work at that rate, a floor no implementation of the "
          "same step goes under on this CPU")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
        print(f"\njson: {a.json}")
    else:
        print("\n" + json.dumps({"commits": commits, "median": med, "ratio": ratio}, separators=(",", ":")))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        spec_path = Path(sys.argv[2])
        res = child(json.loads(spec_path.read_text()))
        (spec_path.parent / "result.json").write_text(json.dumps(res))
    else:
        start = time.time()
        main()
        log(f"done in {time.time() - start:.0f} s")
