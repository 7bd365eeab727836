"""``python -m serve keys create|list|revoke`` and the ``run`` options of keys and collections (docs/serve.md,
"Keys and collections"): a key is printed once, when it is made; only its salted hash is stored, in a keys file
(``--keys FILE``) or in the gallery's database (``--db URL``)."""

from __future__ import annotations

import ipaddress
import logging
import time

from serve.auth import DEFAULT_RATE, SCOPES, FileKeys, KeyStore, check_collection, new_key

log = logging.getLogger("serve.app")
NO_AUTH = "DISABLED (--no-auth)"  # what /health says of a service on a network address without keys


def add_keys_parser(sub) -> None:
    """The ``keys`` command and its three subcommands."""
    k = sub.add_parser("keys", help="make, list and revoke API keys (shown once; only a salted hash is stored)")
    ks = k.add_subparsers(dest="keys_command", required=True)
    for name, text in (("create", "make a key and print it once"), ("list", "list the keys (never the secrets)"),
                       ("revoke", "revoke a key by its id (a running service refuses it at once)")):
        c = ks.add_parser(name, help=text)
        where = c.add_mutually_exclusive_group(required=True)
        where.add_argument("--keys", metavar="FILE", help="keys file of a folder service (`run --keys FILE`); "
                           "create makes it when absent")
        where.add_argument("--db", metavar="URL", help="the gallery's database (`run --db URL`): keys in its table")
        if name == "create":
            c.add_argument("--collection", required=True, help="the collection the key opens (for `run --index`: "
                           "'default'; for `run --gallery NAME=DIR`: NAME)")
            c.add_argument("--scope", required=True, choices=SCOPES, help="read: search, images, explain; write: "
                           "also add and remove images; admin: also /metrics")
            c.add_argument("--name", default="", help="a note: who or what holds the key")
            c.add_argument("--rate", type=int, default=DEFAULT_RATE, help="requests a minute (0: unlimited); past "
                           "it the answer is 429 with Retry-After")
            c.add_argument("--quota-bytes", type=int, default=0, help="write keys: bytes it may upload in all "
                           "(0: unlimited)")
            c.add_argument("--quota-images", type=int, default=0, help="write keys: images it may upload in all "
                           "(0: unlimited)")
        if name == "revoke":
            c.add_argument("id", help="the key's id (12 hex digits: the part after mmgeo_, or from `keys list`)")


def open_keys(keys: str | None = None, db: str | None = None, create: bool = False, **db_kwargs) -> KeyStore:
    """The key store of ``--keys FILE`` or ``--db URL``."""
    if db is not None:
        from serve.db_keys import DbKeys

        return DbKeys(db, create=create, **db_kwargs)
    return FileKeys(keys, create=create)


def keys_command(args) -> int:
    store = open_keys(args.keys, args.db, create=args.keys_command == "create")
    try:
        if args.keys_command == "create":
            token, rec = new_key(args.collection, args.scope, args.name, args.rate, args.quota_bytes,
                                 args.quota_images)
            store.add(rec)
            print(token)
            print(f"key {rec.id}: {rec.scope} on collection {rec.collection!r}; shown once, only its hash is kept "
                  "— send it as 'Authorization: Bearer <key>'", flush=True)
        elif args.keys_command == "list":
            print("id            collection        scope  rate/min  uploaded (quota)               created"
                  "           state")
            for r in store.list():
                quota = (f"{r.used_bytes} B ({r.quota_bytes or '-'}), {r.used_images} img ({r.quota_images or '-'})"
                         if r.scope != "read" else "-")
                state = "revoked " + stamp(r.revoked) if r.revoked else "valid"
                print(f"{r.id}  {r.collection:<16}  {r.scope:<5}  {r.rate:>8}  {quota:<29}  {stamp(r.created)}  "
                      f"{state}" + (f"  {r.name}" if r.name else ""))
        else:
            rec = store.revoke(args.id)
            print(f"revoked key {rec.id} ({rec.scope} on collection {rec.collection!r})")
    finally:
        if hasattr(store, "close"):
            store.close()
    return 0


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


