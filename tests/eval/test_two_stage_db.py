"""``eval.py --db URL`` evaluates a gallery in PostgreSQL as ``--index DIR`` evaluates a folder: the same split built
both ways with the same codec gives the same R@K (within 0.002), and what the database gallery cannot do is refused
in one line."""

import json

import pytest

import eval as eval_app
from serve.cli import main
from tests.search.conftest import pg_server, pg_url  # noqa: F401 (fixtures)

pytest.importorskip("psycopg", reason="the database tests need psycopg 3 (pip install -e '.[db]')")

N, K_PRIME = 24, 5


def test_db_gallery_gives_the_folder_s_recall(gallery_env, pg_url, tmp_path, capsys):  # noqa: F811
    common = ["build", "--ckpt", str(gallery_env.ckpt), "--data", "synthetic", "--split", "test", "--limit", str(N),
              "--codec", "rq8", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "idx")]) == 0
    assert main([*common, "--db", pg_url]) == 0
    eval_app.main(["--index", str(tmp_path / "idx"), "--k-prime", str(K_PRIME), "--out", str(tmp_path / "a.json")])
    eval_app.main(["--db", pg_url, "--k-prime", str(K_PRIME), "--out", str(tmp_path / "b.json")])
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["mode"] == b["mode"] == "two-stage" and b["counts"] == a["counts"]
    recalls = [k for k in a["metrics"] if "_R@" in k]
    assert len(recalls) >= 6
    for k in recalls:  # fractions: 0.002 is two tenths of a point
        assert abs(b["metrics"][k] - a["metrics"][k]) <= 0.002, k
    assert b["two_stage"]["index_type"] == "pgvector-hnsw" and b["two_stage"]["store"]["codec"] == "rq8"
    assert b["first_stage"] == a["first_stage"]
    assert "pgvector-hnsw index, rq8 re-rank store" in capsys.readouterr().out


def test_db_flags_are_checked(gallery_env, tmp_path, capsys):
    for argv, msg in ((["--db", "mysql://x"], "postgresql://"),
                      (["--db", "postgresql://x/y", "--index", str(tmp_path)], "both name the gallery"),
                      (["--ckpt", str(gallery_env.ckpt), "--ef-search", "80"], "--ef-search goes with --db"),
                      (["--db", "postgresql://x/y", "--mode", "two-stage", "--keep-patches", "8", "--prune-queries",
                        str(tmp_path / "q.txt")], "a --db gallery keeps all patches"),
                      (["--db", "postgresql://x/y", "--mode", "exact"], "two-stage search")):
        (tmp_path / "q.txt").write_text("a red circle\n")
        with pytest.raises(SystemExit) as err:
            eval_app.main(argv)
        assert err.value.code == 2 and msg in capsys.readouterr().err, argv
