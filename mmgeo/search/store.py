"""The on-disk gallery format and its reader: global FAISS index + memory-mapped keys/values of every image
(docs/design.md). Writers are in ``mmgeo.search.build``.

Layout of an index directory (format ``mmgeo-gallery`` v1, or v2 when sharded)::

    manifest.json   format, version, model (path, sha256, dims), count, skipped, index_type, shards (v2)
    global.faiss    FAISS index over the (N, d_global) pooled image vectors (inner product = cosine), or
    global.shards/  the same cut into shards of ``shard_size`` (``mmgeo.search.shards``) when N > shard_size (v2)
    keys.npy        (N, H, L, d_a) fp16  image keys k, memory-mapped on load
    values.npy      (N, H, L, d_e) fp16  image values v̂, memory-mapped on load
    mask.npy        (N, L) bool          real patches
    meta.json       [{"id", "path", "width", "height"}] — ``path`` relative to the directory when inside it

Builds are atomic (``mmgeo.io.StagedDir``): everything is written into a temp directory next to the target,
which replaces the target only once complete, so an interrupted build never leaves a half index that loads; a
missing index that a killed build left at ``.NAME.old-*`` is renamed back before loading (``mmgeo.io``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from mmgeo.io import restore_interrupted
from mmgeo.search.shards import ShardedIndex, ShardsError

FORMAT = "mmgeo-gallery"
VERSIONS = (1, 2)  # v2 = v1 + a sharded global index; unsharded indexes are still written as v1 (older mmgeo reads)
FILES = ("manifest.json", "keys.npy", "values.npy", "mask.npy", "meta.json")  # + global.faiss or global.shards/
SHARDS_DIR = "global.shards"
REBUILD = "rebuild it with `python -m serve build`"


class GalleryError(ValueError):
    """An index directory that cannot be used (missing file, wrong version, other model)."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file (the checkpoint an index records), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Gallery:
    """A loaded index directory: FAISS index (or ``ShardedIndex``), memory-mapped keys/values/mask, metadata."""

    def __init__(self, root: str | os.PathLike):
        import faiss

        self.root = Path(root)
        if not self.root.exists():  # a build killed between the two renames of the fallback: put the old one back
            with contextlib.suppress(OSError):
                restore_interrupted(self.root)
        mpath = self.root / "manifest.json"
        if not mpath.is_file():
            raise GalleryError(f"{str(self.root)!r} is not an index: no manifest.json (a missing or interrupted "
                               "build); build one with `python -m serve build`")
        try:
            self.manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as err:
            raise GalleryError(f"{mpath} is not valid JSON ({err}); rebuild the index") from err
        fmt, ver = self.manifest.get("format"), self.manifest.get("version")
        if fmt != FORMAT or ver not in VERSIONS:
            raise GalleryError(f"{self.root} holds index format {fmt!r} v{ver}; this mmgeo reads {FORMAT!r} "
                               f"v{', v'.join(map(str, VERSIONS))} — rebuild the index with `python -m serve build`")
        shards = self.manifest.get("shards")
        if shards and ver < 2:
            raise GalleryError(f"{mpath} is v{ver} but lists shards (a v2 feature); rebuild the index")
        missing = [f for f in FILES if not (self.root / f).is_file()]
        if not shards and not (self.root / "global.faiss").is_file():
            missing.append("global.faiss")
        if missing:
            raise GalleryError(f"index {self.root} is missing {missing}; {REBUILD}")
        self.model_record = self.manifest["model"]
        self.count = int(self.manifest["count"])
        self.keys = np.load(self.root / "keys.npy", mmap_mode="r")  # (N, H, L, d_a) fp16
        self.values = np.load(self.root / "values.npy", mmap_mode="r")  # (N, H, L, d_e) fp16
        self.mask = np.load(self.root / "mask.npy", mmap_mode="r")  # (N, L) bool
        self.meta = json.loads((self.root / "meta.json").read_text())
        if shards:  # memory-mapped shards, searched and merged by ShardedIndex (same search() as a FAISS index)
            try:
                self.index = ShardedIndex.load(self.root / SHARDS_DIR)
            except ShardsError as err:
                raise GalleryError(f"index {self.root}: {err}") from err
        else:
            self.index = faiss.read_index(str(self.root / "global.faiss"))
        r = self.model_record
        expect = {"keys": (self.count, r["num_heads"], r["num_patches"], r["d_a"]),
                  "values": (self.count, r["num_heads"], r["num_patches"], r["d_e"]),
                  "mask": (self.count, r["num_patches"])}
        for name, shape in expect.items():
            if tuple(getattr(self, name).shape) != shape:
                raise GalleryError(f"{name}.npy has shape {tuple(getattr(self, name).shape)}, manifest says {shape}; "
                                   "the index is damaged — rebuild it")
        if self.index.ntotal != self.count or len(self.meta) != self.count:
            raise GalleryError(f"global.faiss holds {self.index.ntotal} vectors and meta.json {len(self.meta)} rows, "
                               f"manifest says {self.count}; rebuild the index")

    def __len__(self) -> int:
        return self.count

    def check_model(self, model, ckpt: str | os.PathLike | None = None) -> None:
        """Raise GalleryError unless ``model`` (and its checkpoint file) is the one the index was built with."""
        r, cfg = self.model_record, model.cfg
        got = {"num_heads": cfg.num_heads, "d_a": cfg.d_a, "d_e": cfg.d_e, "d_global": cfg.d_global,
               "num_patches": (cfg.image_size // cfg.patch_size) ** 2}
        diff = {k: (r.get(k), v) for k, v in got.items() if r.get(k) != v}
        if diff:
            raise GalleryError(f"model does not match the index (index vs model): {diff}; serve with the "
                               "checkpoint the index was built from, or rebuild the index")
        if ckpt is not None and r.get("sha256") and file_sha256(ckpt) != r["sha256"]:
            raise GalleryError(f"checkpoint {ckpt} is not the one the index was built with ({r.get('path')}, "
                               f"sha256 {r['sha256'][:12]}…); rebuild the index or pass that checkpoint")

    def check_images(self, images, sample: int = 256, rtol: float = 0.05) -> None:
        """Raise GalleryError unless stored image i holds the keys of row i of ``images`` (an ``Embedding`` of
        the same model), on up to ``sample`` evenly spaced ids; ``rtol`` allows fp16 storage and device rounding."""
        if len(images) != self.count:
            raise GalleryError(f"the index holds {self.count} images, the encoded set {len(images)}")
        for i in np.unique(np.linspace(0, self.count - 1, min(sample, self.count)).round().astype(int)):
            want = images.attn[i].float().cpu()  # (H, L, d_a)
            err = float((torch.from_numpy(np.array(self.keys[i], np.float32)) - want).norm() / want.norm())
            if not err <= rtol:
                raise GalleryError(f"image {i} of the index is not image {i} of the encoded set (relative key "
                                   f"difference {err:.3g}); build the index from the same images in the same order")

    def image_path(self, image_id: int) -> Path:
        p = Path(self.meta[image_id]["path"])
        return p if p.is_absolute() else self.root / p

    def candidates(self, ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys (H, K, L, d_a), values (H, K, L, d_e) as float32, head-major, and mask (K, L) of the given ids.

        Read from the memory-mapped fp16 arrays (only those rows are touched); the fp16 -> fp32 conversion and
        the (K, H) -> (H, K) transpose are one copy, so each head's K·L keys are one matrix for one GEMM.
        """
        ids = np.asarray(ids, dtype=np.int64)
        out = []
        for arr in (self.keys, self.values):
            rows = torch.from_numpy(arr[ids])  # (K, H, L, d) fp16
            t = torch.empty(rows.shape[1], rows.shape[0], *rows.shape[2:])  # (H, K, L, d) fp32
            out.append(t.copy_(rows.transpose(0, 1)))
        return out[0], out[1], torch.from_numpy(self.mask[ids])
