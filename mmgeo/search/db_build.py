"""Writing a database gallery (``mmgeo.search.database``, docs/design.md §11): build one from encoded images or
from image files, add images to it, the same encoders as an index directory's (``mmgeo.search.codecs``).

A build creates the gallery (manifest + codebooks trained on up to ``train_images`` evenly spaced images, one
transaction) unless the database holds one of the same model and codec already, then adds the images in batches,
each batch one transaction (``database.add_rows``). An image whose content SHA-256 is stored is not encoded again,
so a killed build restarted with the same images only adds what is missing. Image files are hashed by their bytes;
generated images (no path) are stored as PNG in the gallery, hashed by those bytes; encoded rows without images
(``build_db_from_embedding``) by their stored numbers.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from mmgeo.io import file_sha256
from mmgeo.models.embedding import Embedding
from mmgeo.search.codecs import ROLES, TRAIN_IMAGES, bytes_per_image, check_codec, encode_block, train_quantizers
from mmgeo.search.database import (
    DEFAULT_CODEC,
    FORMAT,
    HNSW,
    VERSION,
    Database,
    DbGallery,
    Rows,
    add_rows,
    as_database,
    crash_point,
    create_gallery,
    pack_bits,
    row_bytes,
    stored_hashes,
    update_manifest,
)
from mmgeo.search.store import GalleryError


def model_record(model, ckpt: str | os.PathLike | None) -> dict:
    cfg = model.cfg
    if not model.geometric:
        raise ValueError("the gallery stores geometric keys/values: build it with a geometric model, "
                         "not a global-only (CLIP baseline) one")
    grid = cfg.image_size // cfg.patch_size
    return {"path": None if ckpt is None else str(Path(ckpt).resolve()),
            "sha256": None if ckpt is None else file_sha256(ckpt),
            "num_heads": cfg.num_heads, "d_a": cfg.d_a, "d_e": cfg.d_e, "d_global": cfg.d_global,
            "num_patches": grid * grid, "image_size": cfg.image_size}


def fp16_rounded(x: torch.Tensor) -> np.ndarray:
    """float32 numbers rounded to fp16 first: an index directory writes fp16 arrays, then trains its quantizers on
    them and encodes them, so the same images give the same codebooks and codes here."""
    return x.detach().cpu().to(torch.float16).float().numpy()


def train_store(codec: str, sample: Embedding, rec: dict, train_images: int = TRAIN_IMAGES
                ) -> tuple[dict, dict[tuple[str, int], bytes]]:
    """The store record and codebooks ((role, head) -> bytes) of ``codec``, its quantizers trained on the encoded
    ``sample`` images (as an index directory's: ``codecs.train_quantizers``)."""
    H, L = rec["num_heads"], rec["num_patches"]
    mask_bytes = -(-L // 8)
    if codec == "fp16":
        store = {"codec": "fp16", "mask": "packed", "codebook_bytes": 0,
                 "bytes_per_image": bytes_per_image("fp16", H, L, rec["d_a"], rec["d_e"], "packed")}
        store["row_bytes"] = row_bytes(store, rec, L)
        return store, {}
    check_codec(codec, rec, train_images, len(sample))
    arrays = {"keys": fp16_rounded(sample.attn), "values": fp16_rounded(sample.value)}  # what a folder trains on
    with tempfile.TemporaryDirectory(prefix="mmgeo-codebooks-") as tmp:
        records = train_quantizers(codec, arrays, sample.mask.cpu().numpy(), Path(tmp), train_images)
        books = {(r["role"], r["head"]): (Path(tmp) / r["file"]).read_bytes() for r in records}
    for r in records:
        r["file"] = f"mmgeo_codebooks/{r['role']}.{r['head']}"  # where it is kept: a row, not a file
    store = {"codec": codec, "mask": "packed", "codebook_bytes": sum(len(b) for b in books.values()),
             "train_images": min(len(sample), train_images),
             "rel_error": {role: max(r["rel_error"] for r in records if r["role"] == role) for role in ROLES},
             "quantizers": records}
    store["row_bytes"] = row_bytes(store, rec, L)
    store["bytes_per_image"] = sum(store["row_bytes"].values()) + mask_bytes
    return store, books


def manifest_of(rec: dict, store: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "model": rec, "index_type": "pgvector-hnsw", "hnsw": dict(HNSW),
            "store": store, "skipped": {"count": 0, "files": []}}


def encode_codes(gallery: DbGallery, emb: Embedding) -> tuple[list[bytes], list[bytes], list[bytes | None]]:
    """An ``Embedding`` of images -> per image its stored keys and values (bytes of the gallery's codec) and its
    real-patch bits (None: all real)."""
    n = len(emb)
    out = []
    for role, x in (("keys", emb.attn), ("values", emb.value)):
        if gallery.codec == "fp16":
            arr = x.cpu().to(torch.float16).numpy()
        else:
            arr = encode_block(gallery.quantizers[role], fp16_rounded(x))  # (n, H, L, code_size)
        out.append([arr[i].tobytes() for i in range(n)])
    return out[0], out[1], pack_bits(emb.mask.cpu().numpy())


def encoded_sha256(emb: Embedding, i: int) -> bytes:
    """A content hash of encoded image ``i`` that has no file: its global vector, keys, values and mask."""
    h = hashlib.sha256(b"mmgeo-encoded\0")
    for x in (emb.pooled[i].float(), emb.attn[i].to(torch.float16), emb.value[i].to(torch.float16), emb.mask[i]):
        h.update(x.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def compatible(gallery: DbGallery, rec: dict, codec: str) -> str | None:
    """Why a stored gallery cannot take images of this model and codec (None when it can)."""
    have = gallery.model_record
    dims = ("num_heads", "d_a", "d_e", "d_global", "num_patches")
    diff = {k: (have.get(k), rec.get(k)) for k in dims if have.get(k) != rec.get(k)}
    if diff:
        return f"its model differs (stored vs this one): {diff}"
    if have.get("sha256") and rec.get("sha256") and have["sha256"] != rec["sha256"]:
        return f"it was built with another checkpoint ({have.get('path')}, sha256 {have['sha256'][:12]}…)"
    if gallery.codec != codec:
        return f"its re-rank store is {gallery.codec}, not {codec}"
    return None


def open_or_create(model, db: Database, ckpt, codec: str, train_images: int, replace: bool,
                   sample: Callable[[], Embedding]) -> DbGallery:
    """The database's gallery when it holds one of this model and codec (and not ``replace``), else a new one whose
    codebooks are trained on ``sample()``; a gallery of another model or codec is refused unless ``replace``."""
    rec = model_record(model, ckpt)
    if not replace:
        try:
            existing = DbGallery(db)
        except GalleryError as err:
            if "holds no gallery" not in str(err) and "schema v0" not in str(err):
                raise
        else:
            why = compatible(existing, rec, codec)
            if why is None:
                return existing
            raise GalleryError(f"database {db.display} holds a gallery that cannot take these images: {why}; "
                               "replace it (serve build --replace) or use another database")
    if codec != "fp16":
        check_codec(codec, rec, train_images, train_images)  # before encoding anything
    store, books = train_store(codec, sample() if codec != "fp16" else None, rec, train_images)
    create_gallery(db, manifest_of(rec, store), books, replace=replace)
    return DbGallery(db)


def sample_rows(total: int, train_images: int) -> np.ndarray:
    return np.unique(np.linspace(0, total - 1, min(total, train_images)).round().astype(np.int64))


def build_db_from_embedding(model, images: Embedding, db: Database | str, ckpt=None, codec: str = DEFAULT_CODEC,
                            train_images: int = TRAIN_IMAGES, batch: int = 512, replace: bool = False,
                            metas: Sequence[dict] | None = None) -> dict:
    """A database gallery of already encoded images (id i = row i in a new gallery), stored as ``build_db_gallery``
    stores them; no image files (``encoded/<i>``). -> {"added", "existing", "count"}."""
    db, own = as_database(db)
    try:
        n = len(images)
        gallery = open_or_create(model, db, ckpt, codec, train_images, replace,
                                 lambda: images[torch.from_numpy(sample_rows(n, train_images))])
        added = existing = 0
        for a in range(0, n, batch):
            emb = images[a:a + batch]
            keys, values, mask = encode_codes(gallery, emb)
            m = len(emb)
            rows = Rows([encoded_sha256(emb, i) for i in range(m)],
                        list(metas[a:a + m]) if metas else [{"path": f"encoded/{a + i}", "width": 0, "height": 0}
                                                            for i in range(m)],
                        emb.pooled.float().cpu().numpy(), keys, values, mask, [None] * m, [None] * m)
            _, new = add_rows(db, rows)
            added += int(new.sum())
            existing += m - int(new.sum())
        return {"added": added, "existing": existing, "count": gallery.count}
    finally:
        if own:
            db.close()


def read_item(path, source, keep_file: bool | None = None):
    """One ``(path, image_or_loader)`` item -> (content SHA-256, metadata, RGB image, file bytes to keep or None).
    A file is hashed by its bytes (and kept when ``keep_file``); a generated image (no path) is stored as PNG."""
    from mmgeo.data.images import open_image

    if path is None:
        im = source() if callable(source) else source
        im = im.convert("RGB")
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        data = buf.getvalue()
        return hashlib.sha256(data).digest(), {"path": None, "name": "image.png", "width": im.width,
                                               "height": im.height}, im, data
    p = Path(path)
    data = p.read_bytes()
    im = source() if callable(source) else (source if source is not None else open_image(io.BytesIO(data)))
    im = im.convert("RGB")
    meta = {"path": None if keep_file else str(p.resolve()), "name": p.name, "width": im.width, "height": im.height}
    return hashlib.sha256(data).digest(), meta, im, data if keep_file else None


def store_batch(model, gallery: DbGallery, batch: list, out: dict, on_step=None) -> None:
    """Encode and add one batch of prepared images — (path or name, content SHA-256, metadata, RGB image, file bytes
    to keep or None) — in one transaction; those already stored are not encoded. Appends (path, id) to ``out``'s
    "added" / "existing"."""
    have = stored_hashes(gallery.db, [b[1] for b in batch])
    todo = [b for b in batch if b[1] not in have]
    if todo:
        crash_point("build.encode")
        emb = model.encode_image([b[3] for b in todo])
        keys, values, mask = encode_codes(gallery, emb)
        rows = Rows([b[1] for b in todo], [b[2] for b in todo], emb.pooled.float().cpu().numpy(), keys, values,
                    mask, [None] * len(todo), [b[4] for b in todo])
        ids, new = add_rows(gallery.db, rows, on_step)
        for b, i, fresh in zip(todo, ids, new):
            out["added" if fresh else "existing"].append((b[0], int(i)))
    if have:
        known = _ids_of(gallery, list(have))
        out["existing"] += [(b[0], known[b[1]]) for b in batch if b[1] in have]


def add_items(model, gallery: DbGallery, items: Iterable, total: int | None = None, batch_size: int = 64,
              progress: bool = False, keep_files: bool = False, on_step=None) -> dict:
    """Encode and add ``(path, image_or_loader)`` items (``build.folder_items``' pairs) to a database gallery, a
    batch of ``batch_size`` per transaction; images already stored (same content SHA-256) are not encoded again.
    -> {"added": [(path, id)], "existing": [(path, id)], "skipped": [{"path", "error"}], "count"}."""
    from tqdm.auto import tqdm

    gallery.check_model(model)
    out = {"added": [], "existing": [], "skipped": []}
    batch: list = []
    bar = tqdm(total=total, desc="encode", unit="img", disable=not progress)
    for n, (path, source) in enumerate(items):
        if total is not None and n >= total:
            break
        try:
            sha, meta, im, data = read_item(path, source, keep_files)
        except Exception as err:  # noqa: BLE001 - any unreadable file is skipped and counted
            out["skipped"].append({"path": str(path), "error": f"{type(err).__name__}: {err}"})
            bar.update(1)
            continue
        batch.append((None if path is None else str(path), sha, meta, im, data))
        bar.update(1)
        if len(batch) == batch_size:
            store_batch(model, gallery, batch, out, on_step)
            batch.clear()
            crash_point("build.between")
    if batch:
        store_batch(model, gallery, batch, out, on_step)
    bar.close()
    out["count"] = gallery.count
    return out


def clean_name(name: str) -> str:
    """A file name from a client without control or format characters (Unicode categories Cc, Cf), else "upload"."""
    return "".join(ch for ch in str(name) if unicodedata.category(ch) not in ("Cc", "Cf")) or "upload"


def add_uploads(model, gallery: DbGallery, uploads: Sequence[tuple[str, bytes, object]]) -> dict:
    """Add uploaded files — (file name, its bytes, the decoded RGB image) — to a database gallery in one
    transaction, each kept in its row and hashed by its bytes (the same file again is not stored again).
    -> {"added": [(name, id)], "existing": [(name, id)], "count"}. A name keeps no control or format characters
    (a NUL cannot be stored in jsonb; an escape sequence or a right-to-left override would mislead who reads it)."""
    gallery.check_model(model)
    uploads = [(clean_name(name), data, im) for name, data, im in uploads]
    batch = [(name, hashlib.sha256(data).digest(),
              {"path": None, "name": name, "width": im.width, "height": im.height}, im, data)
             for name, data, im in uploads]
    out = {"added": [], "existing": []}
    if batch:
        store_batch(model, gallery, batch, out)
    out["count"] = gallery.count
    return out


def _ids_of(gallery: DbGallery, hashes: list[bytes]) -> dict[bytes, int]:
    with gallery.db.connection() as conn:
        rows = conn.execute("SELECT content_sha256, id FROM mmgeo_images WHERE content_sha256 = ANY(%s::bytea[])",
                            [hashes]).fetchall()
    return {bytes(h): int(i) for h, i in rows}


def sampler(model, items: Sequence, train_images: int, batch_size: int) -> Callable[[], Embedding]:
    """What trains a new gallery's codebooks: the encoded readable ones of up to ``train_images`` evenly spaced
    ``items`` (encoded in batches of ``batch_size``, as a build encodes them)."""

    def sample() -> Embedding:
        ims = []
        for i in sample_rows(len(items), train_images):
            try:
                ims.append(read_item(*items[i])[2])
            except Exception:  # noqa: BLE001,S112 - unreadable: skipped here, counted by the build
                continue
        if not ims:
            raise ValueError("no readable image among the items to train the codec on")
        return Embedding.cat([model.encode_image(ims[a:a + batch_size]) for a in range(0, len(ims), batch_size)])

    return sample


def build_db_gallery(model, items: Sequence, total: int, db: Database | str, ckpt=None, codec: str = DEFAULT_CODEC,
                     train_images: int = TRAIN_IMAGES, batch_size: int = 64, progress: bool = True,
                     replace: bool = False, keep_files: bool = False) -> dict:
    """Build (or resume) a database gallery of the first ``total`` of ``items`` (``(path, image_or_loader)`` pairs,
    e.g. ``build.folder_items``; generated images have no path and are kept in the gallery as PNG). A new gallery's
    codebooks are trained on up to ``train_images`` evenly spaced items, encoded first. -> ``add_items``' summary
    plus "manifest". ``keep_files``: keep every image file in the database too (replicas on other machines)."""
    db, own = as_database(db)
    try:
        items = list(items)[:total]
        gallery = open_or_create(model, db, ckpt, codec, train_images, replace,
                                 sampler(model, items, train_images, batch_size))
        out = add_items(model, gallery, items, total, batch_size, progress, keep_files)
        crash_point("build.manifest")
        update_manifest(db, {"skipped": {"count": len(out["skipped"]), "files": out["skipped"][:1000]}})
        out["manifest"] = DbGallery(db).manifest
        return out
    finally:
        if own:
            db.close()
