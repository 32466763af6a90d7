"""HTTP under the judge client: one total deadline per request, and no redirects.

httpx (under the official ``openai`` client) bounds each socket operation (the connect, each
read, each write), not a request: a server that sends one byte a second holds a request forever
under a 2 s read timeout. :func:`http_client` builds the ``openai`` client's httpx client on a
transport whose socket operations, inside :func:`deadline`, each wait at most ``min(their own
timeout, the time left)`` and fail at once when no time is left. A request made inside
``deadline(s)`` therefore ends within about ``s`` seconds of its start whatever the server does
(slow headers, a slow body, a slow reader of the request), with an httpx ``*Timeout``, which the
``openai`` client reports as ``APITimeoutError``.

How: an httpcore network backend wrapping the standard synchronous one. The deadline is a
thread-local: the synchronous client does each request's I/O in the thread that makes it
(HTTP/1.1, one request per connection at a time), so the requests of a thread pool keep their
own deadlines. No thread is started and nothing is abandoned: a request past its deadline fails
in its own thread and httpcore closes its connection, as for any failed request. Not bounded
in total: a TLS handshake (each of its reads and writes waits at most the time left when it
began) and name resolution (the system resolver's own timeouts; none for an IP address such as
``127.0.0.1``). A wait for a free connection of the pool is bounded by the pool timeout.

:func:`retry_after_s` and :func:`backoff_s` are the judge client's retry schedule (the ``openai``
client's own: it makes one attempt per call here, and the judge client counts its retries).

The client does not follow redirects (a 3xx is an ``openai.APIStatusError`` with its
``Location``), and, having its own transport, uses no proxy from the environment
(``HTTP_PROXY``), as httpx does for a client given a transport.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import importlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["backoff_s", "deadline", "http_client", "httpx_module", "retry_after_s"]

_local = threading.local()
#: a write goes out in pieces of at most this many bytes, the time left checked before each
_WRITE_PIECE = 64 * 1024


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Requests this thread makes inside the ``with`` (through :func:`http_client`) must be
    complete ``seconds`` after it starts. Nested: the inner deadline counts, then the outer again."""
    previous = getattr(_local, "end", None)
    _local.end = time.monotonic() + float(seconds)
    try:
        yield
    finally:
        _local.end = previous


def _bounded(timeout: float | None, expired: type[Exception]) -> float | None:
    """``timeout`` cut to the time left before this thread's deadline; ``expired`` when none is left."""
    end = getattr(_local, "end", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise expired("the request's total deadline passed")
    return left if timeout is None else min(timeout, left)


def httpx_module() -> Any:
    """The httpx package the installed ``openai`` client is built on (``httpx2`` for openai 3,
    ``httpx`` before)."""
    import openai

    base = next(c for c in openai.DefaultHttpxClient.__mro__[1:] if c.__name__ == "Client")
    return importlib.import_module(base.__module__.split(".")[0])


def _httpcore_module(httpx: Any) -> Any:
    return importlib.import_module("httpcore2" if httpx.__name__ == "httpx2" else "httpcore")


class _Stream:
    """A network stream whose reads and writes end by the thread's deadline."""

    def __init__(self, inner: Any, core: Any):
        self._inner, self._core = inner, core

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, self._core.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sock = self._inner.get_extra_info("socket")
        view = memoryview(buffer)
        while view:
            left = _bounded(timeout, self._core.WriteTimeout)
            if not isinstance(sock, socket.socket):  # not a socket we know: the stream's own write
                self._inner.write(bytes(view[:_WRITE_PIECE]), left)
                view = view[_WRITE_PIECE:]
                continue
            try:  # one send at a time, each waiting at most the time left (httpcore's loop would not)
                sock.settimeout(left)
                view = view[sock.send(view[:_WRITE_PIECE]):]
            except socket.timeout as exc:
                raise self._core.WriteTimeout(str(exc)) from exc
            except OSError as exc:
                raise self._core.WriteError(str(exc)) from exc

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        left = _bounded(timeout, self._core.ConnectTimeout)
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, left), self._core)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend:
    """httpcore's synchronous network backend, with :class:`_Stream` streams."""

    def __init__(self, core: Any):
        self._inner, self._core = core.SyncBackend(), core

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> _Stream:
        left = _bounded(timeout, self._core.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, left, local_address, socket_options), self._core)

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> _Stream:
        left = _bounded(timeout, self._core.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, left, socket_options), self._core)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@contextlib.contextmanager
