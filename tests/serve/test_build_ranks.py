"""``serve build --db URL --workers 2`` (serve.build_ranks, mmgeo.search.db_parallel) against a real PostgreSQL: two
processes store the same rows as one — ids, content hashes, metadata, vectors, codes, codebooks and manifest — also
when the first run is killed (SIGKILL of one rank while it stages a batch) and the same command is run again."""

import pytest
import torch

from serve.cli import main

psycopg = pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")

COLUMNS = "id, content_sha256, meta, embedding::text, key_codes, value_codes, mask, patches, file"


def snapshot(url) -> dict:
    with psycopg.connect(url, autocommit=True) as conn:
        return {"images": conn.execute(f"SELECT {COLUMNS} FROM mmgeo_images ORDER BY id").fetchall(),
                "gallery": conn.execute("SELECT manifest, image_count FROM mmgeo_gallery").fetchall(),
                "codebooks": conn.execute("SELECT role, head, data, sha256 FROM mmgeo_codebooks "
                                          "ORDER BY 1, 2").fetchall(),
                "staged": conn.execute("SELECT count(*) FROM mmgeo_build_rows").fetchall()}


@pytest.mark.slow
def test_two_processes_store_the_rows_one_does(serve_env, pg_server, capfd, monkeypatch):
    from tests.pg import fresh_database

    one, two = fresh_database(pg_server), fresh_database(pg_server)
    common = ["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "14", "--codec", "sq8",
              "--batch-size", "3", "--no-progress"]
    # one thread in every process: the same arithmetic, so the rows can be compared bit for bit on any BLAS
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks inherit it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*common, "--db", one]) == 0
    finally:
        torch.set_num_threads(threads)
    # the first run: rank 1 is killed inside the transaction of its first staged batch; the other rank is stopped
    monkeypatch.setenv("MMGEO_CRASH_AT", "stage.commit@1")  # the spawned ranks inherit it
    capfd.readouterr()
    assert main([*common, "--db", two, "--workers", "2"]) == 1
    err = capfd.readouterr().err
    assert "crash at stage.commit@1" in err and "build process 1 of 2 ended" in err, err[-3000:]
    assert "run the same command again" in err
    killed = snapshot(two)
    assert killed["images"] == [] and killed["gallery"][0][1] == 0  # nothing merged yet
    monkeypatch.delenv("MMGEO_CRASH_AT")
    assert main([*common, "--db", two, "--workers", "2"]) == 0
    assert "added 14 image(s)" in capfd.readouterr().out
    a, b = snapshot(one), snapshot(two)
    assert len(a["images"]) == 14 and b["staged"] == [(0,)]
    for key in a:
        assert a[key] == b[key], key


def test_workers_go_with_a_database(serve_env, tmp_path, capsys):
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "4", "--out",
                 str(tmp_path / "idx"), "--workers", "2"]) == 2
    assert "--workers goes with --db" in capsys.readouterr().err
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--db", "postgresql://x/y",
                 "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    (tmp_path / "q.txt").write_text("a red circle\n")
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--db", "postgresql://x/y",
                 "--keep-patches", "8", "--prune-queries", str(tmp_path / "q.txt")]) == 2
    assert "--keep-patches is not available with --db" in capsys.readouterr().err  # pruning: folders only


@pytest.mark.slow
def test_a_rank_s_user_error_is_one_line(serve_env, pg_url, capsys):
    """A gallery of another codec is refused on every rank; the parent reports rank 0's message, exit 2."""
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "4", "--codec", "fp16",
                 "--db", pg_url, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic", "--limit", "4", "--codec", "sq8",
                 "--db", pg_url, "--no-progress", "--workers", "2"]) == 2
    assert "fp16, not sq8" in capsys.readouterr().err
