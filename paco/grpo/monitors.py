"""Reward-hacking monitors: image measurements that do not ask the judge, computed on every GRPO
evaluation, on the final samples and in the benchmark tables, so that a reward bought with
artifacts shows beside the reward itself.

==================  =============================================================================
monitor             what it measures (per sample)
==================  =============================================================================
grid_artifact       the share of the fine detail explained by the pixel's position within the
                    policy's latent patch grid (VAE stride x transformer patch size: 16 px for
                    FLUX.1 and Qwen-Image and for the embedded default's tiny models):
                    :func:`grid_artifact_score`. About 0 without a grid texture, 1 for a pure one.
grid_artifact_2px   the same at a period of 2 px (pixel-level checkerboards).
high_frequency      share of spectral energy above a quarter of Nyquist: :func:`high_frequency_share`.
panel_similarity    text to image sets: mean SSIM over a composite's panel pairs
                    (:func:`panel_similarity`): near-identical panels score near 1.
input_ssim          editing: SSIM of the edit to its input (:func:`input_ssim`): an edit that
                    drifts from the input scores lower.
==================  =============================================================================

Every monitor reads the greyscale panel (PIL's ``L``: ITU-R 601-2 luma, divided by 255). None of
the peers' trainers (flow_grpo, DanceGRPO, MixGRPO, Flow-Factory, PaCo-RL's own) ships such a
monitor, though their users report grid patterns after low-resolution sampling and rewards
hacked late in the denoising, and paper Table 5 describes consistency rewards pushing towards
near-identical panels.

:func:`sample_monitors` computes every monitor that applies to a subtask's samples;
:func:`monitor_warnings` compares a set of means with a reference (the first evaluation, or the
base samples) against :data:`THRESHOLDS`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

#: the monitors, in report order
MONITORS = ("grid_artifact", "grid_artifact_2px", "high_frequency", "panel_similarity", "input_ssim")

#: how far a monitor's mean may move from its reference before :func:`monitor_warnings` names it:
#: ``(direction, bound)``; ``+1``: a rise beyond ``bound`` warns, ``-1``: a fall. Measured on the
#: embedded default's final samples (base against the LoRAs trained without guards, paired by item
#: and seed): the base's grid artifact score is about 0.002-0.018 with a spread over samples of
#: about 0.01, the Kontext LoRA's grid texture lifts it by 0.10-0.13, the Qwen-Image-Edit LoRA's
#: by 0.01-0.02; the
#: high-frequency share is 0.005-0.02 and moves by about 0.001; an edit's SSIM to its input is
#: about 0.4 and the Kontext LoRA's falls by about 0.09. So: the grid scores and the
#: high-frequency share warn on a rise of 0.01 and 0.005, panel similarity (text to image sets)
#: on a rise of 0.05 SSIM, input SSIM on a fall of 0.02 (the embedded default's goal: an edit no
#: further from its input than the base's by more than 0.02).
THRESHOLDS: dict[str, tuple[int, float]] = {
    "grid_artifact": (+1, 0.01),
    "grid_artifact_2px": (+1, 0.01),
    "high_frequency": (+1, 0.005),
    "panel_similarity": (+1, 0.05),
    "input_ssim": (-1, 0.02),
}

#: the lowest cut-off of :func:`high_frequency_share`, in units of Nyquist (0.5 cycles / px)
HIGH_FREQUENCY_CUTOFF = 0.25


def greyscale(image: Image.Image) -> np.ndarray:
    """``(H, W)`` float64 in [0, 1]: PIL's ``L`` conversion (ITU-R 601-2 luma,
    ``L = R * 299/1000 + G * 587/1000 + B * 114/1000``, rounded to uint8) divided by 255."""
    return np.asarray(image.convert("L"), dtype=np.float64) / 255.0


def power_spectrum(x: np.ndarray) -> np.ndarray:
    """``(H, W)`` float64 periodogram ``|FFT2(w * (x - mean(x)))|**2`` of a greyscale array, with
    ``w[i, j] = h_H[i] * h_W[j]`` and ``h_N[n] = 0.5 - 0.5 cos(2 pi n / N)`` (the periodic Hann
    window, ``scipy.signal.windows.hann(N, sym=False)``); bin ``(k, l)`` is the frequency
    ``(k / H, l / W)`` cycles / px (``numpy.fft.fftfreq``).

    Raises:
        ValueError: ``x`` is not 2-D or a side is < 2.
    """
    from scipy.signal.windows import hann

    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or min(x.shape) < 2:
        raise ValueError(f"power_spectrum needs a 2-D array with sides >= 2, got shape {x.shape}")
    w = np.outer(hann(x.shape[0], sym=False), hann(x.shape[1], sym=False))
    return np.abs(np.fft.fft2(w * (x - x.mean()))) ** 2


def high_frequency_share(image: Image.Image | np.ndarray, cutoff: float = HIGH_FREQUENCY_CUTOFF) -> float:
    """The share of an image's spectral energy above ``cutoff`` x Nyquist.

    ``sum(P[r > cutoff]) / sum(P)`` over the :func:`power_spectrum` ``P`` of the greyscale image,
    with ``r = sqrt(fy**2 + fx**2) / 0.5`` the radial frequency in units of Nyquist (0.5 cycles /
    px). A flat image (no energy) gives 0.0; a 2 px checkerboard on a flat image gives 1.0.

    Args:
        image: a PIL image, or an ``(H, W)`` greyscale array in [0, 1].
        cutoff: in (0, sqrt 2), units of Nyquist.

    Returns:
        float in [0, 1].

    Raises:
        ValueError: ``cutoff`` out of range, or an image side < 2.
    """
    if not 0.0 < cutoff < np.sqrt(2.0):
        raise ValueError(f"cutoff {cutoff} must be in (0, sqrt 2) (units of Nyquist)")
    x = greyscale(image) if isinstance(image, Image.Image) else np.asarray(image, dtype=np.float64)
    p = power_spectrum(x)
    total = float(p.sum())
    if total <= 0.0:
        return 0.0
    fy = np.fft.fftfreq(x.shape[0])[:, None]
    fx = np.fft.fftfreq(x.shape[1])[None, :]
    r = np.sqrt(fy ** 2 + fx ** 2) / 0.5
    return float(p[r > cutoff].sum() / total)


#: the high-pass of :func:`grid_artifact_score`: ``x - G_sigma(x)``, a Gaussian of this many px
#: (``scipy.ndimage.gaussian_filter``, truncated at 4 sigma)
HIGH_PASS_SIGMA = 1.0
_HIGH_PASS_RADIUS = 4  # int(4 * HIGH_PASS_SIGMA + 0.5): the filter's reach, the margin left out


def grid_measurable(shape: tuple[int, ...], period: int) -> bool:
    """Whether :func:`grid_artifact_score` measures an image of ``shape`` ``(H, W)`` px at
    ``period``: each side, cut to whole periods, leaves at least two periods inside the
    high-pass's 4 px margins."""
    return min(s // period * period for s in shape[:2]) - 2 * _HIGH_PASS_RADIUS >= 2 * period


def grid_artifact_score(image: Image.Image | np.ndarray, period: int) -> float:
    """The share of an image's fine detail explained by its position within a ``period`` px grid.

    A texture that repeats every ``period`` px (the latent patch grid's seams or checkerboards)
    makes the high-pass residual ``r = x - G(x)`` of the greyscale image ``x`` depend on the pixel's
    phase ``(i mod period, j mod period)``. The score is the one-way ANOVA effect size epsilon
    squared of ``r`` grouped by phase (``k = period**2`` groups, ``n`` pixels; Kelley 1935)::

        epsilon^2 = (SS_between - (k - 1) * SS_within / (n - k)) / SS_total

    with ``G`` the Gaussian of :data:`HIGH_PASS_SIGMA` px (``mode="reflect"``), the image cropped
    (top-left) to whole periods and the residual's outer 4 px (the filter's reach) left out, the
    phase counted from the crop's top-left pixel. Epsilon squared corrects the share
    ``SS_between / SS_total`` for the ``k - 1`` degrees of freedom the phase means take, so detail
    unrelated to the grid scores about 0 (it can be slightly negative); a ``period``-periodic
    pattern alone scores 1.0 (its residual is the same at every repeat: ``SS_within = 0``); a flat
    image (no residual) gives 0.0. A 2 px pattern is also 16-periodic and scores at both.

    Args:
        image: a PIL image, or an ``(H, W)`` greyscale array in [0, 1].
        period: the grid period in px, an integer >= 2; each side, cropped to whole periods, must
            be >= ``2 * period`` and leave at least ``2 * period`` px inside the 4 px margins.

    Returns:
        float, at most 1.

    Raises:
        ValueError: ``period`` < 2 or not an integer, or an image too small for it.
    """
    from scipy.ndimage import gaussian_filter

    if int(period) != period or period < 2:
        raise ValueError(f"period must be an integer >= 2 px, got {period}")
    period = int(period)
    x = greyscale(image) if isinstance(image, Image.Image) else np.asarray(image, dtype=np.float64)
    if not grid_measurable(x.shape, period):
        raise ValueError(f"an image of {x.shape[0]} x {x.shape[1]} px is too small for a {period} px grid "
                         f"(each side, cut to whole periods, >= {2 * period + 2 * _HIGH_PASS_RADIUS} px)")
    h, w = (s // period * period for s in x.shape)
    m = _HIGH_PASS_RADIUS
    x = x[:h, :w]
    r = (x - gaussian_filter(x, HIGH_PASS_SIGMA, mode="reflect", truncate=4.0))[m:h - m, m:w - m]
    ii, jj = np.indices(r.shape)
    phase = (((ii + m) % period) * period + (jj + m) % period).ravel()
    k = period * period
    values = r.ravel()
    n = values.size
    ss_total = float(((values - values.mean()) ** 2).sum())
    if ss_total <= 0.0:
        return 0.0
    counts = np.bincount(phase, minlength=k)
    means = np.bincount(phase, weights=values, minlength=k) / counts
    ss_between = float((counts * (means - values.mean()) ** 2).sum())
    ss_within = max(ss_total - ss_between, 0.0)
    return float((ss_between - (k - 1) * ss_within / (n - k)) / ss_total)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM of two greyscale ``(H, W)`` arrays in [0, 1] of the same shape:
    ``skimage.metrics.structural_similarity`` with ``data_range=1`` (its 7 x 7 uniform window,
    Wang et al. 2004's constants). In [-1, 1]; 1 for identical arrays.

    Raises:
        ValueError: different shapes or a side < 7 (scikit-image's)."""
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, data_range=1.0))


def panel_similarity(panels: Sequence[Image.Image]) -> float:
    """Mean SSIM (:func:`ssim`) over the pairs ``(i, j)``, ``i < j``, of a composite's panels, each
    in greyscale, resized (bicubic) to the smallest panel's size. 1.0 for identical panels.

    Raises:
        ValueError: fewer than two panels, or a panel side < 7 px."""
    if len(panels) < 2:
        raise ValueError(f"panel_similarity needs at least two panels, got {len(panels)}")
    size = min(p.width for p in panels), min(p.height for p in panels)
    grey = [greyscale(p if p.size == size else p.resize(size, Image.Resampling.BICUBIC)) for p in panels]
    return float(np.mean([ssim(grey[i], grey[j]) for i, j in itertools.combinations(range(len(grey)), 2)]))


def input_ssim(edit: Image.Image, source: Image.Image) -> float:
    """SSIM (:func:`ssim`) of an edit to its input image, in greyscale, the input resized
    (bicubic) to the edit's size (as the editing policies condition on it). In [-1, 1].

    Greyscale, where :func:`paco.pretrain.quality.edit_ssim` (the pretraining records, and the
    earlier figures of docs/embedded_default.md) takes the RGB SSIM: the embedded default's base
    Kontext edits score 0.42 here and 0.39 there.

    Raises:
        ValueError: a side < 7 px."""
    src = source if source.size == edit.size else source.convert("RGB").resize(edit.size, Image.Resampling.BICUBIC)
    return ssim(greyscale(edit), greyscale(src))


def sample_monitors(images: Sequence[Image.Image], items: Sequence[Any], ctx: Any, *, period: int
                    ) -> dict[str, np.ndarray]:
    """Every monitor that applies to a subtask's samples: monitor name -> ``(n,)`` float64.

    The grid and high-frequency monitors measure the whole sample: the latent patch grid is the
    image's, aligned at its top-left pixel, whatever the panels (a grid score is NaN for a sample
    too small for the period, :func:`grid_measurable`); ``panel_similarity`` is computed for
    samples of two panels or more (``ctx.panels``: the grid cut as the rewards cut it; text to
    image sets), ``input_ssim`` for items with a ``reference`` image (edits); a subtask whose
    samples all lack one omits it.

    Args:
        images: the decoded samples.
        items: their :class:`paco.grpo.rewards.SubtaskItem`.
        ctx: a :class:`paco.grpo.rewards.RewardContext` (its grid cutting).
        period: the policy's latent patch period in px (:attr:`paco.grpo.policies.Policy.size_multiple`).

    Raises:
        ValueError: different lengths; a panel or an image side under 7 px (SSIM's window); some
            samples with a reference image and some without, or with two panels and with one.
    """
    if len(images) != len(items):
        raise ValueError(f"{len(images)} images but {len(items)} items")
    out: dict[str, list[float]] = {k: [] for k in MONITORS}
    for image, item in zip(images, items, strict=True):
        grey = greyscale(image)
        for name, p in (("grid_artifact", period), ("grid_artifact_2px", 2)):
            out[name].append(grid_artifact_score(grey, p) if grid_measurable(grey.shape, p) else math.nan)
        out["high_frequency"].append(high_frequency_share(grey))
        if item.rows * item.cols >= 2:
            out["panel_similarity"].append(panel_similarity(ctx.panels(image, item)))
        if getattr(item, "reference", None) is not None:
            out["input_ssim"].append(input_ssim(image, item.reference))
    result = {}
    for k, v in out.items():
        if v and len(v) != len(images):
            raise ValueError(f"monitor {k} applies to {len(v)} of {len(images)} samples: a subtask's samples "
                             "must be all edits or all composites")
        if v:
            result[k] = np.asarray(v, dtype=np.float64)
    return result


def monitor_warnings(means: Mapping[str, float], reference: Mapping[str, float], *, where: str
                     ) -> list[str]:
    """The warnings of the monitors whose mean moved past :data:`THRESHOLDS` from ``reference``.

    Args:
        means: monitor name -> mean of the samples looked at (unknown names are ignored).
        reference: monitor name -> the reference's mean (the first evaluation, the base
            samples); a monitor missing from it is not compared.
        where: what is compared with what, for the message (e.g. ``"grpo@kontext_editing eval
            after epoch 16 vs epoch 0"``).

    Returns:
        one line per monitor past its bound, e.g. ``"grid_artifact rose 0.0123 -> 0.0281
        (+0.0158, bound +0.01): ..."``; empty when none is.
    """
    lines = []
    for name, (direction, bound) in THRESHOLDS.items():
        if name not in means or name not in reference:
            continue
        change = float(means[name]) - float(reference[name])
        if direction * change > bound:
            verb = "rose" if change > 0 else "fell"
            lines.append(f"{name} {verb} {reference[name]:.4f} -> {means[name]:.4f} ({change:+.4f}, bound "
                         f"{'+' if direction > 0 else '-'}{bound:g}): {where}; a sign of reward hacking "
                         "(paco.grpo.monitors)")
    return lines


def select_evaluation(rows: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> int:
    """Checkpoint selection on the monitors: the index of the last evaluation in ``rows`` whose
    monitors stay within :data:`THRESHOLDS` of the first evaluation's (``rows[0]``: before any
    update, the base policy's), i.e. for which :func:`monitor_warnings` against ``rows[0]`` is
    empty.

    Args:
        rows: the evaluation history in epoch order (dicts with the monitor means, as
            ``plots/eval.csv``), at least one.
        names: the monitors that guard (default: every monitor of :data:`THRESHOLDS`).

    Returns:
        an index into ``rows``; 0 when every later evaluation crossed a bound (the base weights:
        the LoRA of the first evaluation changes nothing).

    Raises:
        ValueError: no rows, or an unknown monitor name.
    """
    if not rows:
        raise ValueError("checkpoint selection needs at least one evaluation")
    guard = list(THRESHOLDS) if names is None else list(names)
    unknown = sorted(set(guard) - set(THRESHOLDS))
    if unknown:
        raise ValueError(f"unknown monitor(s) {unknown}; known: {sorted(THRESHOLDS)}")
    first = {k: v for k, v in rows[0].items() if k in guard}
    for i in range(len(rows) - 1, 0, -1):
        if not monitor_warnings({k: v for k, v in rows[i].items() if k in guard}, first, where=""):
            return i
    return 0