def _httpx_errors(httpx: Any, core: Any) -> Iterator[None]:
    """httpcore's exceptions as httpx's of the same name (what the ``openai`` client catches)."""
    try:
        yield
    except Exception as exc:
        for cls in type(exc).__mro__:
            mapped = getattr(httpx, cls.__name__, None)
            if cls.__module__.split(".")[0] == core.__name__ and isinstance(mapped, type):
                raise mapped(str(exc)) from exc
        raise


@functools.lru_cache(maxsize=None)
def _transport_class(httpx_name: str) -> type:
    """The transport class for the httpx package ``httpx_name`` (its base classes are that
    package's: httpx checks them)."""
    httpx = importlib.import_module(httpx_name)
    core = _httpcore_module(httpx)

    class ResponseStream(httpx.SyncByteStream):
        def __init__(self, inner: Any):
            self._inner = inner

        def __iter__(self) -> Iterator[bytes]:
            with _httpx_errors(httpx, core):
                yield from self._inner

        def close(self) -> None:
            with _httpx_errors(httpx, core):
                self._inner.close()

    class DeadlineTransport(httpx.BaseTransport):
        """``httpx.HTTPTransport`` with its defaults, over an httpcore connection pool on
        :class:`_Backend`."""

        def __init__(self) -> None:
            self._pool = core.ConnectionPool(
                ssl_context=httpx.create_ssl_context(), max_connections=1000, max_keepalive_connections=100,
                keepalive_expiry=5.0, network_backend=_Backend(core))

        def handle_request(self, request: Any) -> Any:
            req = core.Request(method=request.method,
                               url=core.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                                            port=request.url.port, target=request.url.raw_path),
                               headers=request.headers.raw, content=request.stream, extensions=request.extensions)
            with _httpx_errors(httpx, core):
                resp = self._pool.handle_request(req)
            return httpx.Response(status_code=resp.status, headers=resp.headers, stream=ResponseStream(resp.stream),
                                  extensions=resp.extensions)

        def close(self) -> None:
            with _httpx_errors(httpx, core):
                self._pool.close()

    return DeadlineTransport


def http_client(timeout_s: float) -> Any:
    """The httpx client for an ``openai.OpenAI(http_client=...)``: the ``openai`` package's own
    defaults, on the deadline transport, redirects not followed.

    Args:
        timeout_s: every phase's timeout (connect, each read, each write, the pool); the total
            is the caller's :func:`deadline`.
    """
    import openai

    httpx = httpx_module()
    return openai.DefaultHttpxClient(transport=_transport_class(httpx.__name__)(), timeout=httpx.Timeout(timeout_s),
                                     follow_redirects=False)


def retry_after_s(headers: Any) -> float | None:
    """The server's ``Retry-After-Ms`` or ``Retry-After`` (seconds, or an HTTP date) in seconds;
    ``None`` when it gives none that parses (the caller checks the sign and finiteness)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            if name == "retry-after":
                try:
                    return email.utils.parsedate_to_datetime(value).timestamp() - time.time()
                except (TypeError, ValueError, OverflowError):
                    return None
    return None


def backoff_s(attempts: int) -> float:
    """The wait before the next attempt after ``attempts`` failed ones, without a ``Retry-After``:
    0.5 s doubling to at most 8 s, less up to 25 % jitter."""
    return min(0.5 * 2.0 ** min(attempts - 1, 16), 8.0) * (1 - 0.25 * random.random())
