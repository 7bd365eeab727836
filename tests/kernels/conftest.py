"""Kernel tests: without a GPU the Triton kernels run on CPU under the interpreter.

TRITON_INTERPRET must be set before triton is imported (it is read when a kernel is decorated); the
top-level tests/conftest.py sets it, only when there is no CUDA device, before any test module loads
(Lightning imports triton). This repeat covers running this folder alone. With a GPU the same tests
run the compiled kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where the kernel tests put their tensors: the GPU if there is one and we are not interpreting."""
    from mmgeo.kernels._common import interpreting

    return "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"


@pytest.fixture
def force_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("MMGEO_KERNELS", "triton")

