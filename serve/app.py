"""The search service: FastAPI app over a gallery index (``mmgeo.search``) and its model.

Endpoints: POST /search, POST /search/image, GET /images/{id}, GET /explain, GET /health, GET /metrics,
GET / (web page). Every bad input is a 4xx with ``{"error": "..."}`` naming the problem; an internal error is a
500 ``{"error": "internal error", "request_id": "<hex>"}`` whose traceback is logged (``serve.app``) under that id.

The OpenAPI document (``/openapi.json``) is the contract: every route declares every status it can answer with
its body schema and content type, and the request limits (``Limits``) appear as schema constraints
(``tests/serve/test_openapi_fuzz.py`` checks it).
"""

import asyncio
import io
import json
import logging
import mimetypes
import re
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, File, Query, Request, UploadFile
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmgeo.data.images import MAX_PIXELS, open_image
from mmgeo.search.store import Gallery
from mmgeo.search.two_stage import search_texts
from serve.batching import MicroBatcher
from serve.guard import BodySizeGuard
from serve.metrics import Metrics, MetricsMiddleware

PAGE = Path(__file__).with_name("page.html")
log = logging.getLogger(__name__)


@dataclass
class Limits:
    max_text_chars: int = 500
    max_k: int = 100
    k_prime: int = 100  # first-stage candidates re-ranked by the geometric score
    max_upload_bytes: int = 10 << 20
    max_image_pixels: int = MAX_PIXELS  # the one decompression-bomb cap (mmgeo.data.images)
    batch_size: int = 32  # most queries in a micro-batch (encode + search + re-rank together); 4 traded CPU for
    # p99 on 2 cores, but not in every state of the test machine (docs/serve.md, "--batch-size")
    batch_wait_ms: float = 3.0  # how long a micro-batch waits for more queries after its first
    batch_workers: int = 2  # micro-batches in flight at once (one gathers at a time; each runs in its own thread)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


NOT_BLANK = r"\S"  # a query needs one non-whitespace character
JSON_BODY_LIMIT = 64 << 10  # bytes of a JSON body (or of any request but an upload), refused unread above it


class ErrorBody(BaseModel):
    """Every 4xx: what was wrong, in words."""

    model_config = ConfigDict(extra="forbid")
    error: str = Field(description="the problem, e.g. 'k must be between 1 and 100, got 0'")


class InternalErrorBody(BaseModel):
    """A 500: no details, an id to find the traceback in the server log (also in the X-Request-ID header)."""

    model_config = ConfigDict(extra="forbid")
    error: str = Field(description="always 'internal error'")
    request_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="id of the logged traceback")


class ResultRow(BaseModel):
    id: int = Field(ge=0, description="index id of the image")
    score: float
    url: str = Field(description="/images/{id}")


class SearchResponse(BaseModel):
    query: str
    rerank: bool
    results: list[ResultRow]


class ImageSearchResponse(BaseModel):
    results: list[ResultRow]


class HealthResponse(BaseModel):
    status: str
    images: int = Field(ge=0)
    index_type: str
    skipped_at_build: int = Field(ge=0)
    codec: str = Field(description="how the re-rank store keeps keys/values (fp16, or FAISS codes: docs/serve.md)")
    store_bytes_per_image: int = Field(ge=0, description="re-rank store bytes per image (codes + mask)")


def _errors(*statuses: int, body_limit: int = JSON_BODY_LIMIT, **described: str) -> dict:
    """``responses=`` for a route: the given 4xx statuses, plus the 413 of the body guard and the 500 every
    route can answer; ``described``: ``s400="..."`` descriptions."""
    out = {s: {"model": ErrorBody, "description": described.get(f"s{s}", "bad request")} for s in statuses}
    out[413] = {"model": ErrorBody, "description": described.get(
        "s413", f"request body over {body_limit} bytes (refused before it is read)")}
    out[500] = {"model": InternalErrorBody, "description": "internal error; the traceback is logged under request_id"}
    return out


TEXT_EMPTY = "text is empty: give a caption-like query, e.g. 'a red circle on the left'"
BINARY = {"schema": {"type": "string", "format": "binary"}}


