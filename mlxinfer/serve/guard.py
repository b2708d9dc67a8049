"""What a server on this machine must refuse from web browsers and slow clients, below the routes.

* Browsers: any web page can make the browser POST to 127.0.0.1 (a "simple" request needs no CORS preflight), and
  with DNS rebinding (a hostname that first points at the attacker, then at 127.0.0.1) it can also read the replies.
  So a request that carries an ``Origin`` (browsers send it on every cross-site POST; curl and SDKs do not) is
  refused unless ``--allow-origin`` names it, and a server bound to a loopback address without an API key answers
  only Host names that mean this machine (localhost, *.localhost, loopback addresses, the --host value).
* Slow clients: uvicorn's h11 protocol waits forever for a request line and headers, so idle or trickling
  connections could hold every file descriptor. ``GuardedH11`` closes a connection whose request has not arrived
  whole within ``HEADER_TIMEOUT`` seconds of it opening (or of its previous response), and takes at most
  ``MAX_CONNECTIONS`` at once (the rest are closed as they are accepted).
"""

from __future__ import annotations

import ipaddress
import json
import resource
from typing import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0   # seconds for a request line and headers (nginx's client_header_timeout is 60; ours are short)
BODY_TIMEOUT = 60.0     # seconds for a request body (app.py reads it)
MAX_CONNECTIONS = 1024  # open connections; more would approach the process's descriptor limit


def raise_descriptor_limit(want: int = 4 * MAX_CONNECTIONS) -> None:
    """Lift the soft open-file limit towards the hard one (as servers do), so MAX_CONNECTIONS fits under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def connection_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft - 64))


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and a cap on open connections."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since_cycle = None
        self._head_timer = None
        if len(self.connections) > connection_cap():
            transport.abort()  # closed at once: its descriptor is back before a flood can use them all
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since_cycle = self.cycle  # a request has arrived once self.cycle is another object
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_since_cycle and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._waiting_since_cycle:
            self._disarm()  # the request line and headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # a keep-alive connection: the next request's head gets the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def is_loopback_name(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class BrowserGuard:
    """ASGI middleware: refuses requests from web pages not allowed, and (loopback servers without a key) Host
    names that do not mean this machine. ``refused(path, status)`` counts each refusal."""

    def __init__(self, app, *, allow_origins: list[str], bind_host: str | None, check_host: bool,
                 refused: Callable[[str, int], None]):
        self.app, self.refused = app, refused
        self.any_origin = "*" in allow_origins
        self.origins = {o.rstrip("/").lower() for o in allow_origins}
        self.check_host = check_host
        self.bind_host = (bind_host or "").lower().strip("[]")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        message = None
        if origin is not None and not self.any_origin and origin.rstrip("/").lower() not in self.origins:
            message = (f"requests from web pages at {origin[:100]} are refused (start the server with "
                       f"--allow-origin {origin[:100]} to allow that page)", "origin_not_allowed")
        elif self.check_host and "host" in headers:
            name = _host_name(headers["host"].strip()).lower()
            if not (is_loopback_name(name) or name == self.bind_host):
                message = (f"the Host {headers['host'][:100]!r} is not this machine: a server on a loopback address "
                           "without an API key answers only localhost names (set --api-key to serve others, e.g. "
                           "behind a proxy)", "host_not_allowed")
        if message is None:
            return await self.app(scope, receive, send)
        self.refused(scope.get("path", ""), 403)
        body = json.dumps({"error": {"message": message[0], "type": "invalid_request_error", "param": None,
                                     "code": message[1]}}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
