"""Redis URLs, checked when a store opens.

redis-py parses a URL only when it first connects, and some mistakes it never reports: a path that is not a number
selects db 0, an unknown query option fails every connection with a TypeError, a missing CA file every handshake. In
a store that degrades to misses, each of those would look like a server that is down, forever. So kvtier reads the
URL itself, takes only the query options it knows (checked for type and range, TLS files loaded once), and hands
redis-py plain keywords and a URL with nothing left to interpret.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvtier.errors import InvalidArgument

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
MAX_DB = 2**31 - 1
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
TLS_VERSIONS = {"TLSv1_2": ssl.TLSVersion.TLSv1_2, "TLSv1_3": ssl.TLSVersion.TLSv1_3}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError("a finite number of seconds > 0")
    return value


def _whole(raw: str) -> int:
    if not raw.isascii() or not raw.isdigit():
        raise ValueError("a whole number >= 0")
    return int(raw)


def _flag(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"one of {', '.join(_TRUE + _FALSE)}")


def _text(raw: str) -> str:
    if not raw:
        raise ValueError("not empty")
    return raw


def _client_name(raw: str) -> str:
    if not raw or not raw.isprintable() or not raw.isascii() or " " in raw:
        raise ValueError("printable ASCII without spaces (Redis refuses other names)")
    return raw


def _file(raw: str) -> str:
    if not os.path.isfile(raw):
        raise ValueError("no such file")
    return raw


def _directory(raw: str) -> str:
    if not os.path.isdir(raw):
        raise ValueError("no such directory")
    return raw


def _choice(choices: dict[str, Any]) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        if raw not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return choices[raw]
    return parse


OPTIONS: dict[str, Callable[[str], Any]] = {
    "db": _whole,
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "socket_keepalive": _flag,
    "client_name": _client_name,
    "username": _text,
    "password": _text,
}
"""Query options of every scheme, and how each is read (the value redis-py is given)."""

TLS_OPTIONS: dict[str, Callable[[str], Any]] = {
    "ssl_cert_reqs": _choice(CERT_REQS),
    "ssl_check_hostname": _flag,
    "ssl_ca_certs": _file,
    "ssl_ca_path": _directory,
    "ssl_certfile": _file,
    "ssl_keyfile": _file,
    "ssl_password": _text,
    "ssl_ciphers": _text,
    "ssl_min_version": _choice(TLS_VERSIONS),
}
"""Query options of ``rediss://`` URLs only."""


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: ``url`` is what redis-py gets (scheme, credentials, host and port or socket path; no db, no
    query), ``options`` the checked keywords from the path and query, ``where`` the server without credentials."""

    url: str
    cluster: bool
    where: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_redis_url(url: str, cluster: bool | None = None) -> RedisTarget:
    """The target of ``url``, or InvalidArgument naming what is wrong with it. ``cluster`` overrides the scheme
    (``cluster=True`` with ``redis://``)."""
    raw_url, url = url, shown(url)
    if not raw_url.isprintable() or " " in raw_url:
        raise InvalidArgument(f"Redis URL {url!r}: spaces and control characters must be %-encoded")
    scheme = raw_url.split("://", 1)[0] if "://" in raw_url else ""
    if not scheme:
        raise InvalidArgument(f"Redis URL {url!r}: expected scheme://…, e.g. redis://host:6379/0")
    if scheme not in SCHEMES:
        raise InvalidArgument(f"Redis URL {url!r}: the scheme must be one of {', '.join(SCHEMES)}")
    in_cluster = scheme.endswith("+cluster")
    if in_cluster and cluster is not None and not cluster:
        raise InvalidArgument(f"Redis URL {url!r}: cluster={cluster!r} contradicts its {scheme}:// scheme")
    in_cluster = in_cluster or bool(cluster)
    base = scheme.removesuffix("+cluster")
    if base == "unix" and in_cluster:
        raise InvalidArgument(f"Redis URL {url!r}: a Redis Cluster is not reached through a unix socket")
    try:
        parts = urlsplit(base + raw_url[len(scheme):])
    except ValueError as exc:                   # an unbalanced IPv6 bracket
        raise InvalidArgument(f"Redis URL {url!r}: {exc}") from None
    host_and_port = parts.netloc.rpartition("@")[2]
    if "]" in host_and_port and not re.fullmatch(r"\[[^\[\]]*\](:[^:\[\]]*)?", host_and_port):
        raise InvalidArgument(f"Redis URL {url!r}: after an IPv6 host in brackets only ':port' may follow")
    if parts.fragment:
        raise InvalidArgument(f"Redis URL {url!r}: a URL fragment ('#…') means nothing here")
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"Redis URL {url!r}: {exc}") from None
    options: dict[str, Any] = {}
    credentials = parts.netloc.rpartition("@")[0]
    if base == "unix":
        if parts.hostname or port is not None:
            raise InvalidArgument(f"Redis URL {url!r}: a unix socket URL names no host: unix:///path/to/redis.sock")
        if parts.path in ("", "/"):
            raise InvalidArgument(f"Redis URL {url!r}: unix:// needs the socket's path, e.g. unix:///run/redis.sock")
        where, target = parts.path, f"unix://{credentials}@{parts.path}" if credentials else f"unix://{parts.path}"
    else:
        if not parts.hostname or port == 0:
            raise InvalidArgument(f"Redis URL {url!r} names no host (or port 0)")
        where = parts.netloc.rpartition("@")[2]
        target = f"{base}://{parts.netloc}"
        _read_db(url, parts.path, in_cluster, options)
    _read_query(url, parts.query, base, in_cluster, options)
    if credentials and ({"username", "password"} & options.keys()):
        raise InvalidArgument(f"Redis URL {url!r}: give the user and password once, before the host or in the query")
    if base == "rediss":
        _check_tls(url, options)
    return RedisTarget(target, in_cluster, where, options)


