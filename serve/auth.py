"""API keys of the service (docs/design.md §12): made, stored, checked and limited.

A key is ``mmgeo_<id>_<secret>``: ``id`` (12 hex digits) names its record and may be logged; ``secret`` (32 random
bytes, base64url) is shown once, when the key is made, and never stored: a record keeps a random salt and
PBKDF2-HMAC-SHA256 of the secret, compared in constant time (``hmac.compare_digest``). A key is bound to one
collection with one scope: ``read`` (search, images, explain) < ``write`` (+ add and remove images) < ``admin``
(+ /metrics). Records live in a JSON file (``FileKeys``, the folder backend's ``--keys FILE``) or in the gallery's
database (``DbKeys`` in ``serve.db_keys``); both are read again when they change, so a revoked key stops working
without a restart.

Limits per key (``KeyRecord``): requests per minute (a token bucket per server process, ``RateLimiter``), and for
write keys the bytes and images it may upload in all (``KeyStore.charge``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCOPES = ("read", "write", "admin")  # each includes the ones before it
PREFIX = "mmgeo_"
KEY_RE = re.compile(r"mmgeo_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")  # the whole token
COLLECTION_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # a collection's name
ITERATIONS = 1000  # PBKDF2 rounds: the secret is 256 random bits, so stretching adds nothing; ~1 ms a request
DEFAULT_RATE = 600  # requests per minute of a new key
DUMMY_SALT = bytes(16)  # an unknown id is hashed too, so that it takes as long as a wrong secret


class AuthError(Exception):
    """Why a request is refused: ``status`` 401 (no valid key), 403 (a valid key that may not do this) or 429
    (over its rate; ``retry_after`` seconds). ``message`` never holds the key."""

    def __init__(self, status: int, message: str, retry_after: int | None = None, key_id: str | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after, self.key_id = status, message, retry_after, key_id


@dataclass
class KeyRecord:
    """What is stored of a key (never its secret)."""

    id: str  # 12 hex digits, the token's second part; safe to log
    collection: str  # the one collection the key opens
    scope: str  # read | write | admin
    salt: str  # hex of 16 random bytes
    hash: str  # hex of PBKDF2-HMAC-SHA256(secret, salt, iterations)
    iterations: int = ITERATIONS  # PBKDF2 rounds this record was hashed with
    name: str = ""  # a note for people: who or what holds it
    created: float = field(default_factory=time.time)  # Unix time it was made
    revoked: float | None = None  # Unix time it was revoked; None: valid
    rate: int = DEFAULT_RATE  # requests per minute (0: unlimited)
    quota_bytes: int = 0  # write keys: bytes it may upload in all (0: unlimited)
    quota_images: int = 0  # write keys: images it may upload in all (0: unlimited)
    used_bytes: int = 0  # uploaded so far
    used_images: int = 0  # uploaded so far

    def allows(self, scope: str) -> bool:
        return SCOPES.index(self.scope) >= SCOPES.index(scope)

    def __repr__(self) -> str:  # no salt or hash in tracebacks and logs
        return f"KeyRecord(id={self.id!r}, collection={self.collection!r}, scope={self.scope!r})"


def digest(secret: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)


def check_collection(name: str) -> str:
    if not isinstance(name, str) or not COLLECTION_RE.fullmatch(name):
        raise ValueError(f"collection name {str(name)[:80]!r} is not valid: use 1-63 lowercase letters, digits, "
                         "'-' or '_', starting with a letter or digit")
    return name


def new_key(collection: str, scope: str, name: str = "", rate: int = DEFAULT_RATE, quota_bytes: int = 0,
            quota_images: int = 0) -> tuple[str, KeyRecord]:
    """A fresh key -> (the token, to show once; its record, to store)."""
    check_collection(collection)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    for what, v in (("--rate", rate), ("--quota-bytes", quota_bytes), ("--quota-images", quota_images)):
        if v < 0:
            raise ValueError(f"{what} must be 0 (unlimited) or more, got {v}")
    key_id = secrets.token_hex(6)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    salt = secrets.token_bytes(16)
    record = KeyRecord(id=key_id, collection=collection, scope=scope, salt=salt.hex(),
                       hash=digest(secret, salt, ITERATIONS).hex(), name=name[:200], rate=rate,
                       quota_bytes=quota_bytes, quota_images=quota_images)
    return f"{PREFIX}{key_id}_{secret}", record


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when there is no such header."""
    if header is None:
        return None
    kind, _, token = header.strip().partition(" ")
    return token.strip() if kind.lower() == "bearer" else ""


def id_of(token: str | None) -> str | None:
    """The id part of a well-formed token (what a log may show), else None."""
    m = KEY_RE.fullmatch(token or "")
    return m.group(1) if m else None


