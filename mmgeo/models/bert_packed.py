"""A `transformers` BERT encoder run over its captions' real tokens only (inference).

``BertModel`` computes every position of a padded batch: in a micro-batch of 8 search queries padded to the
longest, about a quarter of its multiply-adds are padding, and its per-module Python is a large part of a tiny
encoder's time. ``packed_bert_states`` runs the same weights and the same arithmetic — embeddings, then per layer
self-attention (softmax(q·kᵀ/√d_h) over the caption's real tokens), output projection + residual + LayerNorm,
feed-forward + residual + LayerNorm — with every linear layer over the (N, C) real tokens packed together and only
the attention itself over the padded (B, heads, T, d_h) layout.

Limits: a ``BertModel`` in eval mode (no dropout) with absolute position embeddings, no decoder / cross-attention
and one of the GELU / ReLU activations (``supports``); anything else runs the model's own forward
(``towers.token_states``). States match the model's own up to float rounding on real tokens; padding positions are 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}  # config.hidden_act -> the function BERT's ACT2FN gives


def supports(encoder: nn.Module) -> bool:
    """Whether ``packed_bert_states`` computes ``encoder``'s own states (see the module's limits)."""
    if type(encoder).__name__ != "BertModel" or encoder.training:
        return False
    cfg = encoder.config
    return (not cfg.is_decoder and not getattr(cfg, "add_cross_attention", False)
            and getattr(cfg, "position_embedding_type", "absolute") == "absolute"
            and isinstance(cfg.hidden_act, str) and cfg.hidden_act in ACTIVATIONS)


def packed_bert_states(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ids and mask (real tokens first) -> last hidden states (B, T, C), 0 on padding (``supports`` only)."""
    cfg = encoder.config
    B, T = input_ids.shape
    C, nh = cfg.hidden_size, cfg.num_attention_heads
    act = ACTIVATIONS[cfg.hidden_act]
    mask = attention_mask.bool()  # (B, T)
    rows = mask.reshape(-1).nonzero().squeeze(1)  # (N,) flat positions of the real tokens
    x = encoder.embeddings(input_ids=input_ids)  # (B, T, C): word + position + token type, LayerNorm
    h = x.reshape(B * T, C).index_select(0, rows)  # (N, C)
    keys_real = mask[:, None, None, :]  # (B, 1, 1, T): attend to real tokens only
    for layer in encoder.encoder.layer:
        sa = layer.attention.self
        q, k, v = (h.new_zeros(B * T, C).index_copy_(0, rows, proj(h))  # (B·T, C), 0 on padding
                   .view(B, T, nh, C // nh).transpose(1, 2) for proj in (sa.query, sa.key, sa.value))  # (B, nh, T, d_h)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keys_real,
                                             scale=getattr(sa, "scaling", None))  # (B, nh, T, d_h)
        ctx = ctx.transpose(1, 2).reshape(B * T, C).index_select(0, rows)  # (N, C)
        out = layer.attention.output
        h = out.LayerNorm(out.dense(ctx) + h)  # (N, C)
        ff = layer.output
        h = ff.LayerNorm(ff.dense(act(layer.intermediate.dense(h))) + h)  # (N, C)
    return h.new_zeros(B * T, C).index_copy_(0, rows, h).view(B, T, C)  # (B, T, C)
