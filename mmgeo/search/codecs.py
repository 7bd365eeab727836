"""Codecs of the re-rank store (docs/design.md §10): how an index keeps every image's keys k and values v̂.

``fp16`` stores them as they are, 2 bytes a dimension. Every other codec stores FAISS codes: one quantizer
(``faiss.index_factory``: ScalarQuantizer ``SQ``, ProductQuantizer ``PQ``, ResidualQuantizer ``RQ``) per
(keys | values, head), trained on the real patches of a sample of the gallery's own images, then written as a
FAISS file whose size and SHA-256 the manifest records (``codebook_bytes``, counted apart from
``bytes_per_image``). PQ and RQ codes are scored straight from per-query look-up tables (``Codewords``,
``two_stage.rerank_candidates``); SQ codes are decoded a block of candidates at a time
(``Gallery.candidate_blocks``), so fp32 keys/values exist for one block of at most ``store.BLOCK_BYTES``.

Bytes a dimension: fp16 2, sq8 1, sq4 1/2, pq4 1/4, pq8 / rq8 1/8, pq16 / rq16 1/16. PQ and RQ need the
dimension divisible by their dimensions per byte. A mask whose patches are all real is not stored at all
(``"mask": "all"``); otherwise it is kept as packed bits. Limits: the quantizers are trained from the fp16 arrays
of the build (so a build needs their disk space once, in its staging folder), on at most ``train_images``
evenly spaced images and ``TRAIN_VECTORS`` of their patches per quantizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmgeo.io import file_sha256


class CodebookError(ValueError):
    """A codebook file that does not match its index (missing, truncated, from another build)."""


ROLES = ("keys", "values")  # keys k (d_a), values v̂ (d_e)
CODES_FILE = "{role}.codes.npy"  # (N, H, L, code_size) uint8
MASK_BITS_FILE = "mask.bits.npy"  # (N, ceil(L / 8)) uint8, np.packbits of the (N, L) mask, when not all real
QUANTIZER_DIR = "codebooks"
CODEWORDS = 256  # per PQ / RQ codebook: 8-bit codes
TRAIN_IMAGES = 4096  # images sampled (evenly spaced) to train the quantizers
TRAIN_VECTORS = 1 << 16  # and at most this many of their real patches per quantizer (FAISS's PQ samples as many)


@dataclass(frozen=True)
class Codec:
    """A re-rank store codec: ``factory`` (a ``faiss.index_factory`` string with ``{m}`` = d / dims_per_code)."""

    name: str  # the --codec choice
    factory: str  # "" for fp16 (no quantizer)
    dims_per_code: int  # dimensions per code of ``factory`` (PQ / RQ); 1 for SQ and fp16
    bytes_per_dim: float  # stored bytes per dimension
    help: str  # one line for --help

    def factory_for(self, d: int) -> str:
        if d % self.dims_per_code:
            raise ValueError(f"codec {self.name} codes {self.dims_per_code} dimensions per byte; d = {d} is not a "
                             f"multiple of it: choose another codec (python -m serve build --help lists them)")
        return self.factory.format(m=d // self.dims_per_code)


CODECS = {c.name: c for c in [
    Codec("fp16", "", 1, 2.0, "half floats (exact up to fp16 rounding)"),
    Codec("sq8", "SQ8", 1, 1.0, "8-bit scalar quantizer, 1/2 of fp16"),
    Codec("sq4", "SQ4", 1, 0.5, "4-bit scalar quantizer, 1/4 of fp16"),
    Codec("pq4", "PQ{m}x8np", 4, 0.25, "product quantizer, a byte per 4 dimensions, 1/8 of fp16"),
    Codec("pq8", "PQ{m}x8np", 8, 0.125, "product quantizer, a byte per 8 dimensions, 1/16 of fp16"),
    Codec("pq16", "PQ{m}x8np", 16, 0.0625, "product quantizer, a byte per 16 dimensions, 1/32 of fp16"),
    Codec("rq8", "RQ{m}x8", 8, 0.125, "residual quantizer, a byte per 8 dimensions, 1/16 of fp16"),
    Codec("rq16", "RQ{m}x8", 16, 0.0625, "residual quantizer, a byte per 16 dimensions, 1/32 of fp16"),
]}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]


def min_train_vectors(codec: str) -> int:
    """Real patches per head a codec needs to train: PQ / RQ k-means needs a vector per codeword."""
    return CODEWORDS if get_codec(codec).dims_per_code > 1 else 1


def check_codec(codec: str, rec: dict, train_images: int, count: int) -> None:
    """Refuse (ValueError), before any image is encoded: an unknown codec, one that cannot code the model's
    dimensions (``rec``: d_a, d_e, num_patches), and fewer training images or patches (``count`` images at most)
    than it needs."""
    c = get_codec(codec)
    for d in (rec["d_a"], rec["d_e"]):
        c.factory_for(d)
    if train_images < 1:
        raise ValueError(f"train_images must be at least 1, got {train_images}")
    patches = min(count, train_images) * rec["num_patches"]
    if patches < min_train_vectors(codec):
        raise ValueError(f"codec {codec} needs at least {min_train_vectors(codec)} patches per head to train on; "
                         f"{min(count, train_images)} image(s) give at most {patches}: use fp16, sq8 or sq4 for a "
                         "gallery this small")


def mask_bytes(num_patches: int, kind: str) -> int:
    """Stored mask bytes per image: fp16 stores a bool a patch, the others packed bits or (all real) nothing."""
    return {"bool": num_patches, "packed": -(-num_patches // 8), "all": 0}[kind]


def bytes_per_image(codec: str, num_heads: int, num_patches: int, d_a: int, d_e: int, mask: str) -> int:
    """Bytes of the re-rank store per image (codes + mask; codebooks not counted)."""
    c = get_codec(codec)
    per_patch = sum(int(round(d * c.bytes_per_dim)) for d in (d_a, d_e))
    return num_heads * num_patches * per_patch + mask_bytes(num_patches, mask)


# ------------------------------------------------------------------------------------------------ writing

def train_quantizers(codec: str, arrays: dict, mask, out: Path, train_images: int = TRAIN_IMAGES) -> list[dict]:
    """Train one quantizer per (role, head) on the real patches of up to ``train_images`` evenly spaced images of
    ``arrays`` (role -> (N, H, L, d) array or memmap) and write them under ``out`` / codebooks; -> their records."""
    import faiss

    c = get_codec(codec)
    n = len(mask)
    rows = np.unique(np.linspace(0, n - 1, min(n, train_images)).round().astype(np.int64))
    real = np.asarray(mask[rows], dtype=bool)  # (n_s, L)
    (out / QUANTIZER_DIR).mkdir(exist_ok=True)
    records = []
    for role in ROLES:
        sample = np.asarray(arrays[role][rows], dtype=np.float32)  # (n_s, H, L, d)
        d = sample.shape[-1]
        for h in range(sample.shape[1]):
            x = sample[:, h][real]  # (n_real, d)
            if len(x) > TRAIN_VECTORS:  # evenly spaced: bounded training time for any image size
                x = x[np.linspace(0, len(x) - 1, TRAIN_VECTORS).round().astype(np.int64)]
            x = np.ascontiguousarray(x)
            if len(x) < min_train_vectors(codec):
                raise ValueError(f"codec {codec} learns {CODEWORDS} codewords per sub-vector from at least "
                                 f"{CODEWORDS} real patches per head; this gallery has {len(x)}: use fp16, sq8 or "
                                 "sq4 for a gallery this small")
            q = fast_encoding(faiss.index_factory(d, c.factory_for(d)))
            q.train(x)  # FAISS's k-means has a fixed seed: the same sample gives the same codebook
            err = np.linalg.norm(q.sa_decode(q.sa_encode(x)) - x) / max(float(np.linalg.norm(x)), 1e-12)
            name = f"{QUANTIZER_DIR}/{role}.{h}.faiss"
            faiss.write_index(q, str(out / name))
            records.append({"role": role, "head": h, "file": name, "factory": c.factory_for(d), "d": d,
                            "code_size": int(q.sa_code_size()), "bytes": (out / name).stat().st_size,
                            "sha256": file_sha256(out / name), "train_vectors": int(len(x)),
                            "rel_error": round(float(err), 5)})
    return records


def fp16_store(num_heads: int, num_patches: int, d_a: int, d_e: int) -> dict:
    """The manifest's ``store`` record of the fp16 arrays (keys.npy, values.npy, mask.npy)."""
    return {"codec": "fp16", "mask": "bool", "codebook_bytes": 0,
            "bytes_per_image": bytes_per_image("fp16", num_heads, num_patches, d_a, d_e, "bool")}


