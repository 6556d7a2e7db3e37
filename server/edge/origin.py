"""Where a request comes from: the name it reached this server by (Host), and, for a request that
changes state, the page that sent it (Origin, Sec-Fetch-Site).

A browser lets any web page send a "simple" cross-origin request (a multipart form POST is one) to a
server on this machine, and a page whose DNS name is rebound to 127.0.0.1 can even read the answers.
Two checks close both, from the headers alone:

- *Host* (every request, first): on a loopback bind, or whenever ``MEMVIT_ALLOWED_HOSTS`` is set, the
  Host header must name an allowed host: the list, the bind address, ``localhost``, or any IP literal
  (a browser sends an IP literal only when the page's own origin is that address, so a rebinding page,
  whose origin is its DNS name, never does; kubelet probes and Ray's nodes address pods by IP). 400
  otherwise. On any other bind with no list nothing is checked (the name is the proxy's business).
- *Origin* (state-changing routes only): refused (403) when ``Sec-Fetch-Site`` is ``cross-site`` or
  ``same-site``, or when ``Origin`` is present and is neither this server (the Host header, default
  ports normalised) nor a host named in ``MEMVIT_ALLOWED_HOSTS``. Requests without either header
  (curl, the Python client, other servers) are not browser-borne and pass as before.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from ..errors import CrossSiteRequestError, HostNotAllowedError
from ..settings import Settings

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def split_host(value: str) -> tuple[str, int | None]:
    """``"Example.com:8000"`` -> ("example.com", 8000); ``"[::1]:80"`` -> ("::1", 80). ValueError if
    the port is not a number."""
    value = value.strip()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a bare name, or an unbracketed IPv6 address
        name, port = value, ""
    return name.lower().rstrip("."), int(port) if port else None


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(name: str) -> bool:
    name = name.strip("[]").lower()
    return name == "localhost" or (is_ip_literal(name) and ipaddress.ip_address(name).is_loopback)


def _matches(name: str, pattern: str) -> bool:
    """Starlette's TrustedHostMiddleware patterns: exact, ``*`` for any, ``*.example.com`` for a suffix."""
    return name == pattern or (pattern.startswith("*") and name.endswith(pattern[1:]))


class OriginPolicy:
    """The Host and Origin checks for one server's settings (see the module's doc)."""

    def __init__(self, settings: Settings) -> None:
        self.listed = tuple(settings.allowed_hosts)
        bind = settings.host.strip("[]").lower()
        self.checks_host = bool(self.listed) or is_loopback(bind)
        self.names = {*LOOPBACK_NAMES, bind}
        self._allowed: set[str] = set()  # Host values seen allowed: the check is the value's alone

    def host_allowed(self, name: str) -> bool:
        return name in self.names or is_ip_literal(name) or any(_matches(name, p) for p in self.listed)

    def check_host(self, headers: Headers, http_version: str = "1.1") -> None:
        """Raises ``HostNotAllowedError`` (400) when the Host header is not an allowed name."""
        if not self.checks_host:
            return
        host = headers.get("host")
        if host in self._allowed:
            return
        if host is None:
            if http_version == "1.0":  # HTTP/1.0 has no Host; no browser speaks it
                return
            raise HostNotAllowedError("the request has no Host header; HTTP/1.1 requires one")
        try:
            name, _ = split_host(host)
        except ValueError:
            name = ""
        if not name or not self.host_allowed(name):
            raise HostNotAllowedError(
                f"Host {host!r} is not allowed: add it to MEMVIT_ALLOWED_HOSTS (comma-separated) if this "
                "server is reached by that name"
            )
        if len(self._allowed) < 1024:  # bounded: a client may send any number of spellings
            self._allowed.add(host)

    def check_origin(self, headers: Headers, scheme: str = "http") -> None:
        """Raises ``CrossSiteRequestError`` (403) when another site's page sent this request."""
        site = headers.get("sec-fetch-site", "").lower()
        origin = headers.get("origin")
        if site in ("cross-site", "same-site"):
            sender = f"Origin {origin}" if origin else f"Sec-Fetch-Site: {site}"
            raise CrossSiteRequestError(
                f"{site} requests may not change adapters ({sender} is not this server)"
            )
        if origin is None:
            return
        if origin.strip().lower() == "null":
            raise CrossSiteRequestError(
                "cross-site requests may not change adapters (Origin null: a sandboxed or local page)"
            )
        if not self._same_origin(origin, headers.get("host", ""), scheme):
            raise CrossSiteRequestError(
                f"cross-site requests may not change adapters (Origin {origin} is not this server; a "
                "proxy's public name goes in MEMVIT_ALLOWED_HOSTS)"
            )

    def _same_origin(self, origin: str, host: str, scheme: str) -> bool:
        try:
            parts = urlsplit(origin.strip())
            origin_name, origin_port = (parts.hostname or "").rstrip("."), parts.port
            host_name, host_port = split_host(host)
        except ValueError:
            return False
        if not origin_name:
            return False
        # A proxy's public name (the operator listed it): its pages may change state, whatever Host
        # the proxy forwards. A bare "*" lets any Host through, but never any page.
        if any(_matches(origin_name, p) for p in self.listed if p != "*"):
            return True
        if origin_port == DEFAULT_PORTS.get(parts.scheme):
            origin_port = None
        if host_port == DEFAULT_PORTS.get(scheme):
            host_port = None
        return (origin_name, origin_port) == (host_name, host_port)
