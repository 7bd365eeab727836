"""GeoRetriever: one attention space, two operators (DESIGN §2).

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmgeo.kernels import pair_score
from mmgeo.layers import (
    ConvChannelAttentionKeyHead,
    LowRankMapping,
    PhraseWindow,
    PositionAwareTextMLP,
    ValueProjection,
)
from mmgeo.models.config import ModelConfig
from mmgeo.models.towers import (
    build_image_tower,
    build_text_tower,
    image_transform,
    patch_tokens,
    resolve_preprocessing,
)

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(logit_scale)


@dataclass
class Embedding:
    """Encoded captions or images. ``attn``/``value``/``mask`` are None for global-only models.

    pooled (N, d_global) L2-normalised; attn (N, H, L, d_a) queries or keys; value (N, H, L, d_e)
    L2-normalised û or v̂; mask (N, L) bool, True on real tokens / patches.
    """

    pooled: torch.Tensor
    attn: torch.Tensor | None = None
    value: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.pooled.shape[0]

    def _map(self, fn) -> Embedding:
        return Embedding(*(None if x is None else fn(x) for x in (self.pooled, self.attn, self.value, self.mask)))

    def __getitem__(self, idx) -> Embedding:
        return self._map(lambda x: x[idx])

    def to(self, device) -> Embedding:
        return self._map(lambda x: x.to(device))

    @staticmethod
    def cat(parts: list[Embedding]) -> Embedding:
        """Concatenate along N, right-padding token dims to the longest part."""
        def join(xs, dim_len):
            if xs[0] is None:
                return None
            L = max(x.shape[dim_len] for x in xs)
            pad = [F.pad(x, (0, 0, 0, L - x.shape[dim_len])) if x.dim() == 4 else F.pad(x, (0, L - x.shape[-1]))
                   for x in xs]
            return torch.cat(pad, dim=0)

        return Embedding(torch.cat([p.pooled for p in parts]), join([p.attn for p in parts], 2),
                         join([p.value for p in parts], 2), join([p.mask for p in parts], 1))


def _check_texts(texts) -> None:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of strings, e.g. ['a red circle on the left']")
    bad = [i for i, t in enumerate(texts) if not t.strip()]
    if bad:
        raise ValueError(f"empty caption at position(s) {bad[:5]}: every text needs at least one word")


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
        image_dim, grid = self.image_encoder.num_features, tuple(self.image_encoder.patch_embed.grid_size)
        self.text_global = nn.Linear(text_dim, cfg.d_global)
        self.image_global = nn.Linear(image_dim, cfg.d_global)
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
            self.logit_scale_geo = nn.Parameter(torch.tensor(math.log(1 / cfg.init_temperature_geo)))
            if cfg.qk_init_gain is not None:
                self.init_qk_orthogonal_(cfg.qk_init_gain)

    @torch.no_grad()
    def init_qk_orthogonal_(self, gain: float) -> None:
        """Orthogonal init of the Q/K maps' final layers (``query_mlp.fc2``, ``key_head.proj`` as 2-D) with
        ``gain``, biases zeroed: keeps early logits in range (paper: gain 0.05–0.1, DESIGN §8)."""
        for layer in (self.query_mlp.fc2, self.key_head.proj):
            w = layer.weight.view(layer.weight.shape[0], -1)  # (H·d_a, fan_in): a view, init in place
            nn.init.orthogonal_(w, gain=gain)
            if layer.bias is not None:
                layer.bias.zero_()

    @property
    def device(self) -> torch.device:
        return self.logit_scale_global.device

    # ------------------------------------------------------------------ towers
    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Captions -> {"input_ids", "attention_mask"} (B, T), padded to the longest caption."""
        _check_texts(texts)
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
        h = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, C)
        pooled = F.normalize(self.text_global(h[:, 0]), dim=-1)  # [CLS] -> (B, d_g)
        if not self.geometric:
            return Embedding(pooled)
        B, T, _ = h.shape
        hw = self.phrase(h, mask)  # (B, T, (2w+1)·C): each token with its neighbours
        q = self.query_mlp(hw, mask)  # (B, H, T, d_a)
        if self.lowrank is not None:
            q = self.lowrank(q)
        u = self.text_value(hw).view(B, T, self.cfg.num_heads, self.cfg.d_e).transpose(1, 2)  # (B, H, T, d_e)
        return Embedding(pooled, q, F.normalize(u, dim=-1), mask)

    def forward_image(self, pixels: torch.Tensor) -> Embedding:
        tokens, pooled = patch_tokens(self.image_encoder, pixels)  # (B, S, C), (B, C)
        pooled = F.normalize(self.image_global(pooled), dim=-1)  # (B, d_g)
        if not self.geometric:
            return Embedding(pooled)
        k = self.key_head(tokens)  # (B, H, S, d_a)
        if self.lowrank is not None:
            k = self.lowrank(k)
        v = F.normalize(self.value_proj(tokens), dim=-1)  # (B, H, S, d_e)
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
        return pair_score(text.attn, text.mask, text.value, image.attn, image.mask, image.value)

    def logits(self, text: Embedding, image: Embedding) -> dict[str, torch.Tensor]:
        """Temperature-scaled training logits per score, each (B_t, B_i)."""
        out = {"global": self.logit_scale_global.exp().clamp(max=MAX_LOGIT_SCALE) * self.score(text, image, "global")}
        if self.geometric:
            out["geometric"] = self.logit_scale_geo.exp().clamp(max=MAX_LOGIT_SCALE) * self.score(text, image)
        return out

    @property
    def default_mode(self) -> str:
        return "geometric" if self.geometric else "global"

    # ------------------------------------------------------------------ inference API
    @torch.inference_mode()
    def encode_text(self, texts: list[str], batch_size: int = 256) -> Embedding:
        """Captions -> Embedding (on the model's device), in batches."""
        _check_texts(texts)
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
