"""Client of a served judge (``paco.judge.serve`` on CPU, ``vllm serve`` on GPUs). The lifecycle of a
local judge server is :class:`paco.judge.local_server.LocalJudgeServer` (importable from here too).

The score of a pair is PaCo-Reward's ``P(Yes) / (P(Yes) + P(No))`` of the first generated token
(paper §3.2), computed from the ``top_logprobs`` of a ``max_tokens: 1`` chat completion as the
reference reward does (``get_yes_cond_prob_from_completion`` of X-GenGroup/PaCo-RL,
PaCo-GRPO/paco_grpo/utils.py): ``sigmoid(logprob(Yes) - logprob(No))``, or with
``answer_variants`` (the reference's ``canonicalize=True``) the summed probabilities of every top
token whose ``strip().lower()`` text is ``yes`` / ``no``. When only one of the two answers is
among the top tokens the other counts as impossible (log-prob ``-inf``: score 1 or 0), as in
the reference; when neither is, the reply is an error (the reference returns 0.0 there; a judge
that answers neither is not a judge that says "inconsistent").

Requests go through the official ``openai`` client on :mod:`paco.judge.deadline_http`:
``timeout_s`` bounds each attempt in total, redirects are refused, and the retries (counted) are
this module's. Failures never become scores: a request that still fails after ``retries`` retries
raises :class:`JudgeError` naming the URL, the served model name, the HTTP status and the attempts
made; so does a reply with invalid log-probs or more top entries than asked for. A prompt too
long for the judge's context (the server's 400, from ``paco.judge.serve`` or vLLM) raises
:class:`JudgeContextLengthError` with the token count and the limit (the reference retries and
then scores such a pair 0.0).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from PIL import Image

from paco.judge.chat import build_openai_messages, openai_error_message, openai_retries, png_bytes
from paco.judge.deadline_http import backoff_s, deadline, http_client, httpx_module, retry_after_s
from paco.judge.model import canonical_answer
from paco.judge.response import NO, YES

log = logging.getLogger("paco.judge.client")


class JudgeError(RuntimeError):
    """The judge could not be reached, rejected a request, or gave an unusable reply."""


class JudgeContextLengthError(JudgeError):
    """The judge refused a prompt longer than its context (HTTP 400).

    Attributes:
        n_tokens: the prompt's length in tokens as the server counted it.
        limit: the server's context length (``max_model_len``).
    """

    def __init__(self, message: str, n_tokens: int, limit: int):
        super().__init__(message)
        self.n_tokens = n_tokens
        self.limit = limit


# the refusal's wording in paco.judge.serve and vLLM's OpenAI server (two generations of it)
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


def yes_probability(top_logprobs: Sequence[dict[str, Any]], *, answer_variants: bool = False) -> float:
    """``P(Yes) / (P(Yes) + P(No))`` from one position's ``top_logprobs`` entries.

    Args:
        top_logprobs: ``[{"token": str, "logprob": float}, ...]`` (OpenAI / vLLM layout).
        answer_variants: the reference's ``canonicalize=True``: ``P(Yes)`` / ``P(No)`` sum the
            probabilities of every entry whose token, stripped and lower-cased, is ``yes`` /
            ``no`` (:func:`paco.judge.model.canonical_answer`; ``" yes"``, ``"YES\\n"`` count,
            ``"Yes."`` does not). Off: only the exact tokens ``Yes`` and ``No``.

    Returns:
        A float in [0, 1], computed in log space (``sigmoid(lse(yes) - lse(no))``; equal to the
        reference's ``sum(exp) / (sum(exp) + sum(exp))`` in float64 up to rounding). Each entry
        counts once (the reference keys a dict by token text, so of two entries with the same
        text it keeps the last; distinct token ids of a byte-level vocabulary have distinct
        texts).

    Raises:
        JudgeError: neither answer is among the tokens, an entry is not ``{"token": str,
            "logprob": number}``, or a log-prob is a bool, NaN, infinite or above 0 (no slack: a
            float log-softmax is <= 0, its sum's largest term being exactly 1; a positive value
            means logits, e.g. vLLM's ``--logprobs-mode raw_logits``).
    """
    yes, no = [], []
    for entry in top_logprobs:
        if not isinstance(entry, dict):
            raise JudgeError(f"invalid top_logprobs entry {entry!r:.100} (not an object)")
        token, lp = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str):
            raise JudgeError(f"invalid token {token!r:.100} in a top_logprobs entry (not a string)")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 0:
            raise JudgeError(f"invalid logprob {lp!r:.100} for token {token!r:.100} (a log-probability is a "
                             "finite number <= 0)")
        word = canonical_answer(token) if answer_variants else token if token in (YES, NO) else None
        if word == YES:
            yes.append(float(lp))
        elif word == NO:
            no.append(float(lp))
    if not yes and not no:
        shown = [e.get("token") for e in top_logprobs][:8]
        raise JudgeError(f"neither {YES!r} nor {NO!r} among the {len(top_logprobs)} top first tokens {shown}")
    if not no:
        return 1.0
    if not yes:
        return 0.0

    def lse(v: list[float]) -> float:
        m = max(v)
        return m + math.log(sum(math.exp(x - m) for x in v))

    d = lse(yes) - lse(no)
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


def _root(base_url: str) -> str:
    parsed = urllib.parse.urlparse(base_url)
    return f"{parsed.scheme}://{parsed.netloc}"


class JudgeClient:
    """Scores (image A, image B, instruction) triples against an OpenAI-compatible judge, through
    the official ``openai`` client.

    Args:
        base_url: ``http://host:port/v1``.
        model: the served model name (``--served-model-name``).
        concurrency: requests in flight at once (a thread pool over one client; the server
            batches them).
        timeout_s: the total time one attempt of a request may take, from its start to the
            reply's last byte, however slowly the server sends it (see
            :mod:`paco.judge.deadline_http`); also the longest ``Retry-After`` a retry waits for.
        retries: connection errors, timeouts, HTTP 408, 409, 429 and 5xx are retried after
            :func:`~paco.judge.deadline_http.backoff_s` or the server's ``Retry-After``; one
            longer than ``timeout_s`` ends the retries (the error says so). Other 4xx, redirects
            (3xx: refused, never followed) and unusable replies are not retried.
        top_logprobs: how many first tokens to ask for (vLLM allows up to 20); a reply with
            more than one entry more (the sampled token) is an error.
        answer_variants: see :func:`yes_probability`.
        api_key: sent as ``Authorization: Bearer`` (e.g. ``vllm serve --api-key``); ``None``:
            the placeholder ``EMPTY``, which servers without a key ignore.

    Raises:
        ValueError: a URL that is not http(s), a ``timeout_s`` that is not a positive finite
            number, or negative ``retries``.
    """

    def __init__(self, base_url: str, model: str, *, concurrency: int = 8, timeout_s: float = 60.0,
                 retries: int = 3, top_logprobs: int = 20, answer_variants: bool = False,
                 api_key: str | None = None):
        from openai import OpenAI

        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"judge url must be http(s)://host:port/v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.concurrency = max(1, int(concurrency))
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0) or self.retries < 0:
            raise ValueError(f"judge timeout_s must be > 0 s and retries >= 0, got {timeout_s!r} and {retries!r}")
        self.top_logprobs = int(top_logprobs)
        self.answer_variants = bool(answer_variants)
        self._http = http_client(self.timeout_s)
        self._client = OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", max_retries=0,
                              timeout=self.timeout_s, http_client=self._http)
        self.requests = 0

    def __repr__(self) -> str:
        return f"JudgeClient({self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def _request(self, what: str, call: Any) -> Any:
        """``call()`` (one request through the ``openai`` client), each attempt within ``timeout_s``,
        retried as the class docstring says. Raises :class:`JudgeError` (:meth:`_failure`)."""
        import openai

        attempts = 0
        while True:
            attempts += 1
            try:
                with deadline(self.timeout_s):
                    return call()
            except openai.OpenAIError as exc:
                wait, why_not = self._retry_wait(exc, attempts)
                if wait is None:
                    raise self._failure(exc, what, attempts, why_not) from None
            log.info("judge %s at %s: retry %d of %d in %.2f s", what, self.base_url, attempts, self.retries, wait)
            time.sleep(wait)

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

    def _failure(self, exc: Exception, what: str, attempts: int, note: str = "") -> JudgeError:
        """The :class:`JudgeError` for an ``openai`` exception after ``attempts`` attempts."""
        import openai

        tries = f"after {attempts} attempt(s)" + (f"; {note}" if note else "")
        where = f"judge {what} at {self.base_url} (served model {self.model!r})"
        if isinstance(exc, openai.APIStatusError):
            message = openai_error_message(exc)
            status = exc.status_code
            if 300 <= status < 400:
                location = exc.response.headers.get("location")
                return JudgeError(f"{where} refused a redirect (HTTP status {status}) to {location!r}: redirects "
                                  "are not followed; set the judge URL to the server that answers")
            refusal = _context_refusal(message) if status == 400 else None
            if refusal is not None:
                n, limit = refusal
                return JudgeContextLengthError(
                    f"{where} refused (HTTP status 400): the judge prompt is {n} tokens and the judge's context "
                    f"is {limit} positions (prompt + 1 answer token must fit); shorten the instruction "
                    f"(judge_endpoint.instruction: rank, or a shorter theme) or the images. Server: {message}",
                    n, limit)
            retried = openai_retries(status)
            return JudgeError(f"{where} failed (HTTP status {status}{', ' + tries if retried else ', not retried'})"
                              f": {message}")
        if isinstance(exc, openai.APITimeoutError):
            return JudgeError(f"{where} failed (timed out: no complete HTTP response within "
                              f"timeout_s={self.timeout_s:g} s, {tries})")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return JudgeError(f"{where} failed (no HTTP response: cannot connect, {tries}): "
                              f"{type(cause).__name__}: {cause}")
        return JudgeError(f"{where} failed: {type(exc).__name__}: {exc}")

    def served_models(self) -> list[str]:
        """Model ids from ``GET /v1/models``.

        Raises:
            JudgeError: unreachable after the retries, or a redirect (not followed).
        """
        return self._request("GET /models", lambda: [str(m.id) for m in self._client.models.list().data])

    def check_model(self) -> None:
        """Raise :class:`JudgeError` unless the server serves ``model``."""
        served = self.served_models()
        if self.model not in served:
            raise JudgeError(f"judge server {self.base_url} serves {served}, not {self.model!r} "
                             "(check judge_endpoint.served_model_name / --served-model-name)")

    def health(self) -> dict[str, Any]:
        """``GET /health`` at the server root (one try, plain HTTP), complete within
        ``min(timeout_s, 5)`` seconds in all.

        Raises:
            JudgeError: unreachable, too slow, a redirect (not followed), not JSON, or not
                healthy (the server's status is in the message).
        """
        httpx = httpx_module()
        url = f"{_root(self.base_url)}/health"
        limit = min(self.timeout_s, 5.0)
        try:
            with deadline(limit):
                resp = self._http.get(url, timeout=limit)
        except httpx.TimeoutException:
            raise JudgeError(f"judge health check {url} timed out: no complete reply within {limit:g} s") from None
        except httpx.HTTPError as exc:
            raise JudgeError(f"judge health check {url} failed: {type(exc).__name__}: {exc}") from None
        if 300 <= resp.status_code < 400:
            raise JudgeError(f"judge health check {url} refused a redirect (HTTP status {resp.status_code}) to "
                             f"{resp.headers.get('location')!r}: redirects are not followed")
        if resp.status_code >= 400:
            raise JudgeError(f"judge health check {url}: HTTP {resp.status_code}: {resp.content[:300]!r}")
        try:
            obj = json.loads(resp.content)
        except ValueError:
            raise JudgeError(f"judge health check {url}: not JSON: {resp.content[:200]!r}") from None
        return obj if isinstance(obj, dict) else {}

    def _score_one(self, request: tuple[bytes, bytes, str]) -> float:
        png_a, png_b, text = request
        messages = build_openai_messages(png_a, png_b, text)

        def call() -> bytes:  # the raw body: the openai types would read `false` as 0.0, "-1" as -1.0
            raw = self._client.chat.completions.with_raw_response.create(
                model=self.model, messages=messages, max_tokens=1, temperature=0.0, logprobs=True,
                top_logprobs=self.top_logprobs)
            return raw.http_response.content

        body = self._request("POST /chat/completions", call)
        where = f"reply from {self.base_url}/chat/completions (served model {self.model!r})"
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise JudgeError(f"malformed {where}: not JSON ({exc}): {body[:200]!r}") from None
        try:
            top = obj["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"{where} has no first-token top_logprobs ({exc!r}): {body[:200]!r}") from None
        if not isinstance(top, list) or len(top) > self.top_logprobs + 1:
            got = f"{len(top)} top_logprobs entries" if isinstance(top, list) else f"top_logprobs {type(top).__name__}"
            raise JudgeError(f"{where}: {got} for the first token, but {self.top_logprobs} were asked for (a list, "
                             "of at most one more: the sampled token)")
        try:
            return yes_probability(top, answer_variants=self.answer_variants)
        except JudgeError as exc:
            raise JudgeError(f"{where}: {exc}") from None

    def score(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> list[float]:
        """``P(Yes)/(P(Yes)+P(No))`` per triple, in input order, floats in [0, 1].

        Raises:
            JudgeContextLengthError: a prompt is too long for the judge's context.
            JudgeError: any request failed for good (the first failure is raised; no score is
                made up for it).
        """
        triples = list(triples)
        self.requests += len(triples)
        if not triples:
            return []
        # each distinct image is PNG-encoded once (a grid's panels appear in several pairs), by
        # the first request that needs it, so encoding overlaps the requests already in flight
        encoded: dict[int, Future] = {}
        lock = threading.Lock()

        def png(image: Image.Image) -> bytes:
            with lock:
                fut = encoded.get(id(image))
                owner = fut is None
                if owner:
                    fut = encoded[id(image)] = Future()
            if owner:
                try:
                    fut.set_result(png_bytes(image))
                except BaseException as exc:
                    fut.set_exception(exc)
                    raise
            return fut.result()

        def one(triple: tuple[Image.Image, Image.Image, str]) -> float:
            a, b, text = triple
            return self._score_one((png(a), png(b), text))

        if self.concurrency == 1 or len(triples) == 1:
            return [one(t) for t in triples]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(triples))) as pool:
            return list(pool.map(one, triples))



def __getattr__(name: str) -> Any:
    """``LocalJudgeServer`` lives in :mod:`paco.judge.local_server` (imported from here too, lazily:
    that module imports this one)."""
    if name == "LocalJudgeServer":
        from paco.judge.local_server import LocalJudgeServer

        return LocalJudgeServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
