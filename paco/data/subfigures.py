"""Cutting composite images (grids of panels) into their panels.

Two methods, chosen by ``subfigures.method``:

``equal``
    Exactly the reference implementation's ``divide_image`` (X-GenGroup/PaCo-RL,
    ``PaCo-GRPO/paco_grpo/utils.py``, used by its consistency, CLIP-T, CLIP-I and DreamSim
    rewards): every cell is ``W // cols`` wide and ``H // rows`` high, cell ``(r, c)`` is
    ``(c * (W // cols), r * (H // rows), (c + 1) * (W // cols), (r + 1) * (H // rows))``, and the
    remainder (``W % cols`` columns on the right, ``H % rows`` rows at the bottom) belongs to no
    panel. At T2IS's native sizes (multiples of the layout) the cells tile the whole image.

``refine`` (default)
    Equal cells are only the starting guess. Real composites have outer borders, gutters or
    separator lines between cells, and cells of slightly different sizes, which the equal split
    cuts straight through. All thresholds are on the 0-255 scale; a line's *std* is the RMS
    over channels of the pixel standard deviation along it, ignoring 2% at each end.

    1. **Trim the outer border.** From each image edge, drop consecutive *uniform* lines
       (std <= :data:`UNIFORM_STD`) whose mean colour stays within :data:`BAND_STEP` of the
       outermost line's, at most 25% of the image per side; rows (measured over the full
       width) first, then columns (over the rows left). Borders are taken to be symmetric:
       the deeper side is trimmed by at most 1 px more than its opposite, so flat panel
       content of the border's colour at one edge (sky, a white background) is kept.
    2. **Snap each internal cut to a separator band.** Around the equal-split line ``e`` of the
       trimmed area, in the window ``e +- w`` with ``w = tolerance * extent`` (``extent`` is the
       trimmed width for column cuts, height for row cuts; ``w`` is also kept under half a
       nominal cell), find *bands*: runs of consecutive uniform lines (here uniform means
       std <= ``UNIFORM_REL`` x the window's median line std, clipped to
       ``[UNIFORM_MIN, UNIFORM_STD]``) of steady colour and texture, at most ``w`` lines wide.
       A band must be flat (mean std <= 1) or contrast with the lines beside
       it on both sides by >= 16 grey levels (colour, or the flank's extra std): smooth panel
       content such as a heavily blurred panel is neither. The band with the lowest cost
       (distance from ``e`` in units of ``w`` + mean std / ``UNIFORM_STD`` - up to 1 for
       contrast) wins and the cut is made at its edges: the band belongs to neither panel.
    3. **Otherwise snap to a seam.** With no band (panels abut), each boundary in ``e +- w``
       gets ``diff``: the median along the line of the absolute difference between the two
       lines it separates (high only for a straight discontinuity running along most of the
       line, not for content edges), and ``ratio``: ``diff`` over the mean ``diff`` of the two
       neighbouring boundaries (+1), so textured content, which changes everywhere, does not
       look like a seam. The boundary with the largest ``ratio`` is used when its ``diff`` is
       at least :data:`EDGE_MIN`, its ``ratio`` at least :data:`EDGE_RATIO`, and it stands
       out above the window's median ``ratio`` :data:`EDGE_SECOND` times more than the
       runner-up more than 2 px away.
    4. **Otherwise** keep the equal line of the trimmed area.

    If the result along an axis is not a sequence of non-empty, non-overlapping cells, that axis
    falls back to the equal split of the trimmed area.

    On composites from the ``photos`` source (borders, gutters of 0-6 px, jittered cells) the
    boxes match the true ones with mean IoU ~0.999 (equal split: ~0.8-0.86), and ~0.995 after
    JPEG compression at quality 75 (see ``tests/test_subfigures.py`` and
    ``benchmarks/bench_subfigures.py``). Genuinely ambiguous layouts remain: flat panel content
    of exactly the gutter's colour next to the gutter is cut off with it.

Boxes are ``(x0, y0, x1, y1)`` in pixels with ``x1``/``y1`` exclusive, row-major (panel
``r * cols + c``). The work is vectorised with numpy over a planar copy of the image and only
the few line windows that matter, so a grid is split in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from paco.core.io import ArtifactError

__all__ = ["GridTooSmallError", "split_grid", "crop_panels", "box_iou"]

Box = tuple[int, int, int, int]

#: a line is uniform when the RMS over channels of its pixel std (0-255 scale) is <= this ...
UNIFORM_STD = 8.0
#: ... and, inside a cut's search window, <= this fraction of the window's median line std
UNIFORM_REL = 0.2
#: ... but the relative limit never goes below this
UNIFORM_MIN = 2.0
#: consecutive lines of one band (or of a border) differ by at most this much in mean colour
BAND_STEP = 10.0
#: a seam changes at least this many times more than the boundaries just beside it ...
EDGE_RATIO = 1.5
#: ... stands out above the window's median this many times more than the runner-up more
#: than 2 px away ...
EDGE_SECOND = 1.5
#: ... and its median absolute line difference (0-255 scale, mean over channels) is >= this
EDGE_MIN = 3.0

_MAX_TRIM = 0.25  # at most this fraction of the image is trimmed per side
_CHUNK = 32  # lines examined at a time while trimming
_SPAN_MARGIN = 0.02  # fraction of a line ignored at each end by the uniformity test
_FLANK = 3  # lines beyond a band that its contrast is measured against
_FLAT_STD = 1.0  # a band this flat needs no contrast with its flanks
_CONTRAST_MIN = 16.0  # a not-quite-flat band must differ this much from its flanks
_CONTRAST_FULL = 48.0  # band/flank contrast (0-255) earning the full cost bonus


def _as_planar(image: Image.Image) -> np.ndarray:
    """The image as a C-contiguous uint8 ``(C, H, W)`` array (``C`` = 1 for greyscale, else 3).

    Planar layout makes every per-line reduction below run over contiguous memory.
    """
    if image.mode == "L":
        return np.asarray(image)[None]
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def _inset(span: tuple[int, int]) -> tuple[int, int]:
    """``span`` without :data:`_SPAN_MARGIN` of its length at each end (at least 1 px when
    the span is long enough): a line's statistics then ignore a residual pixel or two of border
    that trimming left (e.g. after JPEG ringing) and the corners where cuts cross."""
    m = int(round(_SPAN_MARGIN * (span[1] - span[0])))
    m = max(m, 1) if span[1] - span[0] > 8 else 0
    return span[0] + m, span[1] - m


def _line_stats(a: np.ndarray, axis: int, lo: int, hi: int, span: tuple[int, int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per-line std and mean colour for lines ``lo..hi-1``; a line runs over ``span``.

    ``axis`` 0: lines are rows (statistics over x within ``span``); 1: lines are columns (over
    y). Returns ``(std, mean)``: ``std`` ``(n,)`` is the RMS over channels of the per-channel
    standard deviation, ``mean`` ``(n, C)`` the mean colour, both on the 0-255 scale.
    """
    s0, s1 = _inset(span)
    if axis == 0:
        sub = a[:, lo:hi, s0:s1].astype(np.float32)
        red = 2
    else:
        sub = a[:, s0:s1, lo:hi].astype(np.float32)
        red = 1
    inv = 1.0 / sub.shape[red]
    mean = sub.sum(axis=red) * inv  # (C, n)
    var = (sub * sub).sum(axis=red) * inv - mean * mean
    return np.sqrt(np.maximum(var.mean(axis=0), 0.0)), mean.T


