"""Chain-of-thought label teachers: justify a KNOWN pair label with 1-3 numbered reasons.

The ``labels`` stage turns each pair ``(image A, image B, label)`` into an SFT example whose
target is ``"Yes. <reason>1. ... 2. ...</reason>"`` (:func:`paco.judge.templates.format_response`).
The paper (§3.1) has GPT-5 write those reasons for human labels; here the reason writer is a
backend behind one interface::

    teacher = make_teacher(params["labels"]["teacher"])
    results = teacher.explain([PairItem(pair_id, image_a, image_b, label, theme), ...])

Backends:

* ``template`` (offline, deterministic; the embedded default): reasons derived from measured
  differences between the two panels (CIELAB colour statistics, saturation, greyscale-ness,
  palette overlap, SSIM, brightness-layout correlation, edge orientations, edge density,
  high-frequency energy, posterisation), phrased per consistency dimension (identity, style,
  logic). A Yes cites the most similar measurements, a No the most different ones.
* ``openai``: any OpenAI-compatible ``/chat/completions`` endpoint, images as PNG data URLs, the
  label stated in the instruction (:data:`paco.judge.templates.TEACHER_COT`).
* ``local``: a transformers Qwen2.5-VL loaded from a directory, generating in-process.

``fast=True`` (any backend): the bare ``"Yes."``/``"No."`` target of PaCo-Reward-7B-Fast
(paper §7); nothing is called.

A label is never changed: a teacher response that does not start with the expected answer is
retried and then recorded as failed (``ok=False`` with the reason in ``error``); every input item
gets exactly one :class:`TeacherResult`, in input order.

Params (the ``labels.teacher`` section, :class:`paco.core.params.TeacherParams`; :func:`make_teacher`)::

    backend: template          # template | openai | local
    fast: false                # bare "Yes."/"No." targets, no teacher call
    max_reasons: 3             # 1..max_reasons reasons per pair
    retries: 2                 # re-asks after a wrong answer; openai: also the client's max_retries
    timeout_s: 60              # per HTTP request (openai)
    template: {size: 128}      # side (px) both panels are resized to before measuring
    openai:
      base_url: null           # e.g. http://127.0.0.1:8000/v1
      model: null              # served model name
      api_key_env: null        # NAME of the environment variable holding the key (never the key)
      max_tokens: 256
      temperature: 0.0
      retry_temperature: 0.7   # temperature of re-asks after a wrong/unparsable answer
      concurrency: 4           # parallel requests
    local:
      model_dir: null          # HF directory (a `models` stage output, e.g. data/models/teacher)
      batch_size: 4
      max_new_tokens: 256
      temperature: 0.7         # sampling temperature of retries (the first try is greedy)
      seed: 0
      device: cpu
"""

from __future__ import annotations

import hashlib
import math
import re
import urllib.parse
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
from PIL import Image

from paco.judge.templates import (
    NO,
    YES,
    _as_bool,
    build_messages,
    build_openai_messages,
    format_response,
    judge_instruction,
    openai_error_message,
    openai_retries,
    parse_response,
    png_bytes,
    sanitize_reason,
    teacher_instruction,
)

__all__ = [
    "PairItem",
    "TeacherResult",
    "Teacher",
    "TemplateTeacher",
    "OpenAITeacher",
    "LocalTeacher",
    "Reason",
    "TeacherConfigError",
    "make_teacher",
    "measure_pair",
    "template_reasons",
    "validate_answer",
]


# --------------------------------------------------------------------------------------------
# data types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairItem:
    """One pair to explain.

    Attributes:
        pair_id: stable id (``pairs.parquet``).
        image_a, image_b: the two panels (PIL, any mode/size).
        label: ``True`` = consistent ("Yes"), ``False`` = not ("No").
        theme: the set's theme (main prompt) or ``None`` (selects the judge question, see
            :func:`paco.judge.templates.judge_instruction`).
        question: the judge question itself, for pairs that do not ask the T2IS question (an
            editing pair's ``edit_pf`` / ``edit_sc``, :mod:`paco.data.edit_pairs`).
    """

    pair_id: str
    image_a: Image.Image
    image_b: Image.Image
    label: bool
    theme: str | None = None
    question: str | None = None  # the judge question when it is not the T2IS one (an editing pair's)


@dataclass
class TeacherResult:
    """The teacher's output for one :class:`PairItem`.

    Attributes:
        pair_id: the item's id.
        ok: ``True`` when ``response`` is a valid, label-consistent target.
        reasons: the reasons (``[]`` for the fast variant and for failures).
        response: the canonical target (:func:`paco.judge.templates.format_response`); ``""`` when
            ``ok`` is ``False``.
        error: why the item failed (contains the endpoint URL / model directory), else ``None``.
        attempts: teacher calls made for this item (``fast``: 0; ``template``: 1).
        raw: the last raw teacher text (``openai``/``local``), for audit.
    """

    pair_id: str
    ok: bool
    reasons: list[str]
    response: str
    error: str | None = None
    attempts: int = 0
    raw: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TeacherConfigError(ValueError):
    """The teacher params section is invalid (unknown key, bad value, missing env var)."""


