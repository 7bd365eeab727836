"""Writing gallery index directories (format: ``mmgeo.search.store``): from images, from encoded images, or
random vectors for load tests. Atomic: built in a ``mmgeo.io.StagedDir`` that replaces the target when complete.
Safe: ``check_out`` refuses a target that is neither absent, an empty folder nor an mmgeo index, and one that is,
is inside or contains the image folder; nothing is touched then.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from itertools import islice
from pathlib import Path

import numpy as np

from mmgeo.data.images import list_images, open_image
from mmgeo.io import StagedDir, file_sha256
from mmgeo.search.codecs import TRAIN_IMAGES, check_codec, fp16_store, write_coded_store
from mmgeo.search.faiss_index import build_faiss, choose_index_type
from mmgeo.search.pruning import check_pruning, prune_arrays
from mmgeo.search.shards import write_sharded
from mmgeo.search.store import FORMAT, SHARDS_DIR

NEW_OR_EMPTY = "build into a new or empty folder (an existing mmgeo index there is replaced)"


def _describe(folder: Path) -> str:
    files = dirs = 0
    for p in folder.iterdir():
        if p.is_dir() and not p.is_symlink():
            dirs += 1
        else:
            files += 1
    return ", ".join(f"{n} {what}{'s' if n != 1 else ''}" for n, what in ((files, "file"), (dirs, "folder")) if n)


def _is_index(folder: Path) -> tuple[bool, str]:
    """(whether ``folder`` holds an mmgeo index manifest, why not)."""
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        return False, "no manifest.json"
    try:
        fmt = json.loads(mpath.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return False, "its manifest.json is not readable JSON"
    return (True, "") if fmt == FORMAT else (False, f"its manifest.json is of format {fmt!r}, not {FORMAT!r}")


def check_out(out: str | os.PathLike, images: str | os.PathLike | None = None) -> None:
    """Raise ValueError, touching nothing, unless ``out`` may be (re)built: absent, an empty folder or an mmgeo
    index, not a symbolic link, and not the same as, inside or containing the image folder ``images``."""
    out = Path(out)
    if images is not None:
        o, i = out.resolve(), Path(images).resolve()
        rel = "is" if o == i else "is inside" if i in o.parents else "contains" if o in i.parents else None
        if rel:
            raise ValueError(f"the index folder {str(out)!r} {rel} the image folder {str(images)!r}: building there "
                             f"would replace or mix with your images; pick an index folder outside {str(images)!r}")
    if out.is_symlink():
        raise ValueError(f"{str(out)!r} is a symbolic link (to {os.readlink(out)!r}): refusing to replace it; "
                         "pass the folder itself")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is a file, not an mmgeo index: refusing to replace it; "
                         f"{NEW_OR_EMPTY}")
    if not any(out.iterdir()):
        return
    ok, why = _is_index(out)
    if not ok:
        raise ValueError(f"{str(out)!r} holds {_describe(out)}, not an mmgeo index ({why}): refusing to replace it; "
                         f"{NEW_OR_EMPTY}")


def _check_paths_outside(meta: list[dict], out: Path) -> None:
    """Refuse an index whose images lie inside its own folder (replacing it would delete them)."""
    o = out.resolve()
    for m in meta:
        p = Path(m["path"])
        if p.is_absolute() and (o == p or o in p.parents):
            raise ValueError(f"image {m['path']!r} is inside the index folder {str(out)!r}: building there would "
                             "delete it; pick an index folder outside the image folder")


class FolderItems(list):
    """``folder_items``' (path, loader) pairs; ``folder`` lets ``build_gallery`` refuse an index inside it."""

    folder: Path


def _model_record(model, ckpt: str | os.PathLike | None) -> dict:
    cfg = model.cfg
    grid = cfg.image_size // cfg.patch_size
    return {"path": None if ckpt is None else str(Path(ckpt).resolve()),
            "sha256": None if ckpt is None else file_sha256(ckpt),
            "num_heads": cfg.num_heads, "d_a": cfg.d_a, "d_e": cfg.d_e, "d_global": cfg.d_global,
            "num_patches": grid * grid, "image_size": cfg.image_size}


def _geometric(model) -> None:
    if not model.geometric:
        raise ValueError("the gallery stores geometric keys/values: build it with a geometric model, "
                         "not a global-only (CLIP baseline) one")


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