def _edge_run(a: np.ndarray, axis: int, start: int, stop: int, step: int, span: tuple[int, int]) -> int:
    """Number of consecutive border lines from ``start`` toward ``stop`` (exclusive).

    A border line is uniform and within :data:`BAND_STEP` (every channel) of the colour of the
    outermost line, so a border next to flat panel content of another colour stops there.
    """
    count = 0
    pos = start
    limit = abs(stop - start)
    ref = None
    while count < limit:
        n = min(_CHUNK, limit - count)
        lo, hi = (pos, pos + n) if step > 0 else (pos - n + 1, pos + 1)
        std, mean = _line_stats(a, axis, lo, hi, span)
        if step < 0:
            std, mean = std[::-1], mean[::-1]
        if ref is None:
            ref = mean[0]
        ok = (std <= UNIFORM_STD) & (np.abs(mean - ref).max(axis=-1) <= BAND_STEP)
        bad = np.flatnonzero(~ok)
        if bad.size:
            return count + int(bad[0])
        count += n
        pos += step * n
    return count


def _trim(a: np.ndarray, rows: int, cols: int, tolerance: float) -> tuple[int, int, int, int]:
    """Outer-border trim: the box ``(x0, y0, x1, y1)`` left after removing uniform edge bands.

    Rows are examined over the full width first, then columns over the rows that are left.
    A side is trimmed by at most ``tolerance`` of the image extent (and :data:`_MAX_TRIM`): a
    wider uniform edge band is flat panel content (a blurred or empty panel), not a border.
    Borders are taken to be symmetric: the deeper side of an axis is trimmed by at most 1 px
    more than the opposite side, so flat panel content at one edge (sky, a white background)
    of the border's colour is not mistaken for border.
    """
    h, w = a.shape[1:]
    x0, y0, x1, y1 = 0, 0, w, h
    for axis in (0, 1):
        size, need, span = (h, rows, (x0, x1)) if axis == 0 else (w, cols, (y0, y1))
        cap = int(min(_MAX_TRIM, tolerance) * size)
        lead = _edge_run(a, axis, 0, cap, +1, span)
        trail = _edge_run(a, axis, size - 1, size - 1 - cap, -1, span)
        lead, trail = min(lead, trail + 1), min(trail, lead + 1)
        if size - lead - trail < need:  # nothing would be left: keep this axis whole
            continue
        if axis == 0:
            y0, y1 = lead, h - trail
        else:
            x0, x1 = lead, w - trail
    return x0, y0, x1, y1


