"""The judge's chat requests: the one chat layout, image encoding, and the OpenAI client's errors.

Chat layout (one user turn ``[image A, image B, text]``): :func:`build_messages` (transformers /
Qwen format, PIL images) and :func:`build_openai_messages` (OpenAI-compatible servers, base64
data URLs, :func:`image_data_url` of :func:`png_bytes`). The text is a question of
:mod:`paco.core.templates`; the answer format is :mod:`paco.judge.response`.

Reference vs ours (``X-GenGroup/PaCo-RL``, commit ``cd3c428``):

* chat layout: the GRPO reward (OpenAI client to vLLM) sends one user turn ``[image, image,
  text]`` through the server's chat template; the offline vLLM evaluators hand-write the prompt
  and prefix the images with ``<img1>: `` / ``<img2>: `` labels (``apply_chat_template`` in
  consistency_scorer_vllm.py and editscore/mllm_tools/qwen25vl_vllm.py). We use the unlabelled
  layout everywhere (train, eval, reward): one layout for the whole pipeline.
* image encoding: the reference sends JPEG data URLs (``pil_image_to_base64`` always saves JPEG,
  whatever its ``format`` argument says); we send lossless PNG.

:func:`openai_error_message` and :func:`openai_retries` read the failures of the official
``openai`` client (the judge client and the OpenAI-compatible CoT teacher).
"""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image

__all__ = [
    "build_messages",
    "build_openai_messages",
    "image_data_url",
    "png_bytes",
    "openai_error_message",
    "openai_retries",
]


def _check_text(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text item must be a non-empty str")
    return text


def build_messages(image_a: Any, image_b: Any, text: str) -> list[dict[str, Any]]:
    """The judge's chat layout for transformers / Qwen2.5-VL processors.

    One user turn ``[image A, image B, text]``; no system turn (the Qwen2.5-VL chat template adds
    its default ``"You are a helpful assistant."``).

    Args:
        image_a, image_b: PIL images (or anything the processor accepts as an image item).
        text: the question (e.g. :func:`paco.core.templates.judge_instruction`).

    Returns:
        ``[{"role": "user", "content": [{"type": "image", "image": image_a}, {"type": "image",
        "image": image_b}, {"type": "text", "text": text}]}]`` (a new list each call).

    Raises:
        ValueError: an image is ``None`` or the text is empty.
    """
    if image_a is None or image_b is None:
        raise ValueError("build_messages needs two images")
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image_a},
                {"type": "image", "image": image_b},
                {"type": "text", "text": _check_text(text)},
            ],
        }
    ]


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"


def image_data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` (or ``image/jpeg``) for encoded image bytes.

    Raises:
        TypeError: ``data`` is not bytes.
        ValueError: ``data`` is neither PNG nor JPEG (checked by magic number).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if data.startswith(_PNG_MAGIC):
        mime = "image/png"
    elif data.startswith(_JPEG_MAGIC):
        mime = "image/jpeg"
    else:
        raise ValueError("image data is neither PNG nor JPEG")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def png_bytes(image: Image.Image, compress_level: int = 1) -> bytes:
    """Encode a PIL image as PNG (RGB, RGBA and L kept, other modes converted to RGB).

    ``compress_level`` 1 (zlib's fastest): lossless like any level, several times faster to
    encode than Pillow's default 6 for ~10% more bytes, which matters
    because every judge request carries two images encoded on the trainer's CPU.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    if image.mode not in ("RGB", "RGBA", "L"):
        image = image.convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def build_openai_messages(png_a: bytes, png_b: bytes, text: str) -> list[dict[str, Any]]:
    """The judge's chat layout for OpenAI-compatible servers (vLLM, the CPU judge server).

    Args:
        png_a, png_b: encoded images (PNG; JPEG is also recognised).
        text: the question.

    Returns:
        ``[{"role": "user", "content": [{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}, {... image B ...}, {"type": "text", "text": text}]}]``.

    Raises:
        TypeError, ValueError: see :func:`image_data_url`; empty text.
    """
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(png_a)}},
                {"type": "image_url", "image_url": {"url": image_data_url(png_b)}},
                {"type": "text", "text": _check_text(text)},
            ],
        }
    ]



def openai_error_message(exc: Any) -> str:
    """The server's own message of an ``openai.APIStatusError``: ``body.error.message`` (OpenAI,
    newer vLLM) or ``body.message`` (older vLLM), else the client's message."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return str(getattr(exc, "message", exc))


def openai_retries(status: int | None) -> bool:
    """Whether the official ``openai`` client retries a failure with this HTTP status (``None``:
    no response, i.e. a connection error or a timeout): 408, 409, 429 and 5xx."""
    return status is None or status in (408, 409, 429) or status >= 500
