"""Kernel dispatch shared by ``pair_score`` and ``geo_attention``. Imports triton only when asked to.

``MMGEO_KERNELS`` (read at every call):
    auto       (default) Triton for CUDA tensors of a supported dtype when triton imports, reference otherwise;
               each kernel variant checks itself first (``self_checked``) and falls back to the reference
    triton     Triton always, unchecked: failures raise; CPU tensors need ``TRITON_INTERPRET=1`` (the kernel tests)
    reference  the plain-PyTorch reference on every device

Self-check (``auto`` only, docs/design.md §4): the first call of a kernel per class (kernel, dtype, device, the
kernel's compiled variant: the power-of-two padded dims and flags it is specialised on) runs the Triton forward
on a small input of the call's dims next to the reference. A mismatch beyond ``SELF_CHECK_TOL`` or any exception
(a failed compile) warns once and sends that class to the reference for the rest of the process.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable

import torch

BACKENDS = ("auto", "triton", "reference")
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)  # the interpreter mis-computes bf16 tl.dot
MAX_GRID_Y = 65_535  # CUDA grid axes 1 and 2 hold at most this many blocks: larger batches are launched in parts
# Self-check tolerance relative to the reference's magnitude (as tests/kernels/tolerance.py): fp32 may run TF32.
SELF_CHECK_TOL = {torch.float32: 2e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SELF_CHECKS: dict[tuple, bool] = {}  # (kernel, dtype, device, variant) -> the Triton path passed its self-check
_SELF_CHECK_LOCK = threading.Lock()


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


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def scaled_deviation(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> tuple[bool, float]:
    """(within tolerance, max |actual - expected| / max|expected|), compared in float64.

    Within: |a - e| <= tol · max|e| + tol · |e| everywhere and every value finite (tests/kernels/tolerance.py).
    """
    a, e = actual.detach().double(), expected.detach().double()
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-6)
    if not bool(torch.isfinite(a).all()):
        return False, float("inf")
    err = (a - e).abs()
    return bool((err <= tol * scale + tol * e.abs()).all()), err.max().item() / scale if err.numel() else 0.0


def self_checked(name: str, dtype: torch.dtype, device: torch.device, variant: tuple,
                 probe: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the Triton ``name`` may serve this class under ``MMGEO_KERNELS=auto``; checked once per process.

    ``probe()`` -> (Triton output, reference output) on a small input; run without autograd or autocast. On a
    mismatch or any exception this warns once (kernel, dtype, deviation or error) and returns False from then on.
    """
    key = (name, str(dtype).removeprefix("torch."), str(device), variant)
    ok = SELF_CHECKS.get(key)
    if ok is not None:
        return ok
    with _SELF_CHECK_LOCK:
        if key in SELF_CHECKS:  # another thread checked it meanwhile
            return SELF_CHECKS[key]
        tol = SELF_CHECK_TOL.get(dtype, 2e-2)
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                got, want = probe()
            ok, dev = scaled_deviation(got, want, tol)
            why = f"max deviation {dev:.3g} × max|reference| (tolerance {tol:g})"
        except Exception as err:  # noqa: BLE001 - a failed compile or launch: fall back, do not crash the caller
            ok, why = False, f"{type(err).__name__}: {str(err)[:500]}"
        if not ok:
            warnings.warn(f"mmgeo: the Triton {name} kernel failed its self-check for {key[1]} on {key[2]} "
                          f"(variant {variant}): {why}. The plain-PyTorch reference is used for this class from now "
                          f"on; MMGEO_KERNELS=triton runs the kernel regardless, =reference skips it.",
                          RuntimeWarning, stacklevel=4)  # the caller of the public function
        SELF_CHECKS[key] = ok
    return ok


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
