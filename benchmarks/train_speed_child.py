"""The child process of ``benchmarks/train_speed.py``: one measurement of training speed inside the checkout measured.

    python -c "<harness.run_in_checkout>" benchmarks/train_speed_child.py SPEC_JSON   # started by train_speed

The parent starts this file with the checkout as the working directory, which is first on sys.path, so ``mmgeo``
(and ``train`` in checkouts from before mmgeo.training) are that checkout's, whatever commit it is. So this file
imports nothing from ``benchmarks`` (that package may not exist there, or be another version of it): only the
standard library at import time, torch, Lightning and the checkout's mmgeo inside the functions. Writes
``result.json`` next to the spec.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
import types
import uuid
from pathlib import Path

PARTS = ("text_fwd", "image_fwd", "loss", "backward", "optimizer")  # Lightning's in-step work
PIECES = ("data", "collate", *PARTS)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::conv2d")  # ops the profiler counts FLOPs of


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
    """One measurement inside the checkout ``spec["checkout"]``: the working directory, first on sys.path (the parent
    starts this file with ``benchmarks.harness.run_in_checkout``)."""
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
        piece("loss", lambda: _loss(losses, module, state, cfg), rec)
        piece("backward", lambda: state["loss"].backward(), rec)
        piece("optimizer", lambda: (opt.step(), opt.zero_grad(set_to_none=True)), rec)
    gflop, batch_keys = None, next(keys, None)
    if batch_keys is not None and not errors:
        batch = loader.collate_fn([loader.dataset[k] for k in batch_keys])

        def step() -> None:
            state["text_fwd"] = model.forward_text(batch["input_ids"], batch["attention_mask"])
            state["image_fwd"], state["collate"] = model.forward_image(batch["pixels"]), batch
            _loss(losses, module, state, cfg).backward()
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


def _loss(losses, module, state: dict, cfg):
    """The training step's loss, every term of it (``RetrievalModule.loss_terms``); a checkout from before that
    method: its contrastive loss with the caption negatives (rows past ``num_captions``) as its train.py passed them."""
    text, image, batch = state["text_fwd"], state["image_fwd"], state["collate"]
    if hasattr(module, "loss_terms"):
        return module.loss_terms(text, image, batch)["loss"]
    model, args = module.model, (cfg.loss.global_weight, cfg.loss.local_loss)
    B = int(batch["num_captions"]) if "num_captions" in batch else len(text)
    if B < len(text):
        return losses.contrastive_loss(model, text[:B], image, *args, text[B:])["loss"]
    return losses.contrastive_loss(model, text, image, *args)["loss"]


def main(argv: list[str] | None = None) -> None:
    spec_path = Path((sys.argv[1:] if argv is None else argv)[0])
    res = child(json.loads(spec_path.read_text()))
    (spec_path.parent / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
