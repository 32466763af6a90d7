"""The ``photos`` composite source: grids of views of real photographs with graded drift.

This is the embedded default's real-image data (docs/architecture.md §10). Every photograph ships inside an
installed wheel (``skimage.data`` and matplotlib's ``grace_hopper.jpg``), so nothing is
downloaded.

Semantics
---------
Each prompt has a *subject* photograph. A panel is a **mild view** of its subject: a random crop
covering ``params.crop_scale`` of the photo's area (with the cell's aspect ratio), an optional
horizontal flip, and a mild colour jitter (brightness, contrast, saturation factors in
``1 +- params.color_jitter``). Views of one subject are *consistent*.

On top, each panel has a drift **level** ``L`` in ``0..params.max_level``, ``t = L / max_level``.
Per prompt a *drift subject* (another photo) and a *drift style* (one of :data:`DRIFT_STYLES`)
are fixed. A panel at level ``L`` is its view

* pushed toward the drift style with strength ``a(t) = sqrt(t)``, and
* progressively replaced by a view of the drift subject: a smooth random blob mask (fixed per
  prompt) whose covered area grows with ``r(t) = clip((t - 0.2) / 0.8, 0, 1)``.

``t = 0`` is the plain view; ``t = 1`` is a fully styled view of the drift subject. Panels of one
prompt at the same level are mutually consistent; the further apart two levels, the less
consistent the panels: the ground-truth ranking of candidates against a reference panel is by
``|L_ref - L_cand|`` ascending.

Level assignment (Latin square)
-------------------------------
A prompt has ``N = len(params.levels)`` composites (seeds ``k = 0..N-1``). Panel ``q``
(row-major) of composite ``k`` gets level ``params.levels[(k + perm[q]) % N]`` with ``perm`` a
per-prompt random permutation of ``range(rows * cols)``: at any fixed panel position the ``N``
composites take all ``N`` levels exactly once.

Grid rendering
--------------
A composite is ``params.size`` x ``params.size`` pixels with realistic artefacts: an outer border
of random width in ``params.border_px`` (inclusive range, possibly 0) with a random light or dark
colour; gutters between cells of random width in ``params.gutter_px`` (possibly 0: panels abut)
coloured white, black or grey; and uneven cells: every internal cut is moved by up to
``params.cell_jitter`` times the inner (border-free) extent along its axis (capped at 35% of a
nominal cell so no cell collapses). The TRUE panel boxes ``(x0, y0, x1, y1)`` (x1, y1 exclusive,
row-major) are recorded.

Determinism
-----------
All randomness of composite ``k`` of prompt ``p`` comes from
``numpy.random.default_rng([seed, stable_hash(p), k])`` and the per-prompt choices (drift
subject, style, permutation, blob mask) from ``default_rng([seed, stable_hash(p), PROMPT_STREAM])``,
so the output for a prompt does not depend on the other prompts or on row order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image, ImageFilter

from paco.core.io import encode_image
from paco.core.seeding import stable_hash
from paco.core.params import PhotosParams

__all__ = [
    "DRIFT_STYLES",
    "SUBJECTS",
    "COMPOSITE_COLUMNS",
    "load_subject",
    "render_composites",
    "stable_hash",
    "style_strength",
    "replacement_fraction",
]

#: subject name -> where the photo comes from (``skimage.data`` function or matplotlib sample).
SUBJECTS: dict[str, str] = {
    "astronaut": "skimage:astronaut",
    "cat": "skimage:chelsea",
    "coffee": "skimage:coffee",
    "rocket": "skimage:rocket",
    "grace_hopper": "matplotlib:grace_hopper.jpg",
    "motorcycle": "skimage:stereo_motorcycle",  # left image of the stereo pair
    "galaxies": "skimage:hubble_deep_field",
    "tissue": "skimage:immunohistochemistry",
    "cameraman": "skimage:camera",
    "horse": "skimage:horse",  # binary silhouette
    "coins": "skimage:coins",
    "clock": "skimage:clock",
    "moon": "skimage:moon",
    "brick": "skimage:brick",
    "grass": "skimage:grass",
    "gravel": "skimage:gravel",
}

#: subjects whose source photo is greyscale (hue rotation is not used as their drift style).
GREYSCALE_SUBJECTS = frozenset(
    {"cameraman", "horse", "coins", "clock", "moon", "brick", "grass", "gravel"}
)

#: the named drift styles (see ``_STYLE_FUNCS``).
DRIFT_STYLES: tuple[str, ...] = (
    "mono_posterise",  # greyscale, posterised to 4 grey levels
    "hue_rotate",  # hue rotation by 120-180 degrees (colour subjects only)
    "sepia",  # sepia toning
    "blur",  # heavy Gaussian blur (radius up to 5% of the panel's short side)
    "sketch",  # edge-magnitude pencil sketch over light shading
    "duotone",  # luminance mapped onto a random dark -> light colour ramp
)

#: output columns of :func:`render_composites`.
COMPOSITE_COLUMNS = [
    "composite_id", "prompt_id", "seed", "image", "height", "width",
    "panel_bboxes", "panel_levels", "subject", "drift_subject", "drift_style",
]

#: third SeedSequence word of the per-prompt stream (composite streams use k = 0..N-1).
PROMPT_STREAM = 2**31 - 1

_MIN_CELL = 8  # px: smallest cell the renderer will lay out
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def style_strength(t: float) -> float:
    """Drift-style strength ``a(t) = sqrt(t)`` for ``t`` in [0, 1] (0 at t=0, 1 at t=1).

    The square root makes the first levels clearly visible: with the default levels
    ``[0, 1, 3, 7] / 7`` the strengths are 0, 0.38, 0.65, 1.
    """
    return float(np.clip(t, 0.0, 1.0)) ** 0.5


def replacement_fraction(t: float) -> float:
    """Area fraction replaced by the drift subject, ``clip((t - 0.2) / 0.8, 0, 1)``."""
    return float(np.clip((t - 0.2) / 0.8, 0.0, 1.0))


@functools.lru_cache(maxsize=None)
def _subject_image(name: str) -> Image.Image:
    if name not in SUBJECTS:
        raise ValueError(f"unknown subject {name!r}; valid subjects: {sorted(SUBJECTS)}")
    kind, ref = SUBJECTS[name].split(":", 1)
    if kind == "matplotlib":
        from matplotlib import cbook

        with Image.open(cbook.get_sample_data(ref, asfileobj=False)) as im:
            return im.convert("RGB")
    import skimage.data

    arr = getattr(skimage.data, ref)()
    if isinstance(arr, tuple):  # stereo_motorcycle -> (left, right, disparity)
        arr = arr[0]
    arr = np.asarray(arr)
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    elif arr.dtype != np.uint8:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    return Image.fromarray(np.ascontiguousarray(arr[:, :, :3]), mode="RGB")


def load_subject(name: str) -> Image.Image:
    """The subject photograph ``name`` (a key of :data:`SUBJECTS`) as an RGB PIL image.

    Greyscale and binary sources are converted to RGB. Loads are cached per process; a copy is
    returned, so callers may modify it.

    Raises:
        ValueError: ``name`` is not a known subject (the message lists the valid ones).
    """
    return _subject_image(name).copy()


# --------------------------------------------------------------------------------------------
# views, styles, drift
# --------------------------------------------------------------------------------------------


def _view(src: Image.Image, w: int, h: int, rng: np.random.Generator, crop_scale: tuple[float, float],
          flip: bool) -> np.ndarray:
    """A random crop of ``src`` (area fraction in ``crop_scale``, aspect ``w/h``) resized to
    ``(h, w, 3)`` float32 in [0, 1]."""
    sw, sh = src.size
    scale = rng.uniform(*crop_scale)
    aspect = w / h
    cw = math.sqrt(scale * sw * sh * aspect)
    ch = cw / aspect
    shrink = min(1.0, sw / cw, sh / ch)
    cw, ch = cw * shrink, ch * shrink
    x0 = rng.uniform(0.0, max(sw - cw, 0.0))
    y0 = rng.uniform(0.0, max(sh - ch, 0.0))
    im = src.resize((w, h), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    arr = np.asarray(im, dtype=np.float32) * (1.0 / 255.0)
    return arr[:, ::-1] if flip else arr


def _grey(x: np.ndarray) -> np.ndarray:
    return x @ _LUMA


def _lerp(x: np.ndarray, y: np.ndarray, a: float) -> np.ndarray:
    return x + a * (y - x)


def _style_mono_posterise(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    g = _grey(x)
    post = np.minimum(np.floor(g * 4.0), 3.0) / 3.0
    return _lerp(x, np.repeat(post[..., None], 3, axis=2), a)


def _style_hue_rotate(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    # rotate the chroma plane of YIQ by a * angle (a linear map, so it is exact and fast)
    theta = a * sp["hue_angle"]
    c, s = math.cos(theta), math.sin(theta)
    to_yiq = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    rot = np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    m = (np.linalg.inv(to_yiq) @ rot @ to_yiq).astype(np.float32)
    return x @ m.T


def _style_sepia(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    m = np.array([[0.393, 0.769, 0.189], [0.349, 0.686, 0.168], [0.272, 0.534, 0.131]], dtype=np.float32)
    return _lerp(x, np.minimum(x @ m.T, 1.0), a)


def _style_blur(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    radius = a * 0.05 * min(x.shape[:2])
    if radius < 0.05:
        return x
    im = Image.fromarray(np.clip(x * 255.0 + 0.5, 0, 255).astype(np.uint8))
    return np.asarray(im.filter(ImageFilter.GaussianBlur(radius)), dtype=np.float32) * (1.0 / 255.0)


def _style_sketch(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    g = _grey(x)
    gx = np.zeros_like(g)
    gy = np.zeros_like(g)
    gx[:, 1:-1] = g[:, 2:] - g[:, :-2]
    gy[1:-1, :] = g[2:, :] - g[:-2, :]
    mag = np.sqrt(gx * gx + gy * gy)
    k = 3.0 * float(mag.mean()) + 1e-3
    # pencil lines over light shading (paper is not perfectly flat: 0.7 + 0.3 * grey)
    sketch = np.clip(1.0 - mag / k, 0.0, 1.0) ** 1.5 * (0.7 + 0.3 * g)
    return _lerp(x, np.repeat(sketch[..., None], 3, axis=2), a)


def _style_duotone(x: np.ndarray, a: float, sp: dict[str, Any]) -> np.ndarray:
    g = _grey(x)[..., None]
    lo, hi = sp["duo_lo"], sp["duo_hi"]
    return _lerp(x, lo + g * (hi - lo), a)


_STYLE_FUNCS: dict[str, Callable[[np.ndarray, float, dict[str, Any]], np.ndarray]] = {
    "mono_posterise": _style_mono_posterise,
    "hue_rotate": _style_hue_rotate,
    "sepia": _style_sepia,
    "blur": _style_blur,
    "sketch": _style_sketch,
    "duotone": _style_duotone,
}
assert set(_STYLE_FUNCS) == set(DRIFT_STYLES)


def _color_jitter(x: np.ndarray, b: float, c: float, s: float) -> np.ndarray:
    mean = float(_grey(x).mean())
    x = (x - mean) * c + mean
    x = x * b
    g = _grey(x)[..., None]
    return g + (x - g) * s


def _hsv_colour(h: float, s: float, v: float) -> np.ndarray:
    import colorsys

    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32)


# --------------------------------------------------------------------------------------------
# per-prompt plan
# --------------------------------------------------------------------------------------------


def _resolve_subject(prompt_id: str, subject: Any) -> str:
    names = list(SUBJECTS)
    if subject is None or (isinstance(subject, float) and math.isnan(subject)) or subject is pd.NA:
        return names[stable_hash(prompt_id) % len(names)]
    subject = str(subject)
    if subject not in SUBJECTS:
        raise ValueError(
            f"prompt {prompt_id!r}: unknown subject {subject!r}; valid subjects: {sorted(SUBJECTS)}"
        )
    return subject


def _prompt_plan(prompt_id: str, subject: str, n_panels: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, stable_hash(prompt_id), PROMPT_STREAM])
    others = [s for s in SUBJECTS if s != subject]
    drift_subject = others[int(rng.integers(len(others)))]
    styles = [s for s in DRIFT_STYLES if not (s == "hue_rotate" and subject in GREYSCALE_SUBJECTS)]
    drift_style = styles[int(rng.integers(len(styles)))]
    perm = rng.permutation(n_panels)
    hue = rng.random()
    style_params = {
        "hue_angle": float(rng.choice([-1.0, 1.0]) * rng.uniform(2 * math.pi / 3, math.pi)),
        "duo_lo": _hsv_colour(hue, 0.9, 0.25),
        "duo_hi": _hsv_colour(hue + rng.uniform(0.08, 0.2), 0.35, 1.0),
    }
    # smooth blob field in [0, 1] with (approximately) uniform marginal: the replacement mask at
    # fraction r covers about r of a panel and grows monotonically with r
    coarse = Image.fromarray(rng.random((5, 5)).astype(np.float32), mode="F")
    fine = np.asarray(coarse.resize((64, 64), Image.Resampling.BICUBIC), dtype=np.float64)
    ranks = np.empty(fine.size)
    ranks[np.argsort(fine, axis=None, kind="stable")] = np.arange(fine.size)
    field = (ranks / (fine.size - 1)).reshape(fine.shape).astype(np.float32)
    return {
        "drift_subject": drift_subject,
        "drift_style": drift_style,
        "perm": perm,
        "style_params": style_params,
        "field": Image.fromarray(field, mode="F"),
    }


# --------------------------------------------------------------------------------------------
# grid layout
# --------------------------------------------------------------------------------------------


def _cuts(extent: int, n: int, gutter: int, jitter: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Cell spans ``[(start, end), ...]`` along one axis of an inner extent (offsets from 0)."""
    usable = extent - (n - 1) * gutter
    nominal = usable / n
    amp = min(jitter * extent, 0.35 * nominal)
    offsets = rng.uniform(-amp, amp, size=max(n - 1, 0))
    bounds = [0] + [int(round(i * nominal + offsets[i - 1])) for i in range(1, n)] + [usable]
    for i in range(1, n):  # keep every cell at least _MIN_CELL wide (only bites on tiny grids)
        bounds[i] = max(bounds[i], bounds[i - 1] + _MIN_CELL)
    for i in range(n - 1, 0, -1):
        bounds[i] = min(bounds[i], bounds[i + 1] - _MIN_CELL)
    return [(bounds[i] + i * gutter, bounds[i + 1] + i * gutter) for i in range(n)]


