"""Load test of the search service on loopback: QPS and p50/p99/p99.9/max latency of POST /search, re-rank off and
on.

    python -m benchmarks.load_search [--count 100000] [--clients 1 8 32] [--seconds 8] [--max-requests 3000]
                                     [--client raw|httpx] [--codec fp16|sq8|pq8|...] [--keep-patches N]
                                     [--rerank off|on|both] [--server-args ARGS ...] [--rounds R]
                                     [--warmup-seconds S]
                                     [--db local:DIR|URL [--db-count N] [--hnsw-m M] [--hnsw-ef-construction E]
                                      [--db-ef-search EF] [--recall-ef EF ...] [--recall-ckpt CKPT]]

Builds (once, cached under --workdir) a gallery of ``--count`` random vectors shaped like the default
``geo-tiny`` model's (global vectors in FAISS, keys/values memory-mapped, fp16 or ``--codec``'s codes; no images
encoded), starts ``python -m serve run`` on 127.0.0.1 in a subprocess, and runs k=10 queries at each concurrency,
first with re-rank off, then on (geometric re-rank of the FAISS top 100). Every setting is bounded by --seconds and
--max-requests. The client shares the machine's cores with the server: figures include that cost; the last
columns are the server's own mean time per /search request (from /metrics, queueing in the batcher included) and
the CPU time spent per request by the server (its processes, all threads; from /proc, Linux) and by the load
generator: steadier than latency on a shared machine, so a change in the server's cost shows even when p99 drifts.

Side by side: ``--server-args`` given several times names server variants (e.g. ``--server-args ""
--server-args "--batch-workers 2"``); each of ``--rounds`` rounds starts every variant in turn on the same gallery
and runs its settings, and a summary gives each variant's median QPS, every round's p99 and their median, and its
median CPU per request: one run, alternated, so a slow spell of the machine does not land on one variant alone.
The first setting after a server starts is often its slowest (caches, the database's buffers, a first batch);
``--warmup-seconds S`` runs S seconds of unrecorded load after each start, so the rounds measure a warm service.

Database: ``--db local:DIR`` (or a postgresql:// URL) serves the same gallery from PostgreSQL + pgvector beside the
folder (``--codec rq8``: the folder's rows, codes and codebooks loaded into the database, ``benchmarks.load_db``),
each round starting the folder's server and then the database's (``serve run --db``); ``--db-count`` above
``--count`` gives the database more rows (random global vectors, codes cycling through the folder's). The load
prints and records the insert rates, the HNSW build time and the disk bytes per image; ``--recall-ef`` measures the
first stage's recall@K' against exact inner products per ``hnsw.ef_search`` (and ``--recall-ckpt`` the same over a
trained model's vectors of the synthetic set).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, add_json, alternate, write_json


def prepare(workdir: Path, count: int, index_type: str, codec: str = "fp16", keep_patches: int | None = None) -> Path:
    """Default geo-tiny checkpoint (random weights) + random gallery of ``count`` items with re-rank store ``codec``
    (``keep_patches`` of each image's patches when given), reused when present."""
    import torch

    import mmgeo
    from mmgeo.io import file_sha256
    from mmgeo.search.build import build_random_gallery

    workdir.mkdir(parents=True, exist_ok=True)
    suffix = ("" if codec == "fp16" else f"-{codec}") + (f"-keep{keep_patches}" if keep_patches else "")
    ckpt, index = workdir / "geo-tiny.pt", workdir / f"index-{count}-{index_type}{suffix}"
    if not ckpt.is_file():
        torch.manual_seed(0)
        mmgeo.save_model(mmgeo.create_model("geo-tiny").eval(), ckpt)
    sha = file_sha256(ckpt)
    man = index / "manifest.json"
    if man.is_file() and json.loads(man.read_text())["model"]["sha256"] == sha:
        return index
    cfg = mmgeo.load_model(ckpt).cfg
    t = time.perf_counter()
    print(f"building a random {count:,}-item gallery ({index_type}, {codec} store) in {index} ...", flush=True)
    build_random_gallery(index, count, cfg.num_heads, (cfg.image_size // cfg.patch_size) ** 2, cfg.d_a, cfg.d_e,
                         cfg.d_global, index_type=index_type, model_path=str(ckpt.resolve()), model_sha256=sha,
                         codec=codec, keep_patches=keep_patches)
    print(f"  built in {time.perf_counter() - t:.0f} s", flush=True)
    return index


def prepare_trained(workdir: Path, count: int, index_type: str, codec: str, ckpt: Path) -> Path:
    """A gallery of the first ``count`` synthetic train scenes encoded by the trained checkpoint ``ckpt`` through the
    product's own build (``build_gallery``: images saved inside it, codebooks trained on its keys / values), reused
    while its model's SHA-256 and count match. Its global vectors have the neighbourhoods a real gallery has, which
    random unit vectors lack (HNSW's worst case: ``docs/serve.md``, load testing)."""
    import mmgeo
    from mmgeo.data import ShapesWorld
    from mmgeo.io import file_sha256
    from mmgeo.search.build import build_gallery

    if not ckpt.is_file():
        raise SystemExit(f"--gallery-ckpt {ckpt}: no such checkpoint; give a model.pt that train.py wrote")
    sha = file_sha256(ckpt)
    index = workdir / f"index-{count}-{index_type}-{codec}-trained-{sha[:12]}"
    man = index / "manifest.json"
    rec = json.loads(man.read_text()) if man.is_file() else {}
    if (rec.get("model", {}).get("sha256"), rec.get("count")) == (sha, count):
        return index
    workdir.mkdir(parents=True, exist_ok=True)
    model = mmgeo.load_model(ckpt)
    ds = ShapesWorld("train", 0, image_size=model.cfg.image_size, size=count)
    print(f"building a {count:,}-image gallery of synthetic train scenes encoded by {ckpt} ({index_type}, {codec} "
          f"store) in {index} ...", flush=True)
    t = time.perf_counter()
    build_gallery(model, ((None, lambda i=i: ds[i][0]) for i in range(count)), count, index, ckpt=ckpt,
                  index_type=index_type, batch_size=256, codec=codec, shard_size=None)
    print(f"  built in {time.perf_counter() - t:.0f} s", flush=True)
    return index


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def queries(n: int = 200) -> list[str]:
    from mmgeo.data import ShapesWorld

    ds = ShapesWorld("val", seed=0, image_size=16)
    return [c for i in range(n // 5) for c in ds[i][1]]


WARMUP = 3  # requests sent before each setting is timed (counted in its CPU per request)


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams: one connection, one request at a time.

    The load generator shares the server's cores, so its own CPU per request is part of what is measured;
    this one costs about a quarter of httpx's (``--client httpx`` keeps httpx for comparison).
    """

    def __init__(self, host: str, port: int):
        self.host, self.port, self.reader, self.writer = host, port, None, None

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return status, json.loads(await self.reader.readexactly(length))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def run_setting(url: str, texts: list[str], clients: int, rerank: bool, seconds: float, max_requests: int,
                      kind: str = "raw"):
    import httpx

    lat, errors, sent = [], 0, 0
    host, port = url.removeprefix("http://").split(":")

    async def one(http, body) -> bool:
        if kind == "raw":
            status, out = await http.post_json("/search", body)
        else:
            r = await http.post(url + "/search", json=body)
            status, out = r.status_code, r.json()
        return status == 200 and len(out["results"]) == body["k"]

    async def client(c: int, http):
        nonlocal errors, sent
        i = c
        while time.perf_counter() < stop and sent < max_requests:
            sent += 1
            body = {"text": texts[i % len(texts)], "k": 10, "rerank": rerank}
            t = time.perf_counter()
            try:
                ok = await one(http, body)
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError):
                ok = False
            lat.append(time.perf_counter() - t) if ok else None
            errors += not ok
            i += clients

    if kind == "raw":
        conns = [RawClient(host, int(port)) for _ in range(clients)]
    else:
        shared = httpx.AsyncClient(limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients),
                                   timeout=30)
        conns = [shared] * clients
    for _ in range(WARMUP):
        await one(conns[0], {"text": texts[0], "k": 10, "rerank": rerank})
    stop = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client(c, conns[c]) for c in range(clients)))
    wall = time.perf_counter() - t0
    for c in set(conns):
        await (c.close() if kind == "raw" else c.aclose())
    lat.sort()

    def pct(p):
        return 1000 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    return {"rerank": rerank, "clients": clients, "requests": len(lat) + errors, "qps": len(lat) / wall,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "p999_ms": pct(0.999), "max_ms": pct(1.0), "errors": errors,
            "client": kind}


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of process ``pid`` and its descendants (uvicorn's --workers, PostgreSQL's backends) from /proc;
    None where /proc is not there. Each thread's nanosecond run time (``task/*/schedstat``) where the kernel keeps
    it, else the process's utime + stime in clock ticks (10 ms: a few small queries can read 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    try:
        while todo:
            p = todo.pop()
            tasks = list(Path(f"/proc/{p}/task").iterdir())
            try:
                total += sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9  # ns on the CPU
            except (OSError, ValueError, IndexError):
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in tasks:
                todo += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return None
    return total


def server_search_seconds(url: str) -> tuple[float, int]:
    """(sum of seconds, count) of POST /search as the server timed them (from /metrics)."""
    import httpx

    total = count = 0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('mmgeo_request_seconds_sum{endpoint="/search"}'):
            total = float(line.split()[-1])
        elif line.startswith('mmgeo_request_seconds_count{endpoint="/search"}'):
            count = int(line.split()[-1])
    return total, count


def fmt(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def split_server_args(server_args: str) -> tuple[list[str], dict[str, str]]:
    """``"A=1 B=x --opt v"`` -> (["--opt", "v"], {"A": "1", "B": "x"}): leading NAME=value words are environment."""
    words, env = shlex.split(server_args), {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return words, env


def start_server(gallery: Path | list[str], server_args: str) -> tuple[subprocess.Popen, str]:
    """``python -m serve run`` over ``gallery`` (an index folder, or its options: ``["--db", URL]``) on a free
    loopback port with ``server_args`` (leading ``NAME=value`` words set the server's environment, as in a shell:
    ``"TOKENIZERS_PARALLELISM=false --batch-workers 1"``); returns once /health answers."""
    import httpx

    words, extra_env = split_server_args(server_args)
    env = {**os.environ, **extra_env}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    where = ["--index", str(gallery)] if isinstance(gallery, Path) else gallery
    server = subprocess.Popen([sys.executable, "-m", "serve", "run", *where, "--host", "127.0.0.1",
                               "--port", str(port), *words], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise SystemExit(f"server ({server_args or 'defaults'}) did not start (exit code {server.poll()})")
        time.sleep(0.3)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()


def measure(server: subprocess.Popen, url: str, texts: list[str], clients: int, rerank: bool, args,
            db_pid: int | None = None) -> dict:
    """One setting against a running server: latency from the client, plus the server's own mean time and the CPU
    time per request of the server's process tree, of this process and (``db_pid``: an embedded PostgreSQL's
    postmaster) of the database's processes."""
    s0, n0 = server_search_seconds(url)
    cpu0, own0 = tree_cpu_seconds(server.pid), time.process_time()
    db0 = tree_cpu_seconds(db_pid) if db_pid else None
    r = asyncio.run(run_setting(url, texts, clients, rerank, args.seconds, args.max_requests, args.client))
    cpu1, own1 = tree_cpu_seconds(server.pid), time.process_time()
    db1 = tree_cpu_seconds(db_pid) if db_pid else None
    s1, n1 = server_search_seconds(url)
    n = r["requests"] + WARMUP  # every request sent, as in the CPU times
    # /metrics is one process's: with `--workers N` it saw only a share of the requests, and its mean is not shown
    r["server_mean_ms"] = 1000 * (s1 - s0) / n if n1 - n0 == n else None
    r["server_cpu_ms_per_request"] = None if cpu0 is None or cpu1 is None else 1000 * (cpu1 - cpu0) / n
    r["client_cpu_ms_per_request"] = 1000 * (own1 - own0) / n
    r["db_cpu_ms_per_request"] = None if db0 is None or db1 is None else 1000 * (db1 - db0) / n
    return r


def postmaster_pid(spec: str | None) -> int | None:
    """The postmaster of an embedded (``local:DIR``) PostgreSQL, whose CPU the load test counts; else None."""
    if not spec or not spec.startswith("local:"):
        return None
    try:
        return int((Path(spec[len("local:"):]) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def summarize(rows: list[dict], variants: list[str]) -> None:
    """Per server variant and setting, over the rounds: median QPS, each round's p99 and their median, median
    server CPU per request. Rounds alternate the variants, so slow spells of a shared machine hit them alike."""
    import statistics

    print(f"\nover {max(r['round'] for r in rows) + 1} rounds, variants alternated (median; p99 of each round):")
    for v in variants:
        for rerank in sorted({r["rerank"] for r in rows}):
            for c in sorted({r["clients"] for r in rows}):
                sel = [r for r in rows if r["variant"] == v and r["rerank"] == rerank and r["clients"] == c]
                cpu = [r["server_cpu_ms_per_request"] for r in sel if r["server_cpu_ms_per_request"] is not None]
                p99s = " / ".join(f"{r['p99_ms']:.1f}" for r in sel)
                print(f"  [{v or 'defaults'}] {'top100' if rerank else 'off'}, {c} clients: "
                      f"QPS {statistics.median(r['qps'] for r in sel):.1f}, "
                      f"p99 {statistics.median(r['p99_ms'] for r in sel):.1f} ms "
                      f"({p99s}), "
                      f"server CPU {statistics.median(cpu) if cpu else float('nan'):.2f} ms/req")


def recall_report(args, index: Path, db_count: int, workdir: Path) -> dict:
    """First-stage recall@K' (``--recall-k``) of the database gallery at each ``--recall-ef`` (the load test's
    queries, encoded by its model), and recall@100 over a trained model's vectors with ``--recall-ckpt``; printed and
    returned."""
    import numpy as np

    from benchmarks import load_db

    out = {}
    if args.recall_ef:
        import mmgeo

        fman = json.loads((index / "manifest.json").read_text())
        model = mmgeo.load_model(fman["model"]["path"])  # the gallery's own model encodes the queries
        q = model.encode_text(queries(args.recall_captions)).pooled.float().numpy()
        pooled = np.load(load_db.pooled_cache(workdir, fman, db_count), mmap_mode="r")
        setting = "probes" if args.ivfflat_lists else "ef_search"
        out["k"], out["setting"], out["captions"] = args.recall_k, setting, len(q)
        out["gallery"] = load_db.first_stage_recall(args.db, pooled, q, args.recall_k, args.recall_ef, setting)
        print(f"first-stage recall@{args.recall_k} over {len(q)} captions against exact (load-test rows): " + ", ".join(
            f"{setting} {ef}: {r:.3f}" for ef, r in out["gallery"].items()), flush=True)
    if args.recall_ckpt:
        x, q = load_db.model_vectors(args.recall_ckpt, args.recall_images, 200,
                                     workdir / f"model-vectors-{args.recall_images}.npz")
        out["model"] = load_db.model_recall(args.db, x, q, 100, args.hnsw_m, args.hnsw_ef_construction,
                                            args.recall_ef or [40, 100, 200])
        print(f"first-stage recall@100 over a trained model's vectors ({len(x):,} images, HNSW built in "
              f"{out['model']['build_s']:.0f} s): " + ", ".join(
                  f"ef_search {ef}: {r:.3f}" for ef, r in out["model"]["recall"].items()), flush=True)
    return out


def main(argv=None) -> int:
    from mmgeo.search.codecs import CODECS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--index-type", default="auto", choices=["auto", "flat", "hnsw", "ivfpq"])
    p.add_argument("--codec", default="fp16", choices=list(CODECS), help="re-rank store codec of the gallery")
    p.add_argument("--keep-patches", type=int, default=None, metavar="N",
                   help="prune the gallery to N patches per image (by the attention of random sample queries)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rerank", default="both", choices=["off", "on", "both"], help="which settings to run")
    p.add_argument("--seconds", type=float, default=8.0, help="time limit per setting")
    p.add_argument("--warmup-seconds", type=float, default=0.0, metavar="S",
                   help="after each server start, S seconds of load at the largest --clients and the first "
                        "re-rank setting, not recorded: the rounds then measure a warm service, not its start")
    p.add_argument("--max-requests", type=int, default=3000, help="request limit per setting")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mmgeo-load-bench"))
    p.add_argument("--client", default="raw", choices=["raw", "httpx"],
                   help="load generator: raw = minimal keep-alive HTTP/1.1 on asyncio streams (light), httpx")
    p.add_argument("--server-args", action="append", default=None, metavar="ARGS",
                   help="extra `python -m serve run` options, e.g. '--workers 2' (leading NAME=value words: its "
                        "environment); give it again to compare server variants side by side (each round runs "
                        "every variant in turn)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the variants (alternated); >1 adds a summary")
    p.add_argument("--db", default=None, metavar="SPEC", help="also serve the gallery from PostgreSQL: local:DIR (an "
                   "embedded server, data kept in DIR and reused) or a postgresql:// URL (its gallery is replaced)")
    p.add_argument("--db-count", type=int, default=None, help="rows of the database gallery (default --count)")
    p.add_argument("--hnsw-m", type=int, default=16, help="pgvector HNSW m of the database gallery")
    p.add_argument("--hnsw-ef-construction", type=int, default=64, help="pgvector HNSW ef_construction")
    p.add_argument("--db-ef-search", type=int, default=None, help="`serve run --ef-search` of the database's "
                   "server (default: the server's, 2 x K')")
    p.add_argument("--recall-ef", type=int, nargs="*", default=[], metavar="EF",
                   help="first-stage recall@K' (--recall-k) of the database gallery against exact, at these "
                        "hnsw.ef_search "
                        "(with --ivfflat-lists: these ivfflat.probes)")
    p.add_argument("--recall-k", type=int, default=100, metavar="K", help="the K' of --recall-ef's recall (the "
                   "server's --k-prime: 100 unless --server-args changes it)")
    p.add_argument("--recall-captions", type=int, default=200, metavar="N", help="captions --recall-ef's recall is "
                   "measured over: the load test's own (the first N/5 validation scenes')")
    p.add_argument("--ivfflat-lists", type=int, default=None, metavar="N", help="with --db: serve the database "
                   "through an IVFFlat index of N lists (`serve index --kind ivfflat`) in place of HNSW")
    p.add_argument("--recall-ckpt", default=None, metavar="CKPT", help="also recall over a trained model's global "
                   "vectors of --recall-images synthetic train images (own table, same m / ef_construction)")
    p.add_argument("--recall-images", type=int, default=29_000)
    p.add_argument("--half-index", action="store_true", help="with --ivfflat-lists: index the vectors at half "
                   "precision (`serve index --half`)")
    p.add_argument("--work-mem", default="4GB", metavar="SIZE", help="with --ivfflat-lists: maintenance_work_mem of "
                   "its build (`serve index --work-mem`; 8,000 lists over 1M rows need 13GB)")
    p.add_argument("--db-only", action="store_true", help="with --db: serve only the database gallery")
    p.add_argument("--gallery-ckpt", type=Path, default=None, metavar="CKPT",
                   help="rows of a trained model instead of random vectors: the first --count (and --db-count) "
                        "synthetic train scenes encoded by CKPT, which the server also encodes the queries with")
    add_json(p, "the rows")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.recall_captions < 5:
        p.error(f"--recall-captions must be at least 5 (one validation scene's), got {args.recall_captions}")
    if args.db and args.codec == "fp16":
        p.error("--db needs a coded re-rank store: add --codec rq8 (the database's default)")
    if args.db_only and not args.db:
        p.error("--db-only goes with --db")
    if args.gallery_ckpt and args.keep_patches:
        p.error("--keep-patches goes with random rows only; drop it or --gallery-ckpt")
    workdir = Path(args.workdir)
    index = prepare_trained(workdir, args.count, args.index_type, args.codec, args.gallery_ckpt) \
        if args.gallery_ckpt else prepare(workdir, args.count, args.index_type, args.codec, args.keep_patches)
    galleries = [] if args.db_only else [("folder", index)]
    db_rec = None
    if args.db:
        from benchmarks import load_db

        db_count = args.db_count or args.count
        db_rec = load_db.prepare_db(args.db, index, db_count, args.hnsw_m, args.hnsw_ef_construction, workdir,
                                    scenes=args.gallery_ckpt is not None)
        galleries.append(("db", ["--db", args.db, *(["--ef-search", str(args.db_ef_search)]
                                                   if args.db_ef_search else [])]))
        if args.ivfflat_lists:
            db_rec["ivfflat"] = {"lists": args.ivfflat_lists, "half": args.half_index,
                                 "build_s": load_db.ensure_ivfflat(args.db, args.ivfflat_lists, args.half_index,
                                                                   work_mem=args.work_mem)}
        db_rec["recall"] = recall_report(args, index, db_count, workdir)
    variants = [f"{g}{f' {v}' if v else ''}" if args.db else v for g, _ in galleries for v in args.server_args or [""]]
    plan = {label: (gallery, v) for label, (gallery, v) in
            zip(variants, [(gl, v) for _, gl in galleries for v in args.server_args or [""]])}
    texts = queries()
    settings = [(rr, c) for rr in {"off": [False], "on": [True], "both": [False, True]}[args.rerank]
                for c in args.clients]
    import httpx

    rows, warmups = [], []

    def serve_and_measure(label: str, rnd: int) -> None:
        """Start the server variant, run every setting against it (rows in the order they ran), stop it."""
        gallery, variant = plan[label]
        server, url = start_server(gallery, variant)
        try:
            health = httpx.get(url + "/health").json()
            print(f"{f'round {rnd + 1}/{args.rounds}: ' if args.rounds > 1 else ''}server up"
                  f"{f' ({variant})' if variant else ''}: {health['images']:,} images, index "
                  f"{health['index_type']}, {args.codec} re-rank store"
                  f"{f' of {args.keep_patches} patches per image' if args.keep_patches else ''}"
                  f"{' (database CPU counted apart)' if isinstance(gallery, list) else ''}; "
                  f"{os.cpu_count()} CPU core(s) shared by server and clients ({args.client} client)", flush=True)
            print(f"{'rerank':>7} {'clients':>7} {'requests':>8} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} "
                  f"{'p99.9 ms':>8} {'max ms':>8} {'errors':>6} {'server mean ms':>14} {'server CPU ms/req':>17} "
                  f"{'client CPU ms/req':>17}" + (f" {'db CPU ms/req':>13}" if args.db else ""))
            if args.warmup_seconds > 0:
                w = asyncio.run(run_setting(url, texts, max(args.clients), settings[0][0], args.warmup_seconds,
                                            args.max_requests, args.client))
                warmups.append(w)
                print(f"warm-up, not recorded: {w['requests']} requests in {args.warmup_seconds:g} s at "
                      f"{max(args.clients)} client(s), {w['errors']} errors", flush=True)
            for rerank, c in settings:
                r = measure(server, url, texts, c, rerank, args,
                            postmaster_pid(args.db) if isinstance(gallery, list) else None)
                r.update(server_args=variant, round=rnd, variant=label,
                         gallery="db" if isinstance(gallery, list) else "folder", images=health["images"])
                rows.append(r)
                print(f"{'top100' if rerank else 'off':>7} {c:>7} {r['requests']:>8} {r['qps']:>8.1f} "
                      f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['p999_ms']:>8.1f} {r['max_ms']:>8.1f} "
                      f"{r['errors']:>6} {fmt(r['server_mean_ms'], 1):>14} "
                      f"{fmt(r['server_cpu_ms_per_request']):>17} {fmt(r['client_cpu_ms_per_request']):>17}"
                      + (f" {fmt(r['db_cpu_ms_per_request']):>13}" if args.db else ""), flush=True)
        finally:
            stop_server(server)

    alternate(variants, args.rounds, serve_and_measure)  # each round starts every variant in turn
    if args.rounds > 1 or len(variants) > 1:
        summarize(rows, variants)
    write_json(args.json, {"rows": rows, "db": db_rec} if args.db else rows)
    return 0 if all(r["errors"] == 0 for r in rows + warmups) else 1


if __name__ == "__main__":
    sys.exit(main())