def _check_batch(batch: Sequence[PairItem]) -> list[PairItem]:
    items = list(batch)
    for i, it in enumerate(items):
        if not isinstance(it, PairItem):
            raise TypeError(f"batch[{i}] is {type(it).__name__}, expected PairItem")
        if not isinstance(it.image_a, Image.Image) or not isinstance(it.image_b, Image.Image):
            raise TypeError(f"batch[{i}] ({it.pair_id}): image_a and image_b must be PIL images")
        _as_bool(it.label)
    return items


def validate_answer(text: str, label: bool, max_reasons: int) -> tuple[list[str], str | None]:
    """Check a teacher response against the known label.

    Returns:
        ``(reasons, None)`` for a response that starts with the expected answer and has at least
        one reason (kept: the first ``max_reasons``, sanitised), else ``([], error message)``.
    """
    got, reasons = parse_response(text)
    snippet = repr(text[:120]) if isinstance(text, str) else repr(text)
    if got is None:
        return [], f"response does not start with 'Yes' or 'No': {snippet}"
    if got != bool(label):
        want = YES if label else NO
        return [], f"response answers {YES if got else NO!r} but the label is {want!r}: {snippet}"
    reasons = [r for r in (sanitize_reason(r) for r in reasons) if r][:max_reasons]
    if not reasons:
        return [], f"response gives no reasons: {snippet}"
    return reasons, None


class Teacher(ABC):
    """Base class: ``explain(batch) -> list[TeacherResult]`` (one per item, same order).

    Args:
        fast: return bare ``"Yes."``/``"No."`` targets without calling the backend.
        max_reasons: the most reasons kept per pair (>= 1).
        retries: extra attempts after the first (>= 0).
    """

    backend: str = "base"

    def __init__(self, *, fast: bool = False, max_reasons: int = 3, retries: int = 2) -> None:
        if int(max_reasons) < 1:
            raise TeacherConfigError(f"max_reasons must be >= 1, got {max_reasons}")
        if int(retries) < 0:
            raise TeacherConfigError(f"retries must be >= 0, got {retries}")
        self.fast = bool(fast)
        self.max_reasons = int(max_reasons)
        self.retries = int(retries)

    def explain(self, batch: Sequence[PairItem]) -> list[TeacherResult]:
        """Explain each pair's known label.

        Args:
            batch: :class:`PairItem` list (may be empty).

        Returns:
            One :class:`TeacherResult` per item, in input order. Failures are results with
            ``ok=False``; nothing is dropped and no label is changed.

        Raises:
            TypeError: an item is not a :class:`PairItem` with PIL images and a bool label.
        """
        items = _check_batch(batch)
        if self.fast:
            return [
                TeacherResult(it.pair_id, True, [], format_response(_as_bool(it.label), None), None, 0)
                for it in items
            ]
        if not items:
            return []
        results = self._explain(items)
        assert len(results) == len(items)
        return results

    @abstractmethod
    def _explain(self, items: list[PairItem]) -> list[TeacherResult]: ...

    def question(self, item: PairItem) -> str:
        """The judge question for ``item``: its own ``question`` (an editing pair's), else the
        T2IS question with the item's theme."""
        return item.question if item.question else judge_instruction(item.theme)

    def prompt(self, item: PairItem) -> str:
        """The teacher's instruction for ``item``: the question plus the known answer."""
        return teacher_instruction(self.question(item), _as_bool(item.label), self.max_reasons)

    def describe(self) -> dict[str, Any]:
        """Provenance for metrics / the ``teacher`` column (no secrets)."""
        return {"backend": self.backend, "fast": self.fast, "max_reasons": self.max_reasons}

    def _ok(self, item: PairItem, reasons: list[str], attempts: int, raw: str | None = None) -> TeacherResult:
        return TeacherResult(item.pair_id, True, reasons, format_response(_as_bool(item.label), reasons),
                             None, attempts, raw)

    @staticmethod
    def _fail(item: PairItem, error: str, attempts: int, raw: str | None = None) -> TeacherResult:
        return TeacherResult(item.pair_id, False, [], "", error, attempts, raw)


# --------------------------------------------------------------------------------------------
# template backend: measurements
# --------------------------------------------------------------------------------------------

_NEG_ZERO = re.compile(r"(?<![\d.])-(0(?:\.0+)?)(?![\d.])")  # "-0.00" -> "0.00"
_HEDGE = 0.1           # below this support a reason is phrased as a hedge
_GREY_CHROMA = 6.0      # mean CIELAB chroma below this reads as "nearly greyscale"
_POSTER_LEVELS = 48     # fewer distinct grey levels than this reads as "posterised"
_HUES = (("red", 30.0), ("orange", 62.0), ("yellow", 95.0), ("green", 140.0), ("cyan", 200.0),
         ("blue", 265.0), ("purple", 305.0), ("magenta", 340.0))


