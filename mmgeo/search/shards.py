"""Sharded FAISS index over (N, d) float32 global vectors, inner product (= cosine on unit vectors).

The vectors are cut into shards of at most ``shard_size`` rows, each its own FAISS file; a search asks every
shard for its top-k and merges. Layout of a shard directory (format ``mmgeo-shards`` v1)::

    shards.json        format, version, d, count, metric, shard_size, index_type (as asked),
                       shards: [{file, count, offset, index_type, bytes}]  (id = offset + the shard's own id)
    shard-00000.faiss  FAISS index over rows offset .. offset + count - 1
    shard-00001.faiss  ...

Loading maps the shard files (``faiss.IO_FLAG_MMAP_IFC``) instead of reading them: flat shards and IVF-PQ
inverted lists stay on disk and in the page cache; an HNSW shard maps its vectors but reads its graph links
(about half of its file at 32 links) into memory: faiss 1.15's flag does not map those.

Merge: each shard's top-k is shifted by its id offset, and the Nq × (shards · k) candidates are sorted by score,
equal scores by *descending* id — the order faiss's heap gives them. Which of several ids tied at the k-th score
survive is decided as faiss's heap decides it over the whole id range (see ``_resolve_cut_ties``), so exact (flat)
shards return exactly what one ``IndexFlatIP`` over all vectors returns, ties included. Three faiss code paths
choose among ids tied at the k-th score differently, and there the ids tied *at the cut* may differ (scores and all
other ids do not): k ≥ 100 (faiss switches from a heap to a reservoir, ``distance_compute_min_k_reservoir``),
k = 1 with Nq·d ≥ 128000 (its BLAS top-1 kernel), and several OpenMP threads with fewer queries than threads over
≥ 10,000 vectors (it splits the vectors by thread). Approximate shards (HNSW, IVF-PQ) are merged the same way and
are as approximate as they are alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from mmgeo.io import StagedDir
from mmgeo.search.faiss_index import build_faiss, choose_index_type

FORMAT, VERSION = "mmgeo-shards", 1
MANIFEST = "shards.json"


class ShardsError(ValueError):
    """A shard directory that cannot be used (missing or truncated shard, wrong version, counts that disagree)."""


def _reblock(vectors, shard_size: int) -> Iterator[np.ndarray]:
    """Re-cut an (N, d) array or an iterable of (n_i, d) blocks into float32 arrays of ``shard_size`` rows
    (the last: fewer). Holds one shard plus one block; slicing a memmap reads only those rows."""
    if hasattr(vectors, "shape"):
        if len(vectors.shape) != 2:
            raise ValueError(f"vectors must be (N, d), got shape {tuple(vectors.shape)}")
        blocks = (vectors[i:i + shard_size] for i in range(0, vectors.shape[0], shard_size))
    else:
        blocks = vectors
    parts, have, d = [], 0, None
    for b, block in enumerate(blocks):
        block = np.asarray(block, dtype=np.float32)
        if block.ndim != 2 or (d is not None and block.shape[1] != d):
            raise ValueError(f"block {b} has shape {block.shape}: every block must be (n, d) with one d "
                             f"({'that of the first block' if d is None else d}); reshape one vector to (1, d)")
        d = block.shape[1]
        while len(block):
            take = min(shard_size - have, len(block))
            parts.append(block[:take])
            have, block = have + take, block[take:]
            if have == shard_size:
                yield np.concatenate(parts)  # (shard_size, d)
                parts, have = [], 0
    if have:
        yield np.concatenate(parts)  # (have, d)


def write_sharded(vectors: np.ndarray | Iterable[np.ndarray], out_dir: str | os.PathLike, shard_size: int = 100_000,
                  index_type: str = "auto") -> dict:
    """Write ``vectors`` — an (N, d) array or an iterable of (n_i, d) blocks — as FAISS shards of at most
    ``shard_size`` rows into ``out_dir``; -> the ``shards.json`` record.

    Each shard is built and written as soon as it is full, so memory holds one shard, not N vectors. FAISS type
    per shard by ``choose_index_type(rows, index_type)`` (``auto``: a small last shard is flat).
    Atomic: written into a temp dir next to ``out_dir`` that replaces it only when complete, so an error midway
    (one raised by the block iterator included) leaves ``out_dir`` as it was, or absent. Refuses to replace a
    non-empty directory that is not a shard directory.
    """
    import faiss

    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
    choose_index_type(1, index_type)  # unknown type: fail before any work
    target = Path(out_dir)
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise ValueError(f"{target} is a non-empty directory without {MANIFEST}: refusing to replace it; "
                         "write the shards into a new or empty directory")
    staging = StagedDir.next_to(target)
    try:
        shards, count = [], 0
        for shard in _reblock(vectors, shard_size):  # (n ≤ shard_size, d)
            kind = choose_index_type(len(shard), index_type)
            path = staging.tmp / f"shard-{len(shards):05d}.faiss"
            faiss.write_index(build_faiss(shard, kind), str(path))
            shards.append({"file": path.name, "count": len(shard), "offset": count, "index_type": kind,
                           "bytes": path.stat().st_size})
            count, d = count + len(shard), shard.shape[1]
        if not shards:
            raise ValueError("no vectors to index: give an (N, d) array with N ≥ 1 or a non-empty iterable of blocks")
        record = {"format": FORMAT, "version": VERSION, "d": d, "count": count, "metric": "inner_product",
                  "shard_size": shard_size, "index_type": index_type, "shards": shards}
        (staging.tmp / MANIFEST).write_text(json.dumps(record, indent=1))  # written last
        staging.commit()
        return record
    except BaseException:
        staging.discard()
        raise


_FIX = "rebuild the shards (`python -m serve build` for a gallery index)"


def _load_shard(path: Path, entry: dict, d: int, mmap: bool):
    """One shard's FAISS index, its size, count and d checked against its ``shards.json`` entry."""
    import faiss

    if not path.is_file():
        raise ShardsError(f"shard {path} is missing; {_FIX}")
    if path.stat().st_size != entry["bytes"]:  # checked before mapping: a short mapped file would crash a search
        raise ShardsError(f"shard {path} is {path.stat().st_size} bytes, {MANIFEST} says {entry['bytes']} "
                          f"(truncated or overwritten); {_FIX}")
    try:
        index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    except RuntimeError as err:
        raise ShardsError(f"shard {path} is not a readable FAISS file ({str(err).splitlines()[0]}); {_FIX}") from err
    if index.ntotal != entry["count"] or index.d != d:
        raise ShardsError(f"shard {path} holds {index.ntotal} vectors of d={index.d}, {MANIFEST} says "
                          f"{entry['count']} of d={d}; {_FIX}")
    return index