def write_coded_store(folder: Path, codec: str, train_images: int = TRAIN_IMAGES, block_images: int = 2048) -> dict:
    """Replace the fp16 keys.npy / values.npy / mask.npy of a staged index ``folder`` by ``codec``'s codes (trained
    here, ``train_quantizers``), written ``block_images`` images at a time; -> the manifest's ``store`` record."""
    import faiss

    arrays = {role: np.load(folder / f"{role}.npy", mmap_mode="r") for role in ROLES}  # (N, H, L, d) fp16
    mask = np.load(folder / "mask.npy", mmap_mode="r")  # (N, L) bool
    N, H, L, _ = arrays["keys"].shape
    records = train_quantizers(codec, arrays, mask, folder, train_images)
    code_size = {}
    for role in ROLES:
        qs = [fast_encoding(faiss.read_index(str(folder / r["file"]))) for r in records if r["role"] == role]
        code_size[role] = qs[0].sa_code_size()
        out = np.lib.format.open_memmap(folder / CODES_FILE.format(role=role), mode="w+", dtype=np.uint8,
                                        shape=(N, H, L, code_size[role]))
        for start in range(0, N, block_images):
            out[start:start + block_images] = encode_block(qs, arrays[role][start:start + block_images])
        out.flush()
        del out
    all_real = all(bool(np.all(mask[i:i + block_images])) for i in range(0, N, block_images))
    if not all_real:
        bits = np.lib.format.open_memmap(folder / MASK_BITS_FILE, mode="w+", dtype=np.uint8, shape=(N, -(-L // 8)))
        for start in range(0, N, block_images):
            bits[start:start + block_images] = np.packbits(mask[start:start + block_images], axis=1)
        bits.flush()
        del bits
    del arrays, mask  # close the memmaps before their files go
    for name in ("keys.npy", "values.npy", "mask.npy"):
        (folder / name).unlink()
    kind = "all" if all_real else "packed"
    return {"codec": codec, "mask": kind,
            "bytes_per_image": H * L * sum(code_size.values()) + mask_bytes(L, kind),
            "codebook_bytes": sum(r["bytes"] for r in records),
            "train_images": min(N, train_images),
            "rel_error": {role: max(r["rel_error"] for r in records if r["role"] == role) for role in ROLES},
            "quantizers": records}


def fast_encoding(q):
    """A residual quantizer encodes with look-up tables of codeword products: the same codes, 2-3x faster."""
    if hasattr(q, "rq"):
        q.rq.use_beam_LUT = 1
    return q


def encode_block(quantizers: list, block: np.ndarray) -> np.ndarray:
    """(n, H, L, d) float -> (n, H, L, code_size) uint8 codes, head h by ``quantizers[h]``."""
    n, H, L, d = block.shape
    out = np.empty((n, H, L, quantizers[0].sa_code_size()), np.uint8)
    for h in range(H):
        x = np.ascontiguousarray(block[:, h], dtype=np.float32).reshape(n * L, d)
        out[:, h] = quantizers[h].sa_encode(x).reshape(n, L, -1)
    return out


# ------------------------------------------------------------------------------------------------ reading

def load_quantizers(root: Path, store: dict, num_heads: int, dims: dict, read=None) -> dict[str, list]:
    """The quantizers a manifest's ``store`` record lists, each checked (size, SHA-256, dimension, code size,
    trained) -> role -> one per head. CodebookError naming the file and the fix on any mismatch. ``read``: a
    function of a record -> (the codebook's bytes or None when absent, where it was read from), for codebooks kept
    elsewhere than under ``root`` (a database: ``mmgeo.search.database``); default: the files under ``root``."""
    import faiss

    def read_file(r):
        path = root / r["file"]
        return (path.read_bytes() if path.is_file() else None), f"codebook {path}"

    read = read or read_file
    recs = store.get("quantizers") or []
    out = {role: [None] * num_heads for role in ROLES}
    for r in recs:
        data, where = read(r)
        if data is None:
            raise CodebookError(f"{where} is missing; the index is incomplete — rebuild it with "
                                "`python -m serve build`")
        size = len(data)
        if size != r["bytes"] or hashlib.sha256(data).hexdigest() != r["sha256"]:
            raise CodebookError(f"{where} is not the one this index was built with ({size} bytes, manifest says "
                               f"{r['bytes']}; or its SHA-256 differs): truncated, damaged or copied from another "
                               "index — rebuild the index with `python -m serve build`")
        try:
            q = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as err:
            raise CodebookError(f"{where} cannot be read by FAISS ({str(err).splitlines()[0]}); rebuild the "
                               "index") from err
        if q.d != r["d"] or q.d != dims[r["role"]] or q.sa_code_size() != r["code_size"] or not q.is_trained:
            raise CodebookError(f"{where} codes d={q.d} in {q.sa_code_size()} bytes (trained: {q.is_trained}); the "
                               f"manifest says d={r['d']} in {r['code_size']} and the model d={dims[r['role']]}: "
                               "rebuild the index")
        out[r["role"]][r["head"]] = q
    missing = [f"{role}.{h}" for role, qs in out.items() for h, q in enumerate(qs) if q is None]
    if missing:
        raise CodebookError(f"the manifest lists no codebook for {missing}; the index is damaged — rebuild it")
    return out


def decode(quantizers: list, codes: np.ndarray) -> torch.Tensor:
    """(K, H, L, code_size) uint8 -> (H, K, L, d) float32, head-major, each head decoded by FAISS straight into
    its slice of the output."""
    K, H, L, cs = codes.shape
    d = quantizers[0].d
    out = torch.empty(H, K, L, d)  # (H, K, L, d)
    for h in range(H):
        quantizers[h].sa_decode(np.ascontiguousarray(codes[:, h]).reshape(K * L, cs), out[h].numpy().reshape(-1, d))
    return out


class Codewords:
    """One role's quantizers (one per head) whose every vector is a sum of M codewords, one from each of M
    256-entry tables, and whose code is just the M indices: RQ (``RQ{m}x8``, no norm bytes) and PQ
    (``PQ{m}x8np``: sub-vectors as full-length codewords, zero outside their slice).

    Such codes decode as one ``embedding_bag`` sum over all heads' stacked tables (``decode``, twice as fast as
    FAISS's ``sa_decode``), and a dot product with a code is a sum of M entries of a look-up table (``lut``):
    ``<x, k> = Σ_m <x, c_m[code_m]>`` (Jégou et al. 2011, asymmetric distance computation)."""

    def __init__(self, tables: torch.Tensor):
        self.table = tables.reshape(-1, tables.shape[-1])  # (H * M * 256, d), head-major
        H, MC, _ = tables.shape
        M = MC // CODEWORDS
        self.offsets = (torch.arange(H).view(H, 1, 1, 1) * M + torch.arange(M)) * CODEWORDS  # (H, 1, 1, M)
        self.max_norm = tables.view(H, M, CODEWORDS, -1).norm(dim=-1).amax(2).sum(1)  # (H,) ≥ any decoded |x|

    @classmethod
    def of(cls, quantizers: list) -> Codewords | None:
        """The stacked tables of ``quantizers``, or None when one of them is not a sum of 8-bit codewords."""
        import faiss

        tables = []
        for q in quantizers:
            if hasattr(q, "rq"):
                rq = q.rq
                if rq.code_size != rq.M or any(rq.nbits.at(m) != 8 for m in range(rq.M)):
                    return None
                tables.append(faiss.vector_to_array(rq.codebooks).reshape(rq.M * CODEWORDS, rq.d))
            elif hasattr(q, "pq"):
                pq = q.pq
                if pq.nbits != 8 or pq.code_size != pq.M:
                    return None
                sub = faiss.vector_to_array(pq.centroids).reshape(pq.M, CODEWORDS, pq.dsub)
                full = np.zeros((pq.M, CODEWORDS, pq.d), np.float32)
                for m in range(pq.M):
                    full[m, :, m * pq.dsub:(m + 1) * pq.dsub] = sub[m]
                tables.append(full.reshape(pq.M * CODEWORDS, pq.d))
            else:
                return None
        if len({t.shape for t in tables}) != 1:
            return None
        return cls(torch.from_numpy(np.stack(tables)))  # (H, M * 256, d)

    def indices(self, codes: np.ndarray) -> torch.Tensor:
        """(K, H, L, M) uint8 codes -> (H, K, L, M) int64 rows of ``table``."""
        return torch.from_numpy(np.ascontiguousarray(codes.transpose(1, 0, 2, 3))).long() + self.offsets

    def decode(self, codes: np.ndarray) -> torch.Tensor:
        """(K, H, L, M) uint8 -> (H, K, L, d) float32."""
        K, H, L, M = codes.shape
        out = torch.nn.functional.embedding_bag(self.indices(codes).view(-1, M), self.table, mode="sum")
        return out.view(H, K, L, -1)

    def lut(self, x: torch.Tensor) -> torch.Tensor:
        """(H, n, d) vectors -> (H * M * 256, n): every codeword's dot product with each, head by head; a code's
        dot products are ``embedding_bag(indices, lut, mode="sum")``."""
        H, n, d = x.shape
        return torch.bmm(self.table.view(H, -1, d), x.transpose(1, 2)).view(-1, n)


def unpack_mask(bits: np.ndarray, num_patches: int) -> np.ndarray:
    """(K, ceil(L / 8)) packed bits -> (K, L) bool."""
    return np.unpackbits(bits, axis=1, count=num_patches).astype(bool)
