"""Client of a served judge (``paco.judge.serve`` on CPU, ``vllm serve`` on GPUs) and the lifecycle of
a local judge server.

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
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image

from paco.core.numerics import fix_numerics_env
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when the thread that started it exits
    (Linux ``PR_SET_PDEATHSIG``), or ``None`` elsewhere. libc is loaded here, in the parent: the
    child, between fork and exec, only calls ``prctl``."""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def preexec() -> None:  # pragma: no cover - runs in the child
        prctl(1, signal.SIGTERM)

    return preexec


class LocalJudgeServer:
    """Run a judge server on a free localhost port for the duration of a ``with``: ``python -m
    paco.judge.serve`` (``engine="paco"``), or ``vllm serve`` (``engine="vllm"``, the ``[gpu]``
    extra, a CUDA device; its batching, dtype handling and kernels are vLLM's own).

    ``__enter__`` is :meth:`start` then :meth:`wait_ready`: it starts the process, waits until
    ``/health`` answers (or the process dies, or ``startup_timeout_s`` passes from the start),
    checks that ``/v1/models`` lists ``served_model_name``, and returns the base URL
    (``http://127.0.0.1:<port>/v1``). Calling the two apart lets the caller do its own start-up
    while the server loads. ``__exit__`` stops it (SIGTERM, then SIGKILL after 10 s; again is a
    no-op). The server is started with ``--parent-pid`` of this process, so it also shuts down
    when this process dies without reaching ``__exit__`` (SIGKILL, OOM kill). The server's log
    goes to ``log_path`` (default: a temp file), whose tail is quoted if it fails to start.
    ``batching`` and ``max_model_len`` are the server's ``--batching`` (default ``auto``:
    batch-invariant, see :mod:`paco.judge.serve`) and ``--max-model-len`` (``None``: the model's
    ``max_position_embeddings``). With ``engine="vllm"``
    only ``max_logprobs``, ``dtype`` and ``max_model_len`` are passed on; readiness is
    ``/v1/models`` listing the name, and the server gets SIGTERM when this process's thread that
    started it exits (Linux ``PR_SET_PDEATHSIG``).

    Raises:
        JudgeError: the server did not come up or serves another name.
        ValueError: an unknown engine.
    """

    def __init__(self, model_dir: str | os.PathLike[str], served_model_name: str, *, max_batch_size: int = 16,
                 max_wait_ms: float = 10.0, threads: int = 0, startup_timeout_s: float = 120.0,
                 log_path: str | os.PathLike[str] | None = None, device: str = "auto", dtype: str = "float32",
                 max_logprobs: int = 20, batching: str = "auto", max_model_len: int | None = None,
                 engine: str = "paco", request_timeout_s: float = 300.0):
        if engine not in ("paco", "vllm"):
            raise ValueError(f"engine must be 'paco' or 'vllm', got {engine!r}")
        self.engine = engine
        self.request_timeout_s = float(request_timeout_s)
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.device = device
        self.dtype = dtype
        self.max_logprobs = max_logprobs
        self.batching = batching
        self.max_model_len = max_model_len
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._ready = False
        self._tmp: tempfile.TemporaryDirectory | None = None

    def _log_tail(self) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> str:
        self.start()
        return self.wait_ready()

    def start(self) -> None:
        """Start the server process and return at once (:meth:`wait_ready` waits for it).

        Raises:
            RuntimeError: already started.
        """
        if self.proc is not None:
            raise RuntimeError(f"judge server for {self.model_dir} already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="paco-judge-")
        self._port_file = port_file = Path(self._tmp.name) / "port"
        self._log_file = self.log_path or Path(self._tmp.name) / "server.log"
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        preexec = None
        if self.engine == "vllm":
            port = _free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                   "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                   "--max-logprobs", str(self.max_logprobs), "--dtype", self.dtype, "--seed", "0"]
            if self.max_model_len:
                cmd += ["--max-model-len", str(self.max_model_len)]
            preexec = _parent_death_signal()
            port_file.write_text(str(port))
        else:
            cmd = [sys.executable, "-m", "paco.judge.serve", "--model", str(self.model_dir),
                   "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", "0",
                   "--port-file", str(port_file), "--max-batch-size", str(self.max_batch_size),
                   "--max-wait-ms", str(self.max_wait_ms), "--threads", str(self.threads), "--device", self.device,
                   "--dtype", self.dtype, "--max-logprobs", str(self.max_logprobs), "--batching", self.batching,
                   "--max-model-len", str(self.max_model_len or 0), "--parent-pid", str(os.getpid()),
                   "--request-timeout-s", str(self.request_timeout_s)]
        # OpenMP threads that busy-wait between the server's small forward passes would steal the
        # cores the trainer needs (and the other way round): make them sleep when idle.
        # Scores must not depend on the machine's load or CPU model either (fix_numerics_env).
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        fix_numerics_env(env)
        # a key the user set to reach some remote judge is not this loopback server's (which
        # would then refuse its own stage's requests); it answers loopback Host names only
        env.pop("PACO_JUDGE_API_KEY", None)
        with open(self._log_file, "ab") as logf:
            # vLLM runs its engine in child processes: its own session, so stopping it stops them all
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         preexec_fn=preexec, start_new_session=self.engine == "vllm")
        self._deadline = time.monotonic() + self.startup_timeout_s

    def wait_ready(self) -> str:
        """Wait until the started server is ready (see the class docstring); its base URL.

        Raises:
            JudgeError: it exited, was not healthy ``startup_timeout_s`` after :meth:`start`, or
                serves another name (the server is stopped and its log's tail quoted).
            RuntimeError: not started.
        """
        if self.proc is None:
            raise RuntimeError(f"judge server for {self.model_dir} not started")
        if self.url is not None and self._ready:
            return self.url
        port_file, deadline = self._port_file, self._deadline
        client: JudgeClient | None = None  # one polling client, closed below
        while True:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.__exit__(None, None, None)
                raise JudgeError(f"judge server ({self.model_dir}) exited with code {self.proc.returncode} "
                                 f"before it was ready; its log:\n{tail}")
            if client is None and port_file.is_file() and port_file.read_text().strip():
                self.url = f"http://127.0.0.1:{int(port_file.read_text())}/v1"
                client = JudgeClient(self.url, self.served_model_name, retries=0, timeout_s=5.0)
            if client is not None:
                try:
                    if self.engine == "vllm":
                        if self.served_model_name in client.served_models():
                            break
                    elif client.health().get("status") == "ok":
                        break
                except JudgeError:
                    pass
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.__exit__(None, None, None)
                raise JudgeError(f"judge server ({self.model_dir}) not healthy after {self.startup_timeout_s:g} s; "
                                 f"its log:\n{tail}")
            time.sleep(0.2)
        client.close()
        checker = JudgeClient(self.url, self.served_model_name, retries=2, timeout_s=10.0)
        try:
            checker.check_model()
        except JudgeError:
            self.__exit__(None, None, None)
            raise
        finally:
            checker.close()
        self._ready = True
        log.info("judge server for %s up at %s (pid %d)", self.model_dir, self.url, self.proc.pid)
        return self.url

    def _signal(self, sig: int) -> None:
        import signal as _signal

        if self.engine == "vllm":  # the whole session: the API server and its engine processes
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        elif sig == _signal.SIGKILL:
            self.proc.kill()
        else:
            self.proc.terminate()

    def __exit__(self, *exc: Any) -> None:
        import signal as _signal

        if self.proc is not None and self.proc.poll() is None:
            self._signal(_signal.SIGTERM)
            try:
                self.proc.wait(timeout=10 if self.engine == "paco" else 60)
            except subprocess.TimeoutExpired:
                self._signal(_signal.SIGKILL)
                self.proc.wait()
        elif self.proc is not None and self.engine == "vllm":
            try:  # the API server is gone; its engine processes may not be
                os.killpg(self.proc.pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
