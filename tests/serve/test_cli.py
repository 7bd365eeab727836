"""``python -m serve run`` as users start it: one process, and several uvicorn workers behind one port."""

import json
import urllib.request

import pytest

from tests.serve.conftest import running_server


def _search(url: str, text: str) -> dict:
    req = urllib.request.Request(url + "/search", data=json.dumps({"text": text, "k": 3}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_two_worker_processes_serve_the_same_results(serve_env):
    with running_server(serve_env.idx) as one:
        want = [_search(one, t)["results"] for t in ("a red circle", "two blue squares")]
    with running_server(serve_env.idx, "--workers", "2", "--batch-workers", "1") as two:
        for _ in range(3):  # requests spread over both processes
            assert [_search(two, t)["results"] for t in ("a red circle", "two blue squares")] == want


def test_bad_workers_count_is_refused(serve_env, capsys):
    from serve.cli import main

    assert main(["run", "--index", str(serve_env.idx), "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err


def test_build_help_lists_every_codec_and_refuses_an_unknown_one(capsys):
    from mmgeo.search.codecs import CODECS
    from serve.cli import parse

    with pytest.raises(SystemExit):
        parse(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert all(f"{c.name}: {c.help}" in text for c in CODECS.values())
    assert "{fp16,sq8,sq4,pq4,pq8,pq16,rq8,rq16}" in text
    with pytest.raises(SystemExit):
        parse(["build", "--ckpt", "m.pt", "--data", "synthetic", "--out", "x", "--codec", "pq3"])
    assert "invalid choice: 'pq3'" in capsys.readouterr().err


def test_a_server_process_freezes_what_it_loaded(serve_env):
    """``run``'s app leaves the loaded model, index and libraries out of the garbage collector's scans (a full
    collection over them is a stall of every request in flight)."""
    import gc

    import faiss
    import torch

    from serve.cli import _app, parse, run_settings

    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    gc.unfreeze()
    try:
        app = _app(run_settings(parse(["run", "--index", str(serve_env.idx)])))
        assert gc.get_freeze_count() > 10_000
        assert app.state.gallery.count > 0
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads[0])
        faiss.omp_set_num_threads(threads[1])


def test_run_passes_the_micro_batching_options_to_the_batcher(serve_env):
    import gc

    import faiss
    import torch

    from serve.app import Limits
    from serve.cli import _app, parse, run_settings

    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    try:
        b = _app(run_settings(parse(["run", "--index", str(serve_env.idx), "--batch-size", "3", "--batch-wait-ms",
                                     "1.5", "--batch-workers", "3"]))).state.batcher
        assert (b.max_batch, b.max_wait, b.n_workers) == (3, 0.0015, 3)
        b = _app(run_settings(parse(["run", "--index", str(serve_env.idx)]))).state.batcher
        assert (b.max_batch, b.max_wait, b.n_workers) == (Limits.batch_size, Limits.batch_wait_ms / 1000,
                                                         Limits.batch_workers)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads[0])
        faiss.omp_set_num_threads(threads[1])
