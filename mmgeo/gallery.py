"""An on-disk image gallery for search: FAISS over global vectors + memory-mapped keys/values (DESIGN §2).

Layout of an index directory (format ``mmgeo-gallery`` v1, or v2 when sharded)::

    manifest.json   format, version, model (path, sha256, dims), count, skipped, index_type, shards (v2)
    global.faiss    FAISS index over the (N, d_global) pooled image vectors (inner product = cosine), or
    global.shards/  the same cut into shards of ``shard_size`` (``mmgeo.shards``) when N > shard_size (v2)
    keys.npy        (N, H, L, d_a) fp16  image keys k, memory-mapped on load
    values.npy      (N, H, L, d_e) fp16  image values v̂, memory-mapped on load
    mask.npy        (N, L) bool          real patches
    meta.json       [{"id", "path", "width", "height"}] — ``path`` relative to the directory when inside it

Builds are atomic: everything is written into a temp directory next to the target, which replaces the
target only once complete, so an interrupted build never leaves a half index that loads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from mmgeo.io import StagedDir
from mmgeo.kernels.pair_score import candidate_scores
from mmgeo.shards import ShardedIndex, ShardsError, write_sharded

FORMAT = "mmgeo-gallery"
VERSIONS = (1, 2)  # v2 = v1 + a sharded global index; unsharded indexes are still written as v1 (older mmgeo reads)
FILES = ("manifest.json", "keys.npy", "values.npy", "mask.npy", "meta.json")  # + global.faiss or global.shards/
SHARDS_DIR = "global.shards"
INDEX_TYPES = ("auto", "flat", "hnsw", "ivfpq")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
FLAT_MAX, HNSW_MAX = 10_000, 1_000_000  # auto: exact below 10k images, HNSW below 1M, IVF-PQ above


class GalleryError(ValueError):
    """An index directory that cannot be used (missing file, wrong version, other model)."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def choose_index_type(count: int, index_type: str = "auto") -> str:
    if index_type not in INDEX_TYPES:
        raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {index_type!r}")
    if index_type != "auto":
        return index_type
    return "flat" if count < FLAT_MAX else "hnsw" if count < HNSW_MAX else "ivfpq"


