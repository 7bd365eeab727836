"""Patch pruning of the re-rank store (docs/design.md §10): each image keeps the ``keep`` of its S patches that
receive the most attention from a sample of queries, so the store holds keep/S of the keys and values.

The attention mass of patch j of image i is Σ over the sample's real tokens t and heads of a_tj =
softmax_j(<q_t, k_j>/sqrt(d_a)) over image i's real patches: how much the queries' words look at it. Patches
few words ever look at weigh little in any score (a_tj is small for them), so dropping them changes scores
little — unlike dropping by key norm or at random (``benchmarks/prune_patches.py`` measures all three).
Limits: the sample must resemble the queries the service will get; an image keeps ``keep`` patches whatever
its content; the score's softmax then runs over the kept patches only.

Kept patches stay in grid order; which ones they are is stored per image as packed bits over the S grid
positions (``patches.bits.npy``, (N, ceil(S / 8)) uint8), for heatmaps (``Gallery.image_patches``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmgeo.kernels import attention_scale

PATCHES_FILE = "patches.bits.npy"
CRITERION = "attention mass"


def query_tokens(queries) -> torch.Tensor:
    """The real tokens' queries of an ``Embedding`` of captions, scaled: (H, t, d_a) float32."""
    q = torch.cat([queries.attn[i][:, queries.mask[i]] for i in range(len(queries))], dim=1).float()  # (H, t, d_a)
    return q * attention_scale(q.shape[-1])


WEIGHTS_PER_CHUNK = 1 << 24  # attention weights alive at once (64 MB of fp32)


def attention_mass(q: torch.Tensor, keys, mask, chunk: int | None = None) -> torch.Tensor:
    """(N, S) attention weight each patch receives, summed over the query tokens and heads.

    q (H, t, d_a): ``query_tokens``; keys (N, H, S, d_a) and mask (N, S) bool (tensors or arrays, e.g. memory
    maps), read ``chunk`` images at a time (weights (H, t, chunk·S) exist at once; by default as many images as
    keep them within ``WEIGHTS_PER_CHUNK``)."""
    H, t, d_a = q.shape
    N, S = mask.shape[:2]
    chunk = chunk or max(1, WEIGHTS_PER_CHUNK // (H * max(t, 1) * S))
    mass = torch.zeros(N, S)
    for a in range(0, N, chunk):
        k = torch.from_numpy(np.array(keys[a:a + chunk], dtype=np.float32))  # (c, H, S, d_a), a writable copy
        real = torch.from_numpy(np.array(mask[a:a + chunk], dtype=bool))  # (c, S)
        c = len(k)
        logits = torch.bmm(q, k.transpose(0, 1).reshape(H, c * S, d_a).transpose(1, 2)).view(H, t, c, S)
        logits.masked_fill_(~real[None, None], float("-inf"))
        mass[a:a + c] = logits.softmax(-1).sum((0, 1))  # (c, S)
    return mass


def kept_patches(mass: torch.Tensor, keep: int) -> torch.Tensor:
    """(N, S) mass -> (N, keep) indices of each image's ``keep`` heaviest patches, in grid order."""
    return mass.topk(keep, dim=1).indices.sort(dim=1).values


def prune_arrays(folder: Path, queries, keep: int, chunk: int = 256) -> dict:
    """Replace the fp16 keys.npy / values.npy / mask.npy of a staged index ``folder`` (N, H, S, d) by each image's
    ``keep`` patches of most attention mass from ``queries`` (an ``Embedding`` of sample captions) and write
    ``PATCHES_FILE``; -> the store's ``patches`` record."""
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("keys", "values", "mask")}
    N, H, S, _ = arrays["keys"].shape
    check_pruning(keep, queries, S)  # the builders checked already; this is the arrays' own S
    q = query_tokens(queries)  # (H, t, d_a)
    out = {name: np.lib.format.open_memmap(folder / f"{name}.pruned", mode="w+", dtype=a.dtype,
                                           shape=(N, *a.shape[1:-2], keep, a.shape[-1]) if a.ndim == 4 else (N, keep))
           for name, a in arrays.items()}
    bits = np.lib.format.open_memmap(folder / PATCHES_FILE, mode="w+", dtype=np.uint8, shape=(N, -(-S // 8)))
    for a in range(0, N, chunk):
        idx = kept_patches(attention_mass(q, arrays["keys"][a:a + chunk], arrays["mask"][a:a + chunk]), keep).numpy()
        rows = np.arange(len(idx))[:, None]  # (c, 1)
        out["keys"][a:a + chunk] = np.asarray(arrays["keys"][a:a + chunk])[rows, :, idx].transpose(0, 2, 1, 3)
        out["values"][a:a + chunk] = np.asarray(arrays["values"][a:a + chunk])[rows, :, idx].transpose(0, 2, 1, 3)
        out["mask"][a:a + chunk] = np.asarray(arrays["mask"][a:a + chunk])[rows, idx]
        chosen = np.zeros((len(idx), S), dtype=bool)
        chosen[rows, idx] = True
        bits[a:a + chunk] = np.packbits(chosen, axis=1)
    for m in (*out.values(), bits):
        m.flush()
    del arrays, out, bits  # close the memmaps before the files are replaced
    for name in ("keys", "values", "mask"):
        (folder / f"{name}.pruned").replace(folder / f"{name}.npy")
    return {"kept": keep, "of": S, "criterion": CRITERION, "queries": len(queries), "bytes_per_image": -(-S // 8)}


def unpack_patches(bits: np.ndarray, num_patches: int) -> np.ndarray:
    """(ceil(S / 8),) packed bits of one image -> its kept patches' grid indices, ascending (int64)."""
    return np.flatnonzero(np.unpackbits(bits, count=num_patches)).astype(np.int64)


def read_captions(path, flag: str = "--prune-queries") -> list[str]:
    """Sample captions for patch pruning: the non-blank lines of a UTF-8 text file (``flag`` names it in errors)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: no such file (one sample caption per line)") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({err}); give one caption per line") from None
    captions = [line.strip() for line in text.splitlines() if line.strip()]
    if not captions:
        raise ValueError(f"{flag} {path} holds no caption: give one sample caption per line")
    return captions


def check_pruning(keep: int | None, queries, num_patches: int) -> None:
    """Refuse (ValueError), before anything is encoded, a ``keep`` outside 1..S-1 or one without sample queries."""
    if keep is None:
        if queries is not None:
            raise ValueError("sample queries were given but no number of patches to keep: pass keep_patches too")
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep < num_patches:
        raise ValueError(f"keep_patches must be an integer between 1 and {num_patches - 1} (the model has "
                         f"{num_patches} patches per image), got {keep!r}")
    if queries is None or len(queries) == 0:
        raise ValueError("patch pruning keeps the patches a sample of queries attends to most: give sample captions "
                         "(serve build --prune-queries FILE, one caption per line)")
