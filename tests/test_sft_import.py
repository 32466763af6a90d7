"""Published judge SFT sets in LLaMA-Factory's layout (PaCo-Dataset): paco.judge.sft_import and the
reasons stage's ``sft_import``."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco.core.io import decode_image, encode_image, image_file_byte_limit, read_parquet, write_parquet
from paco.judge.reasons import SFT_COLUMNS
from paco.judge.sft_import import SFTImportError, import_sft

ROOT = Path(__file__).resolve().parents[1]

EDIT_Q = ("Compare the edited image (second) with the original image (first). Instruction: make it red. "
          "Does the edited image remain consistent with the original? Answer Yes or No.")
YES = "Yes. <reason>1. The subject keeps its identity. 2. The style is unchanged.</reason>"
NO = "No. <reason>1. The face differs.</reason>"


def _png(path: Path, seed: int, size: int = 24) -> bytes:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return path.read_bytes()


def _as_cell(path: Path) -> dict:
    return encode_image(decode_image(path.read_bytes()))


def _sharegpt(user: str, answer: str, images: list, role="role", content="content", u="user", a="assistant"):
    return {"messages": [{role: u, content: user}, {role: a, content: answer}], "images": images}


def llamafactory_dir(tmp: Path) -> Path:
    """A dataset_dir as LLaMA-Factory reads it: ``editing`` (sharegpt .json list, custom column and
    tags as PaCo-Dataset's ShareGPT exports use, a system turn), ``t2is`` (alpaca .jsonl) and
    ``cells`` (sharegpt Parquet with image cells, LLaMA-Factory's default tags)."""
    d = tmp / "llamafactory"
    (d / "images").mkdir(parents=True)
    for i in range(6):
        _png(d / "images" / f"{i}.png", i)
    editing = [
        _sharegpt(f"<image><image>{EDIT_Q}", YES, ["images/0.png", "images/1.png"]),
        {"messages": [{"role": "system", "content": "You are a judge."},
                      {"role": "user", "content": f"<image>\n<image>\n{EDIT_Q}"},
                      {"role": "assistant", "content": NO}], "images": ["images/2.png", "images/3.png"]},
    ]
    (d / "editing.json").write_text(json.dumps(editing))
    with open(d / "t2is.jsonl", "w") as f:
        f.write(json.dumps({"instruction": "<image><image>Are the two sub-figures consistent?", "output": "No.",
                            "images": ["images/4.png", "images/5.png"]}) + "\n")
    rng = np.random.default_rng(9)
    cell = encode_image(Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)), "a.png")
    pd.DataFrame([{"conversations": [{"from": "human", "value": "<image><image>Same person?"},
                                     {"from": "gpt", "value": YES}], "images": [cell, cell]}]).to_parquet(d / "cells.parquet")
    info = {
        "sharegpt_editing_cot": {"file_name": "editing.json", "formatting": "sharegpt",
                                 "columns": {"messages": "messages", "images": "images"},
                                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                          "assistant_tag": "assistant"}},
        "t2is_alpaca": {"file_name": "t2is.jsonl", "columns": {"prompt": "instruction", "response": "output",
                                                                "images": "images"}},
        "cells": {"file_name": "cells.parquet", "formatting": "sharegpt", "columns": {"images": "images"}},
        "remote": {"hf_hub_url": "someone/something", "formatting": "sharegpt"},
        "prefs": {"file_name": "editing.json", "formatting": "sharegpt", "ranking": True},
    }
    (d / "dataset_info.json").write_text(json.dumps(info))
    return d


