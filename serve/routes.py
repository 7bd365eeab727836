"""The service's endpoints, added to an app by ``serve.app.create_app`` in this order (the OpenAPI document's):
POST /search and POST /search/image (``add_search_routes``), GET /images/{id} and GET /explain
(``add_image_routes``), GET /health, GET /metrics and GET / (``add_info_routes``).

Every route declares every status it can answer with (``error_responses``); the request limits (``Limits``) are
schema constraints, checked again by the handlers (``check_query``).
"""

import asyncio
import io
import mimetypes
import re
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, File, Query, UploadFile
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

from mmgeo.data.images import open_image
from mmgeo.search.store import Gallery
from serve.api import (
    BINARY,
    JSON_BODY_LIMIT,
    NOT_BLANK,
    ApiError,
    HealthResponse,
    ImageSearchResponse,
    Limits,
    SearchResponse,
    check_query,
    error_responses,
    result_rows,
)
from serve.batching import MicroBatcher
from serve.errors import decode_upload
from serve.metrics import Metrics

PAGE = Path(__file__).with_name("page.html")


def upload_limit(limits: Limits) -> str:
    return f"{limits.max_upload_bytes} bytes and {limits.max_image_pixels} pixels"


def description(limits: Limits) -> str:
    """The app's description in the OpenAPI document: what it does and its limits."""
    return ("Text -> image search: FAISS on global vectors, geometric re-rank.\n\n"
            f"Limits: query text 1..{limits.max_text_chars} characters, not only whitespace; k 1..{limits.max_k}; "
            f"JSON bodies (and any request but an upload) {JSON_BODY_LIMIT} bytes; uploads {upload_limit(limits)}. "
            "A body over its limit is refused with 413 before it is read. Every error is JSON: {\"error\": \"...\"}, "
            "plus request_id on a 500.")


def add_search_routes(app: FastAPI, gallery: Gallery, model, batcher: MicroBatcher, limits: Limits) -> None:
    """POST /search (text queries, micro-batched by ``batcher``) and POST /search/image (an uploaded image)."""

    class SearchRequest(BaseModel):
        """A text query; the limits are this app's ``Limits``."""

        text: str = Field(min_length=1, max_length=limits.max_text_chars, pattern=NOT_BLANK,
                          description="caption-like query, e.g. 'a red circle on the left'")
        k: int = Field(10, ge=1, le=limits.max_k, strict=True, description="results to return (a JSON integer)")
        rerank: bool = Field(True, strict=True,
                             description=f"re-rank the FAISS top K' ({limits.k_prime}) by the geometric score")
        correct: bool = Field(True, strict=True,
                              description="search a query with words the model cannot read as its did_you_mean "
                                          "(each replaced by the closest known word), when it has one; false: as "
                                          "typed, the unknown words ignored")

    @app.post("/search", summary="Text -> ranked images", responses={
        200: {"model": SearchResponse},
        **error_responses(400, 422, s400="malformed JSON body",
                          s422=f"invalid body: text empty or over {limits.max_text_chars} characters, k outside "
                               f"1..{limits.max_k}, a field missing or of the wrong type")})
    async def search(req: SearchRequest):
        check_query(req.text, req.k, limits)
        body = await batcher.submit((req.text, req.k, req.rerank, req.correct))  # batched with concurrent queries
        if isinstance(body, ValueError):
            raise body  # this query's answer only (the 500 handler logs it)
        return Response(body, media_type="application/json")  # rendered in the batch (SearchResponse's shape)

    uploads = upload_limit(limits)

    @app.post("/search/image", summary="Image upload -> similar images (global vectors)",
              description=f"Uploads are limited to {uploads}; over either, the answer is 413.",
              responses={200: {"model": ImageSearchResponse},
                         **error_responses(400, 422, body_limit=limits.max_upload_bytes,
                                           s400="empty upload, not a readable image, or malformed multipart body",
                                           s413=f"upload over {limits.max_upload_bytes} bytes, or an image over "
                                                f"{limits.max_image_pixels} pixels (decompression-bomb guard)",
                                           s422=f"no file, or k outside 1..{limits.max_k}")})
    async def search_image(file: Annotated[UploadFile, File(description=f"image file, at most {uploads}")],
                           k: int = Query(10, ge=1, le=limits.max_k, description="results to return")):
        check_query(None, k, limits)
        data = await file.read(limits.max_upload_bytes + 1)
        if len(data) > limits.max_upload_bytes:
            raise ApiError(413, f"upload is over the limit of {limits.max_upload_bytes} bytes")
        if not data:
            raise ApiError(400, "upload is empty: send an image file in the 'file' field")
        im = await asyncio.to_thread(decode_upload, data, limits.max_image_pixels)
        emb = await asyncio.to_thread(model.encode_image, [im])
        q = emb.pooled.float().cpu().numpy()  # (1, d_g)
        scores, ids = await asyncio.to_thread(lambda: gallery.index.search(q, min(k, gallery.count)))
        keep = ids[0] >= 0
        return {"results": result_rows(ids[0][keep], scores[0][keep])}


