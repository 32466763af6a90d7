"""The reward-hacking monitors (paco.grpo.monitors): exact values on synthetic images, computed
independently here (scipy's one-way ANOVA, scikit-image's SSIM), and a monitor that fires
on a checkerboard injected into a real photograph and stays quiet on the photograph itself."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata
from scipy.ndimage import gaussian_filter
from scipy.stats import f_oneway
from skimage.metrics import structural_similarity

import stages  # noqa: F401  (numerics environment)
from paco.grpo.monitors import (MONITORS, THRESHOLDS, grid_artifact_score, high_frequency_share, input_ssim,
                                monitor_warnings, panel_similarity, sample_monitors)
from paco.grpo.rewards import RewardContext, SubtaskItem

N = 128
II, JJ = np.indices((N, N))
FLAT = np.full((N, N), 0.5)
CHECKER_2 = 0.1 * np.where((II + JJ) % 2 == 0, 1.0, -1.0)          # zero mean, period 2
CHECKER_16 = 0.1 * np.where((II // 8 + JJ // 8) % 2 == 0, 1.0, -1.0)  # zero mean, period 16


def _photo(size: int = N) -> np.ndarray:
    im = Image.fromarray(skdata.astronaut()).convert("L").resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(im, dtype=np.float64) / 255.0


def test_a_flat_image_has_no_artifact_and_no_high_frequencies():
    assert grid_artifact_score(FLAT, 16) == 0.0
    assert grid_artifact_score(FLAT, 2) == 0.0
    assert high_frequency_share(FLAT) == 0.0


def test_a_pure_checkerboard_scores_one_at_its_period():
    assert grid_artifact_score(FLAT + CHECKER_16, 16) == pytest.approx(1.0, abs=1e-12)
    assert grid_artifact_score(FLAT + CHECKER_2, 2) == pytest.approx(1.0, abs=1e-12)
    # a 2 px pattern is also 16-periodic; a 16 px one has no energy at the 2 px harmonics
    assert grid_artifact_score(FLAT + CHECKER_2, 16) == pytest.approx(1.0, abs=1e-12)
    assert abs(grid_artifact_score(FLAT + CHECKER_16, 2)) < 0.05
    assert high_frequency_share(FLAT + CHECKER_2) == pytest.approx(1.0, abs=1e-12)


def test_the_artifact_score_is_the_anova_effect_size_of_the_residual_by_phase():
    # independently: scipy's one-way ANOVA of the high-pass residual grouped by 16 px phase,
    # epsilon squared from its F statistic
    rng = np.random.default_rng(0)
    x = np.clip(_photo() + CHECKER_16 + rng.normal(0, 0.005, (N, N)), 0, 1)
    r = (x - gaussian_filter(x, 1.0, mode="reflect"))[4:-4, 4:-4]
    ii, jj = np.indices(r.shape)
    phase = ((ii + 4) % 16) * 16 + (jj + 4) % 16
    groups = [r[phase == g] for g in range(256)]
    f = f_oneway(*groups).statistic
    df_b, df_w = 255, r.size - 256
    expected = df_b * (f - 1) / (df_b * f + df_w)
    assert grid_artifact_score(x, 16) == pytest.approx(expected, rel=1e-9)
    assert 0.05 < expected < 0.95


def test_the_high_frequency_share_splits_at_a_quarter_of_nyquist():
    low = np.cos(2 * np.pi * 8 * II / N)    # 8 / 128 cycles/px = 0.125 Nyquist
    high = np.cos(2 * np.pi * 40 * II / N)  # 40 / 128 = 0.625 Nyquist
    assert high_frequency_share(0.5 + 0.1 * low) == pytest.approx(0.0, abs=1e-12)
    assert high_frequency_share(0.5 + 0.1 * high) == pytest.approx(1.0, abs=1e-12)
    assert high_frequency_share(0.5 + 0.1 * (low + high)) == pytest.approx(0.5, rel=1e-10)
    assert high_frequency_share(0.5 + 0.1 * (low + high), cutoff=0.7) == pytest.approx(0.0, abs=1e-12)


def test_an_image_is_cropped_to_whole_periods():
    x = np.full((N + 5, N + 11), 0.5)  # cropped to 128 x 128
    x[:N, :N] += CHECKER_16
    assert grid_artifact_score(x, 16) == pytest.approx(1.0, abs=1e-12)


def test_bad_periods_and_small_images_are_refused():
    with pytest.raises(ValueError, match="integer >= 2"):
        grid_artifact_score(FLAT, 1)
    with pytest.raises(ValueError, match="too small"):
        grid_artifact_score(np.zeros((39, 64)), 16)
    with pytest.raises(ValueError, match="cutoff"):
        high_frequency_share(FLAT, cutoff=0)


def test_a_photograph_scores_near_zero_and_a_faint_checkerboard_lifts_it():
    photo = _photo()
    base = grid_artifact_score(photo, 16)
    assert abs(base) < 0.01
    hacked = np.clip(photo + 0.3 * CHECKER_16, 0, 1)
    assert grid_artifact_score(hacked, 16) - base > THRESHOLDS["grid_artifact"][1]
    hacked2 = np.clip(photo + 0.5 * CHECKER_2, 0, 1)
    assert grid_artifact_score(hacked2, 2) - grid_artifact_score(photo, 2) > THRESHOLDS["grid_artifact_2px"][1]
    assert high_frequency_share(hacked2) - high_frequency_share(photo) > THRESHOLDS["high_frequency"][1]


def _pil(x: np.ndarray) -> Image.Image:
    return Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)).convert("RGB")


def test_panel_similarity_is_one_for_identical_panels_and_the_mean_pair_ssim_otherwise():
    photo = _photo(64)
    assert panel_similarity([_pil(photo)] * 4) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    panels = [_pil(np.clip(photo + rng.normal(0, s, photo.shape), 0, 1)) for s in (0.0, 0.05, 0.1, 0.2)]
    grey = [np.asarray(p.convert("L"), dtype=np.float64) / 255 for p in panels]
    expected = np.mean([structural_similarity(grey[i], grey[j], data_range=1.0)
                        for i, j in itertools.combinations(range(4), 2)])
    assert panel_similarity(panels) == pytest.approx(expected, rel=1e-12)
    assert panel_similarity(panels) < 0.9
    with pytest.raises(ValueError, match="two panels"):
        panel_similarity(panels[:1])


def test_input_ssim_is_one_for_the_input_itself_and_resizes_the_input():
    photo = _pil(_photo(96))
    assert input_ssim(photo, photo) == pytest.approx(1.0)
    small = photo.resize((64, 64), Image.Resampling.BICUBIC)
    big = photo.resize((128, 128), Image.Resampling.BICUBIC)
    expected = structural_similarity(np.asarray(small.convert("L"), dtype=np.float64) / 255,
                                     np.asarray(big.resize((64, 64), Image.Resampling.BICUBIC).convert("L"),
                                                dtype=np.float64) / 255, data_range=1.0)
    assert input_ssim(small, big) == pytest.approx(expected, rel=1e-12)


def _grid(panels: list[np.ndarray]) -> Image.Image:
    return _pil(np.block([[panels[0], panels[1]], [panels[2], panels[3]]]))


def test_sample_monitors_per_subtask_kind():
    ctx = RewardContext(split_method="equal")
    photo = _photo(64)
    t2is = SubtaskItem("p0", "a set", "", 2, 2, ("a", "b", "c", "d"))
    same = sample_monitors([_grid([photo] * 4)], [t2is], ctx, period=16)
    assert set(same) == {"grid_artifact", "grid_artifact_2px", "high_frequency", "panel_similarity"}
    assert same["panel_similarity"][0] == pytest.approx(1.0)
    whole = grid_artifact_score(np.asarray(_grid([photo] * 4).convert("L"), dtype=np.float64) / 255, 16)
    assert same["grid_artifact"][0] == pytest.approx(whole)  # the whole composite: the latent grid is the image's
    edit = SubtaskItem("e0", "make it red", "", 1, 1, ("make it red",), reference=_pil(photo))
    edits = sample_monitors([_pil(photo), _pil(np.clip(photo + CHECKER_16[:64, :64], 0, 1))], [edit, edit], ctx, period=16)
    assert set(edits) == {"grid_artifact", "grid_artifact_2px", "high_frequency", "input_ssim"}
    assert edits["input_ssim"][0] == pytest.approx(1.0)
    assert edits["input_ssim"][1] < 0.9
    assert edits["grid_artifact"][1] > edits["grid_artifact"][0] + 0.1
    assert set(edits) <= set(MONITORS)
    with pytest.raises(ValueError, match="all edits or all composites"):
        sample_monitors([_pil(photo), _grid([photo] * 4)], [edit, t2is], ctx, period=16)


def test_a_warning_fires_on_a_checkerboard_and_not_on_the_base():
    ctx = RewardContext(split_method="equal")
    photo = _photo(64)
    edit = SubtaskItem("e0", "make it red", "", 1, 1, ("make it red",), reference=_pil(photo))
    base = {k: float(v.mean()) for k, v in sample_monitors([_pil(photo)], [edit], ctx, period=16).items()}
    hacked_image = _pil(np.clip(photo + 0.3 * CHECKER_16[:64, :64], 0, 1))
    hacked = {k: float(v.mean()) for k, v in sample_monitors([hacked_image], [edit], ctx, period=16).items()}
    assert monitor_warnings(base, base, where="base vs base") == []
    lines = monitor_warnings(hacked, base, where="lora vs base")
    named = {line.split()[0] for line in lines}
    assert "grid_artifact" in named and "input_ssim" in named
    assert all("lora vs base" in line for line in lines)
    # a fall of the artifact score or a rise of input SSIM is no warning
    back = {line.split()[0] for line in monitor_warnings(base, hacked, where="base vs lora")}
    assert not back & {"grid_artifact", "input_ssim"}


def test_samples_too_small_for_the_grid_are_not_measured():
    ctx = RewardContext(split_method="equal")
    photo = _photo(64)
    small = SubtaskItem("p0", "a set", "", 2, 2, ("a", "b", "c", "d"))  # a 32 px composite of 16 px panels
    out = sample_monitors([_grid([photo[:16, :16]] * 4)], [small], ctx, period=16)
    assert np.isnan(out["grid_artifact"][0])  # 32 px: under two periods inside the margins
    assert np.isfinite(out["grid_artifact_2px"][0]) and np.isfinite(out["high_frequency"][0])
    assert monitor_warnings({"grid_artifact": float("nan")}, {"grid_artifact": 0.0}, where="x") == []


def test_checkpoint_selection_keeps_the_last_evaluation_within_the_bounds():
    from paco.grpo.monitors import select_evaluation

    curve = [  # a hand-made evaluation history: the grid score creeps up, input SSIM falls late
        {"epoch": 0, "reward": 0.30, "grid_artifact": 0.010, "input_ssim": 0.42},
        {"epoch": 4, "reward": 0.33, "grid_artifact": 0.015, "input_ssim": 0.41},
        {"epoch": 8, "reward": 0.36, "grid_artifact": 0.019, "input_ssim": 0.405},  # the last within both
        {"epoch": 12, "reward": 0.39, "grid_artifact": 0.030, "input_ssim": 0.41},   # grid +0.02
        {"epoch": 16, "reward": 0.41, "grid_artifact": 0.012, "input_ssim": 0.37},   # SSIM -0.05
    ]
    assert select_evaluation(curve) == 2
    assert select_evaluation(curve, names=["grid_artifact"]) == 4
    assert select_evaluation(curve, names=["input_ssim"]) == 3
    assert select_evaluation(curve[:1]) == 0
    assert select_evaluation([curve[0], curve[3]]) == 0  # none within: the base weights
    with pytest.raises(ValueError, match="unknown monitor"):
        select_evaluation(curve, names=["reward"])
    with pytest.raises(ValueError, match="at least one"):
        select_evaluation([])