def test_rows_are_read_as_llamafactory_reads_them(tmp_path):
    d = llamafactory_dir(tmp_path)
    got = import_sft(d, {"sharegpt_editing_cot": "edit_sc", "t2is_alpaca": "t2is", "cells": "edit_pf"})
    t = got.table
    assert list(t.columns) == SFT_COLUMNS and got.rows == {"sharegpt_editing_cot": 2, "t2is_alpaca": 1, "cells": 1}
    assert not got.skipped and t["pair_id"].is_monotonic_increasing
    by = t.set_index("pair_id")
    first = by.loc["import-sharegpt_editing_cot-000000"]
    assert first["instruction"] == EDIT_Q and bool(first["label"]) is True and first["response"] == YES
    assert list(first["reasons"]) == ["The subject keeps its identity.", "The style is unchanged."]
    # the decoded pixels are stored as PNG (encode_image), as generated rows are; the first image is image_a
    assert first["image_a"]["bytes"] == _as_cell(d / "images/0.png")["bytes"]
    assert first["image_b"]["bytes"] == _as_cell(d / "images/1.png")["bytes"] and first["image_b"]["path"] == "images/1.png"
    assert (first["split"], first["task"], first["teacher"], first["status"]) == ("train", "edit_sc",
                                                                                    "import:sharegpt_editing_cot", "ok")
    second = by.loc["import-sharegpt_editing_cot-000001"]  # the system turn dropped, newlines between images
    assert second["instruction"] == EDIT_Q and bool(second["label"]) is False
    assert second["image_a"]["bytes"] == _as_cell(d / "images/2.png")["bytes"]
    alpaca = by.loc["import-t2is_alpaca-000000"]
    assert alpaca["instruction"] == "Are the two sub-figures consistent?" and alpaca["response"] == "No."
    assert alpaca["task"] == "t2is" and list(alpaca["reasons"]) == []
    cells = by.loc["import-cells-000000"]
    assert cells["instruction"] == "Same person?" and cells["task"] == "edit_pf"
    assert cells["image_a"]["path"] == "a.png"


@pytest.mark.parametrize("datasets, message", [
    ({"missing": "edit_sc"}, "'missing' is not in"),
    ({"remote": "edit_sc"}, r"is remote \(hf_hub_url"),
    ({"prefs": "edit_sc"}, r"ranking \(preference\) dataset"),
    ({"t2is_alpaca": "edit"}, "task 'edit' is not one of"),
])
def test_datasets_the_judge_cannot_take_are_named(tmp_path, datasets, message):
    d = llamafactory_dir(tmp_path)
    with pytest.raises(SFTImportError, match=message):
        import_sft(d, datasets)


def test_no_dataset_info_says_what_a_dataset_dir_holds(tmp_path):
    with pytest.raises(SFTImportError, match="dataset_info.json"):
        import_sft(tmp_path, {"sharegpt_editing_cot": "edit_sc"})


BAD_ROWS = [
    (_sharegpt("<image><image><image>Q?", YES, ["images/0.png", "images/1.png"]), "the two <image> tokens"),
    (_sharegpt("<image>Q? <image>", YES, ["images/0.png", "images/1.png"]), "the two <image> tokens"),
    (_sharegpt("<image><image>Q?", YES, ["images/0.png"]), "the judge takes two images"),
    (_sharegpt("<image><image>Q?", "Maybe. <reason>1. x.</reason>", ["images/0.png", "images/1.png"]),
     "does not start with Yes or No"),
    (_sharegpt("<image><image>Q?", YES, ["images/0.png", "images/nope.png"]), "images/nope.png"),
    (_sharegpt("<image><image>Q?", YES, ["images/0.png", "images/broken.png"]), "cannot decode image"),
    (_sharegpt("<image><image>", YES, ["images/0.png", "images/1.png"]), "no question after its images"),
    ({"messages": [{"role": "user", "content": "<image><image>Q?"}], "images": ["images/0.png", "images/1.png"]},
     "expected one 'user' turn then one 'assistant' turn"),
    ("not an object", "not a JSON object"),
    # the first token is what reward_train reads: leading whitespace would make it a space token
    (_sharegpt("<image><image>Q?", "  " + YES, ["images/0.png", "images/1.png"]), "must start with 'Yes' or 'No'"),
    (_sharegpt("<image><image>Q?", "\n" + NO, ["images/0.png", "images/1.png"]), "must start with 'Yes' or 'No'"),
    (_sharegpt("<image><image>Q?", YES, ["images/0.png", {"bytes": "abc", "path": "x.png"}]),
     "image 2: the cell's bytes are str, not binary"),
    (_sharegpt("<image><image>Q?", YES, ["images/0.png", {"path": "x.png"}]), "image 2: neither a path nor"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_a_malformed_row_is_named_or_with_strict_false_skipped_and_counted(tmp_path, row, message):
    d = llamafactory_dir(tmp_path)
    (d / "images/broken.png").write_bytes((d / "images/0.png").read_bytes()[:40])
    rows = json.loads((d / "editing.json").read_text())
    (d / "editing.json").write_text(json.dumps([rows[0], row, rows[1]]))
    with pytest.raises(SFTImportError, match=re.escape(message)) as err:
        import_sft(d, {"sharegpt_editing_cot": "edit_sc"})
    assert "editing.json: row 1" in str(err.value)
    got = import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=False)
    assert got.rows == {"sharegpt_editing_cot": 2} and len(got.skipped) == 1
    assert "editing.json: row 1" in got.skipped[0]["where"] and message in got.skipped[0]["reason"]
    # a row keeps its place in the dataset: the row after the skipped one is 000002
    assert list(got.table["pair_id"]) == ["import-sharegpt_editing_cot-000000", "import-sharegpt_editing_cot-000002"]


def test_a_dataset_with_no_importable_row_is_an_error(tmp_path):
    d = llamafactory_dir(tmp_path)
    (d / "editing.json").write_text(json.dumps([BAD_ROWS[0][0]]))
    with pytest.raises(SFTImportError, match="no importable row"):
        import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=False)


