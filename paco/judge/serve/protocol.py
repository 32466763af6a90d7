"""The judge server's wire format: the OpenAI-compatible subset of ``POST /v1/chat/completions``
that vLLM serves, its parsing, the ``chat.completion`` reply and the OpenAI error object.

The request is one user message whose content is two ``image_url`` items
(``data:image/png;base64,...`` or JPEG) and one ``text`` item, ``max_tokens`` (or
``max_completion_tokens``) 1, ``logprobs: true``, ``top_logprobs`` from 0 to ``--max-logprobs``
(default 20, as vLLM's flag of the same name). The body is validated by pydantic models of
the OpenAI schema (:class:`ChatCompletionRequest`; fields outside the served subset such as
``temperature`` or ``seed`` are accepted and do not change the answer). The answer is the
greedy first token; ``choices[0].logprobs.content[0]`` carries its log-prob and the
``top_logprobs`` most likely first tokens with their log-probs (``log_softmax`` of the
first-position logits, float32), as vLLM returns them. Only first-token scoring is served:
``max_tokens > 1`` is a 400.

Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``,
:func:`error_body`); which status each failure gets is :mod:`paco.judge.serve.app`'s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paco.core.io import ImageDecodeError, decode_image

if TYPE_CHECKING:
    from paco.judge.serve.batching import BatchingJudge

#: The largest ``top_logprobs`` accepted by default (vLLM's default ``--max-logprobs``).
MAX_TOP_LOGPROBS = 20

#: ``PIL.Image.info`` key under which the server records an image's content digest.
IMAGE_KEY = "paco_digest"


class BadRequest(ValueError):
    """The request does not follow the served protocol or breaks a limit (HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# the OpenAI request schema (the served subset; other fields are accepted and ignored)
# --------------------------------------------------------------------------------------------


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Schema):
    url: str
    detail: str | None = None


class ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: ImageURL


class TextPart(_Schema):
    type: Literal["text"]
    text: str


ContentPart = Annotated[ImagePart | TextPart, Field(discriminator="type")]


class UserMessage(_Schema):
    role: Literal["user"]
    content: list[ContentPart]


class ChatCompletionRequest(_Schema):
    """``POST /v1/chat/completions`` as the OpenAI API defines it, narrowed to what is served."""

    model: str
    messages: list[UserMessage] = Field(min_length=1, max_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    n: int = 1
    stream: bool = False


# --------------------------------------------------------------------------------------------
# the images of data URLs
# --------------------------------------------------------------------------------------------


class _DecodedImages:
    """A byte-bounded LRU of decoded images keyed by the digest of their base64 payload."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> Any:
        with self._lock:
            im = self._entries.get(digest)
            if im is not None:
                self._entries.move_to_end(digest)
            return im

    def put(self, digest: bytes, image: Any) -> None:
        size = image.width * image.height * len(image.getbands())
        if self.max_bytes <= 0 or size > self.max_bytes:
            return
        with self._lock:
            if digest in self._entries:
                return
            self._entries[digest] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.width * old.height * len(old.getbands())


def _decode_data_url(url: str, what: str, max_pixels: int | None, decoded: _DecodedImages | None = None):
    """The image of a ``data:image/...;base64,`` URL, its ``info[IMAGE_KEY]`` set to the
    payload's digest (served from ``decoded`` when seen before).

    Raises:
        BadRequest: not a base64 data URL, invalid base64, not decodable, or over ``max_pixels``.
    """
    if not url.startswith("data:image/") or ";base64," not in url:
        raise BadRequest(f"{what}: only data:image/...;base64 URLs are served")
    payload = url.split(";base64,", 1)[1]
    digest = hashlib.blake2b(payload.encode("ascii", "replace"), digest_size=20).digest()
    if decoded is not None:
        hit = decoded.get(digest)
        if hit is not None:
            return hit
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{what}: invalid base64 ({exc})") from None
    try:
        image = decode_image(data, what=what, max_pixels=max_pixels)
    except ImageDecodeError as exc:  # ImageTooLargeError included: checked from the header
        raise BadRequest(str(exc)) from None
    image.info[IMAGE_KEY] = digest
    if decoded is not None:
        decoded.put(digest, image)
    return image


# --------------------------------------------------------------------------------------------
# parsing a request
# --------------------------------------------------------------------------------------------


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def parse_chat_request(body: bytes | str | dict[str, Any], served_model_name: str, *,
                       max_logprobs: int = MAX_TOP_LOGPROBS, max_image_pixels: int | None = None,
                       decoded: _DecodedImages | None = None) -> tuple[tuple[Any, Any, str], int]:
    """Validate a ``/v1/chat/completions`` body; return ``((image A, image B, text), top_k)``.

    Args:
        body: the raw JSON body, or the parsed object.
        served_model_name: the only accepted ``model``.
        max_logprobs: the largest ``top_logprobs`` served.
        max_image_pixels: width x height bound per image (``None``: Pillow's own guard only).
        decoded: a cache of decoded images (the server's), or ``None``.

    Raises:
        BadRequest: anything outside the served subset (status 404 for an unknown model).
    """
    try:
        req = (ChatCompletionRequest.model_validate(body) if isinstance(body, dict)
               else ChatCompletionRequest.model_validate_json(body))
    except ValidationError as exc:
        raise BadRequest(_validation_message(exc)) from None
    if req.model != served_model_name:
        raise BadRequest(f"The model `{req.model}` does not exist (served: `{served_model_name}`).", status=404)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens not in (None, 1):
        raise BadRequest(f"this server scores the first token only: max_tokens must be 1, got {max_tokens!r}")
    if req.n != 1:
        raise BadRequest("n must be 1")
    if req.stream:
        raise BadRequest("stream is not served")
    top_k = (req.top_logprobs or 0) if req.logprobs else 0
    if top_k > max_logprobs:
        raise BadRequest(f"top_logprobs must be an integer in [0, {max_logprobs}], got {top_k!r}")
    images, texts = [], []
    for part in req.messages[0].content:
        if isinstance(part, ImagePart):
            images.append(part.image_url.url)
        else:
            texts.append(part.text)
    if len(images) != 2 or len(texts) != 1 or not texts[0].strip():
        raise BadRequest(f"the content must be [image A, image B, text]; got {len(images)} image(s) and "
                         f"{len(texts)} text(s)")
    ims = [_decode_data_url(u, f"image {i + 1}", max_image_pixels, decoded) for i, u in enumerate(images)]
    return (ims[0], ims[1], texts[0]), top_k


# --------------------------------------------------------------------------------------------
# replies
# --------------------------------------------------------------------------------------------


def _logprob_entry(batcher: BatchingJudge, token_id: int, logprob: float) -> dict[str, Any]:
    text = batcher.token_text(token_id)
    lp = logprob if math.isfinite(logprob) else -9999.0
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def completion_response(batcher: BatchingJudge, served_model_name: str, result: tuple[int, float, list],
                        request_id: int) -> dict[str, Any]:
    """The ``chat.completion`` object for a scored request (vLLM's field layout)."""
    token_id, logprob, top = result
    entry = _logprob_entry(batcher, token_id, logprob)
    entry["top_logprobs"] = [_logprob_entry(batcher, i, v) for i, v in top]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": entry["token"]},
            "logprobs": {"content": [entry]},
            "finish_reason": "length",
        }],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    }


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "BadRequestError", 408: "RequestTimeout",
                499: "ClientClosedRequest",
                413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": None,
                      "code": status}}