def add_run_options(r, gallery) -> None:
    """``run``'s options of collections and keys; ``gallery``: the group of --index / --db."""
    gallery.add_argument("--gallery", action="append", metavar="NAME=DIR", help="serve index directory DIR as "
                         "collection NAME (repeat for more: each key opens one; docs/serve.md)")
    r.add_argument("--keys", metavar="FILE", default=None, help="API keys file (`python -m serve keys create`): "
                   "every endpoint but /health and the page needs 'Authorization: Bearer <key>'")
    r.add_argument("--db-keys", action="store_true", help="with --db: the API keys in the gallery's database "
                   "(`python -m serve keys create --db URL`), each bound to a collection of it")
    r.add_argument("--no-auth", action="store_true", help="serve a network address (--host) without keys: "
                   "anyone who reaches it may search, fetch and change the gallery (a warning in the log and at "
                   "/health)")


def loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def auth_settings(args) -> dict:
    """``run``'s keys, collections and host -> settings (JSON-able); ValueError for a network address without
    keys unless ``--no-auth``, and for keys together with ``--no-auth``."""
    collections = None
    if args.gallery:
        collections = {}
        for spec in args.gallery:
            name, sep, folder = spec.partition("=")
            if not sep or not folder:
                raise ValueError(f"--gallery {spec[:80]!r}: expected NAME=DIR, e.g. --gallery family=idx/family")
            if check_collection(name) in collections:
                raise ValueError(f"--gallery: collection {name!r} is given twice")
            collections[name] = folder
    if args.keys and args.db:
        raise ValueError("--keys FILE goes with --index / --gallery; with --db the keys live in the database: "
                         "--db-keys (`python -m serve keys create --db URL ...`)")
    if args.db_keys and not args.db:
        raise ValueError("--db-keys goes with --db URL (the keys in the gallery's database); a folder's are --keys")
    if (args.keys or args.db_keys) and args.no_auth:
        raise ValueError("--keys / --db-keys and --no-auth contradict each other: give one")
    if args.keys:
        FileKeys(args.keys)  # exists and parses, or one error line
    auth = "keys" if args.keys or args.db_keys else "none"
    if auth == "none" and not loopback(args.host):
        if not args.no_auth:
            raise ValueError(f"--host {args.host} is a network address and the service has no keys: give --keys "
                             "FILE (python -m serve keys create), or --no-auth to let anyone in who can reach it")
        auth = NO_AUTH
    return {"collections": collections, "keys_file": args.keys, "auth": auth, "host": args.host}


def app_keys(settings: dict) -> KeyStore | None:
    """The key store a server process checks requests against (None: an open service, warned about)."""
    if settings.get("auth") == NO_AUTH:
        log.warning("serving %s without API keys (--no-auth): anyone who can reach it may search and fetch the "
                    "whole gallery", settings.get("host", "a network address"))
    if settings.get("keys_file"):
        return FileKeys(settings["keys_file"])
    if settings.get("auth") == "keys" and settings.get("db"):
        from serve.app import DB_ARGS

        return open_keys(db=settings["db"], **DB_ARGS)
    return None


def add_collection_option(parser) -> None:
    """``--collection NAME`` of build / add / remove with --db: the collection whose rows they write."""
    parser.add_argument("--collection", dest="db_collection", default=None, metavar="NAME", help="with --db: the "
                        "collection to build, add to or remove from (default: 'default'); run it as a database role "
                        "under row-level security (docs/serve.md, 'Keys and collections')")


def enter_collection(args):
    """Work in ``--collection``'s rows (``COLLECTION``) -> the token that ``COLLECTION.reset`` takes once the
    command is done (None without ``--collection``), so that a caller in the same thread (a test) is not left in it."""
    name = getattr(args, "db_collection", None)
    if name is None:
        return None
    from mmgeo.search.db_connect import COLLECTION

    if not getattr(args, "db", None):
        raise ValueError("--collection goes with --db (a folder is one collection: serve it with --gallery)")
    return COLLECTION.set(check_collection(name))
