"""Diagnostics from the paper's troubleshooting table (docs/design.md §3, §8), as a plain JSON-able dict.

``diagnose(model, texts, images, text_to_image)`` looks at the attention of each caption over its own
image and at the Q/K map weights:

- attention entropy per head: mean over real tokens of H(softmax_j(scale·<q_t, k_j>)). Below 0.5·ln 2
  = collapsed / over-concentrated; above 0.95·ln S = near-uniform (attention selects nothing).
- singular values and effective rank (exp of the entropy of the normalised singular values, Roy &
  Vetterli 2007) of the Q map (``query_mlp.fc2``) and K map (``key_head.proj``): a few dominant
  singular values = collinear weights (checkerboard heatmaps).
- head redundancy: cosine similarity between heads' attention maps, centred by the uniform 1/S so
  that two unrelated near-uniform heads do not read as alike; 1 = identical heads.
- logit range: min / max of scale·<q, k> and mean / std of q and k; large logits are the NaN precursor.

Each threshold crossed raises ``warnings.warn`` with the symptom, likely cause and fix, and is listed
under "warnings". ``orthogonality_penalty`` is the regulariser Σ ||W Wᵀ − I||²_F used as a training aid.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from mmgeo.kernels import attention_logits, attention_weights

COLLAPSE_ENTROPY = 0.5 * math.log(2)  # paper: entropy below this for long = collapsed / over-concentrated
UNIFORM_FRACTION = 0.95  # entropy above this fraction of ln S = near-uniform
MIN_RANK_FRACTION = 0.25  # effective rank below this fraction of the full rank = collinear Q/K weights
REDUNDANT_HEADS = 0.9  # cosine between two heads' (centred) attention maps above this = heads alike
LOGIT_LIMIT = 200.0  # |scale·<q, k>| above this = logit explosion, the NaN precursor. Healthy runs learn sharp
# attention and level off at 40-75 (the highest peak measured: 104, at twice the default learning rate;
# docs/design.md §8); an explosion grows by orders of magnitude, toward fp16's overflow (65,504)


def orthogonality_penalty(w: torch.Tensor) -> torch.Tensor:
    """||W Wᵀ − I||²_F on the smaller Gram side of a 2-D weight (docs/design.md §8: fix for collinear Q/K maps)."""
    w = w.view(w.shape[0], -1)
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w  # (m, m), m = min(out, in)
    return (gram - torch.eye(gram.shape[0], device=w.device, dtype=w.dtype)).pow(2).sum()


def attention_entropy(attn: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """attn (N, H, T, S) probabilities over S, token_mask (N, T) bool -> (H,) mean entropy over real tokens."""
    ent = -torch.where(attn > 0, attn * attn.clamp_min(1e-30).log(), torch.zeros_like(attn)).sum(-1)  # (N, H, T)
    w = token_mask.to(ent.dtype).unsqueeze(1)  # (N, 1, T)
    return (ent * w).sum(dim=(0, 2)) / w.sum().clamp_min(1)


def head_redundancy(attn: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """attn (N, H, T, S), token_mask (N, T) -> (H, H) cosine similarity of the heads' centred attention maps."""
    centred = (attn - 1.0 / attn.shape[-1]) * token_mask[:, None, :, None]  # (N, H, T, S), padding zeroed
    flat = F.normalize(centred.transpose(0, 1).reshape(attn.shape[1], -1), dim=-1, eps=1e-12)  # (H, N·T·S)
    return flat @ flat.T


def spectrum(w: torch.Tensor) -> dict:
    """Singular values of a 2-D weight and its effective rank exp(H(σ / Σσ))."""
    s = torch.linalg.svdvals(w.detach().double().view(w.shape[0], -1))  # (min(out, in),) descending
    p = s / s.sum().clamp_min(1e-300)
    erank = math.exp(float(-(p * p.clamp_min(1e-300).log()).sum()))
    return {"singular_values": [round(float(x), 6) for x in s], "effective_rank": erank, "full_rank": len(s),
            "top_share": float(p[0]) if len(p) else 0.0}


def _warn(out: list[str], msg: str) -> None:
    out.append(msg)
    warnings.warn(msg, stacklevel=4)  # the caller of diagnose_tensors


