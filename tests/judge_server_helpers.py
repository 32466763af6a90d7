"""What the judge server's tests share: the served name, random test images, one request body."""

from __future__ import annotations

import numpy as np
from PIL import Image

from paco.judge.chat import build_openai_messages, png_bytes

NAME = "paco-reward-test"


def images(n: int, seed: int = 0, size: tuple[int, int] = (64, 64)) -> list[Image.Image]:
    """``n`` random RGB images of ``size`` (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(n)]


def request_body(a: Image.Image, b: Image.Image, text: str = "same?", top: int = 5) -> dict:
    """A ``/v1/chat/completions`` body for the pair ``(a, b)``: one token, ``top`` logprobs."""
    return {"model": NAME, "messages": build_openai_messages(png_bytes(a), png_bytes(b), text),
            "max_tokens": 1, "logprobs": True, "top_logprobs": top}
