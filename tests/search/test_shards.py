"""Sharded FAISS index: exact sharded search gives one IndexFlatIP's answer (ties included, scores to a few
ulps), atomic writes, clear load errors, memory-mapped shards."""

import json
import shutil
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from mmgeo.search.shards import ShardedIndex, ShardsError, write_sharded


@pytest.fixture(autouse=True)
def _faiss_settings():
    """One FAISS thread (with several, faiss splits large searches by thread, which changes its own tie picks),
    and the BLAS threshold restored after tests that move it."""
    threads, blas = faiss.omp_get_max_threads(), faiss.cvar.distance_compute_blas_threshold
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)
    faiss.cvar.distance_compute_blas_threshold = blas


def unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def flat(x):
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return index


def sharded(x, tmp_path, shard_size, name="s", **kw):
    write_sharded(x, tmp_path / name, shard_size, **kw)
    return ShardedIndex.load(tmp_path / name)


def blas_path(on: bool):
    """faiss 1.15 computes exact scores with BLAS when Nq·d ≥ distance_compute_blas_threshold (128000), else with
    its own SIMD loop; the two round differently. Move the threshold to test both paths on small inputs."""
    faiss.cvar.distance_compute_blas_threshold = 0 if on else 1 << 30


ATOL = 1e-6  # a few float32 ulps at |score| <= 1: BLAS blocks and SIMD loops round by CPU and block offset


def assert_same(got, want, x=None, q=None):
    """The same answer as one index: scores equal to within a few ulps (which rounding faiss's BLAS path gives
    depends on the CPU and where its blocks start, so shard and single index may differ by 1 ulp), and the same
    ids — except where two ids' exact (float64) scores tie within that tolerance, where either order is right."""
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=ATOL)
    differ = got[1] != want[1]
    if differ.any():
        assert x is not None, f"ids differ at {np.argwhere(differ).tolist()} and the scores are not near-ties"
        exact = q.astype(np.float64) @ x.astype(np.float64).T  # (Nq, N)
        for r, c in np.argwhere(differ):
            a, b = exact[r, got[1][r, c]], exact[r, want[1][r, c]]
            assert abs(a - b) <= ATOL, f"row {r}, rank {c}: id {got[1][r, c]} ({a}) vs {want[1][r, c]} ({b})"
    for row in got[1]:
        assert len(set(row.tolist())) == len(row), "an id is returned twice"


N, D, SHARD = 203, 16, 50  # shards of 50, 50, 50, 50, 3


@pytest.fixture(scope="module")
def vectors():
    rng = np.random.default_rng(0)
    return unit(rng.standard_normal((N, D))), unit(rng.standard_normal((70, D)))


@pytest.mark.parametrize("blas", [False, True], ids=["simd", "blas"])
@pytest.mark.parametrize("nq", [1, 64])
@pytest.mark.parametrize("k", [1, 5, SHARD + 7, 150, N + 50], ids=["k1", "k5", "k>shard", "k150", "k>N"])
def test_sharded_search_is_one_flat_index(vectors, tmp_path, blas, nq, k):
    x, q = vectors
    index = sharded(x, tmp_path, SHARD)
    assert [s["count"] for s in index.record["shards"]] == [50, 50, 50, 50, 3] and len(index) == N
    blas_path(blas)
    got = index.search(q[:nq], k)
    want = flat(x).search(q[:nq], min(k, N))  # k is capped at N, as mmgeo.search.faiss_index.search does
    assert got[0].shape == (nq, min(k, N)) and got[0].dtype == np.float32 and got[1].dtype == np.int64
    assert_same(got, want, x, q[:nq])


def test_many_queries_take_the_blas_path_unforced(tmp_path):
    rng = np.random.default_rng(1)
    x, q = unit(rng.standard_normal((300, 64))), unit(rng.standard_normal((2_000, 64)))
    assert q.size >= faiss.cvar.distance_compute_blas_threshold  # faiss's own switch to BLAS
    assert_same(sharded(x, tmp_path, 64).search(q, 20), flat(x).search(q, 20), x, q)


def test_cut_ties_are_picked_as_faiss_picks_them(tmp_path):
    """faiss keeps neither the lowest nor the highest of the ids tied at the k-th score: its heap admits ids in
    order and a better later id evicts the lowest tied one. Shards must reproduce that, searching deeper when a
    shard's own heap evicted an id the whole index keeps."""
    def at(angle):
        return [np.cos(angle), np.sin(angle)]

    low, tie, top = at(1.2), at(0.5), at(0.1)  # scores against q = (1, 0): low < tie < top
    q = np.array([[1, 0]], np.float32)
    x = np.array([tie, tie, top, tie], np.float32)  # shards of 2: [0, 1], [2, 3]
    want = flat(x).search(q, 2)
    assert want[1].tolist() == [[2, 1]]  # id 0 evicted by 2; 3 arrives too late
    assert_same(sharded(x, tmp_path, 2, "a").search(q, 2), want)
    x = np.array([low, low, tie, tie, tie, top], np.float32)  # shards of 3: [0, 1, 2], [3, 4, 5]
    want = flat(x).search(q, 2)
    assert want[1].tolist() == [[5, 3]]  # shard [3, 4, 5] alone keeps [5, 4]: 3 is found by a deeper search
    assert_same(sharded(x, tmp_path, 3, "b").search(q, 2), want)