def _bands(std: np.ndarray, mean: np.ndarray, thr: float) -> list[tuple[int, int]]:
    """Candidate separator bands ``[(start, end), ...]`` (end exclusive) among consecutive lines.

    A band is a maximal run of uniform lines (``std <= thr``) in which consecutive lines differ
    by at most :data:`BAND_STEP` in every channel of their mean colour and their stds differ by
    at most ``max(1.5, half the larger one)`` (so an exactly flat gutter is not merged with
    merely smooth panel content next to it).
    """
    uniform = std <= thr
    if not uniform.any():
        return []
    step = np.abs(np.diff(mean, axis=0)).max(axis=-1)
    jump = np.abs(np.diff(std))
    joined = (uniform[1:] & uniform[:-1] & (step <= BAND_STEP)
              & (jump <= np.maximum(1.5, 0.5 * np.maximum(std[1:], std[:-1]))))
    # a band starts at a uniform line not joined to its predecessor, ends before the next start
    starts = uniform.copy()
    starts[1:] &= ~joined
    ends = uniform.copy()
    ends[:-1] &= ~joined
    return list(zip(np.flatnonzero(starts).tolist(), (np.flatnonzero(ends) + 1).tolist()))


def _best_band(std: np.ndarray, mean: np.ndarray, base: int, e: int, w: int) -> tuple[int, int] | None:
    """The separator band for the cut near line ``e``, or None.

    ``std``/``mean`` describe lines ``base, base + 1, ...``. Uniformity is judged relative to
    the window (``UNIFORM_REL`` x its median line std, clipped to ``[UNIFORM_MIN,
    UNIFORM_STD]``). Bands must intersect ``[e - w, e + w)``, be at most ``w`` lines wide, and
    be either flat (mean line std <= ``_FLAT_STD``) or contrast with the lines flanking them
    (colour difference in some channel, or excess std of a flank line) by at least
    ``_CONTRAST_MIN`` grey levels on both sides (smooth content such as a blurred panel is
    neither).
    Among them the lowest cost wins: distance of the band centre from ``e`` (in units of
    ``w``), plus its mean std over ``UNIFORM_STD``, minus up to 1 for that contrast (a gutter
    usually differs from both neighbouring panels).
    """
    thr = float(np.clip(UNIFORM_REL * np.median(std), UNIFORM_MIN, UNIFORM_STD))
    best = None
    for rs, re in _bands(std, mean, thr):
        if rs + base >= e + w or re + base <= e - w or re - rs > w:
            continue
        colour = mean[rs:re].mean(axis=0)
        flatness = float(std[rs:re].mean())
        # how much the lines just beyond each side (up to _FLANK of them) differ from the band,
        # in colour or in texture; the band's contrast is that of its weaker side
        sides = [range(max(rs - _FLANK, 0), rs), range(re, min(re + _FLANK, len(std)))]
        contrast = min(
            (max(max(float(np.abs(mean[j] - colour).max()), float(std[j]) - flatness) for j in side)
             for side in sides if len(side)),
            default=0.0,
        )
        if flatness > _FLAT_STD and contrast < _CONTRAST_MIN:
            continue  # merely smooth content (e.g. a blurred panel), not a separator
        cost = (abs((rs + re) / 2 + base - e) / w + flatness / UNIFORM_STD
                - min(contrast, _CONTRAST_FULL) / _CONTRAST_FULL)
        if best is None or cost < best[0]:
            best = (cost, rs + base, re + base)
    return None if best is None else (best[1], best[2])


