"""The search service: FastAPI app over a gallery index (``mmgeo.search``) and its model.

Endpoints (``serve.routes``): POST /search, POST /search/image, GET /images/{id}, GET /explain, GET /health,
GET /metrics, GET / (web page). Every bad input is a 4xx with ``{"error": "..."}`` naming the problem; an internal
error is a 500 ``{"error": "internal error", "request_id": "<hex>"}`` whose traceback is logged (``serve.app``)
under that id (``serve.errors``).

The OpenAPI document (``/openapi.json``) is the contract: every route declares every status it can answer with
its body schema and content type, and the request limits (``Limits``, ``serve.api``) appear as schema constraints
(``tests/serve/test_openapi_fuzz.py`` checks it).
"""

import json
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI

from mmgeo.models.vocab import vocabulary_hint
from mmgeo.search.store import Gallery
from mmgeo.search.two_stage import search_texts
from serve.access import Access, AccessMiddleware, CurrentBatcher, CurrentGallery, in_collection, secure_document
from serve.api import (  # noqa: F401 (the service's names, importable from here)
    JSON_BODY_LIMIT,
    ApiError,
    Limits,
    SearchResponse,
    json_body,
    render,
    result_rows,
)
from serve.auth import KeyStore, check_collection
from serve.batching import MicroBatcher
from serve.errors import add_error_handlers
from serve.guard import BodySizeGuard
from serve.metrics import Metrics, MetricsMiddleware
from serve.routes import add_image_routes, add_info_routes, add_search_routes, add_write_routes, description


def search_batch(model, gallery: Gallery, k_prime: int,
                 queries: list[tuple[str, int, bool, bool]]) -> list[bytes | ValueError]:
    """One micro-batch of (text, k, rerank, correct) in a worker thread: one encode call, one FAISS search, one
    batched re-rank -> each query's /search answer, already JSON (``json_body``): rendering it here keeps FastAPI's
    encoder off the event loop, which every request goes through. With ``correct``, a query with words the model
    cannot read is searched as its ``did_you_mean`` when it has one (``mmgeo.models.vocab``), and the answer's
    ``searched`` says so. An answer that cannot be rendered (a non-finite score) is that query's error alone,
    raised by its handler."""
    tokenizer = getattr(model, "tokenizer", None)
    hints = [vocabulary_hint(tokenizer, t) for t, _, _, _ in queries]
    searched = [h["did_you_mean"] if c and h["did_you_mean"] else t for (t, _, _, c), h in zip(queries, hints)]
    emb = model.encode_text(searched)  # rows (B, ...)
    found = search_texts(model, gallery, emb, [k for _, k, _, _ in queries], [r for _, _, r, _ in queries], k_prime)
    return [render({"query": t, "searched": s, "rerank": r, "results": result_rows(ids, scores), **h})
            for (t, _, r, _), s, h, (ids, scores) in zip(queries, searched, hints, found)]


def open_gallery(index_dir=None, db=None, ef_search: int | None = None, db_read=None, db_parallel: int = 1,
                 db_probes: int | None = None):
    """The gallery to serve: an index directory, or a database's (``db``: a URL or ``local:DIR``; a connection pool
    with timeouts, so that a database down or slow is a 503, never a hang; ``db_read``: another URL to read
    through, e.g. a standby's; ``db_parallel``: connections a micro-batch's captions are searched on at once;
    ``db_probes``: IVFFlat lists scanned, when the database's index is IVFFlat)."""
    if db is None:
        return Gallery(index_dir)
    from mmgeo.search.database import DbGallery

    return DbGallery(db, ef_search=ef_search, **({"read": db_read} if db_read else {}), parallel=db_parallel,
                     probes=db_probes,
                     pool_size=DB_POOL_SIZE,
                     connect_timeout=DB_TIMEOUT_S, pool_timeout=DB_TIMEOUT_S, statement_timeout=DB_STATEMENT_TIMEOUT_S,
                     application_name="mmgeo-serve")


DEFAULT_COLLECTION = "default"  # the one collection of a service over one gallery
DB_PARALLEL = 2  # connections a micro-batch's captions are searched on at once (serve run --db-parallel)
DB_POOL_SIZE = 6  # connections per server process (batch workers x DB_PARALLEL + image and health routes)
DB_TIMEOUT_S = 5.0  # to connect, or to wait for a free connection
DB_STATEMENT_TIMEOUT_S = 10.0  # any one statement of the service
DB_ARGS = {"pool_size": DB_POOL_SIZE, "connect_timeout": DB_TIMEOUT_S, "pool_timeout": DB_TIMEOUT_S,
           "statement_timeout": DB_STATEMENT_TIMEOUT_S, "application_name": "mmgeo-serve"}  # the service's pools