def _hue_name(angle: float, chroma: float) -> str:
    if chroma < _GREY_CHROMA:
        return "neutral grey"
    best, dist = "red", 1e9
    for name, a in _HUES:
        d = abs((angle - a + 180.0) % 360.0 - 180.0)
        if d < dist:
            best, dist = name, d
    return best


@dataclass(frozen=True)
class _Features:
    L_mean: float
    L_std: float
    chroma: float
    sat: float
    hue: float
    palette: np.ndarray      # (144,) normalised CIELAB histogram (4 L x 6 a x 6 b bins)
    grid_lab: np.ndarray     # (4, 4, 3) mean CIELAB per cell of a 4 x 4 grid
    grey64: np.ndarray       # (64, 64) float greyscale in [0, 1]
    grey16: np.ndarray       # (16, 16)
    edge_density: float
    hf_energy: float
    orient: np.ndarray       # (12,) normalised gradient-orientation histogram
    levels: int


_C = np.arange(256, dtype=np.float64) / 255.0
#: sRGB (8-bit) -> linear RGB.
_SRGB_TO_LINEAR = np.where(_C <= 0.04045, _C / 12.92, ((_C + 0.055) / 1.055) ** 2.4).astype(np.float32)
#: linear sRGB -> XYZ (D65), each row divided by the D65 white point (so white maps to 1, 1, 1).
_RGB_TO_XYZN = (np.array([[0.412453, 0.357580, 0.180423],
                          [0.212671, 0.715160, 0.072169],
                          [0.019334, 0.119193, 0.950227]]) / np.array([[0.95047], [1.0], [1.08883]])
                ).astype(np.float32)
_COLOUR_SIDE = 64  # colour statistics are measured at 64 x 64 (4096 pixels is plenty)


def _srgb_to_lab(rgb8: np.ndarray) -> np.ndarray:
    """uint8 sRGB ``(H, W, 3)`` -> CIELAB (D65, 2 degree) float32 ``(H, W, 3)``; agrees with
    ``skimage.color.rgb2lab`` to ~1e-3."""
    xyz = _SRGB_TO_LINEAR[rgb8] @ _RGB_TO_XYZN.T
    eps = (6.0 / 29.0) ** 3
    f = np.where(xyz > eps, np.cbrt(xyz), xyz / (3 * (6.0 / 29.0) ** 2) + 4.0 / 29.0)
    fx, fy, fz = f[..., 0], f[..., 1], f[..., 2]
    return np.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], axis=-1)


_RADIUS: dict[int, np.ndarray] = {}


def _hf_mask(size: int) -> np.ndarray:
    m = _RADIUS.get(size)
    if m is None:
        yy, xx = np.mgrid[:size, :size] - size // 2
        m = _RADIUS[size] = np.hypot(yy, xx) / (size / 2) > 0.25
    return m


