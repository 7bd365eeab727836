"""Scoring and attention kernels: fused Triton kernels on CUDA, plain-PyTorch references everywhere (docs/design.md).

Which path runs is set by ``MMGEO_KERNELS`` = auto | triton | reference (``mmgeo.kernels._common``).
Importing this package never imports triton; the kernels load on first use.
"""

from mmgeo.kernels._common import kernel_backend, use_triton
from mmgeo.kernels.geo_attention import geo_attention, geo_attention_reference
from mmgeo.kernels.pair_score import (
    attention_logits,
    attention_weights,
    candidate_scores,
    pair_score,
    pair_score_naive,
    pair_score_reference,
)
from mmgeo.kernels.scale import attention_scale

__all__ = ["attention_logits", "attention_scale", "attention_weights", "candidate_scores", "geo_attention",
           "geo_attention_reference", "kernel_backend", "pair_score", "pair_score_naive", "pair_score_reference",
           "use_triton"]