def _layout(size: int, rows: int, cols: int, params: PhotosParams, rng: np.random.Generator
            ) -> tuple[list[tuple[int, int, int, int]], np.ndarray, np.ndarray, int, int]:
    border = int(rng.integers(params.border_px[0], params.border_px[1] + 1))
    if rng.random() < 0.5:  # light border
        border_rgb = np.clip(rng.uniform(215, 255) + rng.uniform(-6, 6, 3), 0, 255)
    else:  # dark border
        border_rgb = np.clip(rng.uniform(0, 40) + rng.uniform(-6, 6, 3), 0, 255)
    gutter = int(rng.integers(params.gutter_px[0], params.gutter_px[1] + 1))
    kind = int(rng.integers(3))
    gutter_rgb = np.full(3, (255.0, 0.0, rng.uniform(90, 170))[kind])
    inner = size - 2 * border
    need_x = cols * _MIN_CELL + (cols - 1) * gutter
    need_y = rows * _MIN_CELL + (rows - 1) * gutter
    if inner < max(need_x, need_y):
        raise ValueError(
            f"a {rows}x{cols} grid does not fit a {size}px composite with a {border}px border and "
            f"{gutter}px gutters (cells need >= {_MIN_CELL}px)"
        )
    xs = _cuts(inner, cols, gutter, params.cell_jitter, rng)
    ys = _cuts(inner, rows, gutter, params.cell_jitter, rng)
    boxes = [
        (border + x0, border + y0, border + x1, border + y1) for (y0, y1) in ys for (x0, x1) in xs
    ]
    return boxes, border_rgb.astype(np.uint8), gutter_rgb.astype(np.uint8), border, gutter


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def _render_panel(w: int, h: int, level: int, params: PhotosParams, plan: dict[str, Any],
                  subject_im: Image.Image, drift_im: Image.Image, rng: np.random.Generator) -> np.ndarray:
    # draw every random number in a fixed order whatever the level, so streams stay aligned
    flip = bool(rng.random() < 0.5)
    view = _view(subject_im, w, h, rng, params.crop_scale, flip)
    drift_flip = bool(rng.random() < 0.5)
    cj = params.color_jitter
    b, c, s = (1.0 + rng.uniform(-cj, cj) for _ in range(3))
    t = level / params.max_level
    r = replacement_fraction(t)
    x = view
    if r > 0.0:
        dview = _view(drift_im, w, h, rng, params.crop_scale, drift_flip)
        soft = 0.15
        f = np.asarray(plan["field"].resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
        mask = np.clip((r * (1.0 + soft) - f) / soft, 0.0, 1.0)[..., None]
        x = x + mask * (dview - x)
    a = style_strength(t)
    if a > 0.0:
        x = _STYLE_FUNCS[plan["drift_style"]](x, a, plan["style_params"])
    x = _color_jitter(x, b, c, s)
    return np.clip(x * 255.0 + 0.5, 0.0, 255.0).astype(np.uint8)


def _render_composite(prompt_id: str, k: int, rows: int, cols: int, subject: str, plan: dict[str, Any],
                      params: PhotosParams, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, stable_hash(prompt_id), k])
    size = params.size
    boxes, border_rgb, gutter_rgb, border, _gutter = _layout(size, rows, cols, params, rng)
    canvas = np.empty((size, size, 3), dtype=np.uint8)
    canvas[:] = border_rgb
    canvas[border:size - border, border:size - border] = gutter_rgb
    n = len(params.levels)
    levels = [int(params.levels[(k + int(plan["perm"][q])) % n]) for q in range(rows * cols)]
    subject_im = _subject_image(subject)
    drift_im = _subject_image(plan["drift_subject"])
    for (x0, y0, x1, y1), level in zip(boxes, levels, strict=True):
        canvas[y0:y1, x0:x1] = _render_panel(x1 - x0, y1 - y0, level, params, plan, subject_im, drift_im, rng)
    cid = f"{prompt_id}-s{k}"
    return {
        "composite_id": cid,
        "prompt_id": prompt_id,
        "seed": k,
        "image": encode_image(Image.fromarray(canvas, mode="RGB"), path=f"{cid}.png"),
        "height": size,
        "width": size,
        "panel_bboxes": [[int(v) for v in box] for box in boxes],
        "panel_levels": levels,
        "subject": subject,
        "drift_subject": plan["drift_subject"],
        "drift_style": plan["drift_style"],
    }


