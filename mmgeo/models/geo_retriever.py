"""GeoRetriever: one attention space, two operators (docs/design.md §2).

Text tokens -> queries q (M_Q, position-aware MLP) and values u; image patches -> keys k (M_K,
conv / channel-attention head) and values v (P_V). The geometric score lets every caption token
attend over the image's patches and collects <û, v̂> there (``mmgeo.kernels.pair_score``); the
global score is a cosine between pooled vectors and is what FAISS indexes. With
``score="global"`` the geometric heads are not built: the CLIP baseline on the same towers.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from mmgeo.kernels import pair_score, use_triton
from mmgeo.kernels.coverage import coverage, score_and_coverage
from mmgeo.layers import (
    ConvChannelAttentionKeyHead,
    LowRankMapping,
    PatchSalience,
    PhraseWindow,
    PositionAwareTextMLP,
    ValueProjection,
)
from mmgeo.models.config import ModelConfig
from mmgeo.models.embedding import Embedding, check_texts
from mmgeo.models.towers import (
    build_image_tower,
    build_text_tower,
    image_transform,
    patch_tokens,
    resolve_preprocessing,
    token_states,
)

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(logit_scale)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of ``x`` over ``dim`` where ``mask`` (broadcastable to ``x`` without its last axis) is true."""
    m = mask[..., None].to(x.dtype)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


