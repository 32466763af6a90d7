"""The ``openai`` teacher: any OpenAI-compatible ``/chat/completions`` endpoint, through the
official ``openai`` client, images as PNG data URLs, the known label stated in the instruction
(:data:`paco.core.templates.TEACHER_COT`); answers are validated against the label and re-asked
(:func:`paco.judge.teachers.base.validate_answer`)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paco.judge.chat import build_openai_messages, openai_error_message, openai_retries, png_bytes
from paco.judge.teachers.base import PairItem, Teacher, TeacherConfigError, TeacherResult, validate_answer

__all__ = ["OpenAITeacher"]


class OpenAITeacher(Teacher):
    """Teacher behind an OpenAI-compatible ``/chat/completions`` endpoint, through the official
    ``openai`` client.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1`` or ``https://api.openai.com/v1`` (a trailing
            ``/chat/completions`` is accepted and dropped). Only ``http``/``https``.
        model: served model name.
        api_key_env: NAME of the environment variable holding the API key (``None``: the
            placeholder ``EMPTY``, e.g. a local vLLM without ``--api-key``).
        max_tokens, temperature: generation settings of the first try.
        retry_temperature: temperature of re-asks after a wrong or unparsable answer.
        concurrency: parallel requests.
        timeout_s: per-request timeout (the client's ``timeout``).
        fast, max_reasons: see :class:`Teacher`.
        retries: re-asks after a wrong or unparsable answer, and the client's ``max_retries`` of
            transport failures (connection errors, timeouts, HTTP 408/409/429/5xx, retried with
            the client's exponential backoff; other 4xx are not retried).

    A failed item's ``error`` names the URL, the model and, for HTTP errors, the status.

    Raises:
        TeacherConfigError: bad URL, missing model, or ``api_key_env`` names an unset variable.
    """

    backend = "openai"

    def __init__(self, *, base_url: str | None, model: str | None, api_key_env: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, retry_temperature: float = 0.7, concurrency: int = 4,
                 timeout_s: float = 60.0, environ: Mapping[str, str] | None = None, **kw: Any) -> None:
        import os

        super().__init__(**kw)
        # fast never calls the endpoint, so its settings may be left empty then.
        if not self.fast or base_url:
            if not base_url or not isinstance(base_url, str):
                raise TeacherConfigError("openai.base_url is required")
            parsed = urllib.parse.urlparse(base_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise TeacherConfigError(f"openai.base_url must be an http(s) URL, got {base_url!r}")
            if not model:
                raise TeacherConfigError("openai.model is required")
        base = (base_url or "").rstrip("/")
        self.base_url = base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base
        self.url = self.base_url + "/chat/completions"
        self.model = str(model) if model else None
        self.api_key_env = api_key_env or None
        env = os.environ if environ is None else environ
        api_key: str | None = None
        if self.api_key_env and not self.fast:
            api_key = env.get(self.api_key_env)
            if not api_key:
                raise TeacherConfigError(
                    f"openai.api_key_env names the environment variable {self.api_key_env!r}, which is not set"
                )
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.retry_temperature = float(retry_temperature)
        self.concurrency = max(1, int(concurrency))
        self.timeout_s = float(timeout_s)
        if self.timeout_s <= 0 or self.max_tokens < 1:
            raise TeacherConfigError("openai: timeout_s must be > 0, max_tokens >= 1")
        self._client = None
        if self.base_url:
            from openai import OpenAI

            self._client = OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", max_retries=self.retries,
                                  timeout=self.timeout_s)

    def __repr__(self) -> str:  # never show the key
        return f"OpenAITeacher(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "url": self.url, "model": self.model, "api_key_env": self.api_key_env}

    def _post(self, messages: list[dict[str, Any]], temperature: float) -> str:
        """The reply's text.

        Raises:
            openai.OpenAIError: after the client's retries.
            ValueError: a reply without text content.
        """
        try:
            completion = self._client.chat.completions.create(model=self.model, messages=messages,
                                                              max_tokens=self.max_tokens, temperature=temperature)
        except ValueError as exc:  # a body that is not JSON
            raise ValueError(f"malformed response from {self.url}: {exc}") from None
        try:
            content = completion.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            raise ValueError(f"malformed response from {self.url}: {str(completion)[:200]}") from None
        if not isinstance(content, str):
            raise ValueError(f"malformed response from {self.url}: content is {type(content).__name__}")
        return content

    def _one(self, item: PairItem) -> TeacherResult:
        try:
            return self._one_unguarded(item)
        except Exception as e:  # noqa: BLE001 - an unexpected error fails the item, recorded
            return self._fail(item, f"openai teacher {self.url}: {type(e).__name__}: {e}", 0)

    def _transport_error(self, exc: Exception) -> str:
        import openai

        where = f"{self.url} (model {self.model!r})"
        if isinstance(exc, openai.APIStatusError):
            return f"HTTP {exc.status_code} from {where}: {openai_error_message(exc)}"
        if isinstance(exc, openai.APITimeoutError):
            return f"timeout after {self.timeout_s:g}s from {where}"
        return f"cannot reach {where}: {type(exc).__name__}: {exc.__cause__ or exc}"

    def _one_unguarded(self, item: PairItem) -> TeacherResult:
        import openai

        messages = build_openai_messages(png_bytes(item.image_a), png_bytes(item.image_b), self.prompt(item))
        attempts, last_err, raw = 0, "no attempt made", None
        bad_answer = False
        for _ in range(self.retries + 1):
            attempts += 1
            try:
                raw = self._post(messages, self.retry_temperature if bad_answer else self.temperature)
            except openai.OpenAIError as e:  # the client already retried what is worth retrying
                retried = openai_retries(getattr(e, "status_code", None))
                how = f"after the client's {self.retries} retries" if retried else "not retried"
                return self._fail(item, f"{self._transport_error(e)} (attempt {attempts}, {how})", attempts, raw)
            except ValueError as e:
                last_err = str(e)
                bad_answer = True
                continue
            reasons, err = validate_answer(raw, item.label, self.max_reasons)
            if err is None:
                return self._ok(item, reasons, attempts, raw)
            bad_answer = True
            last_err = f"{err} (from {self.url}, model {self.model!r})"
        return self._fail(item, f"{last_err}; gave up after {attempts} attempt(s)", attempts, raw)

    def _explain(self, items: list[PairItem]) -> list[TeacherResult]:
        if self.concurrency == 1 or len(items) == 1:
            return [self._one(it) for it in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            return list(pool.map(self._one, items))
