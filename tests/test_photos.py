"""The ``photos`` composite source (paco.data.photos): determinism, Latin square, boxes, drift."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from scipy.stats import spearmanr

from paco.core.io import decode_image
from paco.core.params import PhotosParams
from paco.data.photos import (
    COMPOSITE_COLUMNS,
    DRIFT_STYLES,
    GREYSCALE_SUBJECTS,
    SUBJECTS,
    load_subject,
    render_composites,
    replacement_fraction,
    stable_hash,
    style_strength,
)

SMALL = PhotosParams(size=128)


def _prompts(n: int, layouts=((2, 2),), prefix: str = "p", subjects=None) -> pd.DataFrame:
    rows = [layouts[i % len(layouts)] for i in range(n)]
    return pd.DataFrame(
        {
            "prompt_id": [f"{prefix}{i:03d}" for i in range(n)],
            "rows": [r for r, _ in rows],
            "cols": [c for _, c in rows],
            "subject": list(subjects) if subjects is not None else [None] * n,
        }
    )


@pytest.fixture(scope="module")
def rendered() -> tuple[pd.DataFrame, pd.DataFrame]:
    prompts = _prompts(12, layouts=((2, 2), (1, 3), (3, 1), (2, 3), (3, 3)))
    return prompts, render_composites(prompts, SMALL, 4, seed=3)


# --------------------------------------------------------------------------------------------
# subjects
# --------------------------------------------------------------------------------------------


def test_subject_names_exact() -> None:
    assert set(SUBJECTS) == {
        "astronaut", "cat", "coffee", "rocket", "grace_hopper", "motorcycle", "galaxies", "tissue",
        "cameraman", "horse", "coins", "clock", "moon", "brick", "grass", "gravel",
    }


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_load_subject_rgb(name: str) -> None:
    im = load_subject(name)
    assert im.mode == "RGB"
    assert min(im.size) >= 256
    arr = np.asarray(im)
    assert arr.std() > 5  # a real photo, not a blank
    if name in GREYSCALE_SUBJECTS:
        assert np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 1], arr[..., 2])


def test_load_subject_cached_copy() -> None:
    a = load_subject("cat")
    a.paste((0, 0, 0), (0, 0, 50, 50))  # mutating the returned image must not poison the cache
    b = load_subject("cat")
    assert np.asarray(b)[:50, :50].std() > 0


def test_load_subject_unknown() -> None:
    with pytest.raises(ValueError, match="valid subjects"):
        load_subject("unicorn")


def test_stable_hash_is_fixed() -> None:
    # pinned: changing the hash silently changes every embedded-default artifact
    assert stable_hash("p0") == 17613450280036892301
    assert stable_hash("prompt-001") == 17047507617074206354


# --------------------------------------------------------------------------------------------
# output contract
# --------------------------------------------------------------------------------------------


def test_columns_and_ids(rendered) -> None:
    prompts, df = rendered
    assert list(df.columns) == COMPOSITE_COLUMNS
    assert len(df) == 4 * len(prompts)
    assert df["composite_id"].is_unique
    for row in df.itertuples():
        assert row.composite_id == f"{row.prompt_id}-s{row.seed}"
        assert row.height == row.width == SMALL.size
        im = decode_image(row.image)
        assert im.size == (row.width, row.height)
        assert row.subject in SUBJECTS and row.drift_subject in SUBJECTS
        assert row.drift_subject != row.subject
        assert row.drift_style in DRIFT_STYLES
        assert all(isinstance(v, int) for box in row.panel_bboxes for v in box)
        assert all(isinstance(v, int) for v in row.panel_levels)
    # per-prompt choices are shared by the prompt's composites
    per_prompt = df.groupby("prompt_id")[["subject", "drift_subject", "drift_style"]].nunique()
    assert (per_prompt == 1).all().all()


def test_determinism_identical_png_bytes() -> None:
    prompts = _prompts(4)
    a = render_composites(prompts, SMALL, 4, seed=0)
    b = render_composites(prompts, SMALL, 4, seed=0)
    assert [c["bytes"] for c in a["image"]] == [c["bytes"] for c in b["image"]]
    assert a.drop(columns="image").equals(b.drop(columns="image"))


def test_row_order_and_other_prompts_do_not_matter() -> None:
    prompts = _prompts(5, layouts=((2, 2), (1, 3)))
    a = render_composites(prompts, SMALL, 4, seed=1)
    shuffled = pd.concat([prompts.iloc[::-1], _prompts(1, prefix="extra")], ignore_index=True)
    b = render_composites(shuffled, SMALL, 4, seed=1).set_index("composite_id")
    for row in a.itertuples():
        other = b.loc[row.composite_id]
        assert row.image["bytes"] == other["image"]["bytes"]
        assert row.panel_bboxes == other["panel_bboxes"]
        assert row.panel_levels == other["panel_levels"]


def test_seed_changes_output() -> None:
    prompts = _prompts(2)
    a = render_composites(prompts, SMALL, 4, seed=0)
    b = render_composites(prompts, SMALL, 4, seed=1)
    assert [c["bytes"] for c in a["image"]] != [c["bytes"] for c in b["image"]]


# --------------------------------------------------------------------------------------------
# Latin square and boxes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [[0, 1, 3, 7], [0, 1, 4, 9, 11]])
def test_latin_square(levels: list[int]) -> None:
    params = PhotosParams(size=96, levels=levels, max_level=max(levels))
    n = len(levels)
    prompts = _prompts(6, layouts=((2, 2), (1, 3), (2, 3), (3, 3), (1, 1), (4, 2)))
    df = render_composites(prompts, params, n, seed=2)
    for pid, g in df.groupby("prompt_id"):
        g = g.sort_values("seed")
        assert list(g["seed"]) == list(range(n))
        grid = np.array(list(g["panel_levels"]))  # (N composites, panels)
        for q in range(grid.shape[1]):  # every position takes every level exactly once
            assert sorted(grid[:, q]) == sorted(levels), (pid, q, grid[:, q])
        # the level of panel q in composite k is levels[(k + perm[q]) % N]
        for q in range(grid.shape[1]):
            start = levels.index(int(grid[0, q]))
            assert [levels.index(int(v)) for v in grid[:, q]] == [(start + k) % n for k in range(n)]


def test_boxes_inside_disjoint_and_grid_aligned(rendered) -> None:
    prompts, df = rendered
    layout = prompts.set_index("prompt_id")
    for row in df.itertuples():
        rows, cols = (int(v) for v in layout.loc[row.prompt_id, ["rows", "cols"]])
        boxes = np.array(row.panel_bboxes)
        assert boxes.shape == (rows * cols, 4)
        assert len(row.panel_levels) == rows * cols
        x0, y0, x1, y1 = boxes.T
        assert (x0 >= 0).all() and (y0 >= 0).all() and (x1 <= row.width).all() and (y1 <= row.height).all()
        assert (x1 > x0).all() and (y1 > y0).all()
        g = boxes.reshape(rows, cols, 4)
        # row-major, straight cuts: a column shares x-extent, a row shares y-extent
        assert (g[:, :, 0] == g[:1, :, 0]).all() and (g[:, :, 2] == g[:1, :, 2]).all()
        assert (g[:, :, 1] == g[:, :1, 1]).all() and (g[:, :, 3] == g[:, :1, 3]).all()
        assert (g[:, 1:, 0] >= g[:, :-1, 2]).all() and (g[1:, :, 1] >= g[:-1, :, 3]).all()
        # gutters between cells and the border are the same on every side
        gut_x = g[0, 1:, 0] - g[0, :-1, 2]
        gut_y = g[1:, 0, 1] - g[:-1, 0, 3]
        assert len(set(gut_x.tolist()) | set(gut_y.tolist())) <= 1
        assert x0.min() == y0.min() == row.width - x1.max() == row.height - y1.max()
        lo, hi = SMALL.gutter_px
        assert all(lo <= v <= hi for v in (*gut_x, *gut_y))
        assert SMALL.border_px[0] <= x0.min() <= SMALL.border_px[1]
        # cell sizes: nominal +- the jitter of two cuts (+ rounding)
        inner = row.width - 2 * int(x0.min())
        for n, sizes, gut in ((cols, g[0, :, 2] - g[0, :, 0], gut_x), (rows, g[:, 0, 3] - g[:, 0, 1], gut_y)):
            nominal = (inner - (n - 1) * (gut[0] if len(gut) else 0)) / n
            assert (np.abs(sizes - nominal) <= 2 * SMALL.cell_jitter * inner + 2).all()


def test_pixels_outside_panels_are_border_or_gutter(rendered) -> None:
    _, df = rendered
    for row in df.itertuples():
        arr = np.asarray(decode_image(row.image))
        inside = np.zeros(arr.shape[:2], dtype=bool)
        for x0, y0, x1, y1 in row.panel_bboxes:
            inside[y0:y1, x0:x1] = True
        outside = arr[~inside]
        if outside.size:
            assert len(np.unique(outside, axis=0)) <= 2  # one border colour, one gutter colour


def test_no_border_no_gutter_tiles_image() -> None:
    params = PhotosParams(size=128, border_px=(0, 0), gutter_px=(0, 0))
    df = render_composites(_prompts(3, layouts=((2, 2), (2, 3), (1, 4))), params, 4, seed=0)
    for row in df.itertuples():
        area = sum((x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in row.panel_bboxes)
        assert area == row.width * row.height


def test_crop_scale_and_jitter_bounds() -> None:
    # no jitter: cells are equal to within one pixel
    params = PhotosParams(size=128, cell_jitter=0.0, gutter_px=(2, 2), border_px=(3, 3))
    df = render_composites(_prompts(2, layouts=((2, 2), (3, 3))), params, 4, seed=0)
    for row in df.itertuples():
        b = np.array(row.panel_bboxes)
        assert np.ptp(b[:, 2] - b[:, 0]) <= 1 and np.ptp(b[:, 3] - b[:, 1]) <= 1


# --------------------------------------------------------------------------------------------
# subjects and drift
# --------------------------------------------------------------------------------------------


def test_subject_assignment() -> None:
    prompts = _prompts(40)
    prompts.loc[0, "subject"] = "moon"
    prompts.loc[1, "subject"] = float("nan")
    df = render_composites(prompts, PhotosParams(size=48), 4, seed=0)
    subj = df.groupby("prompt_id")["subject"].first()
    assert subj["p000"] == "moon"
    names = list(SUBJECTS)
    for pid in prompts["prompt_id"][1:]:
        assert subj[pid] == names[stable_hash(pid) % len(names)]  # stable, not hash()
    assert subj.nunique() > 5
    # the per-prompt drift subject and style do not depend on other prompts
    alone = render_composites(prompts.iloc[[7]], PhotosParams(size=48), 4, seed=0)
    assert alone["drift_subject"].iloc[0] == df.loc[df.prompt_id == "p007", "drift_subject"].iloc[0]
    # the subject column is optional
    no_col = render_composites(prompts.drop(columns="subject").iloc[[3]], PhotosParams(size=48), 4, seed=0)
    assert no_col["subject"].iloc[0] == subj["p003"]


def test_styles_cover_all_and_no_hue_rotation_on_grey() -> None:
    subjects = [s for s in SUBJECTS for _ in range(6)]
    df = render_composites(_prompts(len(subjects), subjects=subjects), PhotosParams(size=48), 4, seed=0)
    first = df.groupby("prompt_id").first()
    assert set(first["drift_style"]) == set(DRIFT_STYLES)
    grey = first[first["subject"].isin(GREYSCALE_SUBJECTS)]
    assert "hue_rotate" not in set(grey["drift_style"])


def test_schedules_monotone() -> None:
    ts = np.linspace(0, 1, 50)
    a = [style_strength(t) for t in ts]
    r = [replacement_fraction(t) for t in ts]
    assert a[0] == 0 and r[0] == 0 and a[-1] == 1 and r[-1] == 1
    assert all(np.diff(a) > 0) and all(np.diff(r) >= 0)


def _panel(im: Image.Image, box, size: int = 32) -> np.ndarray:
    return np.asarray(im.crop(tuple(box)).resize((size, size), Image.Resampling.BILINEAR), dtype=np.float32)


def _stats(p: np.ndarray) -> np.ndarray:
    g = p.mean(axis=2)
    edges = np.abs(np.diff(g, axis=0)).mean() + np.abs(np.diff(g, axis=1)).mean()
    return np.concatenate([p.mean(axis=(0, 1)), p.std(axis=(0, 1)), [edges]])


def test_drift_distance_grows_with_level_gap() -> None:
    """Ground truth sanity: the further apart two levels, the more different the panels.

    Reference panel vs the panels at the same position in the prompt's other composites (the
    Latin square gives them all the other levels). Two image distances: mean absolute pixel
    difference of 32x32 thumbnails (sensitive to the views' different crops) and the distance
    of global colour/texture statistics (insensitive to crops).
    """
    prompts = _prompts(32)
    df = render_composites(prompts, SMALL, 4, seed=5)
    gaps, mad, stat = [], [], []
    for _, g in df.groupby("prompt_id"):
        ims = [decode_image(c) for c in g["image"]]
        boxes, levels = list(g["panel_bboxes"]), list(g["panel_levels"])
        for q in range(4):
            panels = [_panel(ims[k], boxes[k][q]) for k in range(4)]
            for k in range(4):
                for k2 in range(4):
                    if k2 != k:
                        gaps.append(abs(levels[k][q] - levels[k2][q]))
                        mad.append(float(np.abs(panels[k] - panels[k2]).mean()))
                        stat.append(float(np.abs(_stats(panels[k]) - _stats(panels[k2])).mean()))
    gaps_a = np.array(gaps)
    rho_mad = spearmanr(gaps, mad)[0]
    rho_stat = spearmanr(gaps, stat)[0]
    means = [float(np.mean(np.array(stat)[gaps_a == d])) for d in sorted(set(gaps))]
    print(f"\ndrift: Spearman(|dL|, pixel MAD) = {rho_mad:.3f}, (|dL|, colour stats) = {rho_stat:.3f}; "
          f"mean stats distance by |dL| {sorted(set(gaps))}: {np.round(means, 1).tolist()}")
    assert rho_mad > 0.4
    assert rho_stat > 0.6
    # graded: the mean distance grows with the level gap, step by step
    assert all(b > a for a, b in zip(means, means[1:]))


def test_level_zero_panels_are_views_of_the_subject() -> None:
    """At level 0 a panel is a plain view: same-level panels agree more than level 0 vs max."""
    df = render_composites(_prompts(16), SMALL, 4, seed=9)
    same, far = [], []
    for _, g in df.groupby("prompt_id"):
        ims = [decode_image(c) for c in g["image"]]
        found = {}
        for k, (boxes, levels) in enumerate(zip(g["panel_bboxes"], g["panel_levels"])):
            for box, lv in zip(boxes, levels):
                found.setdefault(lv, []).append(_stats(_panel(ims[k], box)))
        zero, top = found[0], found[7]
        same.append(np.abs(zero[0] - zero[1]).mean())
        far.append(np.abs(zero[0] - top[0]).mean())
    assert np.mean(same) < 0.5 * np.mean(far)


# --------------------------------------------------------------------------------------------
# errors and speed
# --------------------------------------------------------------------------------------------


def test_seeds_must_match_levels() -> None:
    with pytest.raises(ValueError, match="seeds_per_prompt=3"):
        render_composites(_prompts(1), SMALL, 3, seed=0)


def test_negative_seed() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        render_composites(_prompts(1), SMALL, 4, seed=-1)


def test_unknown_subject_names_prompt_and_valid_subjects() -> None:
    prompts = _prompts(2, subjects=["cat", "unicorn"])
    with pytest.raises(ValueError) as exc:
        render_composites(prompts, SMALL, 4, seed=0)
    msg = str(exc.value)
    assert "p001" in msg and "unicorn" in msg and "astronaut" in msg and "grace_hopper" in msg


@pytest.mark.parametrize(
    "prompts, match",
    [
        (pd.DataFrame({"prompt_id": ["a"], "rows": [0], "cols": [2]}), "rows and cols"),
        (pd.DataFrame({"prompt_id": ["a", "a"], "rows": [2, 2], "cols": [2, 2]}), "duplicate"),
        (pd.DataFrame({"prompt_id": ["a"], "rows": [2]}), "cols"),
        (pd.DataFrame({"prompt_id": ["a"], "rows": [20], "cols": [20]}), "does not fit"),
    ],
)
def test_bad_prompts(prompts: pd.DataFrame, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_composites(prompts, SMALL, 4, seed=0)


def test_render_speed_reported() -> None:
    for name in SUBJECTS:  # warm the photo cache: loading is a one-off cost
        load_subject(name)
    start = time.perf_counter()
    df = render_composites(_prompts(24), PhotosParams(size=256), 4, seed=0)
    elapsed = time.perf_counter() - start
    print(f"\nphotos: rendered {len(df)} 2x2 composites at 256 px in {elapsed:.2f} s")
    assert len(df) == 96 and math.isfinite(elapsed)