class GeoRetriever(nn.Module):
    """Dual-tower retrieval model with a geometric (token × patch) score and a global score."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = dataclasses.replace(cfg)  # own copy: preprocessing is resolved into it
        self.text_encoder, self.tokenizer, text_dim = build_text_tower(cfg)
        self.image_encoder = build_image_tower(cfg)
        resolve_preprocessing(cfg, self.image_encoder)
        self.cfg = cfg
        self.preprocess = image_transform(cfg)
        image_dim, grid = self.image_encoder.num_features, self.patch_grid
        from_values = cfg.global_pool == "values"  # the global vectors pool the values û / v̂ (H·d_e each)
        self.text_global = nn.Linear(cfg.num_heads * cfg.d_e if from_values else text_dim, cfg.d_global)
        self.image_global = nn.Linear(cfg.num_heads * cfg.d_e if from_values else image_dim, cfg.d_global)
        if from_values:  # one orthogonal map for both: <W ū, W v̄> = <ū, v̄> at the start
            nn.init.orthogonal_(self.text_global.weight)
            nn.init.zeros_(self.text_global.bias)
            self.image_global.load_state_dict(self.text_global.state_dict())
        self.logit_scale_global = nn.Parameter(torch.tensor(math.log(1 / cfg.init_temperature_global)))
        self.geometric = cfg.score == "geometric"
        if self.geometric:
            H = cfg.num_heads
            self.phrase = PhraseWindow(cfg.phrase_window)  # each token with its ±w neighbours
            phrase_dim = self.phrase.out_dim(text_dim)
            self.query_mlp = PositionAwareTextMLP(phrase_dim, H, cfg.d_a, cfg.query_hidden, cfg.pos_dim)  # M_Q
            self.text_value = nn.Linear(phrase_dim, H * cfg.d_e)  # W_u
            self.key_head = ConvChannelAttentionKeyHead(image_dim, grid, H, cfg.d_a, cfg.key_hidden,
                                                        cfg.spatial_gate)  # M_K
            self.value_proj = ValueProjection(image_dim, H, cfg.d_e, gated=cfg.gated_value)  # P_V
            self.lowrank = LowRankMapping(cfg.d_a, cfg.lowrank_rank) if cfg.lowrank_rank else None
            self.salience = PatchSalience(H, cfg.d_a) if cfg.coverage_weight else None
            self.logit_scale_geo = nn.Parameter(torch.tensor(math.log(1 / cfg.init_temperature_geo)))
            if cfg.qk_init_gain is not None:
                self.init_qk_orthogonal_(cfg.qk_init_gain)

    @torch.no_grad()
    def init_qk_orthogonal_(self, gain: float) -> None:
        """Orthogonal init of the Q/K maps' final layers (``query_mlp.fc2``, ``key_head.proj`` as 2-D) with
        ``gain``, biases zeroed: keeps early logits in range (paper: gain 0.05–0.1, docs/design.md §8)."""
        for w in self.qk_maps().values():  # (H·d_a, fan_in): views, init in place
            nn.init.orthogonal_(w, gain=gain)
        for layer in (self.query_mlp.fc2, self.key_head.proj):
            if layer.bias is not None:
                layer.bias.zero_()

    QK_MODULES = ("query_mlp", "key_head", "lowrank")  # the Q/K maps (M_Q, M_K, low-rank U V)
    VALUE_MODULES = ("value_proj", "text_value")  # the value projections (P_V, W_u)

    def qk_maps(self) -> dict[str, torch.Tensor]:
        """The final weights of the Q and K maps as 2-D (out, fan_in) views: ``query_mlp.fc2`` (M_Q) and
        ``key_head.proj`` (M_K) — what the orthogonal init, the orthogonality penalty and the diagnostics use."""
        if not self.geometric:
            raise ValueError("this model has no Q/K maps (score='global'); they exist only in geometric models")
        w_k = self.key_head.proj.weight
        return {"query": self.query_mlp.fc2.weight, "key": w_k.view(w_k.shape[0], -1)}

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by role: "qk" (the Q/K maps), "value" (the value projections), "rest"."""
        groups: dict[str, list[nn.Parameter]] = {"qk": [], "value": [], "rest": []}
        for name, p in self.named_parameters():
            top = name.split(".")[0]
            groups["qk" if top in self.QK_MODULES else "value" if top in self.VALUE_MODULES else "rest"].append(p)
        return groups

    @property
    def patch_grid(self) -> tuple[int, int]:
        """(rows, cols) of the image tower's patch tokens: S = rows · cols keys per image."""
        return tuple(self.image_encoder.patch_embed.grid_size)

    @property
    def device(self) -> torch.device:
        return self.logit_scale_global.device

    # ------------------------------------------------------------------ towers
    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Captions -> {"input_ids", "attention_mask"} (B, T), padded to the longest caption."""
        check_texts(texts)
        full = self.tokenizer(texts, padding=True, return_tensors="pt")
        if full["input_ids"].shape[1] > self.cfg.max_text_len:
            n = int((full["attention_mask"].sum(1) > self.cfg.max_text_len).sum())
            warnings.warn(f"{n} caption(s) longer than max_text_len={self.cfg.max_text_len} tokens were truncated",
                          stacklevel=3)
            full = self.tokenizer(texts, padding=True, truncation=True, max_length=self.cfg.max_text_len,
                                  return_tensors="pt")
        return {"input_ids": full["input_ids"], "attention_mask": full["attention_mask"]}

    def forward_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Embedding:
        mask = attention_mask.bool()  # (B, T)
        h = token_states(self.text_encoder, input_ids, attention_mask)  # (B, T, C); padding read through mask
        pool = self.cfg.global_pool
        if pool != "values":
            summary = masked_mean(h, mask, 1) if pool == "mean" else h[:, 0]  # (B, C): mean of real tokens, or [CLS]
            pooled = F.normalize(self.text_global(summary), dim=-1)  # (B, d_g)
        if not self.geometric:
            return Embedding(pooled)
        B, T, _ = h.shape
        hw = self.phrase(h, mask)  # (B, T, (2w+1)·C): each token with its neighbours
        q = self.query_mlp(hw, mask)  # (B, H, T, d_a)
        if self.lowrank is not None:
            q = self.lowrank(q)
        u_real = self.text_value(hw[mask])  # (N, H*d_e): real tokens only
        u = u_real.new_zeros(B, T, u_real.shape[-1])  # (B, T, H*d_e): 0 on padding
        u[mask] = u_real
        u = F.normalize(u.view(B, T, self.cfg.num_heads, self.cfg.d_e).transpose(1, 2), dim=-1)  # (B, H, T, d_e)
        if pool == "values":  # (B, H·d_e): each head's mean value over real tokens
            pooled = F.normalize(self.text_global(masked_mean(u, mask[:, None], 2).flatten(1)), dim=-1)
        return Embedding(pooled, q, u, mask)

    def forward_image(self, pixels: torch.Tensor) -> Embedding:
        tokens, pooled = patch_tokens(self.image_encoder, pixels)  # (B, S, C), (B, C)
        pool = self.cfg.global_pool
        if pool != "values":
            pooled = F.normalize(self.image_global(tokens.mean(1) if pool == "mean" else pooled), dim=-1)  # (B, d_g)
        if not self.geometric:
            return Embedding(pooled)
        k = self.key_head(tokens)  # (B, H, S, d_a)
        if self.lowrank is not None:
            k = self.lowrank(k)
        v = F.normalize(self.value_proj(tokens), dim=-1)  # (B, H, S, d_e)
        if pool == "values":  # (B, H·d_e): each head's mean patch value
            pooled = F.normalize(self.image_global(v.mean(2).flatten(1)), dim=-1)
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)  # (B, S)
        return Embedding(pooled, k, v, mask)

    def forward(self, input_ids, attention_mask, pixels) -> tuple[Embedding, Embedding]:
        return self.forward_text(input_ids, attention_mask), self.forward_image(pixels)

    # ------------------------------------------------------------------ scores
    def score(self, text: Embedding, image: Embedding, mode: str = "geometric") -> torch.Tensor:
        """Unscaled scores (N_text, N_image): "geometric" (token × patch) or "global" (cosine)."""
        if mode == "global":
            return text.pooled @ image.pooled.T
        if mode != "geometric":
            raise ValueError(f"mode must be 'geometric' or 'global', got {mode!r}")
        if not self.geometric or text.attn is None or image.attn is None:
            raise ValueError("this model has no geometric score (score='global'); use mode='global'")
        args = (text.attn, text.mask, text.value, image.attn, image.mask, image.value)
        if self.salience is None:
            return pair_score(*args)  # (N_t, N_i)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*args, *self.salience.parameters()))
        if not grad and not use_triton("pair_score", text.attn, text.value, image.attn, image.value):
            s, cov = score_and_coverage(*args, self.salience(image.attn))  # one pass: (N_t, N_i) each
            return s + self.cfg.coverage_weight * cov
        s = pair_score(*args)  # (N_t, N_i)
        cov = coverage(*args, self.salience(image.attn))  # (N_t, N_i)
        return s + self.cfg.coverage_weight * cov.to(s.dtype)

    def logits(self, text: Embedding, image: Embedding) -> dict[str, torch.Tensor]:
        """Temperature-scaled training logits per score, each (B_t, B_i)."""
        out = {"global": self.logit_scale_global.exp().clamp(max=MAX_LOGIT_SCALE) * self.score(text, image, "global")}
        if self.geometric:
            out["geometric"] = self.logit_scale_geo.exp().clamp(max=MAX_LOGIT_SCALE) * self.score(text, image)
        return out

    @property
    def coverage_term(self) -> tuple[float, nn.Module] | None:
        """(β, the ``PatchSalience``) when the score adds β·cov (``model_args.coverage_weight``), else None: what the
        re-rank (``mmgeo.search.two_stage``) needs to give the same numbers as ``score``."""
        return (self.cfg.coverage_weight, self.salience) if self.geometric and self.salience is not None else None

    @property
    def default_mode(self) -> str:
        return "geometric" if self.geometric else "global"

    # ------------------------------------------------------------------ inference API
    @torch.inference_mode()
    def encode_text(self, texts: list[str], batch_size: int = 256) -> Embedding:
        """Captions -> Embedding (on the model's device), in batches."""
        check_texts(texts)
        parts = []
        for i in range(0, len(texts), batch_size):
            tok = {k: v.to(self.device) for k, v in self.tokenize(list(texts[i:i + batch_size])).items()}
            parts.append(self.forward_text(**tok))
        if not parts:
            raise ValueError("encode_text needs at least one caption")
        return Embedding.cat(parts)

    @torch.inference_mode()
    def encode_image(self, images, batch_size: int = 256) -> Embedding:
        """PIL images (preprocessed with the model's own transform) or a ready (N, 3, H, W) tensor."""
        if isinstance(images, torch.Tensor):
            expect = (3, self.cfg.image_size, self.cfg.image_size)
            if images.dim() != 4 or tuple(images.shape[1:]) != expect:
                raise ValueError(f"image tensor must be (N, {', '.join(map(str, expect))}) and preprocessed; "
                                 f"got {tuple(images.shape)} — or pass PIL images to use model.preprocess")
            batches = [images[i:i + batch_size] for i in range(0, len(images), batch_size)]
        else:
            images = list(images)
            batches = (torch.stack([self.preprocess(im) for im in images[i:i + batch_size]])
                       for i in range(0, len(images), batch_size))
        parts = [self.forward_image(b.to(self.device)) for b in batches]
        if not parts:
            raise ValueError("encode_image needs at least one image")
        return Embedding.cat(parts)