def _check_text(text: str, limits: Limits) -> str:
    if not text or not text.strip():
        raise ValueError(TEXT_EMPTY)
    if len(text) > limits.max_text_chars:
        raise ValueError(f"text is {len(text)} characters, over the limit of {limits.max_text_chars}")
    return text


def _check_query(text: str | None, k: int | None, limits: Limits) -> None:
    """Raise ApiError(422) naming the problem with a query's text or k (the schema's limits, checked again:
    e.g. text of only characters that str.strip() removes but the schema's pattern does not)."""
    if text is not None:
        try:
            _check_text(text, limits)
        except ValueError as err:
            raise ApiError(422, str(err)) from None
    if k is not None and not 1 <= k <= limits.max_k:
        raise ApiError(422, f"k must be between 1 and {limits.max_k}, got {k}")


def _friendly(err: dict, limits: Limits) -> str | None:
    """The service's own message for a query's text or k outside the schema's limits, else None."""
    field, kind, value = (err.get("loc") or (None,))[-1], err.get("type"), err.get("input")
    if field == "text" and kind in ("string_too_short", "string_pattern_mismatch"):
        return TEXT_EMPTY
    if field == "text" and kind == "string_too_long" and isinstance(value, str):
        return f"text is {len(value)} characters, over the limit of {limits.max_text_chars}"
    if field == "k" and kind in ("greater_than_equal", "less_than_equal"):
        return f"k must be between 1 and {limits.max_k}, got {value}"
    return None


def result_rows(ids, scores) -> list[dict]:
    """Ranked (ids, scores) -> the ``ResultRow`` dicts of an answer."""
    return [{"id": int(i), "score": float(s), "url": f"/images/{int(i)}"} for i, s in zip(ids, scores)]