def _read_db(url: str, path: str, cluster: bool, options: dict[str, Any]) -> None:
    if path in ("", "/"):
        return
    if cluster:
        raise InvalidArgument(f"Redis URL {url!r}: a cluster URL takes no path (a Redis Cluster has only db 0)")
    if not re.fullmatch(r"/[0-9]+", path) or int(path[1:]) > MAX_DB:
        raise InvalidArgument(f"Redis URL {url!r}: the path {path!r} must be a database number, e.g. /0")
    options["db"] = int(path[1:])


def _read_query(url: str, query: str, base: str, cluster: bool, options: dict[str, Any]) -> None:
    if not query:
        return
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InvalidArgument(f"Redis URL {url!r}: the query {query!r} is not name=value pairs joined by &") from None
    known = {**OPTIONS, **(TLS_OPTIONS if base == "rediss" else {})}
    seen: set[str] = set()
    for name, raw in pairs:
        if name in seen:
            raise InvalidArgument(f"Redis URL {url!r}: the option {name!r} is given twice")
        seen.add(name)
        if name in TLS_OPTIONS and base != "rediss":
            raise InvalidArgument(f"Redis URL {url!r}: {name} is a TLS option; TLS needs a rediss:// URL")
        if name not in known:
            raise InvalidArgument(f"Redis URL {url!r}: unknown option {name!r}; kvtier takes "
                                  f"{', '.join(sorted(known))}")
        if name == "db" and (cluster or "db" in options):
            raise InvalidArgument(f"Redis URL {url!r}: " + ("a Redis Cluster has only db 0" if cluster else
                                                            "the database is given both in the path and as ?db="))
        try:
            options[name] = known[name](raw)
        except ValueError as exc:
            raise InvalidArgument(f"Redis URL {url!r}: {name}={raw!r}: expected {exc}") from None
    if options.get("db", 0) > MAX_DB:
        raise InvalidArgument(f"Redis URL {url!r}: db={options['db']} is out of range")


def _check_tls(url: str, options: dict[str, Any]) -> None:
    """Build the TLS context once, as redis-py will at every connection, so a bad file, password, cipher list or
    combination is refused now and not at every handshake."""
    reqs = options.get("ssl_cert_reqs", ssl.CERT_REQUIRED)
    check_hostname = options.get("ssl_check_hostname", reqs != ssl.CERT_NONE)
    if check_hostname and reqs == ssl.CERT_NONE:
        raise InvalidArgument(f"Redis URL {url!r}: ssl_check_hostname=true needs certificate checks "
                              "(ssl_cert_reqs=optional or required)")
    if "ssl_keyfile" in options and "ssl_certfile" not in options:
        raise InvalidArgument(f"Redis URL {url!r}: ssl_keyfile needs ssl_certfile")
    if "ssl_password" in options and "ssl_certfile" not in options:
        raise InvalidArgument(f"Redis URL {url!r}: ssl_password unlocks ssl_keyfile; no ssl_certfile is given")
    context = ssl.create_default_context()
    context.check_hostname = bool(check_hostname)
    context.verify_mode = reqs
    password = options.get("ssl_password")
    steps: list[tuple[str, Callable[[], Any]]] = [     # no password: refused, never a prompt on the terminal
        ("ssl_certfile", lambda: context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"),
                                                         password or (lambda: b""))),
        ("ssl_ca_certs", lambda: context.load_verify_locations(cafile=options["ssl_ca_certs"])),
        ("ssl_ca_path", lambda: context.load_verify_locations(capath=options["ssl_ca_path"])),
        ("ssl_min_version", lambda: setattr(context, "minimum_version", options["ssl_min_version"])),
        ("ssl_ciphers", lambda: context.set_ciphers(options["ssl_ciphers"])),
    ]
    for name, step in steps:
        if name in options:
            try:
                step()
            except (ssl.SSLError, OSError, ValueError) as exc:
                given = [n for n in (name, *_WITH.get(name, ())) if n in options]
                raise InvalidArgument(f"Redis URL {url!r}: {' with '.join(given)} refused by the TLS library: "
                                      f"{exc}") from None


_WITH = {"ssl_certfile": ("ssl_keyfile", "ssl_password")}
_SECRET_QUERY = re.compile(r"((?:^|&)(?:ssl_)?password=)[^&]*")


def shown(url: str) -> str:
    """``url`` with its passwords (in the user part and the query) replaced by ``***``, for messages and logs."""
    head, question, query = url.partition("?")
    scheme, sep, rest = head.partition("://")
    if sep:
        netloc, slash, path = rest.partition("/")
        user, at, host = netloc.rpartition("@")
        if at and ":" in user:
            user = user.split(":", 1)[0] + ":***"
        head = f"{scheme}://{user}{at}{host}{slash}{path}"
    return head + question + _SECRET_QUERY.sub(r"\1***", query)
