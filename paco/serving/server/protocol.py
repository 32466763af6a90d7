"""The judge server's wire format: the OpenAI-compatible subset of ``POST /v1/chat/completions``
that vLLM serves, its parsing, the ``chat.completion`` reply and the OpenAI error object.

The request is one user message whose content is two ``image_url`` items
(``data:image/png;base64,...``; PNG, JPEG, WebP or GIF, as vLLM, each decoded only as the type
its data URL declares) and one ``text`` item, ``max_tokens`` (or
``max_completion_tokens``) 1, ``logprobs: true``, ``top_logprobs`` from 0 to ``--max-logprobs``
(default 20, as vLLM's flag of the same name). The body is validated by pydantic models of
the OpenAI schema (:class:`ChatCompletionRequest`; fields outside the served subset such as
``temperature`` or ``seed`` are accepted and do not change the answer). The answer is the
greedy first token; ``choices[0].logprobs.content[0]`` carries its log-prob and the
``top_logprobs`` most likely first tokens with their log-probs (``log_softmax`` of the
first-position logits, float32), as vLLM returns them. Only first-token scoring is served:
``max_tokens > 1`` is a 400.

Before the body is parsed, its JSON is scanned without building anything (:func:`scan_json`);
both images' sizes are read from their headers and bounded, alone and together, before either
is decoded (:class:`paco.serving.server.limits.ServerLimits`).

Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``,
:func:`error_body`); which status each failure gets is :mod:`paco.serving.server.app`'s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
import time
import warnings
from json.decoder import scanstring
from typing import TYPE_CHECKING, Annotated, Any, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paco.core.caching import BytesLRU
from paco.core.io import ImageDecodeError, render_rgb

if TYPE_CHECKING:
    from paco.serving.server.batching import BatchingJudge

#: The largest ``top_logprobs`` accepted by default (vLLM's default ``--max-logprobs``).
MAX_TOP_LOGPROBS = 20

#: ``PIL.Image.info`` key under which the server records an image's content digest.
IMAGE_KEY = "paco_digest"

#: the data URL media types served -> the only Pillow format each is decoded as (vLLM's set)
SERVED_IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                      "image/gif": "GIF"}

#: deepest JSON nesting a body may have (a judge request has 5 levels)
MAX_JSON_DEPTH = 32


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


class _DecodedImages(BytesLRU):
    """A byte-bounded LRU of decoded images keyed by the digest of their base64 payload (a
    bound <= 0 keeps none)."""

    def __init__(self, max_bytes: int):
        super().__init__(max(int(max_bytes), 0), sizeof=lambda im: im.width * im.height * len(im.getbands()))


_ADDRESS = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")


def _reason(exc: BaseException) -> str:
    """``exc``'s message without object reprs (``<_io.BytesIO object at 0x...>``)."""
    return _ADDRESS.sub("the data", str(exc)) or type(exc).__name__


def _data_url(url: str, what: str) -> tuple[str, str, str]:
    """``(media type, Pillow format, base64 payload)`` of a served ``data:`` URL.

    Raises:
        BadRequest: not a base64 data URL, or a media type outside :data:`SERVED_IMAGE_TYPES`.
    """
    head, sep, payload = url.partition(",")
    params = [p.strip().lower() for p in head.split(";")]
    if not url.startswith("data:") or not sep or "base64" not in params[1:]:
        raise BadRequest(f"{what}: only data:image/...;base64 URLs are served")
    mime = params[0][len("data:"):]
    fmt = SERVED_IMAGE_TYPES.get(mime)
    if fmt is None:
        raise BadRequest(f"{what}: {mime or 'a data URL without a media type'} is not served; send image/png, "
                         "image/jpeg, image/webp or image/gif")
    return mime, fmt, payload


