"""The ``template`` teacher (offline, deterministic): reasons phrased from measured differences
between the two panels (:mod:`paco.judge.teachers.image_features`), per consistency dimension
(identity, style, logic). A Yes cites the most similar measurements, a No the most different
ones; a measurement that contradicts the label is phrased as a hedge, and the label is kept."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from PIL import Image

from paco.judge.response import _as_bool
from paco.judge.teachers.base import PairItem, Teacher, TeacherConfigError, TeacherResult
from paco.judge.teachers.image_features import (
    ImageFeatures,
    cached_features,
    contrast_similarity,
    layout_correlation,
    lighting_difference,
    orientation_overlap,
    palette_overlap,
    posterisation_similarity,
    saturation_similarity,
    scene_difference,
    structure_ssim,
    texture_similarity,
)

__all__ = ["Reason", "TemplateTeacher", "template_reasons"]

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


#: ``(measure, dimension, similarity, phrase(label, support), summary)``; ``summary`` is a noun
#: phrase with the numbers, used for hedged reasons.
_Measurement = tuple[str, str, float, Callable[[bool, float], str], str]


# --------------------------------------------------------------------------------------------
# style
# --------------------------------------------------------------------------------------------


def _palette(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    overlap = palette_overlap(fa, fb)
    ha, hb = _hue_name(fa.hue, fa.chroma), _hue_name(fb.hue, fb.chroma)

    def phrase(label: bool, s: float) -> str:
        if label:
            tail = f"both dominated by {ha} tones" if ha == hb else f"with {ha} tones in image A and {hb} tones in image B"
            return (f"Style: the colour palettes {_adv(s, 'closely', 'broadly', 'partly')} match "
                    f"(CIELAB histogram overlap {overlap:.2f}), {tail}.")
        tail = (f"although both lean towards {ha} tones" if ha == hb
                else f"with {ha} tones in image A but {hb} tones in image B")
        return (f"Style: the colour palettes differ {_adv(s, 'markedly', 'noticeably', 'slightly')} "
                f"(CIELAB histogram overlap {overlap:.2f}), {tail}.")

    return ("palette", "style", overlap, phrase, f"colour palette (CIELAB histogram overlap {overlap:.2f})")


def _saturation(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    s_sat = saturation_similarity(fa, fb)
    grey_a, grey_b = fa.chroma < _GREY_CHROMA, fb.chroma < _GREY_CHROMA

    def phrase(label: bool, s: float) -> str:
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

    return ("saturation", "style", s_sat, phrase,
            f"colour saturation (mean HSV saturation {fa.sat:.2f} vs {fb.sat:.2f})")


def _contrast(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    s_con = contrast_similarity(fa, fb)

    def phrase(label: bool, s: float) -> str:
        if label:
            return (f"Style: tonal contrast is {_adv(s, 'very', 'fairly', 'roughly')} similar "
                    f"(lightness std {fa.L_std:.1f} vs {fb.L_std:.1f} on the L* scale).")
        hi, lo = _ab(fa.L_std >= fb.L_std)
        return (f"Style: image {hi} has {_adv(s, 'much', 'clearly', 'slightly')} higher contrast than image {lo} "
                f"(lightness std {max(fa.L_std, fb.L_std):.1f} vs {min(fa.L_std, fb.L_std):.1f}).")

    return ("contrast", "style", s_con, phrase, f"tonal contrast (lightness std {fa.L_std:.1f} vs {fb.L_std:.1f})")


def _texture(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    s_tex = texture_similarity(fa, fb)

    def phrase(label: bool, s: float) -> str:
        nums = (f"edge density {fa.edge_density:.2f} vs {fb.edge_density:.2f}, "
                f"high-frequency energy {fa.hf_energy:.3f} vs {fb.hf_energy:.3f}")
        if label:
            return f"Style: the level of detail and texture is {_adv(s, 'very', 'fairly', 'roughly')} similar ({nums})."
        smooth, sharp = _ab(fa.edge_density + fa.hf_energy < fb.edge_density + fb.hf_energy)
        return (f"Style: image {smooth} is {_adv(s, 'much', 'clearly', 'slightly')} smoother and less detailed "
                f"than image {sharp} ({nums}).")

    return ("texture", "style", s_tex, phrase,
            f"level of detail (edge density {fa.edge_density:.2f} vs {fb.edge_density:.2f})")


def _posterisation(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    s_post = posterisation_similarity(fa, fb)

    def phrase(label: bool, s: float) -> str:
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

    return ("posterisation", "style", s_post, phrase, f"tonal range ({fa.levels} vs {fb.levels} distinct grey levels)")


# --------------------------------------------------------------------------------------------
# identity
# --------------------------------------------------------------------------------------------


def _structure(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    ssim, s_ssim = structure_ssim(fa, fb)

    def phrase(label: bool, s: float) -> str:
        if label:
            return (f"Identity: the fine structures {_adv(s, 'closely', 'largely', 'partly')} line up "
                    f"(greyscale SSIM {ssim:.2f}).")
        neg = _adv(s, "do not", "barely", "only partly")
        return (f"Identity: the fine structures {neg} correspond (greyscale SSIM {ssim:.2f}), "
                f"pointing to a different subject, pose or viewpoint.")

    return ("ssim", "identity", s_ssim, phrase, f"fine structure (greyscale SSIM {ssim:.2f})")


def _layout(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    r, rm, mirrored, s_lay = layout_correlation(fa, fb)

    def phrase(label: bool, s: float) -> str:
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

    return ("layout", "identity", s_lay, phrase, f"coarse layout (16x16 brightness correlation {r:.2f})")


def _orientation(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    o_or, s_or = orientation_overlap(fa, fb)

    def phrase(label: bool, s: float) -> str:
        if label:
            return (f"Identity: the shapes share {_adv(s, 'the same', 'similar', 'partly similar')} dominant edge "
                    f"orientations (orientation histogram overlap {o_or:.2f}).")
        return (f"Identity: the dominant edge orientations differ {_adv(s, 'markedly', 'noticeably', 'slightly')} "
                f"(orientation histogram overlap {o_or:.2f}), suggesting different shapes.")

    return ("orientation", "identity", s_or, phrase, f"edge orientations (orientation histogram overlap {o_or:.2f})")


# --------------------------------------------------------------------------------------------
# logic
# --------------------------------------------------------------------------------------------


def _lighting(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    dL, s_light = lighting_difference(fa, fb)

    def phrase(label: bool, s: float) -> str:
        if label:
            return (f"Logic: the lighting is {_adv(s, 'fully', 'largely', 'roughly')} consistent "
                    f"(mean lightness L* {fa.L_mean:.0f} vs {fb.L_mean:.0f}).")
        dark, bright = _ab(dL < 0)
        return (f"Logic: the lighting changes: image {dark} is {_adv(s, 'much', 'clearly', 'slightly')} darker "
                f"than image {bright} (mean lightness L* {min(fa.L_mean, fb.L_mean):.0f} vs "
                f"{max(fa.L_mean, fb.L_mean):.0f}).")

    return ("lighting", "logic", s_light, phrase, f"lighting (mean lightness L* {fa.L_mean:.0f} vs {fb.L_mean:.0f})")


def _scene(fa: ImageFeatures, fb: ImageFeatures) -> _Measurement:
    dE, s_grid = scene_difference(fa, fb)

    def phrase(label: bool, s: float) -> str:
        if label:
            return (f"Logic: the scene layout is {_adv(s, 'well', 'largely', 'partly')} preserved, with the same "
                    f"colours in the same regions of the frame (mean regional CIELAB difference {dE:.1f}).")
        return (f"Logic: the scene layout changes {_adv(s, 'markedly', 'noticeably', 'slightly')}: corresponding "
                f"regions differ in colour by {dE:.1f} CIELAB units on average.")

    return ("scene", "logic", s_grid, phrase, f"scene layout (mean regional CIELAB difference {dE:.1f})")


#: the measurements, in the order of :func:`paco.judge.teachers.image_features.similarities`.
_MEASUREMENTS: tuple[Callable[[ImageFeatures, ImageFeatures], _Measurement], ...] = (
    _palette, _saturation, _contrast, _texture, _posterisation,  # style
    _structure, _layout, _orientation,                           # identity
    _lighting, _scene,                                           # logic
)


def _measurements(fa: ImageFeatures, fb: ImageFeatures) -> list[_Measurement]:
    """``(measure, dimension, similarity, phrase(label, support), summary)`` for one pair;
    ``summary`` is a noun phrase with the numbers, used for hedged reasons."""
    return [measure(fa, fb) for measure in _MEASUREMENTS]


# --------------------------------------------------------------------------------------------
# selection and the teacher
# --------------------------------------------------------------------------------------------


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
    fa, fb = cached_features(image_a, size), cached_features(image_b, size)
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
        fast, max_reasons, retries: see :class:`~paco.judge.teachers.base.Teacher` (``retries``
            is unused).

    Raises:
        TeacherConfigError: ``size`` < 16.

    Features are computed once per image and cached.
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
