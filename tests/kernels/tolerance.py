"""Shared comparison for kernel tests: tolerance relative to the reference's magnitude."""

import torch


def assert_close_scaled(actual, expected, tol, what):
    """|actual - expected| within tol × max|expected| (absolute) and tol (relative), compared in float64."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol * max(scale, 1e-6), rtol=tol, msg=what)
