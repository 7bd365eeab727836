"""The service's error answers: every bad input a 4xx ``{"error": "..."}`` naming the problem, an internal error a
500 ``{"error": "internal error", "request_id": "<hex>"}`` whose traceback is logged under that id (logger
``serve.app``)."""

import io
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmgeo.data.images import open_image
from mmgeo.search.database import DatabaseError
from serve.api import ApiError, Limits, friendly

RETRY_AFTER_S = 2  # a 503's Retry-After when the gallery's database cannot be reached
log = logging.getLogger("serve.app")  # the service's log: where an operator looks up a request_id


def add_error_handlers(app: FastAPI, limits: Limits) -> None:
    """ApiError -> its status; a request the schema refuses -> 400 (malformed JSON) or 422 with the service's own
    message; an unknown path -> 404; anything else -> 500 with an id, the traceback logged."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        errs = err.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            return JSONResponse({"error": "malformed JSON body: send e.g. {\"text\": \"a red circle\", \"k\": 10}"},
                                status_code=400)
        msgs = [friendly(e, limits) or f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}" for e in errs]
        return JSONResponse({"error": "; ".join(msgs)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        msg = f"no such endpoint: {request.url.path}" if err.status_code == 404 else str(err.detail)
        return JSONResponse({"error": msg}, status_code=err.status_code)

    @app.exception_handler(DatabaseError)
    async def _database(request: Request, err: DatabaseError):
        """The gallery's database is down or slow: 503 and when to retry, never a hang or a traceback."""
        log.warning("database unavailable: %s", err)
        return JSONResponse({"error": "the gallery's database is unavailable; retry shortly"}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception):
        """The client gets an id, never the exception's text; the log gets the traceback under that id."""
        request_id = uuid.uuid4().hex
        log.error("internal error, request_id=%s, %s %r", request_id, request.method, request.url.path[:200],
                  exc_info=err)
        return JSONResponse({"error": "internal error", "request_id": request_id}, status_code=500,
                            headers={"X-Request-ID": request_id})


def decode_upload(data: bytes, max_pixels: int):
    """An uploaded file's bytes -> the image; ApiError 413 over ``max_pixels``, 400 when it is not an image."""
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