def diagnose_tensors(q, q_mask, k, k_mask, weights: dict[str, torch.Tensor] | None = None,
                     scale: float | None = None, warn: bool = True) -> dict:
    """Diagnostics of matched (caption, image) pairs: q (N, H, T, d_a), q_mask (N, T), k (N, H, S, d_a),
    k_mask (N, S); ``weights`` = Q/K maps for the spectrum. Returns the report dict."""
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be matched pairs (same N, H, d_a); "
                         "index the images by text_to_image first")
    q, k = q.detach().float(), k.detach().float()
    logits = attention_logits(q, k, scale)  # (N, H, T, S)
    patch_ok = k_mask[:, None, None, :]  # (N, 1, 1, S)
    attn = attention_weights(q, k, k_mask[:, None].expand(-1, q.shape[1], -1), scale)  # (N, H, T, S)
    real_logits = logits[(q_mask[:, None, :, None] & patch_ok).expand_as(logits)]
    n_patches = float(k_mask.sum(1).float().mean())
    ent = attention_entropy(attn, q_mask)  # (H,)
    red = head_redundancy(attn, q_mask)  # (H, H)
    H = red.shape[0]
    off = red[~torch.eye(H, dtype=torch.bool, device=red.device)] if H > 1 else red.new_zeros(1)
    report = {
        "entropy": {"per_head": [float(e) for e in ent], "mean": float(ent.mean()), "uniform": math.log(n_patches),
                    "collapse_threshold": COLLAPSE_ENTROPY},
        "head_redundancy": {"matrix": [[float(x) for x in row] for row in red], "max": float(off.max())},
        "logits": {"min": float(real_logits.min()), "max": float(real_logits.max()),
                   "q_mean": float(q.mean()), "q_std": float(q.std()),
                   "k_mean": float(k.mean()), "k_std": float(k.std())},
        "spectrum": {name: spectrum(w) for name, w in (weights or {}).items()},
    }
    report["warnings"] = _check(report, warn)
    return report


def _check(r: dict, warn: bool) -> list[str]:
    out: list[str] = []
    emit = _warn if warn else (lambda o, m: o.append(m))
    for h, e in enumerate(r["entropy"]["per_head"]):
        if e < COLLAPSE_ENTROPY:
            emit(out, f"head {h}: attention entropy {e:.3f} < 0.5·ln2 — collapsed / over-concentrated attention; "
                      "likely d_a too small or exploding logits; fix: raise d_a in steps of 16, check the logit range")
        elif e > UNIFORM_FRACTION * r["entropy"]["uniform"]:
            emit(out, f"head {h}: attention entropy {e:.3f} ≈ ln S = {r['entropy']['uniform']:.3f} — near-uniform "
                      "attention (selects nothing); likely d_a too small or Q/K not trained yet; fix: raise d_a, "
                      "train longer, avoid squashing activations in the maps")
    if r["head_redundancy"]["max"] > REDUNDANT_HEADS:
        emit(out, f"heads alike: attention-map cosine {r['head_redundancy']['max']:.3f} > {REDUNDANT_HEADS} — "
                  "heads share one effective Q/K map; fix: separate per-head maps, orthogonality regulariser")
    lo, hi = r["logits"]["min"], r["logits"]["max"]
    if not (math.isfinite(lo) and math.isfinite(hi)) or max(abs(lo), abs(hi)) > LOGIT_LIMIT:
        emit(out, f"logit range [{lo:.1f}, {hi:.1f}] beyond ±{LOGIT_LIMIT:g} — logit explosion, NaN precursor; "
                  "likely Q/K init; fix: orthogonal init gain 0.05–0.1 (model_args.qk_init_gain), "
                  "or LayerNorm after Q/K")
    for name, s in r["spectrum"].items():
        if s["effective_rank"] < MIN_RANK_FRACTION * s["full_rank"]:
            emit(out, f"{name} map: effective rank {s['effective_rank']:.1f} of {s['full_rank']} — a few singular "
                      "values dominate (collinear Q/K weights, checkerboard heatmaps); fix: dropout 0.1 after the "
                      "maps or the orthogonality loss (aids.ortho_weight)")
    return out


