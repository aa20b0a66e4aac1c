"""``mooncake://`` specs: where a Mooncake Store's master, metadata server and admin endpoint are, checked before
anything connects (a Mooncake client asked to reach a master that is not there retries for about 90 seconds).

``mooncake://MASTER_HOST:PORT[?metadata=…&admin=…&protocol=tcp|rdma&device=…&local_hostname=…]``:

- ``metadata``: the transfer engine's metadata server, ``http://host:port/path`` (``mooncake_master
  --enable_http_metadata_server``; default ``http://MASTER_HOST:8080/metadata``, the master's default) or
  ``P2PHANDSHAKE`` (clients exchange it directly);
- ``admin``: the master's HTTP admin endpoint, ``http://host:port`` (``--metrics_port``, 9003 by default): operators'
  listings (``kvtier storage ls``) need it; serving does not;
- ``protocol``: ``tcp`` (default) or ``rdma``; ``device``: the RDMA devices (``mlx5_0,mlx5_1``), with ``rdma`` only;
- ``local_hostname``: the address other clients reach this one at (default: the local address that routes to the
  master).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvtier.errors import InvalidArgument

SCHEME = "mooncake"
QUERY = ("metadata", "admin", "protocol", "device", "local_hostname")
PROTOCOLS = ("tcp", "rdma")
P2P = "P2PHANDSHAKE"
DEFAULT_METADATA_PORT = 8080
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*$")


@dataclass(frozen=True)
class MooncakeTarget:
    """A checked spec: the master (``host:port``), the metadata server, the admin endpoint (None: not given), the
    protocol, the RDMA devices and the address this client is reached at (None: found when it connects)."""

    master: str
    host: str
    port: int
    metadata: str
    admin: str | None
    protocol: str
    device: str
    local_hostname: str | None

    @property
    def where(self) -> str:
        return self.master


def parse_mooncake_url(spec: str) -> MooncakeTarget:
    """The parts of a ``mooncake://`` spec, each checked; InvalidArgument names what is wrong."""
    if not isinstance(spec, str) or not spec.startswith(f"{SCHEME}://"):
        raise InvalidArgument(f"Mooncake spec {spec!r:.80}: expected mooncake://MASTER_HOST:PORT[?metadata=…]")
    try:
        return _parsed(spec)
    except ValueError as exc:                        # urlsplit's own refusals (an unclosed IPv6 bracket)
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"Mooncake spec {spec!r}: {exc}") from None


def _parsed(spec: str) -> MooncakeTarget:
    parts = urlsplit(spec)
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument(f"Mooncake spec {spec!r}: a Mooncake master takes no user or password")
    if parts.path not in ("", "/") or parts.fragment:
        raise InvalidArgument(f"Mooncake spec {spec!r}: nothing may follow the master's host:port but ?options")
    host, port = _host_port(spec, parts.netloc, "master")
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name not in QUERY:
            raise InvalidArgument(f"Mooncake spec {spec!r}: unknown option {name!r}; it takes {', '.join(QUERY)}")
        if name in options:
            raise InvalidArgument(f"Mooncake spec {spec!r}: {name} is given twice")
        if not value:
            raise InvalidArgument(f"Mooncake spec {spec!r}: {name}= is empty")
        if not value.isprintable() or any(c.isspace() for c in value):
            raise InvalidArgument(f"Mooncake spec {spec!r}: {name}={value!r} holds a space or a control character")
        options[name] = value
    if parts.query and not options:
        raise InvalidArgument(f"Mooncake spec {spec!r}: the query holds no option=value")
    protocol = options.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise InvalidArgument(f"Mooncake spec {spec!r}: protocol={protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    device = options.get("device", "")
    if device and (protocol != "rdma" or not _DEVICE.match(device)):
        raise InvalidArgument(f"Mooncake spec {spec!r}: device={device!r} names RDMA devices (mlx5_0,mlx5_1) and "
                              f"goes with protocol=rdma")
    metadata = options.get("metadata") or f"http://{_joined(host, DEFAULT_METADATA_PORT)}/metadata"
    if metadata != P2P:
        _http(spec, metadata, "metadata")
    admin = options.get("admin")
    if admin is not None:
        admin = _http(spec, admin, "admin").rstrip("/")
    local = options.get("local_hostname")
    if local is not None:
        _check_host(spec, local, "local_hostname")
    return MooncakeTarget(_joined(host, port), host, port, metadata, admin, protocol, device, local)


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_host(spec: str, host: str, what: str) -> None:
    if "%" not in host:
        try:
            ipaddress.ip_address(host)
            return
        except ValueError:
            pass
    numeric = all(label.isdigit() for label in host.split("."))       # 999.1.1.1 is no address and no name
    if not host.isascii() or not _HOST.fullmatch(host) or len(host) > 253 or numeric:
        raise InvalidArgument(f"Mooncake spec {spec!r}: {what} {host!r} is not a host name or IP address")


def _host_port(spec: str, netloc: str, what: str) -> tuple[str, int]:
    if not netloc:
        raise InvalidArgument(f"Mooncake spec {spec!r}: the {what} needs host:port")
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = netloc.rpartition(":")
    if not host or not port_text:
        raise InvalidArgument(f"Mooncake spec {spec!r}: the {what} needs host:port (e.g. 127.0.0.1:50051)")
    _check_host(spec, host, f"the {what}'s host")
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"Mooncake spec {spec!r}: the {what}'s port {port_text!r} is not 1-65535")
    return host, int(port_text)


def _http(spec: str, url: str, what: str) -> str:
    parts = urlsplit(url)
    expected = "http://host:port/path or P2PHANDSHAKE" if what == "metadata" else "http://host:port"
    if parts.scheme not in ("http", "https") or parts.query or parts.fragment or "?" in url or "#" in url:
        raise InvalidArgument(f"Mooncake spec {spec!r}: {what}={url!r}; expected {expected}")
    if what == "admin" and parts.path not in ("", "/"):
        raise InvalidArgument(f"Mooncake spec {spec!r}: admin={url!r} takes no path; expected {expected}")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument(f"Mooncake spec {spec!r}: {what}={url!r} takes no user or password")
    _host_port(spec, parts.netloc, what)
    return url


def route_address(host: str, port: int) -> str:
    """The local address packets to ``host:port`` leave from (what peers reach this client at); nothing is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def reachable(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout`` seconds, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{_joined(host, port)}: {exc.strerror or exc}"