class ShardedIndex:
    """Shards loaded from a ``write_sharded`` directory; ``search`` answers like a FAISS index over all of them."""

    def __init__(self, indexes: list, record: dict, root: Path):
        self.shards, self.record, self.root = indexes, record, root
        self.d, self.ntotal = int(record["d"]), int(record["count"])
        self.offsets = [int(s["offset"]) for s in record["shards"]]
        self.counts = [int(s["count"]) for s in record["shards"]]
        self.exact = all(s["index_type"] == "flat" for s in record["shards"])

    def __len__(self) -> int:
        return self.ntotal

    @classmethod
    def load(cls, root: str | os.PathLike, mmap: bool = True) -> ShardedIndex:
        """Load (memory-mapped unless ``mmap=False``) and check every shard against ``shards.json``."""
        root = Path(root)
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise ShardsError(f"{str(root)!r} is not a sharded index: no {MANIFEST} (a missing or interrupted "
                              f"build); {_FIX}")
        try:
            record = json.loads(mpath.read_text())
        except json.JSONDecodeError as err:
            raise ShardsError(f"{mpath} is not valid JSON ({err}); {_FIX}") from err
        fmt, ver = record.get("format"), record.get("version")
        if fmt != FORMAT or ver != VERSION:
            raise ShardsError(f"{mpath} describes format {fmt!r} v{ver}; this mmgeo reads {FORMAT!r} v{VERSION} "
                              f"— {_FIX}")
        try:
            indexes, offset = [], 0
            for e in record["shards"]:
                if e["offset"] != offset:
                    raise ShardsError(f"{mpath}: shard {e['file']} starts at id {e['offset']}, expected {offset}; "
                                      f"{_FIX}")
                indexes.append(_load_shard(root / e["file"], e, int(record["d"]), mmap))
                offset += e["count"]
            if offset != record["count"] or not indexes:
                raise ShardsError(f"{mpath}: the shards hold {offset} vectors, its count says {record['count']}; "
                                  f"{_FIX}")
        except (KeyError, TypeError) as err:
            raise ShardsError(f"{mpath} lacks or garbles field {err}; {_FIX}") from err
        return cls(indexes, record, root)

    def _search_shard(self, s: int, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = self.shards[s].search(q, k)  # (Nq, k) each; ids local, -1 = not found
        return scores, np.where(ids >= 0, ids + self.offsets[s], -1)

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (scores (Nq, k) float32, ids (Nq, k) int64 global ids), best first.

        ``k`` is capped at ``ntotal`` (as ``faiss_index.search`` does), so exact shards never pad; approximate shards
        pad with id -1 (score -3.4e38) like faiss when they find fewer than asked.
        """
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.d:
            raise ValueError(f"queries must be (Nq, {self.d}) (the index's d), got shape {q.shape}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        k = min(int(k), self.ntotal)
        found = [self._search_shard(s, q, min(k, n)) for s, n in enumerate(self.counts)]
        cand_s = np.concatenate([f[0] for f in found], axis=1)  # (Nq, C), C = Σ min(k, shard count)
        cand_i = np.concatenate([f[1] for f in found], axis=1)  # (Nq, C)
        order = np.lexsort((-cand_i, -cand_s), axis=1)[:, :k]  # (Nq, k) score desc, equal scores id desc
        scores = np.take_along_axis(cand_s, order, axis=1)  # (Nq, k)
        ids = np.take_along_axis(cand_i, order, axis=1)  # (Nq, k)
        if self.exact:
            self._resolve_cut_ties(q, k, found, scores, ids)
        return scores, ids

    def _resolve_cut_ties(self, q: np.ndarray, k: int, found: list, scores: np.ndarray, ids: np.ndarray) -> None:
        """Pick, in place, the ids tied at the k-th score that one IndexFlatIP over all vectors would keep.

        faiss scans ids in order through a size-k heap: an id enters only if it beats the heap's worst score
        strictly, and each later entry evicts the *lowest* id among the worst. So with t the k-th score and g ids
        above it, it keeps the last k - g (by id) of the ids scoring t among the first k ids scoring ≥ t. A shard's
        own top-k may have evicted some of those, so a shard whose list ends at t is searched again with 2k, 4k, …
        (whole batch: same faiss code path, same bits). Only rows with more candidates at t than places are
        touched — rare (exact duplicates straddling the cut), so the loop is over those rows only.
        """
        t = scores[:, k - 1]  # (Nq,) the cut score
        places = (scores == t[:, None]).sum(1)  # (Nq,)
        at_cut = sum((s == t[:, None]).sum(1) for s, _ in found)  # (Nq,) candidates scoring t over all shards
        deeper: dict = {}
        for r in np.flatnonzero(at_cut > places):
            window_ids, window_scores = [], []  # ids scoring ≥ t in id order: the first k are those the heap admits
            for s, (sc, ix) in enumerate(found):
                if len(window_ids) >= k:
                    break
                sc_r, ix_r, kk = sc[r], ix[r], sc.shape[1]
                while sc_r[-1] == t[r] and kk < self.counts[s]:  # the shard may hold more ids scoring t
                    kk = min(2 * kk, self.counts[s])
                    if (s, kk) not in deeper:
                        deeper[s, kk] = self._search_shard(s, q, kk)
                    sc_r, ix_r = deeper[s, kk][0][r], deeper[s, kk][1][r]
                keep = sc_r >= t[r]
                by_id = np.argsort(ix_r[keep], kind="stable")[:k - len(window_ids)]
                window_ids.extend(ix_r[keep][by_id])
                window_scores.extend(sc_r[keep][by_id])
            tied = np.array(window_ids)[np.array(window_scores) == t[r]]  # ascending ids
            n_above = k - places[r]
            ids[r, n_above:] = tied[len(tied) - places[r]:][::-1]  # the last ones, listed id desc
            scores[r, n_above:] = t[r]
