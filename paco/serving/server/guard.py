"""Who may talk to the judge server, checked before a route sees a request
(:class:`RequestGuard`), and its listening socket (:func:`listen_socket`).

In order, for every request:

* ``Host`` (DNS rebinding): a server bound to a loopback address (``127.0.0.1``, ``::1``,
  ``localhost``) answers only requests addressed to a loopback name (``localhost``,
  ``*.localhost``, a loopback IP literal, any port; a request without ``Host`` passes). A web
  page whose own name an attacker re-pointed at 127.0.0.1 sends its own name: a 421. A server
  bound to another address cannot know the names it is reached by and does not check.
* ``Authorization`` (``--api-key`` / ``PACO_JUDGE_API_KEY``, as vLLM's ``--api-key``): with a
  key, every ``/v1`` route needs ``Authorization: Bearer <key>`` (compared in constant time);
  otherwise a 401. ``/health`` stays open, as vLLM's.
* ``Content-Type`` on ``POST``: ``application/json`` (parameters such as ``charset`` allowed),
  otherwise a 415 before the body is read. A browser sends a cross-site ``POST`` without asking
  the server first only as ``text/plain``, a form or multipart; JSON needs a CORS preflight,
  which this server does not grant.

Refusals are OpenAI error objects (:func:`paco.serving.server.protocol.error_body`).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import socket
from typing import Any

from starlette.responses import JSONResponse

from paco.serving.server.protocol import error_body

#: the environment variable read when ``--api-key`` is not given
API_KEY_ENV = "PACO_JUDGE_API_KEY"


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def is_loopback_name(name: str) -> bool:
    """``localhost``, a ``*.localhost`` name or a loopback IP literal (``127.0.0.0/8``, ``::1``)."""
    name = name.strip().lower().rstrip(".")
    ip = _ip(name)
    return ip.is_loopback if ip is not None else name == "localhost" or name.endswith(".localhost")


def _host_name(header: str) -> str:
    """The name part of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``a:80`` -> ``a``)."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """ASGI middleware: the ``Host``, ``Authorization`` and ``Content-Type`` checks of the
    module docstring, before the app sees the request.

    Args:
        app: the wrapped ASGI app.
        api_key: the key ``/v1`` routes need (``None``: none).
        check_host: refuse ``Host`` headers that are not loopback names (for a server bound to
            a loopback address).
    """

    def __init__(self, app: Any, *, api_key: str | None = None, check_host: bool = False):
        self.app = app
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self.check_host = check_host

    def refusal(self, scope: dict[str, Any]) -> tuple[int, str, dict[str, str]] | None:
        """``(status, message, headers)`` for a request to refuse, else ``None``."""
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        host = headers.get(b"host")
        if self.check_host and host is not None:
            name = _host_name(host.decode("latin-1"))
            if not is_loopback_name(name):
                return (421, f"the Host header {name!r} is not a loopback name: this server listens on a loopback "
                             "address and answers only requests addressed to localhost or 127.0.0.1 (a guard "
                             "against DNS rebinding); bind another --host to serve other names", {})
        path = scope.get("path", "")
        if self._key is not None and (path == "/v1" or path.startswith("/v1/")):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(b"Bearer " + token.strip(), self._key):
                return 401, "Unauthorized: this server needs 'Authorization: Bearer <its --api-key>'", {
                    "WWW-Authenticate": "Bearer"}
        if scope.get("method") == "POST":
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                return 415, f"Content-Type must be application/json, got {ctype or 'none'!r}", {}
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                status, message, extra = refused
                response = JSONResponse(error_body(status, message), status_code=status, headers=extra)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ListenError(OSError):
    """The server cannot listen on the host and port it was given (the message says why)."""


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process is listening on that port: stop it, or pick another --port (0: a free one)",
    errno.EADDRNOTAVAIL: "this machine has no such address: check --host",
    errno.EACCES: "not allowed to listen there (ports below 1024 need privileges): pick another --port",
}


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening (``port=0``: a free port).

    ``IPPROTO_TCP`` explicitly: asyncio sets ``TCP_NODELAY`` on accepted sockets only when the
    listening socket says TCP; without it every keep-alive response waits ~40 ms for a delayed
    ACK.

    Raises:
        ListenError: the address is taken, not this machine's, not allowed, or ``host`` does
            not resolve; the message names ``host:port`` and what to do.
    """
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        hint = _LISTEN_HINTS.get(exc.errno, "check --host and --port")
        if isinstance(exc, socket.gaierror):
            hint = "the host name does not resolve: check --host"
        reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {where}: {reason.lower()}; {hint}") from None
    return sock