def test_an_image_over_max_pixels_is_refused(tmp_path):
    d = llamafactory_dir(tmp_path)
    with pytest.raises(SFTImportError, match="max_pixels=100"):
        import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, max_pixels=100)


def _outside(tmp: Path, d: Path) -> Path:
    """A PNG outside the dataset folder, and a symlink to it inside (images/link.png)."""
    outside = tmp / "outside.png"
    _png(outside, 7)
    (d / "images" / "link.png").symlink_to(outside)
    return outside


@pytest.mark.parametrize("file_name, message", [
    ("../outside.json", "leads outside the dataset folder"),
    ("ABS", "is an absolute path"),
    ("../elsewhere", "leads outside the dataset folder"),
    ("link.json", "leads outside the dataset folder"),
    ("linked_dir", "leads outside the dataset folder"),
    ("mixed", "leads outside the dataset folder"),
])
def test_a_file_name_outside_the_dataset_dir_is_refused(tmp_path, file_name, message):
    d = llamafactory_dir(tmp_path)
    rows = (d / "editing.json").read_text()
    (tmp_path / "outside.json").write_text(rows)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.json").write_text(rows)
    (d / "link.json").symlink_to(tmp_path / "outside.json")
    (d / "linked_dir").symlink_to(tmp_path / "elsewhere")
    (d / "mixed").mkdir()
    (d / "mixed" / "a.json").write_text(rows)
    (d / "mixed" / "b.json").symlink_to(tmp_path / "outside.json")  # one file of a folder leads outside
    if file_name == "ABS":
        file_name = str(tmp_path / "outside.json")
    info = json.loads((d / "dataset_info.json").read_text())
    info["sharegpt_editing_cot"]["file_name"] = file_name
    (d / "dataset_info.json").write_text(json.dumps(info))
    for strict in (True, False):  # a data file is no row: never skipped
        with pytest.raises(SFTImportError, match=message) as err:
            import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=strict)
        assert "sharegpt_editing_cot" in str(err.value)


@pytest.mark.parametrize("image, message", [
    ("../outside.png", "leads outside the dataset folder"),
    ("ABS", "is an absolute path"),
    ("images/link.png", "leads outside the dataset folder"),
    ("/dev/zero", "is an absolute path"),
    ("images/zero", "leads outside the dataset folder"),  # a symlink to /dev/zero
    ("images", "is not a regular file"),
])
def test_an_image_outside_the_dataset_dir_is_refused_or_skipped(tmp_path, image, message):
    d = llamafactory_dir(tmp_path)
    outside = _outside(tmp_path, d)
    (d / "images" / "zero").symlink_to("/dev/zero")
    image = str(outside) if image == "ABS" else image
    rows = json.loads((d / "editing.json").read_text())
    bad = _sharegpt(f"<image><image>{EDIT_Q}", YES, [image, "images/1.png"])
    (d / "editing.json").write_text(json.dumps([rows[0], bad, rows[1]]))
    with pytest.raises(SFTImportError, match=re.escape(message)) as err:
        import_sft(d, {"sharegpt_editing_cot": "edit_sc"})
    assert "editing.json: row 1" in str(err.value) and "image 1" in str(err.value)
    got = import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=False)
    assert got.rows == {"sharegpt_editing_cot": 2} and len(got.skipped) == 1
    assert message in got.skipped[0]["reason"] and "editing.json: row 1" in got.skipped[0]["where"]
    png = outside.read_bytes()
    assert not any(png == c["bytes"] for col in ("image_a", "image_b") for c in got.table[col])