def _features(image: Image.Image, size: int) -> _Features:
    """Per-image statistics. Colour at 64 x 64 (box filter), structure and texture at
    ``size`` x ``size``, tonal levels on a nearest-neighbour ``size`` x ``size`` copy."""
    from scipy import ndimage

    img = image.convert("RGB")
    big8 = np.asarray(img.resize((size, size), Image.Resampling.BOX))
    cs = min(_COLOUR_SIDE, size) // 4 * 4
    small8 = np.asarray(img.resize((cs, cs), Image.Resampling.BOX))

    lab = _srgb_to_lab(small8)
    L, A, B = lab[..., 0], lab[..., 1], lab[..., 2]
    chroma = np.hypot(A, B)
    w = float(chroma.sum())
    hue = float(np.degrees(np.arctan2(float((B * chroma).sum()), float((A * chroma).sum()))) % 360.0) if w > 0 else 0.0
    mx = small8.max(axis=-1).astype(np.float32)
    mn = small8.min(axis=-1).astype(np.float32)
    sat = float(np.where(mx > 0, (mx - mn) / np.maximum(mx, 1.0), 0.0).mean())

    lq = np.clip((L / 25.0).astype(int), 0, 3)
    aq = np.clip(((A + 60.0) / 20.0).astype(int), 0, 5)
    bq = np.clip(((B + 60.0) / 20.0).astype(int), 0, 5)
    palette = np.bincount((lq * 36 + aq * 6 + bq).ravel(), minlength=144).astype(np.float64)
    palette /= palette.sum()
    c = cs // 4
    grid_lab = lab.reshape(4, c, 4, c, 3).mean(axis=(1, 3)).astype(np.float64)

    grey = big8.astype(np.float32) @ np.array([0.2125, 0.7154, 0.0721], dtype=np.float32) / 255.0
    g64 = np.asarray(Image.fromarray((grey * 255).astype(np.uint8)).resize((64, 64), Image.Resampling.BOX),
                     dtype=np.float64) / 255.0
    g16 = g64.reshape(16, 4, 16, 4).mean(axis=(1, 3))

    gy = ndimage.sobel(grey, axis=0, mode="reflect") / 4.0
    gx = ndimage.sobel(grey, axis=1, mode="reflect") / 4.0
    mag = np.hypot(gx, gy)
    edge_density = float((mag > 0.1).mean())
    theta = np.mod(np.arctan2(gy, gx), np.pi)
    orient = np.bincount(np.minimum((theta * (12 / np.pi)).astype(int), 11).ravel(),
                         weights=mag.ravel().astype(np.float64), minlength=12)
    orient = orient / orient.sum() if orient.sum() > 0 else np.full(12, 1 / 12)

    spec = np.abs(np.fft.fftshift(np.fft.fft2(grey - grey.mean()))) ** 2
    total = float(spec.sum())
    hf_energy = float(spec[_hf_mask(size)].sum() / total) if total > 0 else 0.0

    near = np.asarray(img.convert("L").resize((size, size), Image.Resampling.NEAREST))
    counts = np.bincount(near.ravel(), minlength=256)
    levels = int((counts >= max(2, near.size // 1000)).sum())

    return _Features(float(L.mean()), float(L.std()), float(chroma.mean()), sat, hue, palette, grid_lab,
                     g64, g16, edge_density, hf_energy, orient, levels)


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    x = x.ravel() - x.mean()
    y = y.ravel() - y.mean()
    d = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / d) if d > 1e-12 else (1.0 if np.allclose(x, y) else 0.0)


@dataclass(frozen=True)
class Reason:
    """One measured reason of the template teacher.

    Attributes:
        measure: measurement name (e.g. ``"palette"``, ``"ssim"``).
        dimension: ``"identity"``, ``"style"`` or ``"logic"``.
        similarity: in [0, 1], 1 = the panels agree on this measurement.
        support: how strongly it supports the label: ``similarity`` for Yes, ``1 - similarity``
            for No.
        text: the phrased reason.
    """

    measure: str
    dimension: str
    similarity: float
    support: float
    text: str


def _adv(support: float, strong: str, moderate: str, weak: str) -> str:
    return strong if support >= 0.75 else moderate if support >= 0.5 else weak


def _ab(a_first: bool) -> tuple[str, str]:
    return ("A", "B") if a_first else ("B", "A")


_Measurement = tuple[str, str, float, Callable[[bool, float], str], str]


def _measurements(fa: _Features, fb: _Features) -> list[_Measurement]:
    """``(measure, dimension, similarity, phrase(label, support), summary)`` for one pair;
    ``summary`` is a noun phrase with the numbers, used for hedged reasons."""
    from skimage.metrics import structural_similarity

    out: list[_Measurement] = []

    # ---- style: palette ------------------------------------------------------------------
    overlap = float(np.minimum(fa.palette, fb.palette).sum())
    ha, hb = _hue_name(fa.hue, fa.chroma), _hue_name(fb.hue, fb.chroma)

    def palette(label: bool, s: float) -> str:
        if label:
            tail = f"both dominated by {ha} tones" if ha == hb else f"with {ha} tones in image A and {hb} tones in image B"
            return (f"Style: the colour palettes {_adv(s, 'closely', 'broadly', 'partly')} match "
                    f"(CIELAB histogram overlap {overlap:.2f}), {tail}.")
        tail = (f"although both lean towards {ha} tones" if ha == hb
                else f"with {ha} tones in image A but {hb} tones in image B")
        return (f"Style: the colour palettes differ {_adv(s, 'markedly', 'noticeably', 'slightly')} "
                f"(CIELAB histogram overlap {overlap:.2f}), {tail}.")

    out.append(("palette", "style", overlap, palette,
                f"colour palette (CIELAB histogram overlap {overlap:.2f})"))

    # ---- style: saturation / greyscale ---------------------------------------------------
    s_sat = min(math.exp(-abs(fa.sat - fb.sat) / 0.12), math.exp(-abs(fa.chroma - fb.chroma) / 15.0))
    grey_a, grey_b = fa.chroma < _GREY_CHROMA, fb.chroma < _GREY_CHROMA

    def saturation(label: bool, s: float) -> str:
        if grey_a and grey_b:
            return (f"Style: both images are nearly greyscale (mean CIELAB chroma {fa.chroma:.1f} and "
                    f"{fb.chroma:.1f}).")
        if grey_a != grey_b:
            m, c = _ab(grey_a)
            cm, cc = (fa.chroma, fb.chroma) if grey_a else (fb.chroma, fa.chroma)
            if label:
                return (f"Style: apart from colour, the rendering is comparable, though image {m} is nearly "
                        f"monochrome (mean chroma {cm:.1f}) and image {c} is in colour (mean chroma {cc:.1f}).")
            return (f"Style: image {m} is almost monochrome (mean CIELAB chroma {cm:.1f}) while image {c} "
                    f"is in full colour (mean chroma {cc:.1f}).")
        if label:
            return (f"Style: colour saturation is {_adv(s, 'very', 'fairly', 'roughly')} similar "
                    f"(mean HSV saturation {fa.sat:.2f} vs {fb.sat:.2f}).")
        hi, lo = _ab(fa.sat >= fb.sat)
        return (f"Style: image {hi} is {_adv(s, 'far', 'clearly', 'slightly')} more saturated than image {lo} "
                f"(mean HSV saturation {max(fa.sat, fb.sat):.2f} vs {min(fa.sat, fb.sat):.2f}).")

    out.append(("saturation", "style", s_sat, saturation,
                f"colour saturation (mean HSV saturation {fa.sat:.2f} vs {fb.sat:.2f})"))

    # ---- style: contrast -----------------------------------------------------------------
    s_con = math.exp(-abs(fa.L_std - fb.L_std) / 8.0)

    def contrast(label: bool, s: float) -> str:
        if label:
            return (f"Style: tonal contrast is {_adv(s, 'very', 'fairly', 'roughly')} similar "
                    f"(lightness std {fa.L_std:.1f} vs {fb.L_std:.1f} on the L* scale).")
        hi, lo = _ab(fa.L_std >= fb.L_std)
        return (f"Style: image {hi} has {_adv(s, 'much', 'clearly', 'slightly')} higher contrast than image {lo} "
                f"(lightness std {max(fa.L_std, fb.L_std):.1f} vs {min(fa.L_std, fb.L_std):.1f}).")

    out.append(("contrast", "style", s_con, contrast,
                f"tonal contrast (lightness std {fa.L_std:.1f} vs {fb.L_std:.1f})"))

    # ---- style: texture / detail ---------------------------------------------------------
    d_tex = max(abs(math.log((fa.edge_density + 0.02) / (fb.edge_density + 0.02))),
                abs(math.log((fa.hf_energy + 0.005) / (fb.hf_energy + 0.005))))
    s_tex = math.exp(-d_tex / 0.6)

    def texture(label: bool, s: float) -> str:
        nums = (f"edge density {fa.edge_density:.2f} vs {fb.edge_density:.2f}, "
                f"high-frequency energy {fa.hf_energy:.3f} vs {fb.hf_energy:.3f}")
        if label:
            return f"Style: the level of detail and texture is {_adv(s, 'very', 'fairly', 'roughly')} similar ({nums})."
        smooth, sharp = _ab(fa.edge_density + fa.hf_energy < fb.edge_density + fb.hf_energy)
        return (f"Style: image {smooth} is {_adv(s, 'much', 'clearly', 'slightly')} smoother and less detailed "
                f"than image {sharp} ({nums}).")

    out.append(("texture", "style", s_tex, texture,
                f"level of detail (edge density {fa.edge_density:.2f} vs {fb.edge_density:.2f})"))

    # ---- style: posterisation ------------------------------------------------------------
    s_post = math.exp(-abs(math.log(max(fa.levels, 1) / max(fb.levels, 1))) / 0.7)

    def posterisation(label: bool, s: float) -> str:
        pa, pb = fa.levels < _POSTER_LEVELS, fb.levels < _POSTER_LEVELS
        if label:
            if pa and pb:
                return (f"Style: both images are posterised to a similar number of tones "
                        f"({fa.levels} and {fb.levels} distinct grey levels).")
            return (f"Style: both images use a continuous tonal range ({fa.levels} and {fb.levels} "
                    f"distinct grey levels).")
        few, many = _ab(fa.levels <= fb.levels)
        nf, nm = min(fa.levels, fb.levels), max(fa.levels, fb.levels)
        if nf < _POSTER_LEVELS:
            return f"Style: image {few} is posterised to {nf} distinct grey levels, versus {nm} in image {many}."
        return f"Style: image {few} uses {_adv(s, 'far', 'clearly', 'slightly')} fewer tones ({nf} vs {nm} grey levels)."

    out.append(("posterisation", "style", s_post, posterisation,
                f"tonal range ({fa.levels} vs {fb.levels} distinct grey levels)"))

    # ---- identity: fine structure (SSIM) -------------------------------------------------
    ssim = float(structural_similarity(fa.grey64, fb.grey64, data_range=1.0))
    s_ssim = float(np.clip(ssim / 0.6, 0.0, 1.0))

    def structure(label: bool, s: float) -> str:
        if label:
            return (f"Identity: the fine structures {_adv(s, 'closely', 'largely', 'partly')} line up "
                    f"(greyscale SSIM {ssim:.2f}).")
        neg = _adv(s, "do not", "barely", "only partly")
        return (f"Identity: the fine structures {neg} correspond (greyscale SSIM {ssim:.2f}), "
                f"pointing to a different subject, pose or viewpoint.")

    out.append(("ssim", "identity", s_ssim, structure, f"fine structure (greyscale SSIM {ssim:.2f})"))

    # ---- identity: coarse layout / mirrored view -----------------------------------------
    r = _corr(fa.grey16, fb.grey16)
    rm = _corr(fa.grey16, fb.grey16[:, ::-1])
    mirrored = rm > 0.5 and rm > r + 0.2

    def layout(label: bool, s: float) -> str:
        if mirrored:
            if label:
                return (f"Identity: image B looks like a horizontally mirrored view of the same content "
                        f"(brightness-layout correlation {rm:.2f} after flipping, {r:.2f} as is).")
            return (f"Identity: image B is arranged as a mirror image of image A rather than the same view "
                    f"(brightness-layout correlation {r:.2f} as is, {rm:.2f} after flipping).")
        if label:
            return (f"Identity: the coarse shape and placement of the main subject "
                    f"{_adv(s, 'closely', 'broadly', 'loosely')} agree (16x16 brightness-layout correlation {r:.2f}).")
        return (f"Identity: the coarse brightness layouts {_adv(s, 'clearly', 'partly', 'slightly')} disagree "
                f"(16x16 correlation {r:.2f}), so the main subject differs in shape or placement.")

    s_lay = max(rm, 0.0) if mirrored else max(r, 0.0)
    out.append(("layout", "identity", float(s_lay), layout,
                f"coarse layout (16x16 brightness correlation {r:.2f})"))

    # ---- identity: edge orientations -----------------------------------------------------
    o_or = float(np.minimum(fa.orient, fb.orient).sum())
    s_or = float(np.clip((o_or - 0.6) / 0.35, 0.0, 1.0))

    def orientation(label: bool, s: float) -> str:
        if label:
            return (f"Identity: the shapes share {_adv(s, 'the same', 'similar', 'partly similar')} dominant edge "
                    f"orientations (orientation histogram overlap {o_or:.2f}).")
        return (f"Identity: the dominant edge orientations differ {_adv(s, 'markedly', 'noticeably', 'slightly')} "
                f"(orientation histogram overlap {o_or:.2f}), suggesting different shapes.")

    out.append(("orientation", "identity", s_or, orientation,
                f"edge orientations (orientation histogram overlap {o_or:.2f})"))

    # ---- logic: lighting -----------------------------------------------------------------
    dL = fa.L_mean - fb.L_mean
    s_light = math.exp(-abs(dL) / 12.0)

    def lighting(label: bool, s: float) -> str:
        if label:
            return (f"Logic: the lighting is {_adv(s, 'fully', 'largely', 'roughly')} consistent "
                    f"(mean lightness L* {fa.L_mean:.0f} vs {fb.L_mean:.0f}).")
        dark, bright = _ab(dL < 0)
        return (f"Logic: the lighting changes: image {dark} is {_adv(s, 'much', 'clearly', 'slightly')} darker "
                f"than image {bright} (mean lightness L* {min(fa.L_mean, fb.L_mean):.0f} vs "
                f"{max(fa.L_mean, fb.L_mean):.0f}).")

    out.append(("lighting", "logic", s_light, lighting,
                f"lighting (mean lightness L* {fa.L_mean:.0f} vs {fb.L_mean:.0f})"))

    # ---- logic: spatial colour layout ----------------------------------------------------
    dE = float(np.linalg.norm(fa.grid_lab - fb.grid_lab, axis=-1).mean())
    s_grid = math.exp(-dE / 18.0)

    def scene(label: bool, s: float) -> str:
        if label:
            return (f"Logic: the scene layout is {_adv(s, 'well', 'largely', 'partly')} preserved, with the same "
                    f"colours in the same regions of the frame (mean regional CIELAB difference {dE:.1f}).")
        return (f"Logic: the scene layout changes {_adv(s, 'markedly', 'noticeably', 'slightly')}: corresponding "
                f"regions differ in colour by {dE:.1f} CIELAB units on average.")

    out.append(("scene", "logic", s_grid, scene,
                f"scene layout (mean regional CIELAB difference {dE:.1f})"))
    return out


def _select(ranked: list[Reason], max_reasons: int, min_support: float = 0.5) -> list[Reason]:
    """Best measurement per dimension first, then the rest; the first is always kept, later
    ones only with ``support >= min_support``."""
    picked: list[Reason] = []
    dims: set[str] = set()
    for r in ranked:
        if r.dimension not in dims:
            picked.append(r)
            dims.add(r.dimension)
    picked += [r for r in ranked if r not in picked]
    keep = ([picked[0]] + [r for r in picked[1:] if r.support >= min_support])[:max_reasons]
    return sorted(keep, key=lambda r: (-r.support, r.measure))


class _FeatureCache:
    """A small LRU of per-image features keyed by (md5 of the pixels, size, mode, side)."""

    def __init__(self, maxsize: int = 512) -> None:
        self.maxsize = maxsize
        self._d: OrderedDict[tuple, _Features] = OrderedDict()

    def get(self, image: Image.Image, size: int) -> _Features:
        key = (hashlib.md5(image.tobytes()).hexdigest(), image.size, image.mode, size)
        f = self._d.get(key)
        if f is None:
            f = _features(image, size)
            self._d[key] = f
            if len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(key)
        return f


_CACHE = _FeatureCache()


def measure_pair(image_a: Image.Image, image_b: Image.Image, size: int = 128) -> dict[str, float]:
    """All similarities in [0, 1] the template teacher uses, by measurement name.

    Keys: ``palette``, ``saturation``, ``contrast``, ``texture``, ``posterisation`` (style),
    ``ssim``, ``layout``, ``orientation`` (identity), ``lighting``, ``scene`` (logic).
    """
    fa, fb = _CACHE.get(image_a, size), _CACHE.get(image_b, size)
    return {m[0]: float(m[2]) for m in _measurements(fa, fb)}


def template_reasons(image_a: Image.Image, image_b: Image.Image, label: bool, max_reasons: int = 3,
                     size: int = 128) -> list[Reason]:
    """The template teacher's reasons for one pair, with their measurements.

    Ranks all measurements by support for ``label`` (similarity for Yes, dissimilarity for No),
    takes the best per consistency dimension, keeps the best overall plus any other with support
    >= 0.5, up to ``max_reasons``. Deterministic (no randomness; ties break by name).

    Returns:
        1..``max_reasons`` :class:`Reason` objects, best first.
    """
    label = _as_bool(label)
    fa, fb = _CACHE.get(image_a, size), _CACHE.get(image_b, size)
    ranked = []
    for name, dim, s, phrase, summary in _measurements(fa, fb):
        s = float(np.clip(s, 0.0, 1.0))
        support = s if label else 1.0 - s
        if support >= _HEDGE:
            text = phrase(label, support)
        elif label:  # the label is not what the measurements suggest: say so, keep the label
            text = (f"{dim.capitalize()}: the {summary} is the closest measured match, so the consistency "
                    f"must rest on content these statistics do not capture.")
        else:
            text = (f"{dim.capitalize()}: the panels are nearly indistinguishable in {summary}, so the "
                    f"inconsistency must lie in details these statistics do not capture.")
        ranked.append(Reason(name, dim, round(s, 6), round(support, 6), _NEG_ZERO.sub(r"\1", text)))
    ranked.sort(key=lambda r: (-r.support, r.measure))
    return _select(ranked, max_reasons)


class TemplateTeacher(Teacher):
    """Offline, deterministic teacher: reasons from measured panel differences.

    Args:
        size: both panels are resized (box filter) to ``size`` x ``size`` before measuring.
        fast, max_reasons, retries: see :class:`Teacher` (``retries`` is unused).

    ~5-10 ms per pair at 128 px on one CPU core (features are cached per image).
    """

    backend = "template"

    def __init__(self, *, size: int = 128, **kw: Any) -> None:
        super().__init__(**kw)
        if int(size) < 16:
            raise TeacherConfigError(f"template.size must be >= 16, got {size}")
        self.size = int(size)

    def _explain(self, items: list[PairItem]) -> list[TeacherResult]:
        out = []
        for it in items:
            try:
                reasons = template_reasons(it.image_a, it.image_b, it.label, self.max_reasons, self.size)
            except Exception as e:  # noqa: BLE001 - recorded per item, never dropped
                out.append(self._fail(it, f"template teacher failed: {type(e).__name__}: {e}", 1))
                continue
            out.append(self._ok(it, [r.text for r in reasons], 1))
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "size": self.size}


# --------------------------------------------------------------------------------------------
# openai backend
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# local backend
# --------------------------------------------------------------------------------------------


class LocalTeacher(Teacher):
    """A transformers VLM (Qwen2.5-VL) generating in-process, same layout and validation.

    Args:
        model_dir: HF directory, loaded with :func:`paco.models.loading.load_judge` on first use.
        model, processor: already-loaded objects (instead of ``model_dir``; tests, reuse).
        batch_size: pairs per ``generate`` call.
        max_new_tokens: generation length.
        temperature: sampling temperature of retries; the first try is greedy.
        seed: seeds the retries' sampling (``seed + attempt``; the global RNG is restored).
        device: torch device for the model and inputs.
        fast, max_reasons, retries: see :class:`Teacher`.

    Raises:
        TeacherConfigError: neither ``model_dir`` nor ``model`` + ``processor`` given.
    """

    backend = "local"

    def __init__(self, *, model_dir: str | None = None, model: Any = None, processor: Any = None,
                 batch_size: int = 4, max_new_tokens: int = 256, temperature: float = 0.7, seed: int = 0,
                 device: str = "cpu", **kw: Any) -> None:
        super().__init__(**kw)
        if model is None or processor is None:
            if not model_dir and not self.fast:
                raise TeacherConfigError("local.model_dir is required (or pass model and processor)")
        self.model_dir = str(model_dir) if model_dir else None
        self._model, self._processor = model, processor
        self.batch_size = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.device = device

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model_dir": self.model_dir, "max_new_tokens": self.max_new_tokens}

    def _load(self) -> tuple[Any, Any]:
        if self._model is None or self._processor is None:
            from paco.models.loading import load_judge

            self._model, self._processor = load_judge(self.model_dir)
            self._model.to(self.device)
        return self._model, self._processor

    def _generate(self, items: list[PairItem], attempt: int) -> list[str]:
        import torch

        model, processor = self._load()
        tok = getattr(processor, "tokenizer", processor)
        old_side = getattr(tok, "padding_side", "right")
        tok.padding_side = "left"
        try:
            texts = [
                processor.apply_chat_template(build_messages(it.image_a, it.image_b, self.prompt(it)),
                                              tokenize=False, add_generation_prompt=True)
                for it in items
            ]
            images = [[it.image_a.convert("RGB"), it.image_b.convert("RGB")] for it in items]
            inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        finally:
            tok.padding_side = old_side
        inputs = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in inputs.items()}
        gen: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        if attempt > 0 and self.temperature > 0:
            gen.update(do_sample=True, temperature=self.temperature)
        else:
            gen.update(do_sample=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed + attempt)
            out = model.generate(**inputs, **gen)
        new = out[:, inputs["input_ids"].shape[1]:]
        return list(processor.batch_decode(new, skip_special_tokens=True))

    def _explain(self, items: list[PairItem]) -> list[TeacherResult]:
        results: dict[int, TeacherResult] = {}
        errors: dict[int, str] = {}
        raws: dict[int, str] = {}
        pending = list(range(len(items)))
        where = self.model_dir or "the given model"
        for attempt in range(self.retries + 1):
            if not pending:
                break
            still: list[int] = []
            for s in range(0, len(pending), self.batch_size):
                chunk = pending[s:s + self.batch_size]
                try:
                    texts = self._generate([items[i] for i in chunk], attempt)
                except Exception as e:  # noqa: BLE001 - a model error fails the chunk, recorded
                    for i in chunk:
                        results[i] = self._fail(items[i], f"local teacher {where}: {type(e).__name__}: {e}",
                                                attempt + 1)
                    continue
                for i, text in zip(chunk, texts):
                    raws[i] = text
                    reasons, err = validate_answer(text, items[i].label, self.max_reasons)
                    if err is None:
                        results[i] = self._ok(items[i], reasons, attempt + 1, text)
                    else:
                        errors[i] = f"{err} (local teacher {where})"
                        still.append(i)
            pending = still
        for i in pending:
            results[i] = self._fail(items[i], f"{errors[i]}; gave up after {self.retries + 1} attempt(s)",
                                    self.retries + 1, raws.get(i))
        return [results[i] for i in range(len(items))]