@pytest.mark.parametrize("blas", [False, True], ids=["simd", "blas"])
def test_duplicates_give_the_same_ties_as_one_flat_index(tmp_path, blas, monkeypatch):
    rng = np.random.default_rng(2)
    base = unit(rng.standard_normal((6, 8)))
    x = base[rng.integers(0, 6, 400)]  # ~67 exact copies of each vector: every score is tied many times
    q = np.concatenate([base, unit(rng.standard_normal((58, 8)))])  # (64, 8)
    blas_path(blas)
    calls = []
    search_shard = ShardedIndex._search_shard
    monkeypatch.setattr(ShardedIndex, "_search_shard",
                        lambda self, s, qq, kk: calls.append(kk) or search_shard(self, s, qq, kk))
    straddling = deeper = 0
    for shard_size in (1, 7, 64, 150):
        index = sharded(x, tmp_path, shard_size, f"s{shard_size}")
        for k in ([1] if not blas else []) + [2, 3, 7, 20, 64, 99]:
            want = flat(x).search(q, k)
            calls.clear()
            assert_same(index.search(q, k), want, x, q)
            deeper += any(kk > k for kk in calls)
            t = want[0][:, -1:]  # the k-th score: rows where more vectors score it than fit
            straddling += int(((q @ x.T >= t - 1e-6).sum(1) > k).sum())
    assert straddling > 100, "no tie straddled the cut: the test checked only the easy case"
    assert deeper > 0, "no shard was searched deeper: the eviction case was not exercised"


def test_documented_tie_limits_change_only_ids_tied_at_the_cut(tmp_path):
    """k ≥ 100 (faiss's reservoir) and k = 1 on the BLAS path pick among ids tied at the k-th score by rules of
    their own; the sharded index picks by the heap's rule. Scores, and every id above the cut, still agree."""
    rng = np.random.default_rng(3)
    base = unit(rng.standard_normal((5, 8)))
    x = base[rng.integers(0, 5, 600)]
    q = np.concatenate([base, unit(rng.standard_normal((11, 8)))])
    index, one = sharded(x, tmp_path, 70), flat(x)
    for blas, k in ((False, 100), (False, 180), (True, 1), (True, 100)):
        blas_path(blas)
        got, want = index.search(q, k), one.search(q, k)
        assert_same(got, want, x, q)  # an id that differs is a copy of faiss's pick (the same exact score)
        above = want[0] > want[0][:, -1:] + ATOL  # (Nq, k): clearly above the k-th score
        np.testing.assert_array_equal(x[got[1][above]], x[want[1][above]])


