"""The judge server's HTTP side: the FastAPI app (:func:`make_app`) and the app on uvicorn
(:class:`JudgeServer`).

Endpoints:

* ``POST /v1/chat/completions`` -- first-token scoring in the OpenAI format
  (:mod:`paco.serving.server.protocol`).
* ``GET /v1/models`` -- the served model name and its ``max_model_len``.
* ``GET /health`` -- the worker's real state: 200 ``{"status": "ok", ...}`` while the batching
  worker is alive and no forward pass has run longer than ``--stall-s``; otherwise 503 with
  ``"status": "stalled"`` (and how long it has been busy) or ``"stopped"``. Counters:
  ``requests``, ``forward_passes``, ``max_batch``, ``isolated_batches``, ``refused``,
  ``rejected`` (limits and overload), ``in_flight``, ``queued``.

A request's body is read here, prepared on the server's thread pool
(:mod:`paco.serving.server.preparation`), scored by the worker (:mod:`paco.serving.server.batching`);
what it may cost is bounded by :class:`paco.serving.server.limits.ServerLimits`. Before any route,
:class:`paco.serving.server.guard.RequestGuard` checks ``Host`` (DNS rebinding), the API key and
``Content-Type``.

Errors are OpenAI error objects (:func:`paco.serving.server.protocol.error_body`): a malformed
request is a 400 with the reason, an unknown model name a 404 (vLLM's behaviour), an input the
judge's processor refuses (``ValueError``, e.g. an extreme aspect ratio) a 400 for that request
only. A request whose client disconnects while it waits is dropped from the queue (not computed;
counted as ``abandoned``), so a client's timeout and retry do not double the work. When a batched
forward pass fails, its requests are scored again one at a time, so only the request that caused
it fails (a 500). A request not answered within ``--request-timeout-s`` is a 503 and is dropped
from the queue (not computed later). The server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from paco.judge.model import JudgeContextError
from paco.serving.server.batching import BatchingJudge
from paco.serving.server.guard import RequestGuard, is_loopback_name, listen_socket
from paco.serving.server.limits import ServerLimits
from paco.serving.server.preparation import RequestPreparer
from paco.serving.server.protocol import MAX_TOP_LOGPROBS, BadRequest, completion_response, error_body

log = logging.getLogger("paco.serving.server")


class _ReadTimeout(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _await_unless_gone(request: Request, future: Future, timeout_s: float) -> Any:
    """The result of the worker's ``future``; raises ``asyncio.TimeoutError`` after
    ``timeout_s`` and :class:`_ClientGone` as soon as the client has disconnected (checked every
    0.25 s), so the caller can cancel a request nobody waits for."""
    waiter = asyncio.wrap_future(future)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waiter.cancel()
            raise asyncio.TimeoutError
        done, _ = await asyncio.wait({waiter}, timeout=min(0.25, remaining))
        if done:
            return waiter.result()
        if await request.is_disconnected():
            waiter.cancel()
            raise _ClientGone




def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


class _Routes:
    """The app's handlers and the request counters they share with ``/health`` (``stats``:
    ``in_flight``, ``rejected``, ``abandoned`` and the next reply's id).

    Args:
        batcher: the worker the requests are queued for.
        prepare: turns a body into the worker's input (runs on ``prepare_pool``).
        prepare_pool: the server's preparation threads.
        limits: the bounds checked here (body, in flight, timeouts, stall).
        served_model_name: the name ``/v1/models`` and ``/health`` report, and replies carry.
        max_model_len: the context ``/v1/models`` and ``/health`` report (``None``: unknown).
    """

    def __init__(self, batcher: BatchingJudge, prepare: RequestPreparer, prepare_pool: ThreadPoolExecutor,
                 limits: ServerLimits, served_model_name: str, max_model_len: int | None):
        self.batcher = batcher
        self.prepare = prepare
        self.prepare_pool = prepare_pool
        self.limits = limits
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.stats = {"in_flight": 0, "rejected": 0, "abandoned": 0, "next_id": 1}

    async def http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail) if exc.status_code != 404 else f"no route {request.url.path}")

    async def validation_error(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()[:3]}")

    async def health(self) -> JSONResponse:
        batcher, stats = self.batcher, self.stats
        busy = batcher.busy_since
        busy_s = round(time.monotonic() - busy, 3) if busy is not None else 0.0
        status = "stopped" if not batcher.alive else "stalled" if busy_s > self.limits.stall_s else "ok"
        body = {"status": status, "model": self.served_model_name, "busy_s": busy_s, "requests": batcher.requests,
                "forward_passes": batcher.forward_passes, "max_batch": batcher.max_batch,
                "isolated_batches": batcher.isolated_batches, "refused": batcher.refused,
                "rejected": stats["rejected"], "abandoned": stats["abandoned"], "in_flight": stats["in_flight"],
                "queued": batcher.queue.qsize(), "batching": batcher.batching, "max_model_len": self.max_model_len}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.served_model_name, "object": "model",
                                                         "created": 0, "owned_by": "paco",
                                                         "max_model_len": self.max_model_len}]})

    async def read_body(self, request: Request) -> bytes:
        """The request body, bounded by ``limits.max_body_bytes`` (declared or counted).

        Raises:
            BadRequest: the body exceeds the bound.
            _ReadTimeout: no piece of the body arrived for ``limits.read_timeout_s``.
        """
        limits = self.limits
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise BadRequest(f"request body of {int(declared)} bytes exceeds the limit of "
                             f"{limits.max_body_bytes} bytes (--max-body-mb)")
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), timeout=limits.read_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _ReadTimeout() from None
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BadRequest(f"request body exceeds the limit of {limits.max_body_bytes} bytes (--max-body-mb)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def chat_completions(self, request: Request) -> JSONResponse:
        batcher, limits, stats = self.batcher, self.limits, self.stats
        if stats["in_flight"] >= limits.max_in_flight:
            stats["rejected"] += 1
            return _error(503, f"overloaded: {stats['in_flight']} requests in flight (--max-in-flight "
                               f"{limits.max_in_flight}); retry later")
        stats["in_flight"] += 1
        batcher.arriving(+1)
        arriving = True
        try:
            try:
                body = await self.read_body(request)
                triple, top_k, inputs = await asyncio.get_running_loop().run_in_executor(
                    self.prepare_pool, self.prepare, body)
            except ClientDisconnect:  # the client left while sending: nothing to answer
                stats["abandoned"] += 1
                return _error(499, "client closed the connection")
            except _ReadTimeout:
                stats["rejected"] += 1
                return _error(408, f"request body not received within {limits.read_timeout_s:g} s")
            except BadRequest as exc:
                stats["rejected"] += 1
                return _error(exc.status, str(exc))
            except ValueError as exc:  # JudgeContextError (vLLM's wording first) or the processor's refusal
                batcher.note_refused()
                prefix = "" if isinstance(exc, JudgeContextError) else "judge cannot score this input: "
                return _error(400, f"{prefix}{exc}")
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                log.exception("preparing a request failed")
                return _error(500, f"judge failed to prepare the request: {type(exc).__name__}: {exc}")
            future = batcher.submit(triple, top_k, inputs)
            batcher.arriving(-1)
            arriving = False
            try:
                result = await _await_unless_gone(request, future, limits.request_timeout_s)
            except asyncio.TimeoutError:
                future.cancel()  # still queued: the worker skips it
                return _error(503, f"judge did not answer within {limits.request_timeout_s:g} s")
            except _ClientGone:
                future.cancel()  # a client that gave up (its timeout, then a retry) costs no compute
                stats["abandoned"] += 1
                return _error(499, "client closed the connection")
            except ValueError as exc:  # refused at the worker (dynamic batching encodes there)
                prefix = "" if isinstance(exc, JudgeContextError) else "judge cannot score this input: "
                return _error(400, f"{prefix}{exc}")
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                return _error(500, f"judge failed: {type(exc).__name__}: {exc}")
            rid = stats["next_id"]
            stats["next_id"] += 1
            return JSONResponse(completion_response(batcher, self.served_model_name, result, rid))
        finally:
            stats["in_flight"] -= 1
            if arriving:
                batcher.arriving(-1)


def make_app(judge: Any, served_model_name: str, *, max_batch_size: int = 16, max_wait_ms: float = 10.0,
             max_logprobs: int = MAX_TOP_LOGPROBS, batching: str = "auto", limits: ServerLimits | None = None,
             api_key: str | None = None, check_host: bool = False):
    """The FastAPI app serving ``judge``; ``app.state.batcher`` holds the worker and its counters
    (call ``app.state.batcher.close()`` when done), ``app.state.stats`` the request counters.

    ``api_key`` and ``check_host`` are :class:`paco.serving.server.guard.RequestGuard`'s (the
    ``Content-Type`` check is always on).

    Raises:
        ValueError: bad batching settings.
    """
    limits = limits or ServerLimits()
    batcher = BatchingJudge(judge, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, batching=batching,
                            track_arrivals=True)
    prepare = RequestPreparer(judge, served_model_name, limits, max_logprobs,
                              encode=batcher.batching != "dynamic")
    max_model_len = getattr(judge, "max_model_len", None)
    app = FastAPI(title="PaCo-Reward judge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher = batcher
    app.state.limits = limits
    # request preparation (decode, processor) on its own bounded pool: each of its threads holds
    # a copy of the tokenizer
    app.state.prepare_pool = ThreadPoolExecutor(max_workers=limits.prepare_threads, thread_name_prefix="prepare")
    routes = _Routes(batcher, prepare, app.state.prepare_pool, limits, served_model_name, max_model_len)
    app.state.stats = routes.stats
    app.add_middleware(RequestGuard, api_key=api_key, check_host=check_host)
    app.add_exception_handler(StarletteHTTPException, routes.http_error)
    app.add_exception_handler(RequestValidationError, routes.validation_error)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app


#: the signals that shut the server down gracefully (a second one: at once)
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Server(uvicorn.Server):
    """uvicorn's server, whose SIGINT, SIGTERM and SIGHUP all shut down gracefully with a log
    line (uvicorn handles the first two only, SIGHUP killed the process at once, dropping the
    requests in flight) and are not raised again afterwards (uvicorn re-raises them: SIGINT
    then ended in a ``KeyboardInterrupt`` traceback and exit code 1). ``stop_signal`` names the
    signal that stopped it."""

    stats: dict[str, int] = {}
    stop_signal: str | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("received %s again: stopping now, without waiting for the requests in flight", name)
            self.force_exit = True
            return
        self.stop_signal = name
        log.warning("received %s: shutting down gracefully (%d request(s) in flight are answered first, for at "
                    "most %g s)", name, self.stats.get("in_flight", 0), self.config.timeout_graceful_shutdown)
        self.should_exit = True


class JudgeServer:
    """A judge app on uvicorn, bound at construction (``port=0``: a free port, see :attr:`port`).

    :meth:`start` serves on a background thread (tests, benchmarks); :meth:`run` serves on the
    calling thread until SIGTERM/SIGINT/SIGHUP (graceful, see :data:`SHUTDOWN_SIGNALS`) or
    :meth:`stop`. ``batcher`` holds the counters.

    Args:
        judge, served_model_name, max_batch_size, max_wait_ms, max_logprobs, batching, limits:
            see :func:`make_app`.
        host, port: where to listen; a loopback ``host`` turns the ``Host`` check on
            (:mod:`paco.serving.server.guard`).
        api_key: the key the ``/v1`` routes need (``None``: none).
        sock: a socket already listening on ``host`` (:func:`paco.serving.server.guard.listen_socket`;
            ``port`` is then its port); ``None``: bound here.
        backlog: the listen backlog (connections waiting to be accepted).
        max_connections: uvicorn's ``limit_concurrency`` (a 503 above it).

    Raises:
        paco.serving.server.guard.ListenError: ``host:port`` cannot be listened on.
    """

    def __init__(self, judge: Any, served_model_name: str, host: str = "127.0.0.1", port: int = 0, *,
                 max_batch_size: int = 16, max_wait_ms: float = 10.0, max_logprobs: int = MAX_TOP_LOGPROBS,
                 batching: str = "auto", limits: ServerLimits | None = None, backlog: int = 2048,
                 max_connections: int = 1024, log_level: str = "warning", api_key: str | None = None,
                 sock: socket.socket | None = None):
        self.sock = sock if sock is not None else listen_socket(host, port, backlog)
        self.app = make_app(judge, served_model_name, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                            max_logprobs=max_logprobs, batching=batching, limits=limits, api_key=api_key,
                            check_host=is_loopback_name(host))
        self.batcher: BatchingJudge = self.app.state.batcher
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off", backlog=backlog,
                                limit_concurrency=max_connections, timeout_keep_alive=30,
                                timeout_graceful_shutdown=10)
        self.server = _Server(config)
        self.server.stats = self.app.state.stats
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.batcher.close()
            self.app.state.prepare_pool.shutdown(wait=False, cancel_futures=True)
            self.sock.close()

    def start(self, timeout_s: float = 30.0) -> "JudgeServer":
        self._thread = threading.Thread(target=self.run, name="judge-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("judge server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
