"""Cutting composites into panels (paco.data.subfigures): synthetic grids with known boxes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.core.io import decode_image
from paco.core.params import PhotosParams
from paco.data.photos import SUBJECTS, load_subject, render_composites
from paco.data.subfigures import box_iou, crop_panels, split_grid

PHOTOS = list(SUBJECTS)


def make_grid(
    rows: int,
    cols: int,
    *,
    size: tuple[int, int] = (240, 240),
    border: int = 0,
    border_rgb=(255, 255, 255),
    gutter: int = 0,
    gutter_rgb=(255, 255, 255),
    col_fracs=None,
    row_fracs=None,
    seed: int = 0,
) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    """A composite of photo crops (a different photo per panel) with known boxes.

    ``col_fracs``/``row_fracs``: relative cell sizes (uneven cells); equal when None.
    """
    rng = np.random.default_rng(seed)
    w, h = size
    canvas = Image.new("RGB", size, tuple(border_rgb))
    canvas.paste(tuple(gutter_rgb), (border, border, w - border, h - border))

    def spans(extent: int, n: int, fracs) -> list[tuple[int, int]]:
        usable = extent - 2 * border - (n - 1) * gutter
        fracs = np.ones(n) if fracs is None else np.asarray(fracs, dtype=float)
        edges = np.round(np.concatenate([[0], np.cumsum(fracs)]) / fracs.sum() * usable).astype(int)
        return [(border + edges[i] + i * gutter, border + edges[i + 1] + i * gutter) for i in range(n)]

    xs, ys = spans(w, cols, col_fracs), spans(h, rows, row_fracs)
    boxes = [(x0, y0, x1, y1) for (y0, y1) in ys for (x0, x1) in xs]
    names = rng.permutation(PHOTOS)
    for i, (x0, y0, x1, y1) in enumerate(boxes):
        photo = load_subject(str(names[i % len(names)]))
        pw, ph = photo.size
        cx, cy = rng.integers(0, pw // 3), rng.integers(0, ph // 3)
        crop = (cx, cy, cx + 2 * pw // 3, cy + 2 * ph // 3)
        panel = photo.resize((x1 - x0, y1 - y0), Image.Resampling.BILINEAR, box=crop)
        canvas.paste(panel, (x0, y0))
    return canvas, boxes


CASES = {
    # name: (rows, cols, make_grid kwargs)
    "2x2 equal, no gutter": (2, 2, {}),
    "2x2 white gutter 4": (2, 2, {"gutter": 4}),
    "2x2 black gutter 2": (2, 2, {"gutter": 2, "gutter_rgb": (0, 0, 0)}),
    "2x2 grey gutter 10": (2, 2, {"gutter": 10, "gutter_rgb": (128, 128, 128)}),
    "2x2 thin line 1": (2, 2, {"gutter": 1, "gutter_rgb": (20, 20, 20)}),
    "2x2 white border 12": (2, 2, {"border": 12, "gutter": 4}),
    "2x2 dark border, no gutter": (2, 2, {"border": 8, "border_rgb": (10, 10, 10)}),
    "2x2 uneven cells, gutter": (2, 2, {"gutter": 3, "col_fracs": [1.25, 1.0], "row_fracs": [1.0, 1.2]}),
    "2x2 uneven cells, abutting": (2, 2, {"col_fracs": [1.2, 1.0], "row_fracs": [0.85, 1.0]}),
    "2x2 uneven + border + gutter": (
        2, 2, {"border": 6, "border_rgb": (230, 230, 225), "gutter": 5, "gutter_rgb": (0, 0, 0),
               "col_fracs": [0.85, 1.0], "row_fracs": [1.15, 1.0]},
    ),
    "1x3 gutter": (1, 3, {"size": (360, 140), "gutter": 4}),
    "1x3 abutting uneven": (1, 3, {"size": (360, 140), "col_fracs": [1.0, 1.15, 0.9]}),
    "3x1 border + gutter": (3, 1, {"size": (140, 360), "border": 5, "gutter": 3, "gutter_rgb": (90, 90, 90)}),
    "3x1 abutting": (3, 1, {"size": (140, 360)}),
    "2x3 gutter": (2, 3, {"size": (360, 240), "gutter": 6, "gutter_rgb": (0, 0, 0)}),
    "2x3 uneven abutting": (
        2, 3, {"size": (360, 240), "col_fracs": [1.1, 0.9, 1.0], "row_fracs": [1.1, 0.9]},
    ),
    "3x3 border + gutter": (
        3, 3, {"size": (300, 300), "border": 4, "gutter": 2, "gutter_rgb": (0, 0, 0)},
    ),
    "2x2 big 1024 gutter": (2, 2, {"size": (1024, 1024), "gutter": 8, "border": 16}),
}
#: cases where equal cells are wrong by construction (border or uneven cells)
HARD = [
    name for name, (_, _, kw) in CASES.items()
    if kw.get("border") or kw.get("col_fracs") or kw.get("row_fracs")
]


def _ious(found, truth) -> list[float]:
    return [box_iou(a, b) for a, b in zip(found, truth, strict=True)]


@pytest.mark.parametrize("name", list(CASES))
def test_refine_synthetic(name: str) -> None:
    rows, cols, kw = CASES[name]
    image, truth = make_grid(rows, cols, **kw)
    found = split_grid(image, rows, cols)
    ious = _ious(found, truth)
    assert min(ious) >= 0.95, (name, found, truth)


def test_refine_synthetic_summary_and_beats_equal() -> None:
    refine_all, equal_all, refine_hard, equal_hard = [], [], [], []
    for seed in range(3):
        for name, (rows, cols, kw) in CASES.items():
            image, truth = make_grid(rows, cols, seed=seed, **kw)
            r = _ious(split_grid(image, rows, cols), truth)
            e = _ious(split_grid(image, rows, cols, method="equal"), truth)
            refine_all += r
            equal_all += e
            if name in HARD:
                refine_hard.append(np.mean(r))
                equal_hard.append(np.mean(e))
                assert np.mean(r) > np.mean(e), name
    print(f"\nsynthetic grids: mean IoU refine {np.mean(refine_all):.4f} (min {np.min(refine_all):.3f}), "
          f"equal {np.mean(equal_all):.4f}; bordered/uneven cases: refine {np.mean(refine_hard):.4f}, "
          f"equal {np.mean(equal_hard):.4f}")
    assert min(refine_all) >= 0.95
    assert np.mean(refine_hard) > np.mean(equal_hard) + 0.05


def test_refine_matches_equal_on_plain_grids() -> None:
    image, truth = make_grid(2, 2, size=(200, 200))
    assert split_grid(image, 2, 2) == split_grid(image, 2, 2, method="equal") == truth


def test_refine_on_photo_composites() -> None:
    layouts = [(2, 2), (1, 3), (3, 1), (2, 3), (3, 3)]
    n = 20
    prompts = pd.DataFrame({
        "prompt_id": [f"c{i:02d}" for i in range(n)],
        "rows": [layouts[i % 5][0] for i in range(n)],
        "cols": [layouts[i % 5][1] for i in range(n)],
    })
    df = render_composites(prompts, PhotosParams(size=256), 4, seed=11)
    layout = prompts.set_index("prompt_id")
    refine, equal, jpeg = [], [], []
    for row in df.itertuples():
        rows, cols = (int(v) for v in layout.loc[row.prompt_id, ["rows", "cols"]])
        image = decode_image(row.image)
        truth = [tuple(b) for b in row.panel_bboxes]
        refine += _ious(split_grid(image, rows, cols), truth)
        equal += _ious(split_grid(image, rows, cols, method="equal"), truth)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=85)
        jpeg += _ious(split_grid(Image.open(buf), rows, cols), truth)
    print(f"\nphoto composites ({len(refine)} panels): mean IoU refine {np.mean(refine):.4f} "
          f"(min {np.min(refine):.3f}, {np.mean(np.array(refine) >= 0.95):.1%} >= 0.95), "
          f"equal {np.mean(equal):.4f}; refine after JPEG q85 {np.mean(jpeg):.4f}")
    assert np.mean(refine) >= 0.95
    assert np.mean(refine) > np.mean(equal)
    assert np.mean(jpeg) >= 0.95


# --------------------------------------------------------------------------------------------
# equal method, validity, inputs
# --------------------------------------------------------------------------------------------


def _divide_image(image: Image.Image, grid_info: tuple[int, int]) -> list[Image.Image]:
    """X-GenGroup/PaCo-RL ``PaCo-GRPO/paco_grpo/utils.py`` ``divide_image``, verbatim in
    substance: ``a`` rows, ``b`` columns, floor-sized cells from the top-left corner."""
    a, b = grid_info
    width, height = image.size
    cell_height, cell_width = height // a, width // b
    cells = []
    for i in range(a):
        for j in range(b):
            upper, left = i * cell_height, j * cell_width
            cells.append(image.crop((left, upper, left + cell_width, upper + cell_height)))
    return cells


def test_equal_exact_boxes() -> None:
    image = Image.new("RGB", (100, 100))
    assert split_grid(image, 2, 2, method="equal") == [
        (0, 0, 50, 50), (50, 0, 100, 50), (0, 50, 50, 100), (50, 50, 100, 100)
    ]
    # cells of W // cols: 101 // 3 = 33, the last column (x = 99, 100) belongs to no panel
    assert split_grid(Image.new("RGB", (101, 10)), 1, 3, method="equal") == [
        (0, 0, 33, 10), (33, 0, 66, 10), (66, 0, 99, 10)
    ]
    # 2 x 3 at 203 x 101: cells 67 x 50, remainder 2 columns and 1 row
    assert split_grid(Image.new("RGB", (203, 101)), 2, 3, method="equal")[-1] == (134, 50, 201, 100)


@pytest.mark.parametrize("size, rows, cols", [
    ((1024, 1024), 2, 2), ((1023, 1025), 2, 2), ((101, 77), 3, 3), ((512, 1537), 3, 1), ((250, 97), 2, 4),
    ((7, 5), 5, 7),
])
def test_equal_is_the_reference_divide_image(size, rows, cols) -> None:
    rng = np.random.default_rng(sum(size) + rows * cols)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    ours = crop_panels(image, split_grid(image, rows, cols, method="equal"))
    ref = _divide_image(image, (rows, cols))
    assert [c.size for c in ours] == [c.size for c in ref]
    for a, b in zip(ours, ref, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows, cols", [(0, 2), (2, 0), (-1, 1), (1.5, 2)])
def test_bad_layout_raises(rows, cols) -> None:
    with pytest.raises(ValueError, match="rows and cols"):
        split_grid(Image.new("RGB", (64, 64)), rows, cols)


def test_bad_arguments_raise() -> None:
    image = Image.new("RGB", (64, 64))
    with pytest.raises(ValueError, match="method"):
        split_grid(image, 2, 2, method="magic")
    with pytest.raises(ValueError, match="tolerance"):
        split_grid(image, 2, 2, tolerance=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        split_grid(image, 2, 2, tolerance=0.7)
    with pytest.raises(ValueError, match="cannot hold"):
        split_grid(Image.new("RGB", (3, 64)), 1, 4)


def _valid(boxes, rows, cols, w, h) -> None:
    assert len(boxes) == rows * cols
    g = np.array(boxes).reshape(rows, cols, 4)
    assert (g[..., 0] >= 0).all() and (g[..., 1] >= 0).all()
    assert (g[..., 2] <= w).all() and (g[..., 3] <= h).all()
    assert (g[..., 2] > g[..., 0]).all() and (g[..., 3] > g[..., 1]).all()
    assert (g[:, 1:, 0] >= g[:, :-1, 2]).all() and (g[1:, :, 1] >= g[:-1, :, 3]).all()


def test_never_empty_or_inverted_boxes() -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        w, h = int(rng.integers(4, 300)), int(rng.integers(4, 300))
        rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        kind = trial % 4
        if kind == 0:
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noise
        elif kind == 1:
            arr = np.full((h, w, 3), int(rng.integers(0, 256)), dtype=np.uint8)  # blank
        elif kind == 2:
            arr = np.zeros((h, w, 3), dtype=np.uint8)  # stripes every few px
            arr[:, :: int(rng.integers(2, 7))] = 255
            arr[:: int(rng.integers(2, 7))] = 128
        else:
            arr = (np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))).astype(np.uint8)  # gradient
        image = Image.fromarray(arr)
        if w < cols or h < rows:
            with pytest.raises(ValueError):
                split_grid(image, rows, cols)
            continue
        for method in ("refine", "equal"):
            _valid(split_grid(image, rows, cols, method=method, tolerance=float(rng.uniform(0.01, 0.45))),
                   rows, cols, w, h)


def test_greyscale_and_rgba_inputs() -> None:
    image, truth = make_grid(2, 2, gutter=4, border=6)
    for converted in (image.convert("L"), image.convert("RGBA")):
        assert min(_ious(split_grid(converted, 2, 2), truth)) >= 0.95


def test_one_by_one_trims_border() -> None:
    image, truth = make_grid(1, 1, border=10, border_rgb=(0, 0, 0))
    assert split_grid(image, 1, 1) == truth
    assert split_grid(image, 1, 1, method="equal") == [(0, 0, 240, 240)]


def test_tolerance_limits_the_search() -> None:
    # the cut is 30 px (12.5%) off the equal line: found with a wide window, not a narrow one
    image, truth = make_grid(1, 2, gutter=4, col_fracs=[1.65, 1.0])
    assert min(_ious(split_grid(image, 1, 2, tolerance=0.2), truth)) >= 0.95
    assert min(_ious(split_grid(image, 1, 2, tolerance=0.05), truth)) < 0.95


# --------------------------------------------------------------------------------------------
# crop_panels, box_iou
# --------------------------------------------------------------------------------------------


def test_crop_panels() -> None:
    image, truth = make_grid(2, 3, size=(300, 200), gutter=4)
    crops = crop_panels(image, truth)
    assert [c.size for c in crops] == [(x1 - x0, y1 - y0) for x0, y0, x1, y1 in truth]
    x0, y0, x1, y1 = truth[4]
    assert np.array_equal(np.asarray(crops[4]), np.asarray(image)[y0:y1, x0:x1])
    for bad in [(0, 0, 0, 10), (10, 10, 5, 20), (0, 0, 301, 10), (-1, 0, 10, 10)]:
        with pytest.raises(ValueError, match="empty or outside"):
            crop_panels(image, [bad])


def test_box_iou() -> None:
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert box_iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0  # exclusive ends: touching boxes
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)
    assert box_iou((0, 0, 10, 10), (2, 2, 8, 8)) == pytest.approx(36 / 100)
    assert box_iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0
    assert box_iou([0, 0, 4, 4], np.array([1, 1, 3, 3])) == pytest.approx(4 / 16)


def test_an_image_too_small_for_its_grid_is_a_clean_stage_error(tmp_path, caplog) -> None:
    import yaml

    from paco.core.io import ArtifactError, encode_image, write_parquet
    from paco.data.subfigures import GridTooSmallError
    from stages import subfigures as stage

    with pytest.raises(GridTooSmallError, match="a 1x1 image cannot hold a 2x2 grid"):
        split_grid(Image.new("RGB", (1, 1)), 2, 2)
    assert issubclass(GridTooSmallError, ArtifactError)  # a bad input, not a bug: exit code 2
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "params.yaml").write_text((root / "params.yaml").read_text())
    write_parquet(tmp_path / "c.parquet", pd.DataFrame({
        "composite_id": ["p-s0"], "prompt_id": ["p"], "seed": [0], "image": [encode_image(Image.new("RGB", (1, 1)))],
        "height": [1], "width": [1]}), image_columns=["image"])
    write_parquet(tmp_path / "prompts.parquet", pd.DataFrame({"prompt_id": ["p"], "rows": [2], "cols": [2]}))
    argv = ["--params", str(tmp_path / "params.yaml"), "--composites", str(tmp_path / "c.parquet"),
            "--prompts", str(tmp_path / "prompts.parquet"), "--out", str(tmp_path / "panels.parquet"),
            "--metrics", str(tmp_path / "m.json")]
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["subfigures"]["strict"] is True
    assert stage.main(argv) == 2
    assert "cannot hold a 2x2 grid" in caplog.text and not (tmp_path / "panels.parquet").exists()


def test_a_composite_too_small_for_its_grid_is_named_or_with_strict_false_skipped_and_counted() -> None:
    from paco.core.io import ArtifactError, encode_image
    from paco.data.panels import extract_panels

    composites = pd.DataFrame({"composite_id": ["tiny", "ok"], "prompt_id": ["p", "p"], "seed": [0, 1],
                               "image": [encode_image(Image.new("RGB", (1, 1))), encode_image(Image.new("RGB", (32, 32)))]})
    prompts = pd.DataFrame({"prompt_id": ["p"], "rows": [2], "cols": [2]})
    with pytest.raises(ArtifactError, match="composite tiny: .*cannot hold a 2x2 grid"):
        extract_panels(composites, prompts)
    panels, report = extract_panels(composites, prompts, strict=False)
    assert set(panels["composite_id"]) == {"ok"} and len(panels) == 4
    assert report["skipped_composites"] == 1 and report["skipped"][0]["composite_id"] == "tiny"
    assert "cannot hold a 2x2 grid" in report["skipped"][0]["reason"]
