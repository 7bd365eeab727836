"""The service's contract, shared by the app factory (``serve.app``), its routes (``serve.routes``) and its error
handlers (``serve.errors``): request limits, the error type, the response schemas, and the checks of a query.
"""

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from mmgeo.data.images import MAX_PIXELS


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
    allow_writes: bool = False  # POST /images and DELETE /images/{id} (a database gallery only; write keys when the
    # service has keys, else anyone who reaches it: docs/serve.md, "Keys and collections")
    max_upload_files: int = 16  # images in one POST /images (all together within max_upload_bytes)


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
    query: str = Field(description="the query as sent")
    searched: str = Field(description="the text searched: the query, or its did_you_mean when the request let the "
                                      "search correct it (correct: true, the default)")
    rerank: bool
    results: list[ResultRow]
    unknown_words: list[str] = Field(description="words of the query the model's vocabulary cannot read (e.g. a plural "
                                                 "the training captions never used): ignored unless did_you_mean was "
                                                 "searched")
    did_you_mean: str | None = Field(description="the query with each unknown word replaced by the closest word the "
                                                 "model knows ('circles' -> 'circle'); null when none is close")


class ImageSearchResponse(BaseModel):
    results: list[ResultRow]


class HealthResponse(BaseModel):
    """Always status and auth; the gallery's fields only with a valid key (or on a service without keys)."""

    status: str
    auth: str = Field(description="'keys' (API keys required), 'none' (no keys: a loopback address), or "
                                  "'DISABLED (--no-auth)' (no keys on a network address: a warning)")
    images: int | None = Field(None, ge=0)
    index_type: str | None = None
    skipped_at_build: int | None = Field(None, ge=0)
    codec: str | None = Field(None, description="how the re-rank store keeps keys/values (fp16, or FAISS codes: "
                                                "docs/serve.md)")
    store_bytes_per_image: int | None = Field(None, ge=0, description="re-rank store bytes per image (codes + mask)")


def error_responses(*statuses: int, body_limit: int = JSON_BODY_LIMIT, **described: str) -> dict:
    """``responses=`` for a route: the given 4xx statuses, plus the 413 of the body guard and the 500 every
    route can answer; ``described``: ``s400="..."`` descriptions."""
    out = {s: {"model": ErrorBody, "description": described.get(f"s{s}", "bad request")} for s in statuses}
    out[413] = {"model": ErrorBody, "description": described.get(
        "s413", f"request body over {body_limit} bytes (refused before it is read)")}
    out[500] = {"model": InternalErrorBody, "description": "internal error; the traceback is logged under request_id"}
    out[503] = {"model": ErrorBody, "description": "the gallery's database is unavailable or slow (a gallery in "
                "PostgreSQL only); retry after the Retry-After header's seconds"}
    return out


TEXT_EMPTY = "text is empty: give a caption-like query, e.g. 'a red circle on the left'"
BINARY = {"schema": {"type": "string", "format": "binary"}}


def check_text(text: str, limits: Limits) -> str:
    if not text or not text.strip():
        raise ValueError(TEXT_EMPTY)
    if len(text) > limits.max_text_chars:
        raise ValueError(f"text is {len(text)} characters, over the limit of {limits.max_text_chars}")
    return text


def check_query(text: str | None, k: int | None, limits: Limits) -> None:
    """Raise ApiError(422) naming the problem with a query's text or k (the schema's limits, checked again:
    e.g. text of only characters that str.strip() removes but the schema's pattern does not)."""
    if text is not None:
        try:
            check_text(text, limits)
        except ValueError as err:
            raise ApiError(422, str(err)) from None
    if k is not None and not 1 <= k <= limits.max_k:
        raise ApiError(422, f"k must be between 1 and {limits.max_k}, got {k}")


def friendly(err: dict, limits: Limits) -> str | None:
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


def render(content) -> bytes | ValueError:
    """``json_body(content)``, or the ValueError of an answer that cannot be rendered (NaN / infinity in it)."""
    try:
        return json_body(content)
    except ValueError as err:
        return err