@torch.no_grad()
def diagnose(model, texts, images, text_to_image: torch.Tensor | None = None, warn: bool = True) -> dict:
    """Diagnostics of a geometric model on encoded captions ``texts`` and images ``images`` (Embeddings).

    Each caption is paired with its own image ``images[text_to_image[i]]`` (default: the i-th image).
    """
    if texts.attn is None or images.attn is None:
        raise ValueError("diagnostics need geometric embeddings (q, k); this model is global-only")
    idx = torch.arange(len(texts)) if text_to_image is None else text_to_image.long()
    if len(idx) != len(texts) or int(idx.max()) >= len(images):
        raise ValueError(f"text_to_image must give one image index < {len(images)} per caption ({len(texts)})")
    idx = idx.to(images.attn.device)
    return diagnose_tensors(texts.attn, texts.mask, images.attn[idx], images.mask[idx], model.qk_maps(),
                            warn=warn)


def scalars(report: dict, prefix: str = "diag/") -> dict[str, float]:
    """Flat scalars of a report for a metrics logger."""
    out = {f"{prefix}entropy_head{h}": e for h, e in enumerate(report["entropy"]["per_head"])}
    out[f"{prefix}entropy_mean"] = report["entropy"]["mean"]
    out[f"{prefix}head_redundancy_max"] = report["head_redundancy"]["max"]
    out.update({f"{prefix}logit_{k}": report["logits"][k] for k in ("min", "max")})
    for name, s in report["spectrum"].items():
        out[f"{prefix}erank_{name}"] = s["effective_rank"]
        out[f"{prefix}top_sv_share_{name}"] = s["top_share"]
    return out


@torch.no_grad()
def nonfinite_cause(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: torch.Tensor) -> str:
    """The likely cause of a non-finite loss on this batch, from the troubleshooting table (docs/design.md §8).

    Checked in order: the inputs, the weights, the towers' features, the attention logit range (the
    paper's NaN precursor), the temperatures; the first finding is returned as "cause; fix".
    """
    if not torch.isfinite(pixels).all():
        bad = int((~torch.isfinite(pixels)).flatten(1).any(1).sum())
        return (f"the batch itself holds non-finite pixel values ({bad} of {len(pixels)} images): corrupt data or a "
                "broken transform; fix: check the dataset / preprocessing")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        return (f"weights are non-finite ({', '.join(bad[:4])}{' …' if len(bad) > 4 else ''}): an update diverged; "
                "fix: resume from an earlier checkpoint with a lower optim.lr or layered clipping (aids.clip_qk)")
    was_training = model.training
    model.eval()
    text, image = model(input_ids, attention_mask, pixels)
    model.train(was_training)
    feats = {"text": text, "image": image}
    for side, e in feats.items():
        if any(x is not None and x.is_floating_point() and not torch.isfinite(x).all()
               for x in (e.pooled, e.attn, e.value)):
            return (f"the {side} tower outputs non-finite features: activations overflow; fix: trainer.precision "
                    "32-true (or bf16-mixed instead of 16-mixed), a lower optim.lr")
    if model.geometric:
        n = min(len(text), len(image))
        r = diagnose_tensors(text.attn[:n], text.mask[:n], image.attn[:n], image.mask[:n], warn=False)
        lo, hi = r["logits"]["min"], r["logits"]["max"]
        if not (math.isfinite(lo) and math.isfinite(hi)) or max(abs(lo), abs(hi)) > LOGIT_LIMIT:
            return (f"attention logits explode (range [{lo:.3g}, {hi:.3g}], beyond ±{LOGIT_LIMIT:g}; q std "
                    f"{r['logits']['q_std']:.3g}, k std {r['logits']['k_std']:.3g}): Q/K init → logit explosion; "
                    "fix: orthogonal Q/K init gain 0.05–0.1 (model_args.qk_init_gain), LayerNorm after the Q/K maps, "
                    "lower optim.lr")
    scales = {n: float(p.exp()) for n, p in model.named_parameters() if n.startswith("logit_scale")}
    if any(s >= 100.0 for s in scales.values()):
        return (f"a temperature sits at its clamp ({scales}): the logits are as sharp as allowed and the loss "
                "saturates; fix: lower optim.lr or a higher init temperature")
    return ("inputs, weights, features and attention logits are finite and in range: the loss or its gradient "
            "overflowed in reduced precision; fix: trainer.precision 32-true, a lower optim.lr")