def _open_declared(data: bytes, fmt: str, mime: str, what: str, max_pixels: int | None) -> Image.Image:
    """``data`` opened (its header read, nothing decoded) by Pillow's ``fmt`` plugin only.

    Raises:
        BadRequest: ``data`` is not a ``fmt`` image, or has more than ``max_pixels`` pixels.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=[fmt])
    except UnidentifiedImageError:
        raise BadRequest(f"{what}: the data is not a {fmt} image (its data URL declares {mime})") from None
    except Image.DecompressionBombError as exc:
        raise BadRequest(f"{what}: image too large for Pillow's decompression-bomb guard ({_reason(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - a plugin's header parser fails in many ways
        raise BadRequest(f"{what}: cannot read the {fmt} image's header ({_reason(exc)})") from None
    n = im.width * im.height
    if max_pixels is not None and n > max_pixels:
        im.close()
        raise BadRequest(f"{what}: image is {im.width}x{im.height} = {n} pixels, more than max_pixels={max_pixels} "
                         "(--max-image-pixels)")
    return im


def _decode_opened(im: Image.Image, fmt: str, what: str) -> Image.Image:
    """The RGB image of an :func:`_open_declared` image, rendered as
    :func:`paco.core.io.decode_image` renders a file (EXIF orientation, 16-bit, alpha).

    Raises:
        BadRequest: truncated or corrupt data, or a mode with no 8-bit rendering.
    """
    try:
        with im, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return render_rgb(im, what)[0]
    except ImageDecodeError as exc:
        raise BadRequest(_reason(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a decoder fails in many ways
        raise BadRequest(f"{what}: cannot decode the {fmt} image ({_reason(exc)})") from None


def _decode_images(urls: list[str], max_pixels: int | None, max_request_pixels: int | None,
                   decoded: _DecodedImages | None) -> list[Any]:
    """The images of ``urls`` (``data:`` URLs), each ``info[IMAGE_KEY]`` set to the digest of
    its declared format and payload (served from ``decoded`` when seen before). Every header
    is read and bounded before any image is decoded.

    Raises:
        BadRequest: a URL or an image that is not served, or a pixel bound is exceeded.
    """
    entries: list[tuple[str, str, bytes, Any]] = []  # (what, format, digest, cached image or None)
    opened: dict[int, Any] = {}  # entry index -> its file, opened and not yet decoded
    try:
        for i, url in enumerate(urls):
            what = f"image {i + 1}"
            mime, fmt, payload = _data_url(url, what)
            digest = hashlib.blake2b(f"{fmt}:{payload}".encode("ascii", "replace"), digest_size=20).digest()
            hit = decoded.get(digest) if decoded is not None else None
            if hit is None:
                try:
                    data = base64.b64decode(payload, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise BadRequest(f"{what}: invalid base64 ({exc})") from None
                opened[i] = _open_declared(data, fmt, mime, what, max_pixels)
            entries.append((what, fmt, digest, hit))
        total = sum(im.width * im.height for im in (hit or opened[i] for i, (*_, hit) in enumerate(entries)))
        if max_request_pixels is not None and total > max_request_pixels:
            raise BadRequest(f"the request's images have {total} pixels in all, more than {max_request_pixels} "
                             "(--max-request-pixels)")
        images = []
        for i, (what, fmt, digest, im) in enumerate(entries):
            if im is None:
                im = _decode_opened(opened.pop(i), fmt, what)
                im.info[IMAGE_KEY] = digest
                if decoded is not None:
                    decoded.put(digest, im)
            images.append(im)
        return images
    finally:
        for im in opened.values():  # left undecoded by an error
            im.close()


# --------------------------------------------------------------------------------------------
# parsing a request
# --------------------------------------------------------------------------------------------


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


_JSON_TOKEN = re.compile(r'["{}\[\],]')
_JSON_KEY = re.compile(r"\s*:")


def _string_end(text: str, start: int) -> int:
    """The index after the JSON string whose opening quote is at ``start``."""
    end = text.find('"', start + 1)
    if end >= 0 and text.find("\\", start + 1, end) < 0:  # no escape before the first quote
        return end + 1
    try:
        return scanstring(text, start + 1, True)[1]
    except ValueError as exc:
        raise BadRequest(f"invalid request: the body is not valid JSON ({exc})") from None


def scan_json(text: str, *, max_values: int, max_content_parts: int) -> None:
    """Bound the JSON ``text`` before anything is built from it: strings are skipped whole
    (a C-level search), and objects, arrays and separators outside them are counted, so a
    body of a million tiny items is refused after reading a few hundred of them.

    Raises:
        BadRequest: more than ``max_values`` objects, arrays and separators in all, more than
            ``max_content_parts`` objects in a ``messages[i].content`` array, nesting deeper
            than :data:`MAX_JSON_DEPTH`, or a malformed string.
    """
    stack: list[tuple[str, str | None]] = []  # (bracket, the key it is the value of)
    key: str | None = None
    values = parts = 0
    pos = 0
    while (m := _JSON_TOKEN.search(text, pos)) is not None:
        ch, pos = m.group(), m.end()
        if ch == '"':
            end = _string_end(text, m.start())
            if stack and stack[-1][0] == "{" and _JSON_KEY.match(text, end):
                key = text[m.start() + 1:end - 1]
            pos = end
            continue
        if ch in "]}":
            if stack:
                stack.pop()
            continue
        values += 1
        if values > max_values:
            raise BadRequest(f"the request body has more than {max_values} JSON values (objects, arrays and items; "
                             f"--max-json-values {max_values}); a judge request has about 20")
        if ch == ",":
            continue
        if (ch == "{" and len(stack) == 4 and stack[0][0] == "{" and stack[1] == ("[", "messages")
                and stack[2][0] == "{" and stack[3] == ("[", "content")):
            parts += 1
            if parts > max_content_parts:
                raise BadRequest(f"the request has more than {max_content_parts} content parts "
                                 f"(--max-content-parts {max_content_parts}); a judge request has 3: "
                                 "[image A, image B, text]")
        stack.append((ch, key if stack and stack[-1][0] == "{" else None))
        key = None
        if len(stack) > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body's JSON is nested deeper than {MAX_JSON_DEPTH} levels")


def parse_chat_request(body: bytes | str | dict[str, Any], served_model_name: str, *,
                       max_logprobs: int = MAX_TOP_LOGPROBS, max_image_pixels: int | None = None,
                       max_request_pixels: int | None = None, max_content_parts: int | None = None,
                       max_json_values: int | None = None,
                       decoded: _DecodedImages | None = None) -> tuple[tuple[Any, Any, str], int]:
    """Validate a ``/v1/chat/completions`` body; return ``((image A, image B, text), top_k)``.

    Args:
        body: the raw JSON body, or the parsed object.
        served_model_name: the only accepted ``model``.
        max_logprobs: the largest ``top_logprobs`` served.
        max_image_pixels: width x height bound per image (``None``: Pillow's own guard only).
        max_request_pixels: bound on both images' pixels together (``None``: none).
        max_content_parts, max_json_values: bounds checked by :func:`scan_json` before a raw
            body is parsed (``None``: no scan).
        decoded: a cache of decoded images (the server's), or ``None``.

    Raises:
        BadRequest: anything outside the served subset or over a bound (status 404 for an
            unknown model).
    """
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"invalid request: the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(body, str) and (max_content_parts is not None or max_json_values is not None):
        scan_json(body, max_values=max_json_values if max_json_values is not None else 1 << 62,
                  max_content_parts=max_content_parts if max_content_parts is not None else 1 << 62)
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
    ims = _decode_images(images, max_image_pixels, max_request_pixels, decoded)
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


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
                408: "RequestTimeout", 413: "BadRequestError", 415: "BadRequestError", 421: "BadRequestError",
                499: "ClientClosedRequest", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": None,
                      "code": status}}