def image_id(raw: str, gallery: Gallery) -> int:
    """A path or query parameter -> an id of ``gallery``; ApiError 400 (not an integer) or 404 (unknown). A database
    gallery's ids have holes where images were removed: it is asked (blocking: call from a worker thread)."""
    if not re.fullmatch(r"[0-9]{1,12}", raw):
        raise ApiError(400, f"image id must be a non-negative integer from the index, got {raw[:80]!r}")
    i = int(raw)
    if hasattr(gallery, "image_record"):
        if gallery.image_record(i) is None:
            raise ApiError(404, f"unknown image id {i}: not in the gallery")
    elif i >= gallery.count:
        raise ApiError(404, f"unknown image id {i}: the index holds ids 0..{gallery.count - 1}")
    return i


def image_source(raw: str, gallery: Gallery) -> tuple[int, Path | bytes | None, str]:
    """(id, its file: a path on disk or the bytes a database gallery keeps, None when gone, a name for its type);
    ApiError as ``image_id``. Blocking."""
    i = image_id(raw, gallery)
    if hasattr(gallery, "image_record"):
        rec = gallery.image_record(i) or {}
        if rec.get("stored_file"):
            data = gallery.image_file(i)
            return i, data, rec.get("name") or "image"
        path = Path(rec["path"]) if rec.get("path") else None
        return i, path if path is not None and path.is_file() else None, rec.get("path") or "?"
    path = gallery.image_path(i)
    return i, path if path.is_file() else None, gallery.meta[i]["path"]


def add_image_routes(app: FastAPI, gallery: Gallery, model, limits: Limits) -> None:
    """GET /images/{id} (the indexed image file) and GET /explain (where each caption word looks in it)."""

    @app.get("/images/{raw_id:path}", summary="The image file of an index id", response_class=Response,
             responses={200: {"description": "the image file, of its own type", "content": {
                            "image/*": BINARY, "application/octet-stream": BINARY}},
                        **error_responses(400, 404, s400="not an integer id (never a path)",
                                          s404="unknown id, or its file is no longer on disk")})
    async def get_image(raw_id: str = PathParam(description="integer id from the index, 0..images-1")):
        i, src, name = await asyncio.to_thread(image_source, raw_id, gallery)
        if src is None:
            raise ApiError(404, f"image {i}'s file is no longer on disk ({name})")
        media = mimetypes.guess_type(src.name if isinstance(src, Path) else name)[0] or "application/octet-stream"
        return FileResponse(src, media_type=media) if isinstance(src, Path) else Response(src, media_type=media)

    @app.get("/explain", summary="PNG heatmap: where each caption word looks in an image", response_class=Response,
             responses={200: {"description": "PNG, one panel per caption token", "content": {"image/png": BINARY}},
                        **error_responses(400, 404, 422, s400="id is not an integer", s404="unknown image id",
                                          s422=f"text missing, empty or over {limits.max_text_chars} characters")})
    async def explain(id: str = Query(..., description="image id (integer from the index)"),
                      text: str = Query(..., min_length=1, max_length=limits.max_text_chars, pattern=NOT_BLANK,
                                        description="caption-like text")):
        from serve.explain import explain_png

        i, src, _ = await asyncio.to_thread(image_source, id, gallery)
        check_query(text, None, limits)
        im = None if src is None else await asyncio.to_thread(open_image, src if isinstance(src, Path) else
                                                              io.BytesIO(src))
        png = await asyncio.to_thread(explain_png, model, gallery, i, text, im)
        return Response(png, media_type="image/png")


