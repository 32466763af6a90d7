"""Editing items (paco.data.edits): the embedded photo edits and the GEdit-Bench import."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pandas as pd
import pytest
from PIL import Image, ImageOps

from paco.core.io import decode_image
from paco.data.edits import EDIT_COLUMNS, EditsError, import_gedit, photo_edits

SUBJECTS = ["astronaut", "cat", "coffee", "cameraman"]


def _px(cell) -> np.ndarray:
    return np.asarray(decode_image(cell), dtype=np.int16)


def test_photo_edits_compute_the_instructed_result_and_split_by_photo():
    ops = ["greyscale", "mirror", "posterise", "zoom", "replace_subject", "warm_cast"]
    df = photo_edits(SUBJECTS, ops, 48, 2, seed=3)
    assert list(df.columns) == list(EDIT_COLUMNS)
    # greyscale is meaningless on the grey-scale cameraman: skipped there, every other pair present
    assert len(df) == len(SUBJECTS) * len(ops) - 1 and "cameraman-greyscale" not in set(df["item_id"])
    assert df["item_id"].is_unique and (df[["height", "width"]] == 48).all().all()
    by_split = df.groupby("split")["subject"].agg(set)
    assert len(by_split["test"]) == 2 and not by_split["test"] & by_split["train"]
    rows = df.set_index("item_id")
    cat_in = decode_image(rows.loc["cat-mirror", "input_image"])
    assert np.array_equal(_px(rows.loc["cat-mirror", "target_image"]), np.asarray(ImageOps.mirror(cat_in)))
    grey = _px(rows.loc["cat-greyscale", "target_image"])
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    assert set(np.unique(_px(rows.loc["coffee-posterise", "target_image"]))) <= {0, 64, 128, 192}
    other = rows.loc["cat-replace_subject", "instruction"].removeprefix("Replace the picture with a photo of the ")
    other_split = rows.loc[f"{other.rstrip('.')}-mirror", "split"]
    assert other.rstrip(".") in {"astronaut", "coffee", "cameraman"} and other_split == rows.loc["cat-mirror", "split"]
    assert np.array_equal(_px(rows.loc["cat-replace_subject", "target_image"]),
                          _px(rows.loc[f"{other.rstrip('.')}-mirror", "input_image"]))
    # deterministic
    again = photo_edits(SUBJECTS, ops, 48, 2, seed=3)
    assert again.drop(columns=["input_image", "target_image"]).equals(df.drop(columns=["input_image", "target_image"]))
    assert all(a["bytes"] == b["bytes"] for a, b in zip(again["target_image"], df["target_image"]))


def test_photo_edits_refuse_unknown_names_and_impossible_splits():
    with pytest.raises(ValueError, match="unknown"):
        photo_edits(["cat", "no_such_photo"], ["mirror"], 32, 1, 0)
    with pytest.raises(ValueError, match="test_photos"):
        photo_edits(["cat", "coffee"], ["mirror"], 32, 2, 0)
    with pytest.raises(ValueError, match="replace_subject takes its replacement from the item's own split"):
        photo_edits(["cat", "coffee", "rocket"], ["replace_subject"], 32, 1, 0)


def _png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 12), colour).save(buf, format="PNG")
    return buf.getvalue()


def _gedit_table(n: int) -> pd.DataFrame:
    """The GEdit-Bench layout as the ``datasets`` Parquet export stores it."""
    return pd.DataFrame([{
        "key": f"k{i:03d}", "task_type": ["background_change", "color_alter", "style_change"][i % 3],
        "instruction": f"edit number {i}", "instruction_language": "cn" if i % 4 == 0 else "en",
        "input_image": {"bytes": _png((i, 0, 0)), "path": f"{i}.png"},
    } for i in range(n)])


def test_gedit_parquet_import_uses_the_reference_split(tmp_path):
    path = tmp_path / "gedit.parquet"
    _gedit_table(40).to_parquet(path)
    res = import_gedit(path, languages=None, test_items=8, split_seed=42, strict=True, max_pixels=1 << 20)
    df = res.table
    assert len(df) == 40 and not res.skipped
    random.seed(42)  # the reference's preprocess.py, written out
    test = random.sample(range(40), 8)
    assert sorted(df.index[df["split"] == "test"]) == sorted(test)
    assert df.loc[5, "item_id"] == "k005" and df.loc[5, "instruction"] == "edit number 5"
    assert tuple(decode_image(df.loc[5, "input_image"]).getpixel((0, 0))) == (5, 0, 0)
    assert df["target_image"].isna().all() and (df["width"] == 20).all()
    en = import_gedit(path, languages=["en"], test_items=4, split_seed=42, strict=True, max_pixels=1 << 20).table
    assert set(en["language"]) == {"en"} and len(en) == 30


def test_gedit_jsonl_import_and_bad_rows(tmp_path):
    (tmp_path / "img").mkdir()
    for i in range(6):
        (tmp_path / "img" / f"{i}.png").write_bytes(_png((0, i, 0)))
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG not really")
    lines = [json.dumps({"key": f"j{i}", "task_type": "t", "instruction": f"do {i}", "instruction_language": "en",
                         "input_image": f"img/{i}.png"}) for i in range(6)]
    bad = [json.dumps({"key": "b1", "instruction": "  ", "input_image": "img/0.png"}),
           json.dumps({"key": "b2", "instruction": "x", "input_image": "img/broken.png"}),
           json.dumps({"key": "b3", "instruction": "x", "input_image": "../outside.png"}),
           "{not json"]
    path = tmp_path / "gedit.jsonl"
    path.write_text("\n".join(lines + bad) + "\n")
    with pytest.raises(EditsError, match=r"gedit.jsonl: line 7: missing or blank instruction"):
        import_gedit(path, languages=None, test_items=2, split_seed=42, strict=True, max_pixels=1 << 20)
    res = import_gedit(path, languages=None, test_items=2, split_seed=42, strict=False, max_pixels=1 << 20)
    assert list(res.table["item_id"]) == [f"j{i}" for i in range(6)]
    reasons = [s["reason"] for s in res.skipped]
    assert len(reasons) == 4
    assert "blank instruction" in reasons[0] and "line 8" in reasons[1] and "outside" in reasons[2]
    assert "not JSON" in reasons[3]
    with pytest.raises(EditsError, match="fewer than edits.import.test_items"):
        import_gedit(path, languages=None, test_items=7, split_seed=42, strict=False, max_pixels=1 << 20)
    with pytest.raises(EditsError, match="pixels"):
        import_gedit(path, languages=None, test_items=2, split_seed=42, strict=True, max_pixels=100)


def test_edits_stage_refuses_an_unknown_operation_as_a_params_error(tmp_path):
    import yaml

    from stages import edits as stage

    from pathlib import Path

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    raw["edits"]["photos"]["operations"] = ["mirror", "sharpen"]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    code = stage.main(["--params", str(params), "--out", str(tmp_path / "e.parquet"), "--metrics",
                       str(tmp_path / "m.json")])
    assert code == 2 and not (tmp_path / "e.parquet").exists()
