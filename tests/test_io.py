"""Artifact I/O: lossless image cells, the datasets Image struct type, atomic writes, errors."""

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from paco.io import IMAGE_TYPE, ArtifactError, ImageDecodeError, decode_image, encode_image, read_parquet, write_json, write_parquet


def random_image(seed=0, size=(37, 23)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_image_cell_round_trip_is_lossless():
    im = random_image()
    cell = encode_image(im, path="x.png")
    assert cell["path"] == "x.png" and cell["bytes"][:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(decode_image(cell)), np.asarray(im))


@pytest.mark.parametrize("data", [b"", b"not an image", None])
def test_undecodable_cells_raise_with_label(data):
    with pytest.raises(ImageDecodeError, match="composite c-7"):
        decode_image({"bytes": data, "path": None}, what="composite c-7")


def test_truncated_png_raises():
    data = encode_image(random_image(size=(200, 200)))["bytes"]
    with pytest.raises(ImageDecodeError):
        decode_image(data[: len(data) // 2])


def test_parquet_image_column_type_and_metadata(tmp_path):
    df = pd.DataFrame({"id": ["a", "b"], "image": [encode_image(random_image(i)) for i in range(2)]})
    path = tmp_path / "t.parquet"
    write_parquet(path, df, image_columns=["image"])
    schema = pq.read_schema(path)
    assert schema.field("image").type == IMAGE_TYPE
    assert json.loads(schema.metadata[b"huggingface"])["info"]["features"]["image"] == {"_type": "Image"}
    back = read_parquet(path, required=["id", "image"])
    assert np.array_equal(np.asarray(decode_image(back.image[1])), np.asarray(random_image(1)))
    assert not list(tmp_path.glob(".*tmp")), "temporary file left behind"


def test_read_parquet_errors(tmp_path):
    with pytest.raises(ArtifactError, match="no such table"):
        read_parquet(tmp_path / "missing.parquet")
    write_parquet(tmp_path / "t.parquet", pd.DataFrame({"a": [1]}))
    with pytest.raises(ArtifactError, match=r"missing column\(s\) \['b'\]"):
        read_parquet(tmp_path / "t.parquet", required=["a", "b"])
    (tmp_path / "junk.parquet").write_bytes(b"junk")
    with pytest.raises(ArtifactError, match="cannot read Parquet"):
        read_parquet(tmp_path / "junk.parquet")


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.json"
    write_json(path, {"a": 1})
    with pytest.raises(ValueError):
        write_json(path, {"a": float("nan")})  # NaN is not valid JSON: refuse, keep the old file
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