def test_an_image_file_over_the_byte_bound_is_refused_before_it_is_read(tmp_path):
    d = llamafactory_dir(tmp_path)
    big = d / "images" / "big.png"
    big.write_bytes((d / "images/0.png").read_bytes() + b"\0" * image_file_byte_limit(1000))  # a tiny image, padded
    rows = json.loads((d / "editing.json").read_text())
    rows[1]["images"] = ["images/big.png", "images/1.png"]
    (d / "editing.json").write_text(json.dumps(rows))
    got = import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=False, max_pixels=1000)
    assert len(got.skipped) == 1 and "more than the limit of" in got.skipped[0]["reason"]
    assert "images/big.png" in got.skipped[0]["reason"]


@pytest.mark.parametrize("change, message", [
    ({"columns": "x"}, "'columns' must be an object of column names"),
    ({"columns": {"messages": 3}}, "'columns' must be an object of column names"),
    ({"tags": ["role", "content"]}, "'tags' must be an object of tag names"),
])
def test_a_malformed_dataset_entry_is_named(tmp_path, change, message):
    d = llamafactory_dir(tmp_path)
    info = json.loads((d / "dataset_info.json").read_text())
    info["sharegpt_editing_cot"].update(change)
    (d / "dataset_info.json").write_text(json.dumps(info))
    for strict in (True, False):
        with pytest.raises(SFTImportError, match=re.escape(message)) as err:
            import_sft(d, {"sharegpt_editing_cot": "edit_sc"}, strict=strict)
        assert "dataset 'sharegpt_editing_cot'" in str(err.value)


def test_a_parquet_image_cell_with_text_bytes_is_a_row_error(tmp_path):
    d = llamafactory_dir(tmp_path)
    good = pd.read_parquet(d / "cells.parquet").to_dict("records")[0]
    bad = {"conversations": good["conversations"], "images": [{"bytes": "not binary", "path": "a.png"}] * 2}
    pd.DataFrame([bad]).to_parquet(d / "cells.parquet")  # a string-typed bytes field
    with pytest.raises(SFTImportError, match=r"cells.parquet: row 0: image 1: the cell's bytes are str"):
        import_sft(d, {"cells": "edit_pf"})
    with pytest.raises(SFTImportError, match=r"no importable row \(1 skipped\)"):
        import_sft(d, {"cells": "edit_pf"}, strict=False)


def test_jpeg_images_are_stored_as_png_of_their_decoded_pixels(tmp_path):
    d = llamafactory_dir(tmp_path)
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(d / "images/0.jpg", quality=80)
    rows = json.loads((d / "editing.json").read_text())
    rows[0]["images"] = ["images/0.jpg", "images/1.png"]
    (d / "editing.json").write_text(json.dumps(rows))
    t = import_sft(d, {"sharegpt_editing_cot": "edit_sc"}).table.set_index("pair_id")
    cell = t.loc["import-sharegpt_editing_cot-000000", "image_a"]
    assert cell["bytes"].startswith(b"\x89PNG\r\n\x1a\n") and cell["path"] == "images/0.jpg"
    assert np.array_equal(np.asarray(decode_image(cell)), np.asarray(decode_image((d / "images/0.jpg").read_bytes())))


# --------------------------------------------------------------------------------------------
# the reasons stage
# --------------------------------------------------------------------------------------------


