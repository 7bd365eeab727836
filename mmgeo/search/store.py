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

A compressed re-rank store (v3, ``serve build --codec``; ``mmgeo.search.codecs``, docs/design.md §10) replaces the
three arrays by ``keys.codes.npy`` / ``values.codes.npy`` (N, H, L, code_size) uint8, ``mask.bits.npy`` (packed
bits; absent when every patch is real) and ``codebooks/{keys,values}.<head>.faiss``; the manifest's ``store``
record names the codec, ``bytes_per_image``, ``codebook_bytes`` and each codebook's size and SHA-256, all checked on
load. Every store is read through ``Gallery.candidate_blocks``.

A pruned store (v4, ``serve build --keep-patches``; ``mmgeo.search.pruning``) keeps L < S patches per image: the
arrays or codes above hold those L, in grid order, and ``patches.bits.npy`` (N, ceil(S / 8)) uint8 says which they
are; the ``store`` record's ``patches`` names the count, the criterion and the sample it was measured on.

Builds are atomic (``mmgeo.io.StagedDir``): everything is written into a temp directory next to the target,
which replaces the target only once complete, so an interrupted build never leaves a half index that loads; a
missing index that a killed build left at ``.NAME.old-*`` is renamed back before loading (``mmgeo.io``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from mmgeo.io import file_sha256, restore_interrupted
from mmgeo.search.codecs import (
    CODECS,
    CODES_FILE,
    MASK_BITS_FILE,
    ROLES,
    CodebookError,
    Codewords,
    decode,
    fp16_store,
    load_quantizers,
    unpack_mask,
)
from mmgeo.search.pruning import PATCHES_FILE, unpack_patches
from mmgeo.search.shards import ShardedIndex, ShardsError

FORMAT = "mmgeo-gallery"
VERSIONS = (1, 2, 3, 4)  # v2 = v1 + a sharded global index; v3 = a compressed re-rank store; v4 = a pruned one
#                          (fewer patches per image). An fp16 store is still written as v1 / v2, so older mmgeo reads it
META_FILES = ("manifest.json", "meta.json")  # + the store's files (store_files) + global.faiss or global.shards/
FP16_FILES = ("keys.npy", "values.npy", "mask.npy")
BLOCK_BYTES = 8 << 20  # fp32 keys + values decoded at a time (candidate_blocks): 5 geo-vitb16-bert candidates
BLOCK_IMAGES = 256  # and at most this many candidates (geo-tiny: 1.8 MB for K' = 100, one block)
SHARDS_DIR = "global.shards"
REBUILD = "rebuild it with `python -m serve build`"


class GalleryError(ValueError):
    """An index directory that cannot be used (missing file, wrong version, other model)."""


def store_files(store: dict) -> list[str]:
    """The files of a manifest's re-rank ``store`` record (codebooks are listed in the record itself)."""
    pruned = [PATCHES_FILE] if store.get("patches") else []
    if store["codec"] == "fp16":
        return [*FP16_FILES, *pruned]
    return [CODES_FILE.format(role=role) for role in ROLES] + ([MASK_BITS_FILE] if store["mask"] == "packed" else []) \
        + pruned


class RerankStore:
    """What the re-rank reads of a gallery, whatever keeps it: per image its keys / values (fp16 arrays, or codes
    of ``quantizers`` whose ``codewords`` sum to them), its real patches and which grid patches were stored.
    ``Gallery`` (an index directory, memory-mapped) and ``mmgeo.search.database.CandidateRows`` (rows a database
    returned with the first stage) are both one; ``two_stage.rerank_candidates`` reads either the same way.

    A subclass sets ``model_record``, ``store``, ``codec``, ``num_patches``, ``patch_bits`` ((N, ceil(S / 8)) or
    None) and, for fp16, ``keys`` / ``values`` / ``mask`` ((N, H, L, d) fp16, (N, L) bool), else ``codes``
    (role -> (N, H, L, code_size) uint8), ``mask_bits`` ((N, ceil(L / 8)) or None: all real), ``quantizers`` and
    ``codewords`` (role -> ``Codewords`` or None); rows are indexed by position.
    """

    count: int

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
        the same model), on up to ``sample`` evenly spaced ids; ``rtol`` allows fp16 storage and device rounding,
        plus twice the key error a compressed store measured on its training sample."""
        rtol += 2 * self.store.get("rel_error", {}).get("keys", 0.0)
        if len(images) != self.count:
            raise GalleryError(f"the index holds {self.count} images, the encoded set {len(images)}")
        for i in np.unique(np.linspace(0, self.count - 1, min(sample, self.count)).round().astype(int)):
            want = images.attn[i].float().cpu()[:, self.image_patches(int(i))]  # (H, L, d_a): the stored patches
            err = float((self.image_keys(int(i)) - want).norm() / want.norm())
            if not err <= rtol:
                raise GalleryError(f"image {i} of the index is not image {i} of the encoded set (relative key "
                                   f"difference {err:.3g}); build the index from the same images in the same order")

    def image_patches(self, image_id: int) -> torch.Tensor:
        """(L,) int64 grid positions (0..S-1) of one image's stored patches: all S, or those a pruned store kept."""
        S = self.model_record["num_patches"]
        if self.patch_bits is None:
            return torch.arange(S)
        idx = unpack_patches(self.patch_bits[image_id], S)
        if len(idx) != self.num_patches:
            raise GalleryError(f"{PATCHES_FILE} marks {len(idx)} patches of image {image_id}, the manifest says "
                               f"{self.num_patches}; the index is damaged — {REBUILD}")
        return torch.from_numpy(idx)

    def image_keys(self, image_id: int) -> torch.Tensor:
        """(H, L, d_a) float32 keys of one image's stored patches (decoded when the store is compressed)."""
        if self.codec == "fp16":
            return torch.from_numpy(np.array(self.keys[image_id], np.float32))
        return self._decode("keys", self.codes["keys"][[image_id]])[:, 0]

    def image_mask(self, image_id: int) -> torch.Tensor:
        """(L,) bool: the image's real patches."""
        return self._mask_rows(np.array([image_id]))[0]

    def _mask_rows(self, rows: np.ndarray) -> torch.Tensor:
        """(K, L) bool mask of the given ids, whatever the store keeps (bools, packed bits, or nothing: all real)."""
        if self.codec == "fp16":
            return torch.from_numpy(self.mask[rows])
        L = self.num_patches
        if self.mask_bits is None:  # every patch of every image is real
            return torch.ones(len(rows), L, dtype=torch.bool)
        return torch.from_numpy(unpack_mask(self.mask_bits[rows], L))

    def _decode(self, role: str, codes: np.ndarray) -> torch.Tensor:
        """(K, H, L, code_size) codes of ``role`` -> (H, K, L, d) float32."""
        words = self.codewords[role]
        return words.decode(codes) if words is not None else decode(self.quantizers[role], codes)

    @property
    def scores_from_codes(self) -> bool:
        """Keys and values are both sums of codewords (PQ, RQ): re-rank scores them from look-up tables
        (``code_blocks``) instead of decoding them."""
        return self.codec != "fp16" and all(self.codewords[role] is not None for role in ROLES)

    def block_size(self, width: int | None = None) -> int:
        """Candidates per block: ``BLOCK_IMAGES``, fewer when their ``width`` fp32 numbers per head and patch
        (default d_a + d_e: decoded keys and values) would pass ``BLOCK_BYTES``."""
        r = self.model_record
        per_image = 4 * r["num_heads"] * self.num_patches * (width or r["d_a"] + r["d_e"])
        return max(1, min(BLOCK_IMAGES, BLOCK_BYTES // per_image))

    def code_blocks(self, ids, block: int):
        """Yield key rows (H, K_b, L, M_k), value rows (H, K_b, L, M_v) of the ``codewords`` tables (int64) and mask
        (K_b, L) bool of consecutive blocks of ``block`` of the given ids, in order (``scores_from_codes`` only)."""
        ids = np.asarray(ids, dtype=np.int64)
        for start in range(0, len(ids), block):
            rows = ids[start:start + block]
            yield (*(self.codewords[role].indices(self.codes[role][rows]) for role in ROLES), self._mask_rows(rows))

    def candidate_blocks(self, ids, block: int | None = None):
        """Yield keys (H, K_b, L, d_a), values (H, K_b, L, d_e) float32, head-major, and mask (K_b, L) bool of
        consecutive blocks of ``block`` (default ``block_size()``) of the given ids, in order.

        Only those rows of the memory-mapped store are read; fp16 rows are converted and transposed in one copy,
        codes are decoded by their quantizers (``mmgeo.search.codecs.Codewords``, FAISS for SQ). fp32 keys/values
        exist for one block at a time, so memory does not grow with K'.
        """
        ids = np.asarray(ids, dtype=np.int64)
        block = block or self.block_size()
        for start in range(0, len(ids), block):
            rows = ids[start:start + block]
            if self.codec == "fp16":
                kv = []
                for arr in (self.keys, self.values):
                    x = torch.from_numpy(arr[rows])  # (K_b, H, L, d) fp16
                    kv.append(torch.empty(x.shape[1], x.shape[0], *x.shape[2:]).copy_(x.transpose(0, 1)))
            else:
                kv = [self._decode(role, self.codes[role][rows]) for role in ROLES]  # (H, K_b, L, d)
            yield kv[0], kv[1], self._mask_rows(rows)


class Gallery(RerankStore):
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
        self.store = self.manifest.get("store") or {"codec": "fp16", "mask": "bool"}  # v1 / v2: fp16
        self.codec = self.store["codec"]
        if self.codec not in CODECS or (self.codec != "fp16" and ver < 3):
            raise GalleryError(f"{mpath} v{ver} names re-rank store codec {self.codec!r}; this mmgeo reads "
                               f"{', '.join(CODECS)} (compressed ones in v3) — {REBUILD}")
        if self.store.get("patches") and ver < 4:
            raise GalleryError(f"{mpath} v{ver} records a pruned re-rank store (a v4 feature); {REBUILD}")
        files = [*META_FILES, *store_files(self.store)]
        missing = [f for f in files if not (self.root / f).is_file()]
        if not shards and not (self.root / "global.faiss").is_file():
            missing.append("global.faiss")
        if missing:
            raise GalleryError(f"index {self.root} is missing {missing}; {REBUILD}")
        self.model_record = r = self.manifest["model"]
        self.count = int(self.manifest["count"])
        H, S = r["num_heads"], r["num_patches"]
        self.num_patches = L = self._stored_patches(S)
        if "bytes_per_image" not in self.store:  # an index from before the store record: fp16
            self.store = fp16_store(H, L, r["d_a"], r["d_e"])
        self.dims = {"keys": r["d_a"], "values": r["d_e"]}
        if self.codec == "fp16":
            self.keys = np.load(self.root / "keys.npy", mmap_mode="r")  # (N, H, L, d_a) fp16
            self.values = np.load(self.root / "values.npy", mmap_mode="r")  # (N, H, L, d_e) fp16
            self.mask = np.load(self.root / "mask.npy", mmap_mode="r")  # (N, L) bool
            arrays = {"keys.npy": self.keys, "values.npy": self.values, "mask.npy": self.mask}
            expect = {"keys.npy": (self.count, H, L, r["d_a"]), "values.npy": (self.count, H, L, r["d_e"]),
                      "mask.npy": (self.count, L)}
        else:
            try:
                self.quantizers = load_quantizers(self.root, self.store, H, self.dims)  # role -> one per head
                self.codewords = {role: Codewords.of(self.quantizers[role]) for role in ROLES}  # None: SQ
            except CodebookError as err:
                raise GalleryError(str(err)) from err
            self.codes = {role: np.load(self.root / CODES_FILE.format(role=role), mmap_mode="r")  # (N, H, L, cs)
                          for role in ROLES}
            self.mask_bits = (np.load(self.root / MASK_BITS_FILE, mmap_mode="r")  # (N, ceil(L / 8)) uint8
                              if self.store["mask"] == "packed" else None)
            arrays = {CODES_FILE.format(role=role): self.codes[role] for role in ROLES}
            expect = {CODES_FILE.format(role=role): (self.count, H, L, self.quantizers[role][0].sa_code_size())
                      for role in ROLES}
            if self.mask_bits is not None:
                arrays[MASK_BITS_FILE], expect[MASK_BITS_FILE] = self.mask_bits, (self.count, -(-L // 8))
        self.patch_bits = None  # (N, ceil(S / 8)) uint8: which grid patches a pruned store kept
        if L != S:
            self.patch_bits = arrays[PATCHES_FILE] = np.load(self.root / PATCHES_FILE, mmap_mode="r")
            expect[PATCHES_FILE] = (self.count, -(-S // 8))
        for name, shape in expect.items():
            if tuple(arrays[name].shape) != shape:
                raise GalleryError(f"{name} has shape {tuple(arrays[name].shape)}, manifest says {shape}; "
                                   "the index is damaged — rebuild it")
        self.meta = json.loads((self.root / "meta.json").read_text())
        if shards:  # memory-mapped shards, searched and merged by ShardedIndex (same search() as a FAISS index)
            try:
                self.index = ShardedIndex.load(self.root / SHARDS_DIR)
            except ShardsError as err:
                raise GalleryError(f"index {self.root}: {err}") from err
        else:
            self.index = faiss.read_index(str(self.root / "global.faiss"))
        if self.index.ntotal != self.count or len(self.meta) != self.count:
            raise GalleryError(f"global.faiss holds {self.index.ntotal} vectors and meta.json {len(self.meta)} rows, "
                               f"manifest says {self.count}; rebuild the index")

    def _stored_patches(self, S: int) -> int:
        """Patches stored per image: S, or the count a pruned store's record gives (checked)."""
        rec = self.store.get("patches")
        if not rec:
            return S
        kept = rec.get("kept") if isinstance(rec, dict) else None
        if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept < S or rec.get("of") != S:
            raise GalleryError(f"manifest.json of {self.root}: the pruned store record {rec!r} does not fit the "
                               f"model's {S} patches; the index is damaged — {REBUILD}")
        return kept

    def image_path(self, image_id: int) -> Path:
        p = Path(self.meta[image_id]["path"])
        return p if p.is_absolute() else self.root / p
