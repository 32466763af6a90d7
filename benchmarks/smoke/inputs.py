"""The GPU smoke run's inputs (``benchmarks/gpu_smoke.py``): synthetic panel pairs of random
textures, an ``sft.parquet``-shaped table of them and a ``prompts.parquet``-shaped table of 2x2
T2IS grids; seeded, no files read."""

from __future__ import annotations

from typing import Any

import numpy as np


def _texture(rng: np.random.Generator, size: int) -> np.ndarray:
    from PIL import Image

    noise = rng.normal(0.0, 1.0, (max(2, size // 8), max(2, size // 8), 3))
    tint = rng.uniform(0.2, 0.9, 3)
    img = Image.fromarray(np.uint8(np.clip(128 + 60 * noise, 0, 255))).resize((2 * size, 2 * size), Image.BILINEAR)
    x = np.asarray(img, np.float32) / 255.0
    return np.uint8(np.clip((0.5 * x + 0.5 * tint) * 255, 0, 255))


def _view(rng: np.random.Generator, arr: np.ndarray, size: int):
    from PIL import Image

    s = int(rng.uniform(0.7, 0.95) * arr.shape[0])
    y0, x0 = rng.integers(0, arr.shape[0] - s + 1, size=2)
    return Image.fromarray(arr[y0:y0 + s, x0:x0 + s]).resize((size, size), Image.BILINEAR)


def pair_images(n: int, size: int, seed: int = 0) -> list[tuple[Any, Any, bool]]:
    """``n`` panel pairs ``(A, B, label)`` of ``size`` px: even ``i`` two crops of one random
    texture (a consistent pair, label True), odd ``i`` crops of two textures (False)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = _texture(rng, size)
        b = a if i % 2 == 0 else _texture(rng, size)
        out.append((_view(rng, a, size), _view(rng, b, size), i % 2 == 0))
    return out


def sft_table(n_train: int, n_test: int, size: int, seed: int = 0):
    """An ``sft.parquet``-shaped table (the reasons stage's columns) of synthetic pairs with the
    T2IS theme instruction (the preset's ``reasons.instruction: theme``)."""
    import pandas as pd

    from paco.core.io import encode_image
    from paco.core.templates import judge_instruction
    from paco.judge.response import format_response

    rows = []
    for k, (a, b, label) in enumerate(pair_images(n_train + n_test, size, seed)):
        split = "train" if k < n_train else "test"
        reasons = ["the textures and colours match."] if label else ["the colour palettes differ."]
        rows.append({"pair_id": f"{split}-{k:04d}", "instance_id": f"inst-{k // 2}", "prompt_id": f"p{k % 4}",
                     "split": split, "instruction": judge_instruction("a textured wall"),
                     "image_a": encode_image(a), "image_b": encode_image(b), "label": label, "reasons": reasons,
                     "response": format_response(label, reasons), "teacher": "synthetic", "status": "ok",
                     "error": None})
    return pd.DataFrame(rows)


def prompts_table(n_train: int, n_test: int):
    """A ``prompts.parquet``-shaped table: 2x2 T2IS grids of 1024 x 1024 px."""
    import pandas as pd

    subjects = ["a red fox", "a lighthouse", "a paper boat", "a snowy cabin", "a teapot", "a bicycle"]
    rows = []
    for i in range(n_train + n_test):
        s = subjects[i % len(subjects)]
        panels = [f"{s} at dawn.", f"{s} at noon.", f"{s} at dusk.", f"{s} at night."]
        rows.append({"prompt_id": f"p{i:02d}", "split": "train" if i < n_train else "test",
                     "prompt": f"FOUR-PANEL Images with a 2x2 grid layout of {s} through one day. "
                               f"[TOP]-[LEFT]:{panels[0]} [TOP]-[RIGHT]:{panels[1]} "
                               f"[BOTTOM]-[LEFT]:{panels[2]} [BOTTOM]-[RIGHT]:{panels[3]}",
                     "global_prompt": f"{s} through one day", "rows": 2, "cols": 2, "panel_prompts": panels,
                     "height": 1024, "width": 1024, "category": "smoke", "criteria": []})
    return pd.DataFrame(rows)
