"""The benchmarks' evaluator client: any OpenAI-compatible chat
endpoint (vLLM serving Qwen2.5-VL-7B-Instruct, Gemma-3-4B-IT, Qwen2.5-VL-72B-AWQ; GPT-4.1; the
project's own judge server) asked through the official ``openai`` client on the judge client's
HTTP machinery (:class:`paco.serving.client.ServedClient`: one total deadline per attempt, counted
retries of connection errors, 408/409/429/5xx, ``Retry-After``, no redirects), with every answer
kept in an :class:`~paco.benchmark.answer_cache.AnswerCache`.

Three request kinds, each one user turn of any number of images and one text:

* ``yes_no`` (:meth:`Evaluator.yes_probability`): ``max_tokens`` 1, temperature 0, the first
  token's ``top_logprobs``; the score is ``P(Yes) / (P(Yes) + P(No))``
  (:func:`paco.judge.model.yes_probability`). T2IS-Bench's official visual-consistency code
  (chengyou-jia/T2IS ``T2IS_Eval/test_prompt_consistency.py`` lines 147-158, commit
  ``a40b858``) generates one token with Qwen2.5-VL and soft-maxes the two logits of the vocabulary
  ids 2753 and 9454 (Qwen2's tokens ``No`` and ``Yes``, capitalised, no leading space) against
  each other, which is the same ratio of the full soft-max's probabilities; hence the default
  ``answer_variants=False`` (exact ``Yes`` / ``No``). Through an API only the top tokens are seen:
  one answer outside them counts as impossible (score 0 or 1), neither is an error.
* ``reply`` (:meth:`Evaluator.reply`): the reply's text at temperature 0 (GEdit-Bench's VIEScore
  JSON replies, parsed by the protocol module).
* ``score_tokens`` (:meth:`Evaluator.score_token_logprobs`): ``max_tokens`` 1, the first token's
  ``top_logprobs`` as ``{token text: log-prob}`` (the expected-score stand-in for SC / PQ).

Chat layout: images first, then the text (T2IS ``test_prompt_consistency.py`` lines 122-131;
Step1X-Edit ``GEdit-Bench/viescore/mllm_tools/qwen25vl_eval.py`` lines 66-73), or
``text_first=True``: the text, then the images, as VIEScore's GPT backends send them
(``GEdit-Bench/viescore/mllm_tools/openai.py`` lines 103-126, commit ``570eba6``). Images go as
lossless PNG data URLs (the GPT backend sends JPEG, ibid. lines 27-38).

Cache key (:func:`~paco.benchmark.answer_cache.request_key` of the request's fields):
``evaluator`` (this client's name), ``model``, ``kind``, ``text`` (exact), ``images`` (the
SHA-256 of each image's bytes as sent, in order), ``max_tokens``, ``top_logprobs`` (``None`` for
``reply``), ``layout`` (``images_first`` / ``text_first``) and ``attempt`` (a deliberate re-ask,
e.g. GEdit's one re-query of an unparsed reply, is a request of its own). Not in it: the URL and
API key (a server moved or re-keyed answers the same), ``answer_variants`` (a score is recomputed
from the stored log-probs on every hit, so a hit gives the value a fresh ask would have given).

Failures are named errors and never scores: :class:`EvaluatorError` (a request that failed for
good: the message names the evaluator, URL, served model, HTTP status and attempts),
:class:`EvaluatorContextLengthError`, :class:`EvaluatorReplyError` (a reply without what its
kind needs). A failed request writes nothing to the cache. The same three kinds answered by a
transformers model in this process (no server): :class:`paco.benchmark.local_evaluator.LocalEvaluator`,
whose keys add ``backend`` so its answers never mix with a server's.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image

from paco.benchmark.answer_cache import AnswerCache, request_key
from paco.judge.chat import image_data_url, png_bytes
from paco.judge.model import AnswerLogprobsError, yes_probability
from paco.serving.client import ContextLengthError, ServedClient, ServedModelError

__all__ = [
    "KINDS",
    "Evaluator",
    "EvaluatorContextLengthError",
    "EvaluatorError",
    "EvaluatorReplyError",
    "build_chat",
    "token_logprobs",
]

#: the request kinds (the ``kind`` of a cache key)
KINDS = ("yes_no", "reply", "score_tokens")

ImageInput = Image.Image | bytes
Request = tuple[Sequence[ImageInput], str]


class EvaluatorError(ServedModelError):
    """An evaluator request failed for good (unreachable, timed out, an HTTP error after the
    retries, a redirect); the message names the evaluator, URL, served model, status and attempts."""


class EvaluatorContextLengthError(EvaluatorError, ContextLengthError):
    """The evaluator refused a prompt longer than its context (HTTP 400); ``n_tokens`` and
    ``limit`` as in :class:`paco.serving.judge_client.JudgeContextLengthError`."""


class EvaluatorReplyError(EvaluatorError):
    """A reply (fresh or cached) lacks what its kind needs: not JSON, no text, no first-token
    log-probs, more top entries than asked for, an invalid log-prob, or neither Yes nor No."""


def build_chat(pngs: Sequence[bytes], text: str, *, text_first: bool = False) -> list[dict[str, Any]]:
    """One user turn of ``len(pngs)`` images and ``text`` for an OpenAI-compatible server:
    :func:`paco.judge.chat.build_openai_messages` for any number of images (equal to it for two
    images and ``text_first=False``).

    Args:
        pngs: encoded images (PNG or JPEG bytes), in the order sent; may be empty.
        text: the question or prompt, sent as given.
        text_first: the text before the images (VIEScore's GPT layout) instead of after.

    Returns:
        ``[{"role": "user", "content": [image_url items ..., {"type": "text", "text": text}]}]``
        (the text item first when ``text_first``).

    Raises:
        TypeError, ValueError: an image that is not PNG/JPEG bytes
            (:func:`paco.judge.chat.image_data_url`); a text that is not a non-empty str.
    """
    images = [{"type": "image_url", "image_url": {"url": image_data_url(p)}} for p in pngs]
    item = {"type": "text", "text": _check_text(text)}
    return [{"role": "user", "content": [item, *images] if text_first else [*images, item]}]


def _check_text(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"an evaluator question must be a non-empty str, got {text!r:.80}")
    return text


def _encode(image: Any) -> bytes:
    """The bytes sent for one image: PNG of a PIL image (:func:`paco.judge.chat.png_bytes`), or
    PNG/JPEG bytes as given."""
    if isinstance(image, Image.Image):
        return png_bytes(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        image_data_url(data)  # raises ValueError unless PNG or JPEG
        return data
    raise TypeError(f"an evaluator image must be a PIL image or PNG/JPEG bytes, got {type(image).__name__}")


def _top_entries(top: Any, limit: int | None, where: str) -> list[dict[str, Any]]:
    """``[{"token", "logprob"}]`` of one position's ``top_logprobs`` (other fields dropped), each
    a str token and a finite log-prob <= 0; at most ``limit + 1`` entries when ``limit`` is given
    (vLLM may add the sampled token). Raises :class:`EvaluatorReplyError`."""
    if not isinstance(top, list) or (limit is not None and len(top) > limit + 1):
        got = f"{len(top)} entries" if isinstance(top, list) else f"a {type(top).__name__}"
        raise EvaluatorReplyError(f"{where}: first-token top_logprobs is {got}, but a list of at most "
                                  f"{limit} (+1, the sampled token) was asked for")
    out = []
    for entry in top:
        token, lp = (entry.get("token"), entry.get("logprob")) if isinstance(entry, dict) else (None, None)
        if not isinstance(token, str) or isinstance(lp, bool) or not isinstance(lp, (int, float)) \
                or not math.isfinite(lp) or lp > 0:
            raise EvaluatorReplyError(f"{where}: invalid top_logprobs entry {entry!r:.120} (a str token and a "
                                      "finite log-probability <= 0)")
        out.append({"token": token, "logprob": float(lp)})
    return out


def _extract(kind: str, body: bytes, top: int | None, where: str) -> dict[str, Any]:
    """The answer record of a raw ``/chat/completions`` body: ``{"content", "finish_reason"}``
    for ``reply``; ``{"content", "top_logprobs"}`` (the first token's) for the log-prob kinds.
    Raises :class:`EvaluatorReplyError`."""
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise EvaluatorReplyError(f"malformed {where}: not JSON ({exc}): {body[:200]!r}") from None
    try:
        choice = obj["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EvaluatorReplyError(f"{where} has no choices[0].message ({exc!r}): {body[:200]!r}") from None
    if content is not None and not isinstance(content, str):
        raise EvaluatorReplyError(f"{where}: message content is a {type(content).__name__}, not text")
    if kind == "reply":
        if content is None:
            raise EvaluatorReplyError(f"{where} has no text (message content null, e.g. a refusal): "
                                      f"{body[:300]!r}")
        reason = choice.get("finish_reason")
        return {"content": content, "finish_reason": reason if isinstance(reason, str) else None}
    try:
        entries = choice["logprobs"]["content"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EvaluatorReplyError(f"{where} has no first-token top_logprobs ({exc!r}): {body[:200]!r}") from None
    return {"content": content, "top_logprobs": _top_entries(entries, top, where)}


def token_logprobs(answer: dict[str, Any], where: str = "answer") -> dict[str, float]:
    """``{token text: log-prob}`` of a ``score_tokens`` answer's first-token top entries.

    Entries with the same text (distinct token ids that decode alike) are merged into the
    log of their summed probabilities (log-sum-exp), so each value is ``log P(first token's
    text)`` over the listed tokens.

    Raises:
        EvaluatorReplyError: no list of valid entries (see :func:`_top_entries`).
    """
    out: dict[str, list[float]] = {}
    for e in _top_entries(answer.get("top_logprobs"), None, where):
        out.setdefault(e["token"], []).append(e["logprob"])

    def lse(v: list[float]) -> float:
        m = max(v)
        return m if len(v) == 1 else m + math.log(sum(math.exp(x - m) for x in v))

    return {t: lse(v) for t, v in out.items()}


class Evaluator:
    """An OpenAI-compatible evaluator with an answer cache (module docstring: kinds, layout,
    key, errors).

    Args:
        name: this evaluator's name in the cache key and the scores (e.g. ``qwen2.5-vl-7b``).
        base_url: ``http(s)://host:port/v1``.
        model: the served model name.
        api_key: ``Authorization: Bearer`` (``None``: the placeholder ``EMPTY``).
        concurrency: requests in flight at once in the batch methods.
        timeout_s: the total time one attempt may take, seconds (> 0).
        retries: retries of a retryable failure (>= 0), as :class:`~paco.serving.client.ServedClient`.
        supervisor: the :class:`~paco.serving.client.Supervisor` of a server the stage started
            (it restarts one that died); ``None``: a URL.
        top_logprobs: first-token entries asked for by the log-prob kinds (1-20 on vLLM / OpenAI).
        answer_variants: see :func:`paco.judge.model.yes_probability` (default: exact ``Yes`` /
            ``No``, as the official T2IS code).
        cache: an :class:`AnswerCache`, a directory for one (``answers-<cache_part>.jsonl``), or
            ``None`` (in memory only).

    Attributes:
        asked: answers fetched from the server by this instance; ``hits``: answers the cache gave.

    Raises:
        ValueError: an empty name, a bad URL, timeout, retries or ``top_logprobs`` < 1.
        paco.benchmark.answer_cache.AnswerCacheError: the cache directory cannot be used.
    """

    def __init__(self, name: str, base_url: str, model: str, *, api_key: str | None = None, concurrency: int = 8,
                 timeout_s: float = 120.0, retries: int = 3, top_logprobs: int = 20, answer_variants: bool = False,
                 cache: AnswerCache | str | Path | None = None, cache_part: str = "0", supervisor: Any = None):
        self._setup(name, model, top_logprobs, answer_variants)
        self._client = ServedClient(base_url, model, concurrency=concurrency, timeout_s=timeout_s, retries=retries,
                                    api_key=api_key, supervisor=supervisor)
        self.base_url, self.concurrency = self._client.base_url, self._client.concurrency
        self.cache = cache if isinstance(cache, AnswerCache) else AnswerCache(cache, part=cache_part)

    def _setup(self, name: str, model: str, top_logprobs: int, answer_variants: bool) -> None:
        """Check and set what every backend shares (name, model, ``top_logprobs``, counters).

        Raises:
            ValueError: an empty name or model, ``top_logprobs`` not an int >= 1.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"an evaluator needs a non-empty name, got {name!r}")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"evaluator {name!r} needs a served model name, got {model!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 1:
            raise ValueError(f"evaluator {name!r}: top_logprobs must be an int >= 1, got {top_logprobs!r}")
        self.name, self.model = name, model
        self.top_logprobs, self.answer_variants = top_logprobs, bool(answer_variants)
        self.asked = self.hits = 0
        self._lock = threading.Lock()

    def _key_fields(self) -> dict[str, Any]:
        """Fields this backend adds to every request's cache key (none for the OpenAI client, so
        its keys are those of the module docstring; :class:`paco.benchmark.local_evaluator.LocalEvaluator`
        adds ``backend`` and ``dtype``)."""
        return {}

    def __repr__(self) -> str:
        return f"Evaluator({self.name!r}, {self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def describe(self) -> dict[str, Any]:
        """``{name, base_url, model, top_logprobs, answer_variants}`` (for metrics and reports)."""
        return {"name": self.name, "base_url": self.base_url, "model": self.model,
                "top_logprobs": self.top_logprobs, "answer_variants": self.answer_variants}

    def check_model(self) -> None:
        """Raise :class:`EvaluatorError` unless the server is reachable and serves ``model``."""
        try:
            self._client.check_model()
        except ServedModelError as exc:
            raise EvaluatorError(f"evaluator {self.name!r}: {exc}") from None

    # ------------------------------------------------------------------ the three kinds

    def yes_probability(self, images: Sequence[ImageInput], question: str, *, text_first: bool = False) -> float:
        """``P(Yes) / (P(Yes) + P(No))`` of the first token, a float in [0, 1] (module docstring).

        Raises:
            EvaluatorError: the request failed; EvaluatorReplyError: no usable log-probs, or
            neither ``Yes`` nor ``No`` among them; TypeError, ValueError: bad images or text.
        """
        return self.yes_probabilities([(images, question)], text_first=text_first)[0]

    def yes_probabilities(self, requests: Iterable[Request], *, text_first: bool = False) -> list[float]:
        """:meth:`yes_probability` of each ``(images, question)``, in order, ``concurrency`` at a time."""
        answers = self._answers("yes_no", requests, max_tokens=1, text_first=text_first, attempt=0)
        return [self._yes(a, w) for a, w in answers]

    def reply(self, images: Sequence[ImageInput], prompt: str, max_tokens: int, *, text_first: bool = False,
              attempt: int = 0) -> str:
        """The reply's text (temperature 0, at most ``max_tokens`` tokens), as the server sent it.

        ``attempt``: 0 for the first ask; n > 0 asks again (a request of its own in the cache).

        Raises:
            EvaluatorError: the request failed; EvaluatorReplyError: no text (e.g. a refusal);
            TypeError, ValueError: bad images, text, ``max_tokens`` or ``attempt``.
        """
        return self.replies([(images, prompt)], max_tokens, text_first=text_first, attempt=attempt)[0]

    def replies(self, requests: Iterable[Request], max_tokens: int, *, text_first: bool = False,
                attempt: int = 0) -> list[str]:
        """:meth:`reply` of each ``(images, prompt)``, in order, ``concurrency`` at a time."""
        answers = self._answers("reply", requests, max_tokens=max_tokens, text_first=text_first, attempt=attempt)
        out = []
        for answer, where in answers:
            if not isinstance(answer.get("content"), str):
                raise EvaluatorReplyError(f"{where}: no reply text")
            out.append(answer["content"])
        return out

    def score_token_logprobs(self, images: Sequence[ImageInput], prompt: str, *,
                             text_first: bool = False) -> dict[str, float]:
        """``{token text: log-prob}`` of the first token's top ``top_logprobs`` entries
        (:func:`token_logprobs`; natural-log probabilities, each <= 0).

        Raises:
            EvaluatorError: the request failed; EvaluatorReplyError: no usable log-probs;
            TypeError, ValueError: bad images or text.
        """
        return self.score_token_logprobs_many([(images, prompt)], text_first=text_first)[0]

    def score_token_logprobs_many(self, requests: Iterable[Request], *,
                                  text_first: bool = False) -> list[dict[str, float]]:
        """:meth:`score_token_logprobs` of each ``(images, prompt)``, in order."""
        answers = self._answers("score_tokens", requests, max_tokens=1, text_first=text_first, attempt=0)
        return [token_logprobs(a, w) for a, w in answers]

    # ------------------------------------------------------------------ asking and caching

    def _where(self, cached: bool) -> str:
        return (f"evaluator {self.name!r} {'cached reply' if cached else 'reply'} from "
                f"{self.base_url}/chat/completions (served model {self.model!r})")

    def _yes(self, answer: dict[str, Any], where: str) -> float:
        top = _top_entries(answer.get("top_logprobs"), None, where)
        try:
            return yes_probability(top, answer_variants=self.answer_variants)
        except AnswerLogprobsError as exc:
            raise EvaluatorReplyError(f"{where}: {exc}") from None

    def pending(self, kind: str, requests: Iterable[Request], *, max_tokens: int | None = None,
                text_first: bool = False, attempt: int = 0) -> int:
        """How many distinct requests of this batch the cache cannot answer, i.e. how many the
        matching batch method would ask the server (0: it sends nothing, so a caller may skip
        starting a server). ``kind`` one of :data:`KINDS`; ``max_tokens`` is 1 for ``yes_no`` and
        ``score_tokens`` (their methods' value, the default) and required for ``reply``.

        Raises:
            ValueError: an unknown kind, a missing or bad ``max_tokens``, a bad ``attempt`` or text;
            TypeError: bad images.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if max_tokens is None and kind == "reply":
            raise ValueError("pending('reply', ...) needs the max_tokens of the replies asked for")
        _, jobs = self._plan(kind, list(requests), max_tokens=1 if max_tokens is None else max_tokens,
                             text_first=text_first, attempt=attempt)
        return len(jobs)

    def _answers(self, kind: str, requests: Iterable[Request], *, max_tokens: int, text_first: bool,
                 attempt: int) -> list[tuple[dict[str, Any], str]]:
        """``(answer, where)`` per request, in order: cached ones as stored, the others asked
        (each distinct request once, ``concurrency`` at a time) and cached as they arrive. On the
        first failure the requests not yet started are cancelled and it is raised."""
        requests = list(requests)
        keys, jobs = self._plan(kind, requests, max_tokens=max_tokens, text_first=text_first, attempt=attempt)
        with self._lock:
            self.hits += len(requests) - len(jobs)
        self._run([lambda job=job: self._ask(*job) for job in jobs.values()])
        return [(self.cache.get(k)["answer"], self._where(k not in jobs)) for k in keys]

    def _plan(self, kind: str, requests: list[Request], *, max_tokens: int, text_first: bool, attempt: int
              ) -> tuple[list[str], dict[str, tuple[dict[str, Any], list[bytes]]]]:
        """The cache key of each request, in order, and ``{key: (request, image bytes)}`` of the
        distinct ones the cache lacks."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
        memo: dict[int, tuple[bytes, str]] = {}  # id(image) -> (bytes, sha256): a panel of many pairs encodes once
        keys, jobs = [], {}
        for images, text in requests:
            if isinstance(images, (Image.Image, bytes, str)) or not isinstance(images, Sequence):
                raise TypeError(f"images must be a sequence of images, got {type(images).__name__}")
            sent = []
            for image in images:
                if id(image) not in memo:
                    data = _encode(image)
                    memo[id(image)] = (data, hashlib.sha256(data).hexdigest())
                sent.append(memo[id(image)])
            request = {"evaluator": self.name, "model": self.model, "kind": kind, "text": _check_text(text),
                       "images": [sha for _, sha in sent], "max_tokens": max_tokens,
                       "top_logprobs": None if kind == "reply" else self.top_logprobs,
                       "layout": "text_first" if text_first else "images_first", "attempt": attempt,
                       **self._key_fields()}
            key = request_key(request)
            keys.append(key)
            if key not in self.cache and key not in jobs:
                jobs[key] = (request, [data for data, _ in sent])
        return keys, jobs

    def _run(self, calls: list[Callable[[], None]]) -> None:
        if self.concurrency == 1 or len(calls) <= 1:
            for call in calls:
                call()
            return
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(calls))) as pool:
            futures = [pool.submit(call) for call in calls]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise

    def _ask(self, request: dict[str, Any], pngs: list[bytes]) -> None:
        """Ask one request and cache its answer; raises the named errors (nothing cached)."""
        kind, top = request["kind"], request["top_logprobs"]
        params: dict[str, Any] = {"messages": build_chat(pngs, request["text"],
                                                         text_first=request["layout"] == "text_first"),
                                  "max_tokens": request["max_tokens"], "temperature": 0.0}
        if kind != "reply":
            params.update(logprobs=True, top_logprobs=top)
        try:
            body = self._client.chat_body(**params)
        except ContextLengthError as exc:
            raise EvaluatorContextLengthError(f"evaluator {self.name!r}: {exc}", exc.n_tokens, exc.limit) from None
        except ServedModelError as exc:
            raise EvaluatorError(f"evaluator {self.name!r}: {exc}") from None
        answer = _extract(kind, body, top, self._where(cached=False))
        self.cache.put(request, answer)
        with self._lock:
            self.asked += 1