def add_info_routes(app: FastAPI, gallery: Gallery, batcher: MicroBatcher, metrics: Metrics) -> None:
    """GET /health, GET /metrics (Prometheus) and GET / (the web page)."""

    @app.get("/health", summary="Status; with a key, its collection's gallery size and kind",
             responses={200: {"model": HealthResponse}, **error_responses()})
    async def health():
        access = app.state.access
        if not access.reveals():  # no key: nothing about the galleries
            return {"status": "ok", "auth": access.auth}
        count = await asyncio.to_thread(lambda: gallery.count)  # a database gallery's is a query
        return {"status": "ok", "auth": access.auth, "images": count, "index_type": gallery.manifest["index_type"],
                "skipped_at_build": gallery.manifest["skipped"]["count"], "codec": gallery.codec,
                "store_bytes_per_image": gallery.store.get("bytes_per_image", 0)}

    @app.get("/metrics", summary="Prometheus text format", response_class=Response, responses={
        200: {"description": "text exposition format 0.0.4", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses()})
    async def get_metrics():
        count = await asyncio.to_thread(lambda: gallery.count)
        body = metrics.render({
            "mmgeo_index_images": ("Images in the loaded index.", count),
            "mmgeo_text_batches_total": ("Micro-batches of query encodings run.", batcher.batches),
            "mmgeo_text_batched_queries_total": ("Queries encoded in micro-batches.", batcher.items)})
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    @app.get("/", summary="The web page (search box)", response_class=Response, responses={
        200: {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}, **error_responses()})
    async def page():
        return HTMLResponse(PAGE.read_text())


class AddedImage(BaseModel):
    name: str = Field(description="the uploaded file's name")
    id: int = Field(ge=0, description="its id in the gallery")
    added: bool = Field(description="false when the same file was stored already (same content SHA-256)")


class AddResponse(BaseModel):
    images: list[AddedImage]
    count: int = Field(ge=0, description="images in the gallery now")


class RemoveResponse(BaseModel):
    removed: int = Field(ge=0, description="the id removed")
    count: int = Field(ge=0, description="images in the gallery now")


def add_write_routes(app: FastAPI, gallery, model, limits: Limits) -> None:
    """POST /images (upload -> encode -> insert, one transaction) and DELETE /images/{id} over a database gallery
    (``mmgeo.search.database``), when ``limits.allow_writes``."""
    from mmgeo.search.database import remove_images
    from mmgeo.search.db_build import add_uploads

    uploads = f"at most {limits.max_upload_files} files of {upload_limit(limits)} in all"

    @app.post("/images", summary="Add images to the gallery", status_code=200,
              description=f"Uploads: {uploads}. Each file is encoded and stored with the gallery's codebooks, all "
                          "in one transaction; a file stored already (same bytes) keeps its id.",
              responses={200: {"model": AddResponse},
                         **error_responses(400, 422, body_limit=limits.max_upload_bytes,
                                           s400="an empty file, or one that is not a readable image",
                                           s413=f"uploads over {limits.max_upload_bytes} bytes in all, or an image "
                                                f"over {limits.max_image_pixels} pixels",
                                           s422=f"no file, or more than {limits.max_upload_files}")})
    async def add_images(files: Annotated[list[UploadFile], File(description=f"image files, {uploads}")]):
        if not 1 <= len(files) <= limits.max_upload_files:
            raise ApiError(422, f"send 1..{limits.max_upload_files} files in the 'files' field, got {len(files)}")
        got, total = [], 0
        for f in files:
            data = await f.read(limits.max_upload_bytes + 1)
            total += len(data)
            if total > limits.max_upload_bytes:
                raise ApiError(413, f"uploads are over the limit of {limits.max_upload_bytes} bytes in all")
            if not data:
                raise ApiError(400, f"upload {str(f.filename)[:80]!r} is empty")
            im = await asyncio.to_thread(decode_upload, data, limits.max_image_pixels)
            got.append((Path(f.filename or "upload").name[:200] or "upload", data, im))
        await asyncio.to_thread(app.state.access.charge, total, len(got))  # the key's upload quotas (403)
        out = await asyncio.to_thread(add_uploads, model, gallery, got)
        rows = [{"name": n, "id": i, "added": True} for n, i in out["added"]]
        rows += [{"name": n, "id": i, "added": False} for n, i in out["existing"]]
        return {"images": rows, "count": out["count"]}

    @app.delete("/images/{raw_id}", summary="Remove an image from the gallery",
                responses={200: {"model": RemoveResponse},
                           **error_responses(400, 404, s400="not an integer id", s404="unknown id")})
    async def delete_image(raw_id: str = PathParam(description="integer id from the gallery")):
        if not re.fullmatch(r"[0-9]{1,12}", raw_id):
            raise ApiError(400, f"image id must be a non-negative integer from the index, got {raw_id[:80]!r}")
        gone = await asyncio.to_thread(remove_images, gallery.db, [int(raw_id)])
        if not gone:
            raise ApiError(404, f"unknown image id {int(raw_id)}: not in the gallery")
        return {"removed": gone[0], "count": await asyncio.to_thread(lambda: gallery.count)}