class KeyStore(ABC):
    """Records by id; subclasses (FileKeys, serve.db_keys.DbKeys) fill ``records`` and add, revoke and charge
    them."""

    def __init__(self):
        self.records: dict[str, KeyRecord] = {}
        self.lock = threading.Lock()

    def refresh(self) -> None:  # noqa: B027 - a hook: a store read once (DbKeys) keeps this no-op
        """Read the records again if they changed (cheap when they did not)."""

    def verify(self, token: str | None) -> KeyRecord:
        """The valid record of ``token``; AuthError 401 otherwise (no key, malformed, unknown, wrong or revoked:
        each takes one hash, so that timing tells none of them from another)."""
        if token is None:
            raise AuthError(401, "this endpoint needs an API key: send the header 'Authorization: Bearer <key>' "
                                 "(python -m serve keys create)")
        m = KEY_RE.fullmatch(token)
        if m is None:
            digest("", DUMMY_SALT, ITERATIONS)
            raise AuthError(401, "the API key is malformed: expected 'Authorization: Bearer mmgeo_<id>_<secret>'")
        key_id, secret = m.groups()
        rec = self.lookup(key_id)
        salt, iterations = (bytes.fromhex(rec.salt), rec.iterations) if rec else (DUMMY_SALT, ITERATIONS)
        good = hmac.compare_digest(digest(secret, salt, iterations), bytes.fromhex(rec.hash) if rec else bytes(32))
        if rec is None or not good or rec.revoked is not None:
            raise AuthError(401, "the API key is not valid (unknown, wrong or revoked)", key_id=key_id)
        return rec

    def lookup(self, key_id: str) -> KeyRecord | None:
        """The record of ``key_id`` as stored now, or None."""
        self.refresh()
        return self.records.get(key_id)

    @abstractmethod
    def charge(self, key_id: str, nbytes: int, images: int) -> None:
        """Count an upload against the key's quotas; AuthError 403 (nothing counted) when it would pass one."""

    @abstractmethod
    def add(self, record: KeyRecord) -> None:
        """Store a new record."""

    @abstractmethod
    def revoke(self, key_id: str) -> KeyRecord:
        """Mark the key revoked; its record as now stored."""

    def list(self) -> list[KeyRecord]:
        self.refresh()
        return sorted(self.records.values(), key=lambda r: (r.collection, r.created))


def over_quota(rec: KeyRecord, nbytes: int, images: int) -> str | None:
    """Why this upload would pass the key's quotas, or None."""
    if rec.quota_bytes and rec.used_bytes + nbytes > rec.quota_bytes:
        return f"this key's upload quota is {rec.quota_bytes} bytes, {rec.used_bytes} used; this upload is {nbytes}"
    if rec.quota_images and rec.used_images + images > rec.quota_images:
        return f"this key's upload quota is {rec.quota_images} images, {rec.used_images} used; this upload is {images}"
    return None


class FileKeys(KeyStore):
    """Records in a JSON file (``{"format": "mmgeo-keys", "keys": [...]}``, hashes only, mode 0600), read again
    when its modification time or size changes; written atomically (temporary file, then rename)."""

    FORMAT = "mmgeo-keys"

    def __init__(self, path: str | os.PathLike, create: bool = False):
        super().__init__()
        self.path = Path(path)
        self.stamp = None
        if not self.path.is_file():
            if not create:
                raise ValueError(f"--keys {self.path}: no such file; make keys with `python -m serve keys create "
                                 f"--keys {self.path} --collection NAME --scope read`")
            if not self.path.parent.is_dir():
                raise ValueError(f"--keys {self.path}: folder {str(self.path.parent)!r} does not exist")
            self._write({})
        self.refresh()

    def refresh(self) -> None:
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self.stamp:
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("format") != self.FORMAT:
                raise ValueError("not an mmgeo keys file")
            records = {r["id"]: KeyRecord(**r) for r in doc["keys"]}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"--keys {self.path} is not a keys file of `python -m serve keys` "
                             f"({type(err).__name__}): make a new one") from None
        with self.lock:
            self.records, self.stamp = records, stamp

    def _write(self, records: dict[str, KeyRecord]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": self.FORMAT, "keys": [asdict(r) for r in records.values()]}, f, indent=1)
        os.replace(tmp, self.path)

    def _update(self, change) -> KeyRecord | None:
        """Apply ``change(records)`` to the file's current records under an exclusive lock, and write them."""
        import fcntl

        with open(self.path.with_name(f".{self.path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.stamp = None
            self.refresh()
            records = dict(self.records)
            out = change(records)
            self._write(records)
            self.stamp = None
            self.refresh()
        return out

    def add(self, record: KeyRecord) -> None:
        self._update(lambda rs: rs.__setitem__(record.id, record))

    def revoke(self, key_id: str) -> KeyRecord:
        def change(rs):
            if key_id not in rs:
                raise ValueError(f"no key with id {key_id!r} in {self.path} (python -m serve keys list)")
            if rs[key_id].revoked is None:
                rs[key_id].revoked = time.time()
            return rs[key_id]

        return self._update(change)

    def charge(self, key_id: str, nbytes: int, images: int) -> None:
        def change(rs):
            why = over_quota(rs[key_id], nbytes, images)
            if why:
                raise AuthError(403, why, key_id=key_id)
            rs[key_id].used_bytes += nbytes
            rs[key_id].used_images += images

        self._update(change)


class RateLimiter:
    """A token bucket per key id (in this server process): ``rate`` requests a minute, bursts of up to 10 seconds'
    worth (at least 5)."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.lock = clock, threading.Lock()
        self.buckets: dict[str, tuple[float, float]] = {}  # id -> (tokens, time)

    def take(self, rec: KeyRecord) -> None:
        """One request of ``rec``; AuthError 429 with the seconds until the next one is allowed."""
        if not rec.rate:
            return
        per_s, cap = rec.rate / 60.0, max(5.0, rec.rate / 6.0)
        with self.lock:
            now = self.clock()
            tokens, then = self.buckets.get(rec.id, (cap, now))
            tokens = min(cap, tokens + (now - then) * per_s)
            if tokens < 1.0:
                self.buckets[rec.id] = (tokens, now)
                wait = max(1, int(-(-(1.0 - tokens) // per_s)))
                raise AuthError(429, f"this key's limit is {rec.rate} requests a minute; retry in {wait} s",
                                retry_after=wait, key_id=rec.id)
            self.buckets[rec.id] = (tokens - 1.0, now)