def json_body(content) -> bytes:
    """``content`` as the bytes ``JSONResponse`` would send (compact, UTF-8, NaN and infinity refused)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _render(content) -> bytes | ValueError:
    try:
        return json_body(content)
    except ValueError as err:  # NaN / infinity in the answer
        return err


def create_app(index_dir, model=None, ckpt=None, limits: Limits | None = None) -> FastAPI:
    """App over the index at ``index_dir``; the model is ``model`` or loaded from ``ckpt`` / the manifest's path."""
    import mmgeo

    limits = limits or Limits()
    gallery = Gallery(index_dir)
    if model is None:
        ckpt = ckpt or gallery.model_record.get("path")
        if not ckpt:
            raise ValueError(f"index {index_dir} records no checkpoint path; pass --ckpt")
        model = mmgeo.load_model(ckpt)
    gallery.check_model(model, ckpt)

    def search_batch(queries: list[tuple[str, int, bool]]) -> list[bytes | ValueError]:
        """One micro-batch of (text, k, rerank) in a worker thread: one encode call, one FAISS search, one
        batched re-rank -> each query's /search answer, already JSON (``json_body``): rendering it here keeps
        FastAPI's encoder off the event loop, which every request goes through. An answer that cannot be
        rendered (a non-finite score) is that query's error alone, raised by its handler."""
        emb = model.encode_text([t for t, _, _ in queries])  # rows (B, ...)
        found = search_texts(model, gallery, emb, [k for _, k, _ in queries], [r for _, _, r in queries],
                             limits.k_prime)
        return [_render({"query": t, "rerank": r, "results": result_rows(ids, scores)})
                for (t, _, r), (ids, scores) in zip(queries, found)]

    batcher = MicroBatcher(search_batch, limits.batch_size, limits.batch_wait_ms, limits.batch_workers)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    upload_limit = f"{limits.max_upload_bytes} bytes and {limits.max_image_pixels} pixels"
    app = FastAPI(title="mmgeo image search", lifespan=lifespan, description=(
        "Text -> image search: FAISS on global vectors, geometric re-rank.\n\n"
        f"Limits: query text 1..{limits.max_text_chars} characters, not only whitespace; k 1..{limits.max_k}; "
        f"JSON bodies (and any request but an upload) {JSON_BODY_LIMIT} bytes; uploads {upload_limit}. "
        "A body over its limit is refused with 413 before it is read. Every error is JSON: {\"error\": \"...\"}, "
        "plus request_id on a 500."))
    app.state.gallery, app.state.model, app.state.batcher, app.state.limits = gallery, model, batcher, limits
    app.add_middleware(BodySizeGuard, limits={"/search/image": limits.max_upload_bytes + (64 << 10)},
                       default=JSON_BODY_LIMIT)  # multipart headroom; JSON bodies are small
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts the guard's 413s too

    class SearchRequest(BaseModel):
        """A text query; the limits are this app's ``Limits``."""

        text: str = Field(min_length=1, max_length=limits.max_text_chars, pattern=NOT_BLANK,
                          description="caption-like query, e.g. 'a red circle on the left'")
        k: int = Field(10, ge=1, le=limits.max_k, strict=True, description="results to return (a JSON integer)")
        rerank: bool = Field(True, strict=True,
                             description=f"re-rank the FAISS top K' ({limits.k_prime}) by the geometric score")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        errs = err.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            return JSONResponse({"error": "malformed JSON body: send e.g. {\"text\": \"a red circle\", \"k\": 10}"},
                                status_code=400)
        msgs = [_friendly(e, limits) or f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}" for e in errs]
        return JSONResponse({"error": "; ".join(msgs)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        msg = f"no such endpoint: {request.url.path}" if err.status_code == 404 else str(err.detail)
        return JSONResponse({"error": msg}, status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception):
        """The client gets an id, never the exception's text; the log gets the traceback under that id."""
        request_id = uuid.uuid4().hex
        log.error("internal error, request_id=%s, %s %r", request_id, request.method, request.url.path[:200],
                  exc_info=err)
        return JSONResponse({"error": "internal error", "request_id": request_id}, status_code=500,
                            headers={"X-Request-ID": request_id})

    def image_id(raw: str) -> int:
        if not re.fullmatch(r"[0-9]{1,12}", raw):
            raise ApiError(400, f"image id must be a non-negative integer from the index, got {raw[:80]!r}")
        i = int(raw)
        if i >= gallery.count:
            raise ApiError(404, f"unknown image id {i}: the index holds ids 0..{gallery.count - 1}")
        return i

    text_limits = {"min_length": 1, "max_length": limits.max_text_chars, "pattern": NOT_BLANK}
    k_limits = {"ge": 1, "le": limits.max_k}

    @app.post("/search", summary="Text -> ranked images", responses={
        200: {"model": SearchResponse},
        **_errors(400, 422, s400="malformed JSON body",
                  s422=f"invalid body: text empty or over {limits.max_text_chars} characters, k outside "
                       f"1..{limits.max_k}, a field missing or of the wrong type")})
    async def search(req: SearchRequest):
        _check_query(req.text, req.k, limits)
        body = await batcher.submit((req.text, req.k, req.rerank))  # batched with concurrent queries
        if isinstance(body, ValueError):
            raise body  # this query's answer only (the 500 handler logs it)
        return Response(body, media_type="application/json")  # rendered in the batch (SearchResponse's shape)

    @app.post("/search/image", summary="Image upload -> similar images (global vectors)",
              description=f"Uploads are limited to {upload_limit}; over either, the answer is 413.",
              responses={200: {"model": ImageSearchResponse},
                         **_errors(400, 422, body_limit=limits.max_upload_bytes,
                                   s400="empty upload, not a readable image, or malformed multipart body",
                                   s413=f"upload over {limits.max_upload_bytes} bytes, or an image over "
                                        f"{limits.max_image_pixels} pixels (decompression-bomb guard)",
                                   s422=f"no file, or k outside 1..{limits.max_k}")})
    async def search_image(file: Annotated[UploadFile, File(description=f"image file, at most {upload_limit}")],
                           k: int = Query(10, **k_limits, description="results to return")):
        _check_query(None, k, limits)
        data = await file.read(limits.max_upload_bytes + 1)
        if len(data) > limits.max_upload_bytes:
            raise ApiError(413, f"upload is over the limit of {limits.max_upload_bytes} bytes")
        if not data:
            raise ApiError(400, "upload is empty: send an image file in the 'file' field")
        im = await asyncio.to_thread(_decode_upload, data, limits.max_image_pixels)
        emb = await asyncio.to_thread(model.encode_image, [im])
        q = emb.pooled.float().cpu().numpy()  # (1, d_g)
        scores, ids = await asyncio.to_thread(gallery.index.search, q, min(k, gallery.count))
        keep = ids[0] >= 0
        return {"results": result_rows(ids[0][keep], scores[0][keep])}

    @app.get("/images/{raw_id:path}", summary="The image file of an index id", response_class=Response,
             responses={200: {"description": "the image file, of its own type", "content": {
                            "image/*": BINARY, "application/octet-stream": BINARY}},
                        **_errors(400, 404, s400="not an integer id (never a path)",
                                  s404="unknown id, or its file is no longer on disk")})
    async def get_image(raw_id: str = PathParam(description="integer id from the index, 0..images-1")):
        i = image_id(raw_id)
        path = gallery.image_path(i)
        if not path.is_file():
            raise ApiError(404, f"image {i}'s file is no longer on disk ({gallery.meta[i]['path']})")
        return FileResponse(path, media_type=mimetypes.guess_type(path.name)[0] or "application/octet-stream")

    @app.get("/explain", summary="PNG heatmap: where each caption word looks in an image", response_class=Response,
             responses={200: {"description": "PNG, one panel per caption token", "content": {"image/png": BINARY}},
                        **_errors(400, 404, 422, s400="id is not an integer", s404="unknown image id",
                                  s422=f"text missing, empty or over {limits.max_text_chars} characters")})
    async def explain(id: str = Query(..., description="image id (integer from the index)"),
                      text: str = Query(..., **text_limits, description="caption-like text")):
        from serve.explain import explain_png

        i = image_id(id)
        _check_query(text, None, limits)
        path = gallery.image_path(i)
        im = await asyncio.to_thread(open_image, path) if path.is_file() else None
        png = await asyncio.to_thread(explain_png, model, gallery, i, text, im)
        return Response(png, media_type="image/png")

    @app.get("/health", summary="Status and index size", responses={200: {"model": HealthResponse}, **_errors()})
    async def health():
        return {"status": "ok", "images": gallery.count, "index_type": gallery.manifest["index_type"],
                "skipped_at_build": gallery.manifest["skipped"]["count"], "codec": gallery.codec,
                "store_bytes_per_image": gallery.store.get("bytes_per_image", 0)}

    @app.get("/metrics", summary="Prometheus text format", response_class=Response, responses={
        200: {"description": "text exposition format 0.0.4", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors()})
    async def get_metrics():
        body = metrics.render({
            "mmgeo_index_images": ("Images in the loaded index.", gallery.count),
            "mmgeo_text_batches_total": ("Micro-batches of query encodings run.", batcher.batches),
            "mmgeo_text_batched_queries_total": ("Queries encoded in micro-batches.", batcher.items)})
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    @app.get("/", summary="The web page (search box)", response_class=Response, responses={
        200: {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}, **_errors()})
    async def page():
        return HTMLResponse(PAGE.read_text())

    default_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's document less the 422 it adds for /images/{raw_id}: a str path parameter never fails."""
        if app.openapi_schema is None:
            doc = default_openapi()
            doc["paths"]["/images/{raw_id}"]["get"]["responses"].pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            if "#/components/schemas/HTTPValidationError" not in json.dumps(doc["paths"]):
                schemas.pop("HTTPValidationError", None), schemas.pop("ValidationError", None)
        return app.openapi_schema

    app.openapi = openapi
    return app


def _decode_upload(data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        return open_image(io.BytesIO(data), max_pixels=max_pixels)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ApiError(413, f"image has too many pixels (decompression bomb guard): {err}") from None
    except ValueError as err:
        if "pixels" in str(err):
            raise ApiError(413, f"image has too many pixels: {err}") from None
        raise ApiError(400, f"upload is not a readable image: {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ApiError(400, f"upload is not a readable image (PNG, JPEG, ...): {type(err).__name__}") from None