# --------------------------------------------------------------------------------------------
# factory
# --------------------------------------------------------------------------------------------

def make_teacher(cfg: Any = None, **overrides: Any) -> Teacher:
    """Build a teacher from the ``labels.teacher`` params section.

    Args:
        cfg: a :class:`paco.core.params.TeacherParams`, or a mapping validated by it (missing keys take
            its defaults, the one schema of the section). ``None`` gives the default template
            teacher.
        **overrides: top-level keys overriding ``cfg`` (e.g. ``fast=True``).

    Returns:
        :class:`TemplateTeacher`, :class:`OpenAITeacher` or :class:`LocalTeacher`.

    Raises:
        TeacherConfigError: unknown key (named with its dotted path), unknown backend, or a
            backend-specific error (missing base_url/model/model_dir, unset api_key_env).
    """
    from pydantic import ValidationError

    from paco.core.params import TeacherParams, format_validation_errors

    raw = cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg or {})
    if not isinstance(raw, Mapping):
        raise TeacherConfigError(f"teacher must be a mapping, got {type(cfg).__name__}")
    merged = {**raw, **overrides}
    try:
        c = TeacherParams.model_validate(merged).model_dump()
    except ValidationError as exc:
        raise TeacherConfigError(format_validation_errors(exc, "teacher", merged)) from exc
    common = {"fast": bool(c["fast"]), "max_reasons": int(c["max_reasons"]), "retries": int(c["retries"])}
    backend = c["backend"]
    if backend == "template":
        return TemplateTeacher(size=int(c["template"]["size"]), **common)
    if backend == "openai":
        o = c["openai"]
        return OpenAITeacher(base_url=o["base_url"], model=o["model"], api_key_env=o["api_key_env"],
                             max_tokens=o["max_tokens"], temperature=o["temperature"],
                             retry_temperature=o["retry_temperature"], concurrency=o["concurrency"],
                             timeout_s=c["timeout_s"], **common)
    if backend == "local":
        lo = c["local"]
        return LocalTeacher(model_dir=lo["model_dir"], batch_size=lo["batch_size"],
                            max_new_tokens=lo["max_new_tokens"], temperature=lo["temperature"], seed=lo["seed"],
                            device=lo["device"], **common)
    raise TeacherConfigError(f"teacher.backend: unknown backend {backend!r} (template | openai | local)")
