"""Small JSON-over-HTTP helpers shared by the OpenAI-compatible clients (CoT teacher, judge).

Standard library only (``urllib``), so the clients work wherever the pipeline does. Errors are
classified for retrying: :class:`TransientHTTPError` (cannot connect, timeout, HTTP 5xx, 408,
429, a body that is not JSON) is worth retrying with backoff; :class:`PermanentHTTPError`
(any other 4xx) is not. Every message names the URL, and the status for HTTP errors.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class HTTPRequestError(RuntimeError):
    """A request failed; ``url`` and ``status`` (``None`` without an HTTP response) say where."""

    def __init__(self, message: str, *, url: str, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class TransientHTTPError(HTTPRequestError):
    """Connection error, timeout, HTTP 5xx/408/429 or a malformed body: retried."""


class PermanentHTTPError(HTTPRequestError):
    """Any other HTTP 4xx: retrying cannot help."""


def request_json(url: str, payload: dict[str, Any] | None = None, *, timeout_s: float,
                 api_key: str | None = None) -> Any:
    """``POST`` ``payload`` as JSON (``GET`` when ``payload`` is ``None``) and parse the reply.

    Raises:
        TransientHTTPError, PermanentHTTPError: see the module docstring.
    """
    headers = {"Accept": "application/json"}
    data = None
    if payload is not None:
        data = json.dumps(payload).encode("utf-8")
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read()[:300].decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the body is only for the message
            detail = ""
        msg = f"HTTP {e.code} from {url}: {detail}".rstrip(": ")
        cls = TransientHTTPError if (e.code >= 500 or e.code in (408, 429)) else PermanentHTTPError
        raise cls(msg, url=url, status=e.code) from None
    except urllib.error.URLError as e:
        raise TransientHTTPError(f"cannot reach {url}: {e.reason}", url=url) from None
    except (TimeoutError, socket.timeout) as e:
        raise TransientHTTPError(f"timeout after {timeout_s:g}s from {url}: {e}", url=url) from None
    except (ConnectionError, OSError, http.client.HTTPException) as e:
        raise TransientHTTPError(f"connection error with {url}: {type(e).__name__}: {e}", url=url) from None
    try:
        return json.loads(body)
    except ValueError:
        raise TransientHTTPError(f"malformed (non-JSON) response from {url}: {body[:200]!r}", url=url) from None


def backoff_delay(failures: int, backoff_s: float, backoff_max_s: float) -> float:
    """Delay before the next try after ``failures`` (>= 1) transient failures:
    ``min(backoff_s * 2**(failures - 1), backoff_max_s)``."""
    return min(backoff_s * (2 ** max(failures - 1, 0)), backoff_max_s)


def with_retries(call: Callable[[], T], *, retries: int, backoff_s: float, backoff_max_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``call`` up to ``retries + 1`` times, sleeping :func:`backoff_delay` after each
    :class:`TransientHTTPError`; a :class:`PermanentHTTPError` is raised at once.

    Raises:
        TransientHTTPError: the last one, its message extended with the number of attempts.
        PermanentHTTPError: unchanged.
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except TransientHTTPError as e:
            if attempt == retries:
                raise TransientHTTPError(f"{e}; gave up after {attempt + 1} attempt(s)", url=e.url,
                                         status=e.status) from None
            sleep(backoff_delay(attempt + 1, backoff_s, backoff_max_s))
    raise AssertionError("unreachable")