def create_app(index_dir=None, model=None, ckpt=None, limits: Limits | None = None, db=None,
               ef_search: int | None = None, db_read=None, collections: dict | None = None,
               keys: KeyStore | None = None, auth: str = "none", db_parallel: int = DB_PARALLEL,
               db_probes: int | None = None) -> FastAPI:
    """App over the index at ``index_dir`` or the gallery in database ``db`` (read through ``db_read`` when given),
    or over ``collections`` (name -> index directory, one gallery each: docs/serve.md, "Keys and collections"); the
    model is ``model`` or loaded from ``ckpt`` / the manifest's path. ``keys``: the API keys every request but the
    public ones must show (``serve.access``); None: open, ``auth`` says why (for /health)."""
    import mmgeo

    limits = limits or Limits()
    if collections is None and db is not None and hasattr(keys, "db"):  # keys in the database: its collections
        from serve.db_keys import open_db_collections

        galleries = open_db_collections(keys, ef_search, db_read, db_parallel, db_probes, **DB_ARGS)
    elif collections is None:
        galleries = {DEFAULT_COLLECTION: open_gallery(index_dir, db, ef_search, db_read, db_parallel, db_probes)}
    else:
        galleries = {check_collection(name): open_gallery(path) for name, path in collections.items()}
    first = next(iter(galleries.values()))
    if model is None:
        ckpt = ckpt or first.model_record.get("path")
        if not ckpt:
            raise ValueError(f"index {first.root} records no checkpoint path; pass --ckpt")
        model = mmgeo.load_model(ckpt)
    for g in galleries.values():
        g.check_model(model, ckpt)
    batchers = {name: MicroBatcher(in_collection(name, partial(search_batch, model, g, limits.k_prime), keys),
                                   limits.batch_size, limits.batch_wait_ms, limits.batch_workers)
                for name, g in galleries.items()}
    access = Access(galleries, keys, "keys" if keys is not None else auth)
    gallery, batcher = CurrentGallery(access), CurrentBatcher(access, batchers)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()
        for g in galleries.values():
            if hasattr(g, "close"):  # a database gallery's connection pool
                g.close()
        if hasattr(keys, "close"):  # keys in the database: the pool its galleries share
            keys.close()

    app = FastAPI(title="mmgeo image search", lifespan=lifespan, description=description(limits))
    one = len(galleries) == 1
    app.state.gallery = first if one else gallery
    app.state.batcher = next(iter(batchers.values())) if one else batcher
    app.state.model, app.state.limits, app.state.access = model, limits, access
    writes = limits.allow_writes and hasattr(first, "first_stage")  # a database gallery
    if limits.allow_writes and not writes:
        raise ValueError("--allow-writes needs a gallery in a database (--db): an index directory is read-only")
    uploads = {p: limits.max_upload_bytes + (64 << 10) for p in ("/search/image", *(["/images"] if writes else []))}
    app.add_middleware(BodySizeGuard, limits=uploads, default=JSON_BODY_LIMIT)  # multipart headroom; JSON is small
    app.add_middleware(AccessMiddleware, access=access)  # before the guard: no body is read for a refused caller
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts the guard's 413s too
    add_error_handlers(app, limits)
    add_search_routes(app, gallery, model, batcher, limits)
    add_image_routes(app, gallery, model, limits)
    if writes:
        add_write_routes(app, gallery, model, limits)
    add_info_routes(app, gallery, batcher, metrics)
    app.openapi = partial(openapi, app, app.openapi)
    return app


def openapi(app: FastAPI, default_openapi) -> dict:
    """FastAPI's document less the 422 it adds for /images/{raw_id}: a str path parameter never fails."""
    if app.openapi_schema is None:
        doc = default_openapi()
        doc["paths"]["/images/{raw_id}"]["get"]["responses"].pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        if "#/components/schemas/HTTPValidationError" not in json.dumps(doc["paths"]):
            schemas.pop("HTTPValidationError", None), schemas.pop("ValidationError", None)
        if app.state.access.keys is not None:
            secure_document(doc)
    return app.openapi_schema
