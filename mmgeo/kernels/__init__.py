"""Scoring and attention kernels: plain-PyTorch references now, fused Triton kernels on CUDA (issue 4)."""

from mmgeo.kernels.pair_score import pair_score, pair_score_naive, pair_score_reference

__all__ = ["pair_score", "pair_score_naive", "pair_score_reference"]
