"""Who may ask what of the service (docs/design.md §12): the key check in front of every route, the collection a
request reads, and what the OpenAPI document says of both.

- ``Access``: the service's keys (``serve.auth``; None: no keys, on a loopback address or with ``--no-auth``) and
  its galleries by collection. ``AccessMiddleware`` (pure ASGI, before the body is read) finds the route's scope
  (``scope_of``), checks ``Authorization: Bearer <key>``, the key's rate, and the collection the request names in
  ``X-Collection`` (optional: the key's own is implied); it sets the request's key and collection
  (``CURRENT``), which ``CurrentGallery`` and ``CurrentBatcher`` follow, so the routes of ``serve.routes`` serve the
  key's collection without naming it.
- Refusals: 401 (no key, malformed, unknown, wrong, revoked), 403 (a valid key of another collection, or of a scope
  below the route's), 429 (over the key's rate, with ``Retry-After``); each logged (logger ``serve.app``) with the
  key's id at most, never the key.
"""

from __future__ import annotations

import contextvars
import json
import logging

from mmgeo.search.db_connect import COLLECTION
from serve.api import ApiError
from serve.auth import AuthError, KeyRecord, KeyStore, RateLimiter, bearer, id_of

log = logging.getLogger("serve.app")
HEADER = "x-collection"  # a request may name its collection; it must then be its key's
PUBLIC = {"/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # the static shell: no gallery in it
CURRENT: contextvars.ContextVar[tuple[str, KeyRecord | None] | None] = contextvars.ContextVar("mmgeo_access",
                                                                                             default=None)


def scope_of(method: str, path: str) -> str | None:
    """The scope a request needs: None (public), "optional" (/health: a key adds the gallery's details), "read",
    "write" or "admin". Unknown paths need "read": nothing answers an anonymous caller but the public shell."""
    if path in PUBLIC and method in ("GET", "HEAD"):
        return None
    if path == "/health":
        return "optional"
    if path == "/metrics":
        return "admin"
    if (method == "POST" and path == "/images") or (method == "DELETE" and path.startswith("/images/")):
        return "write"
    return "read"


class Access:
    """The service's keys (``keys``: a ``KeyStore``, None when open) and galleries (collection -> gallery; with one
    and no keys it is every request's). ``auth``: what /health says of it."""

    def __init__(self, galleries: dict, keys: KeyStore | None, auth: str):
        if keys is None and len(galleries) > 1:
            raise ValueError(f"{len(galleries)} collections need keys (--keys FILE): a request's key tells which "
                             "collection it reads")
        self.galleries, self.keys, self.auth = galleries, keys, auth
        self.default = next(iter(galleries)) if len(galleries) == 1 else None
        self.limiter = RateLimiter()

    def current(self) -> str:
        got = CURRENT.get()
        if got is not None:
            return got[0]
        if self.default is None:
            raise LookupError("no collection chosen for this request")
        return self.default

    def key(self) -> KeyRecord | None:
        got = CURRENT.get()
        return None if got is None else got[1]

    def reveals(self) -> bool:
        """Whether this request may see its gallery's details (/health): with a valid key, or on an open service."""
        return self.keys is None or self.key() is not None

    def charge(self, nbytes: int, images: int) -> None:
        """Count an upload against the request's key's quotas (AuthError 403 past them); no key: nothing."""
        rec = self.key()
        if rec is not None and self.keys is not None:
            try:
                self.keys.charge(rec.id, nbytes, images)
            except AuthError as err:
                log.warning("refused an upload: 403 quota (key id %s)", rec.id)
                raise ApiError(err.status, err.message) from None

    def admit(self, method: str, path: str, authorization: str | None, named: str | None) -> tuple[str, KeyRecord
                                                                                                    | None] | None:
        """The (collection, key) a request runs as, None for a public one; AuthError when it is refused."""
        need = scope_of(method, path)
        if need is None:
            return None
        if self.keys is None:  # one collection, no keys: every request's
            return self.default, None
        token = bearer(authorization)
        if need == "optional" and token is None:
            return None
        rec = self.keys.verify(token)
        if named is not None and named != rec.collection:
            raise AuthError(403, "this key does not open the collection named in X-Collection", key_id=rec.id)
        if need != "optional" and not rec.allows(need):
            raise AuthError(403, f"this endpoint needs a {need} key; this one is {rec.scope}", key_id=rec.id)
        if rec.collection not in self.galleries:
            raise AuthError(403, "this key's collection is not served here", key_id=rec.id)
        self.limiter.take(rec)
        return rec.collection, rec


class AccessMiddleware:
    """Pure ASGI: admit or refuse each HTTP request before it is routed or its body read (``Access.admit``)."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        named = headers.get(HEADER.encode())
        try:
            got = self.access.admit(scope["method"], scope["path"], auth.decode("latin-1") if auth else None,
                                    named.decode("latin-1") if named is not None else None)
        except AuthError as err:
            if err.status in (401, 403, 429):
                key_id = err.key_id or id_of(bearer(auth.decode("latin-1")) if auth else None)
                log.warning("refused %s %s: %d %s (key id %s)", scope["method"], scope["path"][:100], err.status,
                            "rate" if err.status == 429 else "authentication" if err.status == 401 else "scope",
                            key_id or "none")
            return await refuse(send, err)
        token = CURRENT.set(got)
        db_token = COLLECTION.set(got[0]) if got is not None and self.access.keys is not None else None
        try:
            await self.app(scope, receive, send)
        finally:
            if db_token is not None:
                COLLECTION.reset(db_token)
            CURRENT.reset(token)


async def refuse(send, err: AuthError) -> None:
    body = json.dumps({"error": err.message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="mmgeo"'))
    if err.retry_after is not None:
        headers.append((b"retry-after", str(err.retry_after).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def in_collection(name: str, fn, keys):
    """``fn`` run in collection ``name``'s database transactions (``COLLECTION``) when the service has keys: a
    micro-batch runs in a thread of its own, outside any request's context."""
    if keys is None:
        return fn

    def run(items):
        token = COLLECTION.set(name)
        try:
            return fn(items)
        finally:
            COLLECTION.reset(token)

    return run


class CurrentGallery:
    """The gallery of the request's collection (``Access.current``): every attribute is that gallery's."""

    def __init__(self, access: Access):
        self._access = access

    def __getattr__(self, name):
        return getattr(self._access.galleries[self._access.current()], name)


class CurrentBatcher:
    """The micro-batcher of the request's collection (one per collection: a batch searches one gallery)."""

    def __init__(self, access: Access, batchers: dict):
        self.access, self.batchers = access, batchers

    async def start(self) -> None:
        for b in self.batchers.values():
            await b.start()

    async def stop(self) -> None:
        for b in self.batchers.values():
            await b.stop()

    async def submit(self, item):
        return await self.batchers[self.access.current()].submit(item)

    @property
    def batches(self) -> int:
        return sum(b.batches for b in self.batchers.values())

    @property
    def items(self) -> int:
        return sum(b.items for b in self.batchers.values())


REFUSALS = {401: "no API key, or not a valid one (unknown, wrong or revoked): send 'Authorization: Bearer <key>'",
            403: "a valid key that may not do this: another collection's (X-Collection), a scope below the "
                 "endpoint's, or past its upload quota",
            429: "over the key's request rate; retry after the Retry-After header's seconds"}


COLLECTION_PARAMETER = {"name": "X-Collection", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "the collection this request is for; it must be the key's (403 otherwise). "
                                       "Absent: the key's own"}


def secure_document(doc: dict) -> dict:
    """Declare the bearer scheme, each operation's need of it, and the 401 / 403 / 429 answers of secured ones."""
    doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer", "description": "an API key: python -m serve keys create"}
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            need = scope_of(method.upper(), path.split("{")[0] + ("0" if "{" in path else ""))
            if need is None:
                op["security"] = []
                continue
            op["security"] = [{}, {"bearer": []}] if need == "optional" else [{"bearer": []}]
            if need != "optional":
                op.setdefault("parameters", []).append(COLLECTION_PARAMETER)
            statuses = (401,) if need == "optional" else (401, 403, 429)
            for s in statuses:
                answer = {"description": REFUSALS[s], "content": {"application/json": {"schema": error}}}
                if s == 429:
                    answer["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
                op["responses"].setdefault(str(s), answer)
    return doc
