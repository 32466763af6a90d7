"""The GEdit-Bench import of paco.data.edits and the edits stage's table: exact keys, languages as the
benchmark writes them, unreadable files and lines, image files bounded to the file's folder."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from paco.core.io import IMAGE_TYPE, decode_image, image_file_byte_limit
from paco.data.edits import EditsError, import_gedit

ROOT = Path(__file__).resolve().parents[1]
OPTS = {"test_items": 1, "split_seed": 42, "max_pixels": 1 << 20}


def _png(colour=(9, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 12), colour).save(buf, format="PNG")
    return buf.getvalue()


def _parquet(path: Path, keys: pa.Array, languages: list[str] | None = None) -> Path:
    """A GEdit-Bench table as the ``datasets`` export writes it (Arrow types, nulls kept)."""
    n = len(keys)
    pq.write_table(pa.table({
        "key": keys, "task_type": ["color_alter"] * n, "instruction": [f"edit {i}" for i in range(n)],
        "instruction_language": languages or ["en"] * n,
        "input_image": pa.array([{"bytes": _png((i, 0, 0)), "path": f"{i}.png"} for i in range(n)], IMAGE_TYPE),
    }), path)
    return path


def test_an_int_key_stays_exact_zero_included_and_a_null_key_is_a_row_error(tmp_path):
    path = _parquet(tmp_path / "g.parquet", pa.array([0, 1, None, 3], pa.int64()))
    with pytest.raises(EditsError, match=r"g.parquet: row 2: missing key \(null\)"):
        import_gedit(path, languages=None, strict=True, **OPTS)
    res = import_gedit(path, languages=None, strict=False, **OPTS)
    assert list(res.table["item_id"]) == ["0", "1", "3"]
    assert len(res.skipped) == 1 and "row 2" in res.skipped[0]["where"] and "missing key" in res.skipped[0]["reason"]
    strings = import_gedit(_parquet(tmp_path / "s.parquet", pa.array(["a", "0", "b"])), languages=None,
                           strict=True, **OPTS)
    assert list(strings.table["item_id"]) == ["a", "0", "b"]


def test_a_float_key_is_a_row_error(tmp_path):
    path = _parquet(tmp_path / "g.parquet", pa.array([1.0, 2.5], pa.float64()))
    with pytest.raises(EditsError, match=r"g.parquet: row 0: key 1.0 is a float"):
        import_gedit(path, languages=None, strict=True, **OPTS)


def test_languages_compare_case_insensitively_and_rows_left_out_by_language_are_counted(tmp_path):
    path = _parquet(tmp_path / "g.parquet", pa.array(["a", "b", "c", "d", "e"]), ["en", "EN", "cn", "CN", "En"])
    res = import_gedit(path, languages=["en"], strict=True, **OPTS)
    assert list(res.table["item_id"]) == ["a", "b", "e"] and list(res.table["language"]) == ["en", "EN", "En"]
    assert res.skipped_by_language == {"cn": 2} and not res.skipped
    res = import_gedit(path, languages=["CN"], strict=True, **OPTS)
    assert list(res.table["item_id"]) == ["c", "d"] and res.skipped_by_language == {"en": 3}
    with pytest.raises(EditsError, match=r"no editing item \(languages \['fr'\].*5 left out by language"):
        import_gedit(path, languages=["fr"], strict=True, **OPTS)


@pytest.mark.parametrize("content", [b"", b"PAR1 this is not parquet PAR1"])
def test_an_unreadable_parquet_file_is_an_error_naming_it_even_with_strict_false(tmp_path, content):
    path = tmp_path / "shard.parquet"
    path.write_bytes(content)
    for strict in (True, False):
        with pytest.raises(EditsError, match=r"shard.parquet: not a readable Parquet file"):
            import_gedit(path, languages=None, strict=strict, **OPTS)


def _jsonl(tmp: Path, lines: list[bytes]) -> Path:
    (tmp / "img").mkdir(exist_ok=True)
    for i in range(3):
        (tmp / "img" / f"{i}.png").write_bytes(_png((0, i, 0)))
    path = tmp / "gedit.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _line(key, image="img/0.png", **extra) -> bytes:
    return json.dumps({"key": key, "instruction": "do it", "input_image": image, **extra}).encode()


def test_a_jsonl_line_with_a_bad_utf8_byte_is_named_and_skipped_with_strict_false(tmp_path):
    bad = _line("b").replace(b"do it", b"do \xff it")
    path = _jsonl(tmp_path, [_line("a"), bad, _line(0, "img/1.png"), _line(None, "img/2.png")])
    with pytest.raises(EditsError, match=r"gedit.jsonl: line 2: invalid UTF-8 byte\(s\) b'\\xff'"):
        import_gedit(path, languages=None, strict=True, **OPTS)
    res = import_gedit(path, languages=None, strict=False, **OPTS)
    assert list(res.table["item_id"]) == ["a", "0"]  # a JSON 0 is a key; null is not
    assert [s["where"].rsplit(": ", 1)[1] for s in res.skipped] == ["line 2", "line 4"]
    assert "missing key" in res.skipped[1]["reason"]


def test_a_jsonl_image_file_is_read_with_a_byte_bound(tmp_path):
    path = _jsonl(tmp_path, [_line("a"), _line("big", "img/big.png")])
    (tmp_path / "img" / "big.png").write_bytes(_png() + b"\0" * image_file_byte_limit(1000))  # a tiny image, padded
    res = import_gedit(path, languages=None, strict=False, test_items=1, split_seed=42, max_pixels=1000)
    assert list(res.table["item_id"]) == ["a"] and "more than the limit of" in res.skipped[0]["reason"]
    assert "line 2" in res.skipped[0]["where"]


# --------------------------------------------------------------------------------------------
# the edits stage writes image columns as the other image tables
# --------------------------------------------------------------------------------------------


def _stage(tmp: Path, edits: dict, import_path: Path | None = None) -> tuple[pa.Table, dict]:
    from stages import edits as stage

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["edits"].update(edits)
    params = tmp / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    argv = ["--params", str(params), "--out", str(tmp / "out" / "edits.parquet"), "--metrics",
            str(tmp / "out" / "metrics.json")]
    assert stage.main(argv + (["--import-path", str(import_path)] if import_path else [])) == 0
    return pq.read_table(tmp / "out" / "edits.parquet"), json.loads((tmp / "out" / "report.json").read_text())


def _features(table: pa.Table) -> dict:
    return json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]


def test_the_imported_edits_table_declares_its_image_columns(tmp_path):
    path = _parquet(tmp_path / "g.parquet", pa.array(["a", "b", "c"]), ["en", "cn", "EN"])
    table, report = _stage(tmp_path, {"source": "import", "import": {"languages": ["en"], "test_items": 1}}, path)
    assert table.schema.field("input_image").type == IMAGE_TYPE and table.schema.field("target_image").type == IMAGE_TYPE
    assert _features(table) == {"input_image": {"_type": "Image"}, "target_image": {"_type": "Image"}}
    assert table.column("target_image").null_count == 2 and table.num_rows == 2
    assert report["skipped_by_language"] == {"cn": 1} and report["skipped_rows"] == 0
    row = table.to_pylist()[0]
    assert tuple(decode_image(row["input_image"]).getpixel((0, 0))) == (0, 0, 0)


def test_the_photo_edits_table_declares_its_image_columns(tmp_path):
    table, report = _stage(tmp_path, {"photos": {"subjects": ["cat", "coffee"], "operations": ["mirror"],
                                                 "size": 16, "test_photos": 1}})
    assert _features(table) == {"input_image": {"_type": "Image"}, "target_image": {"_type": "Image"}}
    assert table.schema.field("target_image").type == IMAGE_TYPE and report["items"] == 2
    assert report["skipped_by_language"] == {}