def render_composites(prompts: pd.DataFrame, params: PhotosParams, seeds_per_prompt: int, seed: int
                      ) -> pd.DataFrame:
    """Render ``seeds_per_prompt`` composites per prompt from real photographs.

    Args:
        prompts: one row per prompt with columns ``prompt_id`` (str, unique), ``rows``, ``cols``
            (ints >= 1) and optionally ``subject`` (a key of :data:`SUBJECTS`, or None/NaN to
            pick one deterministically from a stable hash of ``prompt_id``).
        params: the ``composites.photos`` parameters.
        seeds_per_prompt: composites per prompt; must equal ``len(params.levels)`` (one level
            per composite and panel position: the Latin square).
        seed: the stage seed (a non-negative int).

    Returns:
        One row per composite, prompts in input order and seeds ``k = 0..N-1``, with columns
        :data:`COMPOSITE_COLUMNS`: ``composite_id`` (``f"{prompt_id}-s{k}"``), ``prompt_id``,
        ``seed`` (``k``), ``image`` (a PNG image cell), ``height``, ``width`` (px),
        ``panel_bboxes`` (row-major ``[x0, y0, x1, y1]``, x1/y1 exclusive), ``panel_levels``
        (drift level per panel), ``subject``, ``drift_subject``, ``drift_style``.

    Raises:
        ValueError: a negative seed, ``seeds_per_prompt != len(params.levels)``, a missing
            column, a duplicate
            prompt_id, a bad layout (rows/cols < 1 or cells that do not fit ``params.size``),
            or an unknown subject (the message names the prompt_id and the valid subjects).
    """
    if int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    seed = int(seed)
    if seeds_per_prompt != len(params.levels):
        raise ValueError(
            f"seeds_per_prompt={seeds_per_prompt} but photos.levels has {len(params.levels)} levels "
            f"({params.levels}): each composite of a prompt needs its own level"
        )
    missing = [c for c in ("prompt_id", "rows", "cols") if c not in prompts.columns]
    if missing:
        raise ValueError(f"prompts lack column(s) {missing}; have {list(prompts.columns)}")
    dup = prompts["prompt_id"][prompts["prompt_id"].duplicated()].unique().tolist()
    if dup:
        raise ValueError(f"duplicate prompt_id(s): {dup[:5]}")
    subjects = prompts["subject"] if "subject" in prompts.columns else [None] * len(prompts)

    # validate everything before rendering anything
    jobs = []
    for pid, rows, cols, subj in zip(prompts["prompt_id"], prompts["rows"], prompts["cols"], subjects):
        pid = str(pid)
        rows, cols = int(rows), int(cols)
        if rows < 1 or cols < 1:
            raise ValueError(f"prompt {pid!r}: rows and cols must be >= 1, got {rows}x{cols}")
        jobs.append((pid, rows, cols, _resolve_subject(pid, subj)))

    records = []
    for pid, rows, cols, subject in jobs:
        plan = _prompt_plan(pid, subject, rows * cols, seed)
        for k in range(seeds_per_prompt):
            records.append(_render_composite(pid, k, rows, cols, subject, plan, params, seed))
    return pd.DataFrame.from_records(records, columns=COMPOSITE_COLUMNS)
