"""The model sections of ``benchmarks.gpu_check`` (training, evaluation): whole models on the GPU, as that module's
docstring describes; run by it, one section per process."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_check_inputs import TINY, empty_cache, timed


def model_overrides(dry: bool) -> tuple[dict, str]:
    """ModelConfig overrides that need no download, and what they imply."""
    o = dict(image_pretrained=False, text_pretrained=False)
    if dry:
        return dict(o, **TINY, text_backbone="scratch", text_vocab=[f"w{i}" for i in range(50)]), "tiny (tests' TINY)"
    try:
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained("bert-base-uncased")
        AutoTokenizer.from_pretrained("bert-base-uncased")
        return o, "random init (bert-base-uncased config from the local cache)"
    except OSError:
        o.update(text_backbone="scratch", text_vocab=[f"w{i}" for i in range(30_518)], text_hidden=768,
                 text_layers=12, text_heads=12)
        return o, ("bert-base-uncased not in the local HF cache: random-init BERT-base-sized scratch text tower "
                   "(hidden 768, 12 layers, 12 heads, 30,522 tokens)")


def train_loop(sec, step, dev, steps: int, warmup: int, share_s: float) -> dict:
    """Warm-up steps, then up to ``steps`` timed steps within ``share_s``: samples/s inputs and peak memory."""
    import torch

    for _ in range(warmup):
        step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, done = time.perf_counter(), 0
    while done < steps and (done == 0 or (time.perf_counter() - t0) * (done + 1) / done < share_s):
        step()
        done += 1
        if cuda and done == 1:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"steps": done, "seconds": secs, "steps_per_s": done / secs, "peak_gib": peak,
            "status": "ok" if done == steps else "partial: section budget"}


def section_training(sec, dev, dry: bool) -> None:
    import torch

    import mmgeo
    from mmgeo.kernels import use_triton
    from mmgeo.training.losses import retrieval_loss

    os.environ["MMGEO_KERNELS"] = "auto"
    batch, steps, warmup = (4, 2, 1) if dry else (256, 100, 3)
    T = 8 if dry else 32
    overrides, note = model_overrides(dry)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16)
    for name in ("geo-vitb16-bert", "clip-vitb16-bert"):
        def go(name=name):
            torch.manual_seed(0)
            model = mmgeo.create_model(name, **overrides).to(dev).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            vocab = model.text_encoder.config.vocab_size
            ids = torch.randint(5, vocab, (batch, T), device=dev)  # (B, T)
            att = (torch.arange(T, device=dev)[None] < torch.randint(2, T + 1, (batch, 1), device=dev)).long()
            px = torch.randn(batch, 3, model.cfg.image_size, model.cfg.image_size, device=dev)  # (B, 3, H, W)

            def step():
                with torch.autocast(**amp):
                    loss = retrieval_loss(model.logits(*model(ids, att, px)))["loss"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            with torch.autocast(**amp), torch.no_grad():  # what the score gets under autocast
                t, i = model(ids, att, px)
            dtypes = {"score_inputs": [str(x.dtype)[6:] for x in (t.attn, t.value, i.attn, i.value)],
                      "pair_score_path": "triton" if use_triton("pair_score", t.attn, t.value, i.attn, i.value)
                      else "reference"} if model.geometric else {}
            r = train_loop(sec, step, dev, steps, warmup, sec.left() / (3 if "geo" in name else 2) - 10)
            return {**r, **dtypes, "samples_per_s": r["steps_per_s"] * batch}

        sec.run({"model": name, "batch": batch, "tokens": T, "note": note}, go, need_s=20)
        empty_cache()

    def openclip():
        import open_clip

        arch = "ViT-B-16"
        if dry:
            from tests.openclip_tiny import register  # the repository root is the working directory

            arch = register(Path(tempfile.mkdtemp(prefix="gpu-check-oc-")))
        torch.manual_seed(0)
        model = open_clip.create_model(arch).to(dev).train()
        opt, loss_fn = torch.optim.AdamW(model.parameters(), lr=1e-4), open_clip.ClipLoss()
        size, ctx = model.visual.image_size, model.context_length
        px = torch.randn(batch, 3, *((size,) * 2 if isinstance(size, int) else size), device=dev)
        text = torch.randint(1, 49_407, (batch, ctx), device=dev)  # (B, context)

        def step():
            with torch.autocast(**amp):
                out = model(px, text)
                feats = (out["image_features"], out["text_features"], out["logit_scale"]) \
                    if isinstance(out, dict) else out[:3]
                loss = loss_fn(*feats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        r = train_loop(sec, step, dev, steps, warmup, sec.left() - 10)
        return {**r, "samples_per_s": r["steps_per_s"] * batch, "model": f"open_clip {arch}", "tokens": ctx}

    sec.run({"model": "open_clip ViT-B-16", "batch": batch, "note": "random init, open_clip.ClipLoss"}, openclip,
            need_s=15)


# -------------------------------------------------------------------------------------------------- evaluation


class ScoreOnly:
    """What scoring and the gallery read of a model (its config, geometric flag; no coverage term), scored by
    GeoRetriever.score."""

    def __init__(self, cfg):
        self.cfg, self.geometric = cfg, True
        self.salience = self.coverage_term = None  # the score is s alone (docs/design.md §2)

    def score(self, text, image, mode="geometric"):
        from mmgeo.models.geo_retriever import GeoRetriever

        return GeoRetriever.score(self, text, image, mode)


def section_evaluation(sec, dev, dry: bool) -> None:
    import torch

    from benchmarks.gpu_check_inputs import random_embedding
    from mmgeo.eval.retrieval import EncodedSplit
    from mmgeo.eval.two_stage import evaluate_split
    from mmgeo.kernels import use_triton
    from mmgeo.models.registry import model_config
    from mmgeo.search.build import build_gallery_from_embedding
    from mmgeo.search.store import Gallery

    os.environ["MMGEO_KERNELS"] = "auto"
    cfg = model_config("geo-vitb16-bert", image_pretrained=False, text_pretrained=False, **(TINY if dry else {}))
    H, S, T = cfg.num_heads, (cfg.image_size // cfg.patch_size) ** 2, 8 if dry else 32
    model = ScoreOnly(cfg)
    dtype = torch.float32 if dry else torch.bfloat16
    n_t, n_i = (20, 10) if dry else (5_000, 1_000)

    def exact():
        texts = random_embedding(n_t, H, T, cfg.d_a, cfg.d_e, cfg.d_global, dtype, dev, 0, min_len=4)
        images = random_embedding(n_i, H, S, cfg.d_a, cfg.d_e, cfg.d_global, dtype, dev, 1)
        with torch.inference_mode():
            ms = timed(lambda: model.score(texts, images), dev, budget_s=10)
        path = "triton" if use_triton("pair_score", texts.attn, texts.value, images.attn, images.value) else "reference"
        return {"seconds": ms / 1e3, "pairs_per_s": n_t * n_i / ms * 1e3, "pair_score_path": path}

    sec.run({"what": "exact geometric score", "captions": n_t, "images": n_i, "H": H, "T": T, "S": S,
             "d_a": cfg.d_a, "dtype": str(dtype)[6:], "device": dev.type}, exact, need_s=5)
    n_t, n_i, kp = (20, 10, 5) if dry else (1_000, 1_000, 100)

    def two_stage():
        texts = random_embedding(n_t, H, T, cfg.d_a, cfg.d_e, cfg.d_global, torch.float32, "cpu", 2, min_len=4)
        images = random_embedding(n_i, H, S, cfg.d_a, cfg.d_e, cfg.d_global, torch.float32, "cpu", 3)
        split = EncodedSplit(texts, images, torch.arange(n_t) % n_i)
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            t0 = time.perf_counter()
            build_gallery_from_embedding(model, images, Path(tmp) / "index", index_type="flat")
            t1 = time.perf_counter()
            scores, rec = evaluate_split(model, split, k_prime=kp, gallery=Gallery(Path(tmp) / "index"),
                                         progress=False)
            t2 = time.perf_counter()
        assert scores.shape == (n_t, n_i)
        return {"build_s": t1 - t0, "seconds": t2 - t1, "queries_per_s": n_t / (t2 - t1),
                "index_type": rec["two_stage"]["index_type"]}

    sec.run({"what": "two-stage (flat FAISS top-K', CPU re-rank)", "captions": n_t, "images": n_i, "k_prime": kp,
             "H": H, "T": T, "S": S, "d_a": cfg.d_a, "dtype": "float32 (fp16 stored)", "device": "cpu"},
            two_stage, need_s=5)
