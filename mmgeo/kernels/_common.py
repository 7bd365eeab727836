"""Kernel dispatch shared by ``pair_score`` and ``geo_attention``. Imports triton only when asked to.

``MMGEO_KERNELS`` (read at every call):
    auto       (default) Triton for CUDA tensors of a supported dtype when triton imports, reference otherwise
    triton     Triton always; CPU tensors need ``TRITON_INTERPRET=1`` (how the kernel tests run)
    reference  the plain-PyTorch reference on every device
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "reference")
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)  # the interpreter mis-computes bf16 tl.dot
MAX_GRID_Y = 65_535  # CUDA grid axes 1 and 2 hold at most this many blocks: larger batches are launched in parts


def kernel_backend() -> str:
    value = os.environ.get("MMGEO_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"MMGEO_KERNELS={value!r} is not one of {', '.join(BACKENDS)}; unset it for 'auto'")
    return value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(name: str, *tensors: torch.Tensor) -> bool:
    """Whether ``name`` runs its Triton kernel on ``tensors`` (raises if forced but impossible)."""
    backend = kernel_backend()
    if backend == "reference":
        return False
    x = tensors[0]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))  # what the kernel would get
    if backend == "auto":
        return x.is_cuda and dtype in GPU_DTYPES and triton_available()
    if not triton_available():
        raise RuntimeError(f"MMGEO_KERNELS=triton but triton does not import; pip install triton, or set "
                           f"MMGEO_KERNELS=reference for {name}")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"MMGEO_KERNELS=triton with {x.device.type} tensors needs TRITON_INTERPRET=1 set before "
                           f"triton is imported; or move the inputs of {name} to CUDA")
    allowed = GPU_DTYPES if x.is_cuda and not interpreting() else INTERPRETER_DTYPES
    if dtype not in allowed:
        raise TypeError(f"the Triton {name} takes {', '.join(str(d) for d in allowed)} here, got {dtype}; "
                        f"cast the inputs or set MMGEO_KERNELS=reference")
    return True


def autotune_configs(table, m_name: str, n_name: str, interpreted=(16, 16, 1, 1)) -> list:
    """triton.Config list from (BLOCK_M, BLOCK_N, num_warps, num_stages) rows; one small config when
    interpreting (a multi-config autotune needs a GPU driver to time the candidates; small tiles let
    tiny test shapes cross tile edges)."""
    import triton

    rows = [interpreted] if interpreting() else table
    return [triton.Config({m_name: bm, n_name: bn}, num_warps=nw, num_stages=ns) for bm, bn, nw, ns in rows]


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: TF32 for fp32 only where PyTorch's matmul would use it too."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