def _commit(staging: StagedDir, model_rec: dict, meta: list[dict], kind: str, shards: dict | None,
            skipped: list[dict], codec: str = "fp16", train_images: int = TRAIN_IMAGES, prune: tuple | None = None
            ) -> dict:
    """Prune the fp16 arrays when ``prune`` = (sample queries, patches to keep) says so, compress them when
    ``codec`` says so, write meta and manifest into the staging dir (the global index is there already), commit."""
    _check_paths_outside(meta, staging.target)
    r = model_rec
    patches = prune_arrays(staging.tmp, prune[0], prune[1]) if prune else None
    if codec == "fp16":
        store = fp16_store(r["num_heads"], patches["kept"] if patches else r["num_patches"], r["d_a"], r["d_e"])
    else:
        store = write_coded_store(staging.tmp, codec, train_images)
    if patches:  # which patches each image kept: counted in the store's bytes
        store["patches"] = patches
        store["bytes_per_image"] += patches["bytes_per_image"]
    check_out(staging.target)  # again: the target may have changed during the build
    (staging.tmp / "meta.json").write_text(json.dumps(meta))
    version = 4 if patches else 3 if codec != "fp16" else 2 if shards else 1
    manifest = {"format": FORMAT, "version": version, "model": model_rec, "count": len(meta),
                "index_type": kind, "skipped": {"count": len(skipped), "files": skipped[:1000]},
                "store": store}
    if shards:
        manifest["shards"] = shards
    (staging.tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # written last
    staging.commit()
    return manifest


def _save_rows(dest: Path, shape: tuple, dtype, blocks: Iterable[np.ndarray]) -> None:
    """Write a .npy of ``shape`` from consecutive row blocks, through a memmap (one block in memory)."""
    out = np.lib.format.open_memmap(dest, mode="w+", dtype=dtype, shape=shape)
    start = 0
    for block in blocks:
        out[start:start + len(block)] = block
        start += len(block)
    out.flush()
    del out


def _row_blocks(arr, n: int, row_bytes: int):
    step = max(1, (64 << 20) // max(1, row_bytes))  # 64 MB per block
    return (arr[i:min(i + step, n)] for i in range(0, n, step))


def build_gallery(model, items: Iterable[tuple[str, object]], total: int, out: str | os.PathLike,
                  ckpt: str | os.PathLike | None = None, index_type: str = "auto", batch_size: int = 64,
                  progress: bool = True, fail_after_encode: bool = False, shard_size: int | None = 100_000,
                  codec: str = "fp16", train_images: int = TRAIN_IMAGES, keep_patches: int | None = None,
                  prune_queries=None) -> dict:
    """Encode images into an index directory at ``out``; -> the manifest.

    ``items`` yields ``(path, image_or_loader)`` where the second is a PIL image or a zero-argument
    callable returning one (it may raise: the file is skipped and counted). ``path=None`` (generated
    images) saves the image as ``images/<id>.png`` inside the index. ``total`` bounds the count. Over
    ``shard_size`` images the global index is sharded (``None``: never). ``codec`` (``mmgeo.search.codecs``)
    chooses how keys/values are stored: fp16, or codes of quantizers trained on ``train_images`` of them.
    ``keep_patches``: store only that many patches per image, those the encoded sample captions ``prune_queries``
    (an ``Embedding``) attend to most (``mmgeo.search.pruning``). ``fail_after_encode`` raises after encoding,
    before the commit (for tests of interrupted builds).
    Refuses (``check_out``) an ``out`` that is not absent, empty or an index, or that is, is inside or contains
    ``items.folder`` (``folder_items``) or any indexed image.
    """
    from tqdm.auto import tqdm

    _geometric(model)
    check_out(out, getattr(items, "folder", None))
    rec = _model_record(model, ckpt)
    check_pruning(keep_patches, prune_queries, rec["num_patches"])
    check_codec(codec, {**rec, "num_patches": keep_patches or rec["num_patches"]}, train_images, total)
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
            emb = model.encode_image(batch)
            sl = slice(len(meta) - len(batch), len(meta))
            arr["keys"][sl] = emb.attn.cpu().numpy()  # (B, H, L, d_a)
            arr["values"][sl] = emb.value.cpu().numpy()  # (B, H, L, d_e)
            arr["mask"][sl] = emb.mask.cpu().numpy()  # (B, L)
            arr["pooled"][sl] = emb.pooled.float().cpu().numpy()  # (B, d_g)
            batch.clear()

        for path, source in islice(items, total):
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
            batch.append(im)
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
            part = arr[name]
            _save_rows(staging.tmp / f"{name}.npy", (n, *part.shape[1:]), part.dtype,
                       _row_blocks(part, n, part[0].nbytes))
        kind, shards = _write_global(staging.tmp, arr["pooled"][:n], index_type, shard_size)
        arr.clear()  # close the memmaps before removing their files
        for p in staging.tmp.glob("*.partial"):
            p.unlink()
        if fail_after_encode:
            raise RuntimeError("injected failure after encoding (test hook)")
        return _commit(staging, rec, meta, kind, shards, skipped, codec, train_images,
                       (prune_queries, keep_patches) if keep_patches else None)
    except BaseException:
        staging.discard()
        raise


def build_gallery_from_embedding(model, images, out: str | os.PathLike, ckpt: str | os.PathLike | None = None,
                                 index_type: str = "auto", shard_size: int | None = None, codec: str = "fp16",
                                 train_images: int = TRAIN_IMAGES, keep_patches: int | None = None,
                                 prune_queries=None) -> dict:
    """An index directory of already encoded images (an ``Embedding``, id i = row i), stored exactly as
    ``build_gallery`` stores them (fp16 keys/values or ``codec``'s codes, all patches or ``keep_patches`` chosen by
    ``prune_queries``); no image files (``encoded/<id>``)."""
    _geometric(model)
    check_out(out)
    rec = _model_record(model, ckpt)
    n = len(images)
    check_pruning(keep_patches, prune_queries, rec["num_patches"])
    check_codec(codec, {**rec, "num_patches": keep_patches or rec["num_patches"]}, train_images, n)
    staging = StagedDir.next_to(Path(out))
    try:
        for name, x, dtype in (("keys", images.attn, np.float16), ("values", images.value, np.float16),
                               ("mask", images.mask, np.bool_)):
            blocks = (b.cpu().numpy() for b in _row_blocks(x, n, x[0].numel() * 4))
            _save_rows(staging.tmp / f"{name}.npy", tuple(x.shape), dtype, blocks)
        meta = [{"id": i, "path": f"encoded/{i}", "width": 0, "height": 0} for i in range(n)]
        kind, shards = _write_global(staging.tmp, images.pooled.float().cpu().numpy(), index_type, shard_size)
        return _commit(staging, rec, meta, kind, shards, [], codec, train_images,
                       (prune_queries, keep_patches) if keep_patches else None)
    except BaseException:
        staging.discard()
        raise


def folder_items(folder: str | os.PathLike) -> tuple[FolderItems, int]:
    """(path, loader) pairs for every image file of a folder (``.folder`` says which), and their count."""
    paths = list_images(folder)
    items = FolderItems((p, (lambda p=p: open_image(p))) for p in paths)
    items.folder = Path(folder)
    return items, len(paths)


def build_random_gallery(out: str | os.PathLike, count: int, num_heads: int, num_patches: int, d_a: int, d_e: int,
                         d_global: int, index_type: str = "auto", seed: int = 0, chunk: int = 10_000,
                         model_path: str | None = None, model_sha256: str | None = None,
                         shard_size: int | None = 100_000, codec: str = "fp16",
                         train_images: int = TRAIN_IMAGES, keep_patches: int | None = None) -> dict:
    """A gallery of random unit vectors (no images, no encoding) — for load tests of large indexes. ``keep_patches``
    prunes it by the attention of 64 random sample queries of 16 tokens (the store's shapes and files, not a
    meaningful choice of patches)."""
    check_out(out)
    queries = None
    if keep_patches is not None:
        import torch

        from mmgeo.models.embedding import Embedding

        g = torch.Generator().manual_seed(seed)
        queries = Embedding(torch.zeros(64, d_global), torch.randn(64, num_heads, 16, d_a, generator=g),
                            torch.zeros(64, num_heads, 16, d_e), torch.ones(64, 16, dtype=torch.bool))
    check_pruning(keep_patches, queries, num_patches)
    check_codec(codec, {"d_a": d_a, "d_e": d_e, "num_patches": keep_patches or num_patches}, train_images, count)
    rng = np.random.default_rng(seed)

    def blocks(shape, unit):
        for i in range(0, count, chunk):
            x = rng.standard_normal((min(chunk, count - i), *shape[1:]), dtype=np.float32)
            yield x / np.linalg.norm(x, axis=-1, keepdims=True) if unit else x

    staging = StagedDir.next_to(Path(out))
    try:
        for name, shape in (("keys", (count, num_heads, num_patches, d_a)),
                            ("values", (count, num_heads, num_patches, d_e))):
            _save_rows(staging.tmp / f"{name}.npy", shape, np.float16, blocks(shape, name == "values"))
        np.save(staging.tmp / "mask.npy", np.ones((count, num_patches), dtype=np.bool_))
        pooled = rng.standard_normal((count, d_global), dtype=np.float32)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        meta = [{"id": i, "path": f"random/{i}.png", "width": 0, "height": 0} for i in range(count)]
        rec = {"path": model_path, "sha256": model_sha256, "num_heads": num_heads, "d_a": d_a, "d_e": d_e,
               "d_global": d_global, "num_patches": num_patches, "image_size": None}
        kind, shards = _write_global(staging.tmp, pooled, index_type, shard_size)
        return _commit(staging, rec, meta, kind, shards, [], codec, train_images,
                       (queries, keep_patches) if keep_patches else None)
    except BaseException:
        staging.discard()
        raise
