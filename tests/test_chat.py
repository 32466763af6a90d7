"""paco.judge.chat: the judge's chat layout (transformers and OpenAI formats) and image data URLs."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from paco.judge.chat import build_messages, build_openai_messages, image_data_url, png_bytes


def _img(seed: int, size=(24, 16)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_build_messages_layout():
    a, b = _img(0), _img(1)
    msgs = build_messages(a, b, "Question?")
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": a},
                {"type": "image", "image": b},
                {"type": "text", "text": "Question?"},
            ],
        }
    ]
    assert msgs[0]["content"][0]["image"] is a and msgs[0]["content"][1]["image"] is b
    assert build_messages(a, b, "Q") is not build_messages(a, b, "Q")
    with pytest.raises(ValueError):
        build_messages(a, None, "Q")
    with pytest.raises(ValueError):
        build_messages(a, b, "")


def test_build_openai_messages_layout():
    a, b = _img(0), _img(1)
    pa, pb = png_bytes(a), png_bytes(b)
    msgs = build_openai_messages(pa, pb, "Question?")
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    content = msgs[0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
    assert content[2]["text"] == "Question?"
    for c, raw, img in zip(content[:2], (pa, pb), (a, b)):
        url = c["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        data = base64.b64decode(url.split(",", 1)[1])
        assert data == raw
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), np.asarray(img))
    buf = io.BytesIO()
    a.save(buf, format="JPEG")
    assert image_data_url(buf.getvalue()).startswith("data:image/jpeg;base64,")
    with pytest.raises(ValueError):
        build_openai_messages(b"not an image", pb, "Q")
    with pytest.raises(TypeError):
        build_openai_messages(a, pb, "Q")