def _seam_strength(a: np.ndarray, axis: int, lo: int, hi: int, span: tuple[int, int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Seam evidence for the boundaries ``j = lo..hi-1`` (between line ``j - 1`` and line ``j``).

    Returns ``(diff, ratio)``. ``diff[j]`` is the median along the line (over ``span``) of the
    channel-mean absolute difference between the two lines (0-255 scale): the median makes it
    a *straightness* test, as a seam differs along most of its length and a content edge only
    along part of it. ``ratio[j]`` is ``diff[j]`` over the mean of the two neighbouring
    boundaries' ``diff`` (+1): a seam is a line where the image changes much more than just
    beside it, which also holds next to strongly textured content.
    """
    lo2, hi2 = max(lo - 1, 1), min(hi + 1, a.shape[2 if axis == 1 else 1])
    if axis == 0:
        sub = a[:, lo2 - 1:hi2, span[0]:span[1]].astype(np.int16)
        d = np.median(np.abs(np.diff(sub, axis=1)).mean(axis=0), axis=1)
    else:
        sub = a[:, span[0]:span[1], lo2 - 1:hi2].astype(np.int16)
        d = np.median(np.abs(np.diff(sub, axis=2)).mean(axis=0), axis=0)
    padded = np.concatenate(([d[0]] if lo2 == lo else [], d, [d[-1]] if hi2 == hi else []))
    diff = padded[1:-1]
    ratio = diff / (0.5 * (padded[:-2] + padded[2:]) + 1.0)
    return diff, ratio


def _refine_axis(a: np.ndarray, axis: int, n: int, region: tuple[int, int], span: tuple[int, int],
                 tolerance: float) -> list[tuple[int, int]]:
    """Cell spans ``[(start, end)] * n`` along one axis of the trimmed region."""
    t0, t1 = region
    extent = t1 - t0
    equal = [t0 + int(round(i * extent / n)) for i in range(n + 1)]
    spans = [(equal[i], equal[i + 1]) for i in range(n)]
    if n == 1:
        return spans
    cell = extent / n
    w = max(1, min(int(round(tolerance * extent)), int(cell / 2) - 1))
    starts = [t0] + [0] * (n - 1)
    ends = [0] * (n - 1) + [t1]
    for i in range(1, n):
        e = equal[i]
        # (2) separator bands intersecting [e - w, e + w); lines up to 2w away are examined so
        # that bands and their flanks are seen whole
        lo = max(t0 + 1, e - 2 * w, int(e - cell / 2) + 1)
        hi = min(t1 - 1, e + 2 * w, int(e + cell / 2))
        band = _best_band(*_line_stats(a, axis, lo, hi, span), lo, e, w) if hi > lo else None
        if band is not None:
            ends[i - 1], starts[i] = band
            continue
        # (3) abutting panels: a straight discontinuity that clearly stands out
        lo = max(t0 + 1, e - w)
        hi = min(t1, e + w + 1)
        cut = e
        if hi - lo >= 3:
            diff, ratio = _seam_strength(a, axis, lo, hi, span)
            p = int(np.argmax(ratio))
            others = np.concatenate((ratio[:max(p - 2, 0)], ratio[p + 3:]))
            base = float(np.median(ratio))
            second = float(others.max()) if others.size else base
            if (diff[p] >= EDGE_MIN and ratio[p] >= EDGE_RATIO
                    and ratio[p] - base >= EDGE_SECOND * (second - base)):
                cut = lo + p
        # (4) otherwise the equal line
        ends[i - 1], starts[i] = cut, cut
    out = list(zip(starts, ends))
    valid = all(s < e for s, e in out) and all(out[i][1] <= out[i + 1][0] for i in range(n - 1))
    return out if valid else spans


class GridTooSmallError(ArtifactError):
    """An image has fewer pixels along an axis than its grid has cells: a bad input (the
    composites import refuses such images, ``paco.data.composites.MIN_PANEL_PX``), so an
    :class:`~paco.core.io.ArtifactError` (and a ``ValueError``)."""


def split_grid(image: Image.Image, rows: int, cols: int, *, method: str = "refine",
               tolerance: float = 0.08) -> list[Box]:
    """Find the ``rows x cols`` panel boxes of a composite image.

    Args:
        image: the composite (any PIL mode; analysed as RGB, or as-is when greyscale ``L``).
        rows, cols: the grid layout (>= 1 each).
        method: ``"refine"`` (trim borders, snap cuts to separator bands or abutting edges, see
            the module docstring) or ``"equal"`` (the reference's ``divide_image``: cells of
            ``W // cols`` x ``H // rows`` px from the top-left corner, the remainder dropped).
        tolerance: ``refine`` only: half-width of the search window around each equal-split
            line, as a fraction of the trimmed width (column cuts) or height (row cuts), in
            ``(0, 0.5)``. Cuts further than that from the equal line are not found.

    Returns:
        ``rows * cols`` boxes ``(x0, y0, x1, y1)`` in pixels (x1, y1 exclusive), row-major; every
        box is non-empty and inside the image.

    Raises:
        GridTooSmallError: an image smaller than the grid (fewer pixels than cells along an axis).
        ValueError: rows or cols < 1, an unknown method, or a tolerance outside ``(0, 0.5)``.
    """
    if int(rows) != rows or int(cols) != cols or rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be integers >= 1, got rows={rows!r}, cols={cols!r}")
    rows, cols = int(rows), int(cols)
    w, h = image.size
    if w < cols or h < rows:
        raise GridTooSmallError(f"a {w}x{h} image cannot hold a {rows}x{cols} grid of non-empty panels")
    if method == "equal":
        # X-GenGroup/PaCo-RL PaCo-GRPO/paco_grpo/utils.py divide_image: floor-sized cells
        cw, ch = w // cols, h // rows
        return [(c * cw, r * ch, (c + 1) * cw, (r + 1) * ch) for r in range(rows) for c in range(cols)]
    if method != "refine":
        raise ValueError(f"unknown split method {method!r}; expected 'refine' or 'equal'")
    if not 0.0 < tolerance < 0.5:
        raise ValueError(f"tolerance must be in (0, 0.5), got {tolerance!r}")

    a = _as_planar(image)
    x0, y0, x1, y1 = _trim(a, rows, cols, tolerance)
    xspans = _refine_axis(a, 1, cols, (x0, x1), (y0, y1), tolerance)
    yspans = _refine_axis(a, 0, rows, (y0, y1), (x0, x1), tolerance)
    return [(xs, ys, xe, ye) for (ys, ye) in yspans for (xs, xe) in xspans]


def crop_panels(image: Image.Image, boxes: Sequence[Sequence[int]]) -> list[Image.Image]:
    """Crop ``boxes`` (``(x0, y0, x1, y1)``, x1/y1 exclusive) out of ``image``, in order.

    Raises:
        ValueError: a box is empty, inverted or not inside the image.
    """
    w, h = image.size
    out = []
    for box in boxes:
        bx0, by0, bx1, by1 = (int(v) for v in box)
        if not (0 <= bx0 < bx1 <= w and 0 <= by0 < by1 <= h):
            raise ValueError(f"box {tuple(box)} is empty or outside the {w}x{h} image")
        out.append(image.crop((bx0, by0, bx1, by1)))
    return out


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``(x0, y0, x1, y1)`` boxes (x1/y1 exclusive).

    Returns 0.0 when the union is empty (both boxes degenerate).
    """
    ax0, ay0, ax1, ay1 = (float(v) for v in a)
    bx0, by0, bx1, by1 = (float(v) for v in b)
    iw = max(0.0, min(ax1, bx1) - max(ax0, bx0))
    ih = max(0.0, min(ay1, by1) - max(ay0, by0))
    inter = iw * ih
    union = max(0.0, ax1 - ax0) * max(0.0, ay1 - ay0) + max(0.0, bx1 - bx0) * max(0.0, by1 - by0) - inter
    return inter / union if union > 0 else 0.0
