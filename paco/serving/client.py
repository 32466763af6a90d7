"""The client side of every served model (the judge, the benchmarks' evaluators): one retry and
deadline policy over the official ``openai`` client, for a server at a URL or one the stage started
(:class:`paco.serving.local.LocalServer`).

Requests go through the ``openai`` client on :mod:`paco.serving.http`: ``timeout_s`` bounds each
attempt in total, however slowly the server sends, and redirects are refused. The retries are
this module's (``openai``'s own ``max_retries`` is 0, so every attempt has its own deadline and the
error counts them): connection errors, timeouts, HTTP 408, 409, 429 and 5xx are retried up to
``retries`` times after :func:`~paco.serving.http.backoff_s` (0.5 s doubling to 8 s, less up to
25 % jitter) or the server's ``Retry-After`` (one longer than ``timeout_s`` ends the retries).

A server the stage started itself is *supervised*: after a request whose connection was refused or
dropped (not a timeout) the client asks the server's :class:`Supervisor` whether it died; a dead
local server is restarted (a bounded number of times, :class:`paco.serving.local.LocalServer`) and
the request is asked again with its attempts counted afresh, so every request that was in flight
when it died is re-asked. A
URL endpoint has no supervisor: its requests keep the retries above.

Failures never become results: a request that still fails raises :class:`ServedModelError` naming
the URL, the served model name, the HTTP status and the attempts made; a prompt longer than the
server's context raises :class:`ContextLengthError` with the token count and the limit.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from typing import Any, Protocol

from paco.judge.chat import openai_error_message, openai_retries
from paco.serving.http import backoff_s, deadline, http_client, httpx_module, retry_after_s

log = logging.getLogger("paco.serving.client")


class ServedModelError(RuntimeError):
    """A served model could not be reached, refused a request, or gave an unusable reply."""


class ContextLengthError(ServedModelError):
    """The server refused a prompt longer than its context (HTTP 400).

    Attributes:
        n_tokens: the prompt's length in tokens as the server counted it.
        limit: the server's context length (``max_model_len``).
    """

    def __init__(self, message: str, n_tokens: int, limit: int):
        super().__init__(message)
        self.n_tokens = n_tokens
        self.limit = limit


# the refusal's wording in paco.serving.server and vLLM's OpenAI server (two generations of it)
_CONTEXT_PATTERNS = (
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens \((\d+) in the messages"),
     ("limit", "n")),
    (re.compile(r"prompt \(length (\d+)\) is longer than the maximum model length of (\d+)"), ("n", "limit")),
)


def _context_refusal(message: str) -> tuple[int, int] | None:
    """``(prompt tokens, limit)`` if ``message`` is a context-length refusal, else ``None``."""
    for pattern, names in _CONTEXT_PATTERNS:
        m = pattern.search(message)
        if m:
            got = dict(zip(names, map(int, m.groups()), strict=True))
            return got["n"], got["limit"]
    return None


class Supervisor(Protocol):
    """What a client asks about the server behind its URL after a request got no HTTP response."""

    generation: int
    """How many times the server has been (re)started; read before each attempt."""

    def recover(self, generation: int) -> bool:
        """``True`` if the server was restarted since ``generation`` (now, or by another thread):
        the request is asked again with a fresh count of attempts; ``False`` if it is the same
        server (the request's ordinary retries go on).

        Raises:
            ServedModelError: the server died and cannot be restarted (its log's tail quoted).
        """


def _root(base_url: str) -> str:
    parsed = urllib.parse.urlparse(base_url)
    return f"{parsed.scheme}://{parsed.netloc}"


class ServedClient:
    """Requests to an OpenAI-compatible server through the official ``openai`` client, with the
    module's retry, deadline and supervision policy.

    Args:
        base_url: ``http(s)://host:port/v1``.
        model: the served model name (``--served-model-name``).
        concurrency: requests in flight at once in the subclasses' batch methods (>= 1).
        timeout_s: the total time one attempt may take, from its start to the reply's last byte
            (:mod:`paco.serving.http`); also the longest ``Retry-After`` a retry waits for.
        retries: retries of a retryable failure (>= 0; module docstring).
        api_key: sent as ``Authorization: Bearer``; ``None``: the placeholder ``EMPTY``, which
            servers without a key ignore.
        supervisor: the :class:`Supervisor` of a server the stage started (``None``: a URL).

    Raises:
        ValueError: a URL that is not http(s), a ``timeout_s`` that is not a positive finite
            number, or negative ``retries``.
    """

    #: the errors raised (a subclass raises its own subclasses of them) and the word that starts
    #: their messages
    error: type[ServedModelError] = ServedModelError
    context_error: type[ContextLengthError] = ContextLengthError
    label = ""

    def __init__(self, base_url: str, model: str, *, concurrency: int = 8, timeout_s: float = 60.0,
                 retries: int = 3, api_key: str | None = None, supervisor: Supervisor | None = None):
        from openai import OpenAI

        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"server url must be http(s)://host:port/v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.concurrency = max(1, int(concurrency))
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0) or self.retries < 0:
            raise ValueError(f"timeout_s must be > 0 s and retries >= 0, got {timeout_s!r} and {retries!r}")
        self.supervisor = supervisor
        self._http = http_client(self.timeout_s)
        self._client = OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", max_retries=0,
                              timeout=self.timeout_s, http_client=self._http)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def _request(self, what: str, call: Any) -> Any:
        """``call()`` (one request through the ``openai`` client), each attempt within ``timeout_s``,
        retried and supervised as the module docstring says.

        Raises:
            ServedModelError: :meth:`_failure`; or the supervisor's, when a dead server cannot
                be restarted.
        """
        import openai

        attempts = 0
        while True:
            attempts += 1
            generation = self.supervisor.generation if self.supervisor is not None else 0
            try:
                with deadline(self.timeout_s):
                    return call()
            except openai.OpenAIError as exc:
                # a dead server refuses or drops the connection; a timeout is a slow live one
                if self.supervisor is not None and isinstance(exc, openai.APIConnectionError) \
                        and not isinstance(exc, openai.APITimeoutError) and self._recovered(what, generation):
                    log.warning("%s at %s: the server was restarted; asking again", what, self.base_url)
                    attempts = 0
                    continue
                wait, why_not = self._retry_wait(exc, attempts)
                if wait is None:
                    raise self._failure(exc, what, attempts, why_not) from None
            log.info("%s at %s: retry %d of %d in %.2f s", what, self.base_url, attempts, self.retries, wait)
            time.sleep(wait)

    def _recovered(self, what: str, generation: int) -> bool:
        """The supervisor's :meth:`~Supervisor.recover`, its error raised as this client's."""
        try:
            return self.supervisor.recover(generation)
        except ServedModelError as exc:
            raise self.error(f"{self.label}{what} at {self.base_url} (served model {self.model!r}): {exc}") from None

    def _retry_wait(self, exc: Exception, attempts: int) -> tuple[float | None, str]:
        """``(seconds to wait, "")`` before retrying ``exc`` after ``attempts`` attempts, or
        ``(None, why not)`` (``""`` where plain: not retryable, or no retries left)."""
        import openai

        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        retryable = openai_retries(status) if status is not None else isinstance(exc, openai.APIConnectionError)
        if not retryable or attempts > self.retries:
            return None, ""
        after = retry_after_s(exc.response.headers) if status is not None else None
        if after is not None and math.isfinite(after) and after > 0:
            if after > self.timeout_s:
                return None, (f"the server asked to retry after {after:g} s (Retry-After), more than "
                              f"timeout_s={self.timeout_s:g} s: no retry")
            return after, ""
        return backoff_s(attempts), ""

    def _failure(self, exc: Exception, what: str, attempts: int, note: str = "") -> ServedModelError:
        """The :class:`ServedModelError` for an ``openai`` exception after ``attempts`` attempts."""
        import openai

        tries = f"after {attempts} attempt(s)" + (f"; {note}" if note else "")
        where = f"{self.label}{what} at {self.base_url} (served model {self.model!r})"
        if isinstance(exc, openai.APIStatusError):
            message = openai_error_message(exc)
            status = exc.status_code
            if 300 <= status < 400:
                location = exc.response.headers.get("location")
                return self.error(f"{where} refused a redirect (HTTP status {status}) to {location!r}: redirects "
                                  "are not followed; set the URL of the server that answers")
            refusal = _context_refusal(message) if status == 400 else None
            if refusal is not None:
                n, limit = refusal
                return self._context_error(where, message, n, limit)
            retried = openai_retries(status)
            return self.error(f"{where} failed (HTTP status {status}{', ' + tries if retried else ', not retried'})"
                              f": {message}")
        if isinstance(exc, openai.APITimeoutError):
            return self.error(f"{where} failed (timed out: no complete HTTP response within "
                              f"timeout_s={self.timeout_s:g} s, {tries})")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return self.error(f"{where} failed (no HTTP response: cannot connect, {tries}): "
                              f"{type(cause).__name__}: {cause}")
        return self.error(f"{where} failed: {type(exc).__name__}: {exc}")

    def served_models(self) -> list[str]:
        """Model ids from ``GET /v1/models``.

        Raises:
            ServedModelError: unreachable after the retries, or a redirect (not followed).
        """
        return self._request("GET /models", lambda: [str(m.id) for m in self._client.models.list().data])

    def check_model(self) -> None:
        """Raise :class:`ServedModelError` unless the server serves ``model``."""
        served = self.served_models()
        if self.model not in served:
            raise self.error(f"{self.label}server {self.base_url} serves {served}, not {self.model!r} "
                             "(check the served model name: judge_endpoint.served_model_name, --served-model-name)")

    def health(self) -> dict[str, Any]:
        """``GET /health`` at the server root (one try, plain HTTP), complete within
        ``min(timeout_s, 5)`` seconds in all.

        Raises:
            ServedModelError: unreachable, too slow, a redirect (not followed), not JSON, or not
                healthy (the server's status is in the message).
        """
        httpx = httpx_module()
        url = f"{_root(self.base_url)}/health"
        limit = min(self.timeout_s, 5.0)
        try:
            with deadline(limit):
                resp = self._http.get(url, timeout=limit)
        except httpx.TimeoutException:
            raise self.error(f"{self.label}health check {url} timed out: no complete reply within {limit:g} s") from None
        except httpx.HTTPError as exc:
            raise self.error(f"{self.label}health check {url} failed: {type(exc).__name__}: {exc}") from None
        if 300 <= resp.status_code < 400:
            raise self.error(f"{self.label}health check {url} refused a redirect (HTTP status {resp.status_code}) to "
                             f"{resp.headers.get('location')!r}: redirects are not followed")
        if resp.status_code >= 400:
            raise self.error(f"{self.label}health check {url}: HTTP {resp.status_code}: {resp.content[:300]!r}")
        try:
            obj = json.loads(resp.content)
        except ValueError:
            raise self.error(f"{self.label}health check {url}: not JSON: {resp.content[:200]!r}") from None
        return obj if isinstance(obj, dict) else {}

    def _context_error(self, where: str, message: str, n: int, limit: int) -> ContextLengthError:
        """The error for a prompt of ``n`` tokens refused by a context of ``limit`` (a subclass
        words it for its requests)."""
        return self.context_error(f"{where} refused (HTTP status 400): the prompt is {n} tokens and the context is "
                                  f"{limit} positions. Server: {message}", n, limit)

    def chat_body(self, **params: Any) -> bytes:
        """The raw body of one ``POST /chat/completions`` with ``model`` and ``params`` (raw: the
        ``openai`` types would read ``false`` as 0.0, ``"-1"`` as -1.0), through :meth:`_request`.

        Raises:
            ServedModelError: as :meth:`_request`.
        """
        def call() -> bytes:
            raw = self._client.chat.completions.with_raw_response.create(model=self.model, **params)
            return raw.http_response.content

        return self._request("POST /chat/completions", call)
