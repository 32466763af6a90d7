"""The client of a served PaCo-Reward judge (``paco.serving.server`` or vLLM): a pair's score over the
OpenAI API, with :mod:`paco.serving.client`'s retry, deadline and supervision policy.

The score of a pair is PaCo-Reward's ``P(Yes) / (P(Yes) + P(No))`` of the first generated token
(paper §3.2), computed from the ``top_logprobs`` of a ``max_tokens: 1`` chat completion as the
reference reward does (:func:`paco.judge.model.yes_probability`). A reply without usable
log-probs, or with more top entries than asked for, is an error, never a score; so is a request
that fails for good. A prompt too long for the judge's context raises
:class:`JudgeContextLengthError` with the token count and the limit (the reference retries and
then scores such a pair 0.0).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from PIL import Image

from paco.judge.chat import build_openai_messages, png_bytes
from paco.judge.model import AnswerLogprobsError, yes_probability
from paco.serving.client import ContextLengthError, ServedClient, ServedModelError, Supervisor


class JudgeError(ServedModelError):
    """The judge could not be reached, rejected a request, or gave an unusable reply."""


class JudgeContextLengthError(JudgeError, ContextLengthError):
    """The judge refused a prompt longer than its context (HTTP 400); ``n_tokens`` and ``limit``
    as in :class:`paco.serving.client.ContextLengthError`."""


class JudgeClient(ServedClient):
    """Scores (image A, image B, instruction) triples against an OpenAI-compatible judge.

    Args:
        base_url, model, concurrency, timeout_s, retries, api_key, supervisor: as
            :class:`paco.serving.client.ServedClient` (``concurrency``: a thread pool over one
            client; the server batches the requests).
        top_logprobs: how many first tokens to ask for (vLLM allows up to its ``--max-logprobs``);
            a reply with more than one entry more (the sampled token) is an error.
        answer_variants: see :func:`paco.judge.model.yes_probability`.

    Attributes:
        requests: pairs asked for so far.

    Raises:
        ValueError: as :class:`~paco.serving.client.ServedClient`.
    """

    def __init__(self, base_url: str, model: str, *, concurrency: int = 8, timeout_s: float = 60.0,
                 retries: int = 3, top_logprobs: int = 20, answer_variants: bool = False,
                 api_key: str | None = None, supervisor: Supervisor | None = None):
        super().__init__(base_url, model, concurrency=concurrency, timeout_s=timeout_s, retries=retries,
                         api_key=api_key, supervisor=supervisor)
        self.top_logprobs = int(top_logprobs)
        self.answer_variants = bool(answer_variants)
        self.requests = 0

    error = JudgeError
    context_error = JudgeContextLengthError
    label = "judge "

    def _context_error(self, where: str, message: str, n: int, limit: int) -> ContextLengthError:
        return self.context_error(
            f"{where} refused (HTTP status 400): the judge prompt is {n} tokens and the judge's context "
            f"is {limit} positions (prompt + 1 answer token must fit); shorten the instruction "
            f"(judge_endpoint.instruction: rank, or a shorter theme) or the images. Server: {message}", n, limit)

    def _score_one(self, request: tuple[bytes, bytes, str]) -> float:
        png_a, png_b, text = request
        messages = build_openai_messages(png_a, png_b, text)

        body = self.chat_body(messages=messages, max_tokens=1, temperature=0.0, logprobs=True,
                              top_logprobs=self.top_logprobs)
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
        except AnswerLogprobsError as exc:
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
