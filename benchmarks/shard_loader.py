"""The shard loader alone (no model) against the model's training step: is reading shards the bottleneck?

    python -m benchmarks.shard_loader [--config configs/synthetic.yaml] [--images 2000] [--per-shard 250]
                                      [--workers 2] [--steps 25] [--json out.json] [-- --a.b value ...]
    python -m benchmarks.shard_loader --images 64 --per-shard 16 --steps 3 --model-steps 2   # smoke run, seconds

Writes the first --images images of the shapes world's train split as PNG shards (``mmgeo.data.make_shards``, at the
config model's input size) into a temporary folder, then measures, in this process:

- shard loader: ``ShardLoader`` as train.py builds it (--workers loader processes; decode, the model's preprocess,
  caption draw and negatives, tokenisation, collation), batches per second after the first (worker start-up
  excluded), over --steps batches of the config's batch size;
- map-style loader: the same over the in-memory shapes world (``ResumableLoader``, images drawn on the fly);
- model step: forward, loss (with the caption negatives), backward and AdamW on one batch from the shard loader,
  median of --model-steps after two warm-ups, with torch's threads (--threads, 0 = torch's default).

Samples/s = batch size × batches/s (wall clock). On a shared machine wall time follows the load, so the CPU seconds
per step are given too (loader: workers and main process over the whole read, worker start-up included; model:
all its threads): the loader keeps up when it needs fewer CPU seconds per step than the step itself, and its
samples/s exceeds the step's.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import tempfile
import time

from benchmarks.harness import add_json, environment, logger, markdown_table, measured_on, write_json

log = logger("shard_loader")


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its finished children (the loader's workers, once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def loader_rate(loader, steps: int) -> tuple[float, float]:
    """(batches/s of ``loader`` over ``steps`` batches after its first, CPU seconds per batch of the whole epoch
    read: workers and main process, start-up included)."""
    cpu = cpu_seconds()
    it = iter(loader)
    next(it)  # worker start-up and the first shard
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    rate = steps / (time.perf_counter() - start)
    del it  # joins the workers: their CPU time is counted
    gc.collect()
    return rate, (cpu_seconds() - cpu) / (steps + 1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic.yaml")
    p.add_argument("--images", type=int, default=2000, help="shapes-world train images written to shards")
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes")
    p.add_argument("--steps", type=int, default=25, help="loader batches timed")
    p.add_argument("--model-steps", type=int, default=5, help="model steps timed")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the model step (0 = default)")
    add_json(p)
    args, overrides = p.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]

    import torch

    from mmgeo.data import ShapesWorld
    from mmgeo.data.make_shards import write_shards
    from mmgeo.data.pairs import open_split
    from mmgeo.training.config import load_train_config
    from mmgeo.training.loop import build_loader
    from mmgeo.training.losses import contrastive_loss
    from mmgeo.training.module import RetrievalModule

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_train_config(args.config, overrides + ["--data.num_workers", str(args.workers)])
    batch = cfg.trainer.batch_size
    if args.images < batch * (args.steps + 2):
        p.error(f"--images {args.images} is too few for {args.steps + 2} batches of {batch}")
    torch.manual_seed(0)
    module = RetrievalModule(cfg)
    size = module.model.cfg.image_size
    with tempfile.TemporaryDirectory(prefix="mmgeo-shards-") as tmp:
        start = time.time()
        world = ShapesWorld("train", seed=cfg.data.seed, image_size=size, size=args.images)
        pattern = write_shards((world[i] for i in range(len(world))), tmp, args.per_shard)
        log(f"wrote {args.images} images to {pattern} in {time.time() - start:.0f} s")
        cfg.data.name, cfg.data.shards, cfg.data.samples_per_epoch = "webdataset", pattern, args.images
        shard_loader = build_loader(cfg, module, open_split(cfg.data, "train", None, size))
        shard_bps, shard_cpu = loader_rate(shard_loader, args.steps)
        log(f"shard loader: {shard_bps * batch:.0f} samples/s")
        cfg.data.name = "synthetic"
        map_loader = build_loader(cfg, module, open_split(cfg.data, "train", args.images, size))
        map_loader.progress = lambda: 0
        map_bps, map_cpu = loader_rate(map_loader, args.steps)
        log(f"map-style loader: {map_bps * batch:.0f} samples/s")
        one = next(iter(shard_loader))

    model = module.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B = int(one["num_captions"])

    def step() -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        text, image = model(one["input_ids"], one["attention_mask"], one["pixels"])
        losses = contrastive_loss(model, text[:B], image, cfg.loss.global_weight, False,
                                  text[B:] if len(text) > B else None, cfg.loss.distill_weight)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        opt.step()
        return time.perf_counter() - t, time.process_time() - c

    step(), step()
    timed = [step() for _ in range(args.model_steps)]
    model_s, model_cpu = statistics.median(t for t, _ in timed), statistics.median(c for _, c in timed)
    log(f"model step: {batch / model_s:.0f} samples/s")
    env = environment()
    rows = [["shard loader alone", f"{args.workers} workers", f"{shard_bps * batch:,.0f}", f"{shard_bps:.2f}",
             f"{shard_cpu:.2f}", f"{batch / shard_cpu:,.0f}"],
            ["map-style loader alone (shapes world)", f"{args.workers} workers", f"{map_bps * batch:,.0f}",
             f"{map_bps:.2f}", f"{map_cpu:.2f}", f"{batch / map_cpu:,.0f}"],
            ["model step (fwd + loss + bwd + AdamW)", f"{torch.get_num_threads()} threads", f"{batch / model_s:,.0f}",
             f"{1 / model_s:.2f}", f"{model_cpu:.2f}", f"{batch / model_cpu:,.0f}"]]
    print(f"{cfg.model}, batch {batch}, caption_negatives {cfg.data.caption_negatives}, {size} px; "
          f"{args.images} images in shards of {args.per_shard}. {measured_on(env)}")
    print(markdown_table(["what", "on", "samples/s", "steps/s", "CPU s per step", "samples per CPU s"], rows,
                         "llrrrr"))
    out = {"config": args.config, "batch": batch, "workers": args.workers, "images": args.images,
           "shard_loader_samples_per_s": shard_bps * batch, "map_loader_samples_per_s": map_bps * batch,
           "model_samples_per_s": batch / model_s, "shard_loader_cpu_s_per_step": shard_cpu,
           "map_loader_cpu_s_per_step": map_cpu, "model_cpu_s_per_step": model_cpu, "environment": env}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