def test_blocks_are_resharded_and_written_as_each_shard_fills(vectors, tmp_path):
    x, q = vectors
    seen = []

    def blocks():  # uneven blocks, 1..31 rows
        i, sizes = 0, [1, 31, 17, 2, 30, 29, 5, 31, 31, 26]
        for n in sizes:
            # every full shard before this block's first row is already on disk (in the build's temp dir)
            seen.append(len(list(tmp_path.glob(".s.building-*/shard-*.faiss"))) == i // SHARD)
            yield x[i:i + n]
            i += n
        assert i == N

    rec = write_sharded(blocks(), tmp_path / "s", SHARD)
    assert all(seen) and len(seen) == 10
    assert [(s["count"], s["offset"]) for s in rec["shards"]] == [(50, 0), (50, 50), (50, 100), (50, 150), (3, 200)]
    assert rec["count"] == N and rec["d"] == D and {s["index_type"] for s in rec["shards"]} == {"flat"}
    assert json.loads((tmp_path / "s" / "shards.json").read_text()) == rec
    assert_same(ShardedIndex.load(tmp_path / "s").search(q, 9), flat(x).search(q, 9), x, q)


def test_interrupted_write_leaves_no_index_and_keeps_an_old_one(vectors, tmp_path):
    x, q = vectors

    def failing(after):
        for i in range(0, N, 10):
            if i >= after:
                raise RuntimeError("disk on fire")
            yield x[i:i + 10]

    with pytest.raises(RuntimeError, match="disk on fire"):  # after two full shards were written
        write_sharded(failing(120), tmp_path / "new", SHARD)
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.building-*"))
    old = tmp_path / "old"
    write_sharded(x[:100], old, 30)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_sharded(failing(120), old, SHARD)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert_same(ShardedIndex.load(old).search(q, 5), flat(x[:100]).search(q, 5), x[:100], q)
    write_sharded(x, old, SHARD)  # a complete write replaces it
    assert len(ShardedIndex.load(old)) == N and not list(tmp_path.glob(".old.*"))


def test_bad_input_is_refused(vectors, tmp_path):
    x, q = vectors
    with pytest.raises(ValueError, match="shard_size must be a positive integer"):
        write_sharded(x, tmp_path / "a", 0)
    with pytest.raises(ValueError, match="index_type must be one of"):
        write_sharded(x, tmp_path / "a", 10, index_type="annoy")
    with pytest.raises(ValueError, match="no vectors"):
        write_sharded(iter([]), tmp_path / "a", 10)
    with pytest.raises(ValueError, match=r"block 1 has shape \(3, 8\).*one d \(16\)"):
        write_sharded(iter([x[:5], np.zeros((3, 8))]), tmp_path / "a", 10)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to replace it"):
        write_sharded(x, tmp_path / "docs", 10)
    assert (tmp_path / "docs" / "notes.txt").read_text() == "mine"
    index = sharded(x, tmp_path, SHARD)
    with pytest.raises(ValueError, match=r"queries must be \(Nq, 16\)"):
        index.search(q[:, :8], 3)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        index.search(q, 0)


def test_damaged_shard_directories_are_named_with_the_fix(vectors, tmp_path):
    x, _ = vectors
    write_sharded(x, tmp_path / "good", SHARD)

    def damaged(name, change):
        d = shutil.copytree(tmp_path / "good", tmp_path / name)
        change(d)
        return d

    def edit(root, **fields):
        rec = json.loads((root / "shards.json").read_text())
        (root / "shards.json").write_text(json.dumps({**rec, **fields}))

    with pytest.raises(ShardsError, match="no shards.json"):
        ShardedIndex.load(tmp_path / "nothing")
    cases = {
        "missing": (lambda d: (d / "shard-00002.faiss").unlink(), r"shard-00002.faiss is missing; rebuild"),
        "truncated": (lambda d: (d / "shard-00001.faiss").write_bytes((d / "shard-00001.faiss").read_bytes()[:-100]),
                      r"shard-00001.faiss is \d+ bytes, shards.json says \d+ \(truncated or overwritten\); rebuild"),
        "version": (lambda d: edit(d, version=7), r"'mmgeo-shards' v7; this mmgeo reads 'mmgeo-shards' v1 — rebuild"),
        "count": (lambda d: edit(d, count=999), r"the shards hold 203 vectors, its count says 999; rebuild"),
        "d": (lambda d: edit(d, d=8), r"shard-00000.faiss holds 50 vectors of d=16, shards.json says 50 of d=8"),
        "garbled": (lambda d: (d / "shards.json").write_text("{"), r"shards.json is not valid JSON"),
        "no field": (lambda d: edit(d, shards=[{"file": "shard-00000.faiss"}]), r"lacks or garbles field 'offset'"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(ShardsError, match=message):
            ShardedIndex.load(damaged(name, change))


def _mapped_files() -> set[str]:
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's mappings from /proc/self/maps")
def test_mmap_load_maps_the_shard_files_instead_of_reading_them(vectors, tmp_path):
    x, q = vectors
    write_sharded(x, tmp_path / "s", SHARD)
    files = {str((tmp_path / "s" / f"shard-0000{i}.faiss").resolve()) for i in range(5)}
    read = ShardedIndex.load(tmp_path / "s", mmap=False)
    assert not files & _mapped_files()  # read into memory: no mapping of the files
    mapped = ShardedIndex.load(tmp_path / "s")
    assert files <= _mapped_files()  # the vectors are served from the files' pages
    assert_same(mapped.search(q, 10), read.search(q, 10), x, q)
    del mapped
    assert not files & _mapped_files()  # unmapped with the index


def test_approximate_and_auto_shards(vectors, tmp_path):
    x, q = vectors
    hnsw = sharded(x, tmp_path, SHARD, "h", index_type="hnsw")
    assert [s["index_type"] for s in hnsw.record["shards"]] == ["hnsw"] * 5 and not hnsw.exact
    _, ids = hnsw.search(x, 1)
    assert (ids[:, 0] == np.arange(N)).mean() > 0.95  # global ids: each vector finds itself
    auto = sharded(x, tmp_path, SHARD, "a")
    assert auto.exact and auto.record["index_type"] == "auto"  # 50-row shards: flat by size