def build_faiss(vectors: np.ndarray, index_type: str = "auto"):
    """FAISS inner-product index over (N, d) float32 vectors; type by size unless given."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = vectors.shape
    kind = choose_index_type(n, index_type)
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction, index.hnsw.efSearch = 80, 128
    else:
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))  # FAISS wants ~39 training points per list
        m = next(m for m in (16, 8, 4, 2, 1) if d % m == 0)  # PQ sub-quantizers must divide d
        nbits = min(8, max(4, int(math.log2(max(n // 39, 16)))))  # 8 bits (256 codes) once there is data for it
        index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors[np.random.default_rng(0).permutation(n)[:256 * nlist]])
        index.nprobe = min(nlist, 16)
    index.add(vectors)
    return index


def list_images(folder: str | os.PathLike) -> list[Path]:
    """Image files under ``folder`` (recursive, by suffix), sorted for a stable id order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {str(folder)!r} does not exist")
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def open_image(path: str | os.PathLike, max_pixels: int = 50_000_000):
    """PIL RGB image, fully decoded; raises ValueError/OSError on unreadable files or too many pixels."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            if im.width * im.height > max_pixels:
                raise ValueError(f"{im.width}x{im.height} pixels is over the limit of {max_pixels}")
            return im.convert("RGB")


def _model_record(model, ckpt: str | os.PathLike | None) -> dict:
    cfg = model.cfg
    grid = cfg.image_size // cfg.patch_size
    return {"path": None if ckpt is None else str(Path(ckpt).resolve()),
            "sha256": None if ckpt is None else file_sha256(ckpt),
            "num_heads": cfg.num_heads, "d_a": cfg.d_a, "d_e": cfg.d_e, "d_global": cfg.d_global,
            "num_patches": grid * grid, "image_size": cfg.image_size}


def _write_global(tmp: Path, pooled: np.ndarray, index_type: str, shard_size: int | None) -> tuple[str, dict | None]:
    """FAISS index over (N, d_g) ``pooled`` (an array or memmap): ``global.faiss``, or ``global.shards/`` when N is
    over ``shard_size`` (read one shard at a time). -> (index type, shards record for the manifest or None)."""
    import faiss

    if shard_size is not None and len(pooled) > shard_size:
        rec = write_sharded(pooled, tmp / SHARDS_DIR, shard_size, index_type)
        kinds = dict.fromkeys(s["index_type"] for s in rec["shards"])  # distinct, in shard order
        return "+".join(kinds), {"dir": SHARDS_DIR, "count": len(rec["shards"]), "shard_size": shard_size}
    kind = choose_index_type(len(pooled), index_type)
    faiss.write_index(build_faiss(pooled, kind), str(tmp / "global.faiss"))
    return kind, None


def _write(staging: StagedDir, model_rec: dict, meta: list[dict], kind: str, shards: dict | None,
           skipped: list[dict]) -> dict:
    """Write meta and manifest into the staging dir (arrays and FAISS index are already there) and commit."""
    (staging.tmp / "meta.json").write_text(json.dumps(meta))
    manifest = {"format": FORMAT, "version": 2 if shards else 1, "model": model_rec, "count": len(meta),
                "index_type": kind, "skipped": {"count": len(skipped), "files": skipped[:1000]},
                "dtype": "float16"}
    if shards:
        manifest["shards"] = shards
    (staging.tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # written last
    staging.commit()
    return manifest


def build_gallery(model, items: Iterable[tuple[str, object]], total: int, out: str | os.PathLike,
                  ckpt: str | os.PathLike | None = None, index_type: str = "auto", batch_size: int = 64,
                  progress: bool = True, fail_after_encode: bool = False, shard_size: int | None = 100_000) -> dict:
    """Encode images into an index directory at ``out``; -> the manifest.

    ``items`` yields ``(path, image_or_loader)`` where the second is a PIL image or a zero-argument
    callable returning one (it may raise: the file is skipped and counted). ``path=None`` (generated
    images) saves the image as ``images/<id>.png`` inside the index. ``total`` bounds the count. Over
    ``shard_size`` images the global index is sharded (``None``: never).
    ``fail_after_encode`` raises after encoding, before the commit (for tests of interrupted builds).
    """
    from tqdm.auto import tqdm

    if not model.geometric:
        raise ValueError("the gallery stores geometric keys/values: build it with a geometric model, "
                         "not a global-only (CLIP baseline) one")
    rec = _model_record(model, ckpt)
    H, L = rec["num_heads"], rec["num_patches"]
    staging = StagedDir.next_to(Path(out))
    try:
        arr = {name: np.lib.format.open_memmap(staging.tmp / f"{name}.partial", mode="w+", dtype=dt, shape=shape)
               for name, dt, shape in [("keys", np.float16, (total, H, L, rec["d_a"])),
                                       ("values", np.float16, (total, H, L, rec["d_e"])),
                                       ("mask", np.bool_, (total, L)),
                                       ("pooled", np.float32, (total, rec["d_global"]))]}
        meta, skipped, batch = [], [], []
        bar = tqdm(total=total, desc="encode", unit="img", disable=not progress)

        def flush():
            emb = model.encode_image([im for _, im in batch])
            n0 = len(meta) - len(batch)
            sl = slice(n0, n0 + len(batch))
            arr["keys"][sl] = emb.attn.cpu().numpy()  # (B, H, L, d_a)
            arr["values"][sl] = emb.value.cpu().numpy()  # (B, H, L, d_e)
            arr["mask"][sl] = emb.mask.cpu().numpy()  # (B, L)
            arr["pooled"][sl] = emb.pooled.float().cpu().numpy()  # (B, d_g)
            batch.clear()

        for path, source in _take(items, total):
            try:
                im = source() if callable(source) else source
                im = im.convert("RGB")
            except Exception as err:  # noqa: BLE001 - any unreadable file is skipped and counted
                skipped.append({"path": str(path), "error": f"{type(err).__name__}: {err}"})
                bar.update(1)
                continue
            if path is None:  # generated image: keep a copy inside the index so /images/{id} can serve it
                (staging.tmp / "images").mkdir(exist_ok=True)
                path = f"images/{len(meta):07d}.png"
                im.save(staging.tmp / path)
            else:
                path = str(Path(path).resolve())
            meta.append({"id": len(meta), "path": path, "width": im.width, "height": im.height})
            batch.append((path, im))
            bar.update(1)
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
        bar.close()
        if not meta:
            raise ValueError(f"no readable image among {len(skipped)} file(s); first error: "
                             f"{skipped[0]['error'] if skipped else 'no files'}")
        n = len(meta)
        for name in ("keys", "values", "mask"):
            _finish_array(arr[name], n, staging.tmp / f"{name}.npy")
        kind, shards = _write_global(staging.tmp, arr["pooled"][:n], index_type, shard_size)
        arr.clear()  # close the memmaps before removing their files
        for p in staging.tmp.glob("*.partial"):
            p.unlink()
        if fail_after_encode:
            raise RuntimeError("injected failure after encoding (test hook)")
        return _write(staging, rec, meta, kind, shards, skipped)
    except BaseException:
        staging.discard()
        raise


def _take(items, total) -> Iterator:
    for i, item in enumerate(items):
        if i >= total:
            return
        yield item


def _finish_array(partial: np.memmap, n: int, dest: Path) -> None:
    """Copy the first ``n`` rows of a preallocated memmap into ``dest`` (.npy), in chunks."""
    out = np.lib.format.open_memmap(dest, mode="w+", dtype=partial.dtype, shape=(n, *partial.shape[1:]))
    step = max(1, (64 << 20) // max(1, partial[0].nbytes))
    for i in range(0, n, step):
        out[i:i + step] = partial[i:min(i + step, n)]
    out.flush()
    del out


def folder_items(folder: str | os.PathLike) -> tuple[list, int]:
    """(path, loader) pairs for every image file of a folder, and their count."""
    paths = list_images(folder)
    return [(p, (lambda p=p: open_image(p))) for p in paths], len(paths)


def build_random_gallery(out: str | os.PathLike, count: int, num_heads: int, num_patches: int, d_a: int, d_e: int,
                         d_global: int, index_type: str = "auto", seed: int = 0, chunk: int = 10_000,
                         model_path: str | None = None, model_sha256: str | None = None,
                         shard_size: int | None = 100_000) -> dict:
    """A gallery of random unit vectors (no images, no encoding) — for load tests of large indexes."""
    rng = np.random.default_rng(seed)
    staging = StagedDir.next_to(Path(out))
    try:
        shapes = {"keys": (count, num_heads, num_patches, d_a), "values": (count, num_heads, num_patches, d_e)}
        for name, shape in shapes.items():
            mm = np.lib.format.open_memmap(staging.tmp / f"{name}.npy", mode="w+", dtype=np.float16, shape=shape)
            for i in range(0, count, chunk):
                x = rng.standard_normal((min(chunk, count - i), *shape[1:]), dtype=np.float32)
                if name == "values":
                    x /= np.linalg.norm(x, axis=-1, keepdims=True)
                mm[i:i + chunk] = x
            mm.flush()
            del mm
        np.save(staging.tmp / "mask.npy", np.ones((count, num_patches), dtype=np.bool_))
        pooled = rng.standard_normal((count, d_global), dtype=np.float32)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        meta = [{"id": i, "path": f"random/{i}.png", "width": 0, "height": 0} for i in range(count)]
        rec = {"path": model_path, "sha256": model_sha256, "num_heads": num_heads, "d_a": d_a, "d_e": d_e,
               "d_global": d_global, "num_patches": num_patches, "image_size": None}
        kind, shards = _write_global(staging.tmp, pooled, index_type, shard_size)
        return _write(staging, rec, meta, kind, shards, [])
    except BaseException:
        staging.discard()
        raise


class Gallery:
    """A loaded index directory: FAISS index (or ``ShardedIndex``), memory-mapped keys/values/mask, metadata."""

    def __init__(self, root: str | os.PathLike):
        import faiss

        self.root = Path(root)
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
            raise GalleryError(f"index {self.root} is missing {missing}; rebuild it with `python -m serve build`")
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


def rerank_scores(q: torch.Tensor, q_mask: torch.Tensor, u: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """The geometric score (``mmgeo.kernels.pair_score``'s numbers) of one caption against K candidate images.

    q (H, T, d_a), q_mask (T,), u (H, T, d_e) of the caption; keys (H, K, S, d_a), values (H, K, S, d_e) and
    mask (K, S) from ``Gallery.candidates`` -> (K,), by ``candidate_scores``: two GEMMs per head over all
    K·S patches at once (<q_t, k_j> and <u_t, v_j>), not K small ones.
    """
    q, u = q[:, q_mask].float(), u[:, q_mask].float()  # (H, n, d) real tokens only
    per_token = candidate_scores(q, u, keys, values, mask, keys.shape[-1] ** -0.5)  # (n, K), summed over heads
    return per_token.mean(0) / q.shape[0]  # mean over tokens and heads


@torch.inference_mode()
def search_texts(model, gallery: Gallery, texts, ks, reranks, k_prime: int = 100) -> list[tuple[np.ndarray, ...]]:
    """Two-stage search for a batch of encoded captions -> one (ids (k,), scores (k,)) per caption, best first.

    One FAISS search for the batch over the global vectors (top ``max(k, k_prime)`` for a re-ranked query,
    top ``k`` otherwise); each re-ranked query's K' candidates are read (fp16 on disk, fp32 here) and
    re-scored by the geometric score against their stored keys/values (``rerank_scores``).
    """
    want = [min(max(k, k_prime) if r else k, gallery.count) for k, r in zip(ks, reranks)]  # per query
    q = np.ascontiguousarray(texts.pooled.float().cpu().numpy())  # (B, d_g)
    g_scores, ids = gallery.index.search(q, max(want))  # (B, W); HNSW / IVF may pad with -1
    valid = (ids >= 0) & (np.arange(ids.shape[1])[None] < np.asarray(want)[:, None])  # (B, W)
    rows = [i for i in range(len(ks)) if reranks[i] and valid[i].any()]
    out = [(ids[i][valid[i]][:ks[i]], g_scores[i][valid[i]][:ks[i]]) for i in range(len(ks))]
    if not rows:
        return out
    if not model.geometric:
        raise ValueError("re-ranking needs a geometric model; this one is global-only: search with rerank off")
    texts = texts.to("cpu")
    for i in rows:
        c = ids[i][valid[i]]  # (K'_i,) candidates
        s = rerank_scores(texts.attn[i], texts.mask[i], texts.value[i], *gallery.candidates(c)).numpy()  # (K'_i,)
        order = np.argsort(-s, kind="stable")[:ks[i]]
        out[i] = c[order], s[order]
    return out


def search_text(model, gallery: Gallery, text, k: int, rerank: bool = True, k_prime: int = 100):
    """Two-stage search for one encoded caption -> (ids (k,), scores (k,)) best first (``search_texts``)."""
    return search_texts(model, gallery, text[:1], [k], [rerank], k_prime)[0]