def _reasons(tmp: Path, params: dict, out: Path) -> dict:
    from paco.data.edit_pairs import EDIT_PAIR_COLUMNS

    rng = np.random.default_rng(0)
    panels = pd.DataFrame({"panel_id": [f"p{i}" for i in range(3)], "image": [
        encode_image(Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))) for _ in range(3)]})
    pairs = pd.DataFrame({"pair_id": ["x0", "x1", "x2"], "instance_id": ["i0", "i0", "i1"], "prompt_id": ["a"] * 3,
                          "split": ["train", "train", "test"], "panel_a": ["p0", "p1", "p2"],
                          "panel_b": ["p1", "p2", "p0"], "label": [True, False, True]})
    write_parquet(tmp / "pairs.parquet", pairs)
    write_parquet(tmp / "panels.parquet", panels, image_columns=["image"])
    write_parquet(tmp / "prompts.parquet", pd.DataFrame({"prompt_id": ["a"], "global_prompt": ["A fox"]}))
    write_parquet(tmp / "edit_pairs.parquet", pd.DataFrame({c: [] for c in EDIT_PAIR_COLUMNS}))
    (tmp / "params.yaml").write_text(json.dumps(params))
    cmd = [sys.executable, "-m", "stages.reasons", "--params", str(tmp / "params.yaml"),
           "--pairs", str(tmp / "pairs.parquet"), "--panels", str(tmp / "panels.parquet"),
           "--prompts", str(tmp / "prompts.parquet"), "--edit-pairs", str(tmp / "edit_pairs.parquet"),
           "--sft-import", str(tmp / "llamafactory"), "--progress", str(out / "progress"),
           "--out", str(out / "sft.parquet"), "--metrics", str(out / "metrics.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PACO_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_the_reasons_stage_joins_the_imported_rows_and_keeps_its_progress(tmp_path):
    llamafactory_dir(tmp_path)
    base = {"reasons": {"chunk_size": 2, "teacher": {"backend": "template", "template": {"size": 32}}}}
    out = tmp_path / "out"
    report = _reasons(tmp_path, base, out)
    assert report["pairs"] == 3 and report["imported"] == {} and report["resumed_chunks"] == 0
    alone = read_parquet(out / "sft.parquet")

    with_import = {"reasons": {**base["reasons"], "sft_import": {
        "enabled": True, "datasets": {"sharegpt_editing_cot": "edit_sc", "t2is_alpaca": "t2is"}}}}
    report = _reasons(tmp_path, with_import, out)
    # the teacher's chunks are reused: the imported sets are not part of their identity
    assert report["resumed_chunks"] == 2, report
    assert report["imported"] == {"sharegpt_editing_cot": 2, "t2is_alpaca": 1} and report["pairs"] == 6
    assert report["per_task"] == {"edit_sc": 2, "t2is": 4} and report["teacher"] == alone["teacher"].iloc[0]
    sft = read_parquet(out / "sft.parquet")
    mine = sft[~sft["pair_id"].str.startswith("import-")].reset_index(drop=True)
    pd.testing.assert_frame_equal(mine.drop(columns=["image_a", "image_b"]), alone.drop(columns=["image_a", "image_b"]))
    assert sorted(sft.loc[sft["pair_id"].str.startswith("import-"), "teacher"]) == [
        "import:sharegpt_editing_cot", "import:sharegpt_editing_cot", "import:t2is_alpaca"]


def test_the_reasons_stage_reports_a_row_skipped_for_an_outside_image(tmp_path):
    d = llamafactory_dir(tmp_path)
    _outside(tmp_path, d)
    rows = json.loads((d / "editing.json").read_text())
    rows[1]["images"] = ["images/2.png", "images/link.png"]
    (d / "editing.json").write_text(json.dumps(rows))
    params = {"reasons": {"chunk_size": 2, "teacher": {"backend": "template", "template": {"size": 32}},
                          "sft_import": {"enabled": True, "strict": False,
                                         "datasets": {"sharegpt_editing_cot": "edit_sc"}}}}
    report = _reasons(tmp_path, params, tmp_path / "out")
    assert report["imported"] == {"sharegpt_editing_cot": 1} and report["import_skipped"] == 1
    skipped = report["import_skipped_rows"][0]
    assert skipped["dataset"] == "sharegpt_editing_cot" and "editing.json: row 1" in skipped["where"]
    assert "image 2" in skipped["reason"] and "leads outside the dataset folder" in skipped["reason"]


def test_params_refuse_an_enabled_import_without_datasets(tmp_path):
    from paco.core.params import ParamsError, load_params

    path = tmp_path / "params.yaml"
    path.write_text(json.dumps({"reasons": {"sft_import": {"enabled": True, "datasets": {}}}}))
    with pytest.raises(ParamsError, match="at least one dataset"):
        load_params(path)
