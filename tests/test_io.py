"""Artifact I/O: lossless image cells, the datasets Image struct type, atomic writes, errors."""

import io
import json
import struct
import zlib

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from paco.core.io import (
    ALPHA_BACKGROUND,
    IMAGE_TYPE,
    ArtifactError,
    ImageDecodeError,
    ImageTooLargeError,
    UnsupportedImageModeError,
    decode_image,
    encode_image,
    iter_text_lines,
    load_image,
    read_parquet,
    write_json,
    write_parquet,
)


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


# --------------------------------------------------------------------------------------------
# decoding by the image's real mode and orientation
# --------------------------------------------------------------------------------------------


def png_bytes(im: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **save)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (8-bit grey) but holds no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_16bit_greyscale_is_scaled_not_clipped():
    v = np.array([[0, 1, 128, 129], [257, 32767, 32768, 65535]], dtype=np.uint16)
    src = Image.fromarray(v)
    assert src.mode == "I;16"
    im, info = load_image(png_bytes(src))
    expected = np.floor(v.astype(np.float64) * 255.0 / 65535.0 + 0.5).astype(np.uint8)  # round half up
    got = np.asarray(im)
    assert im.mode == "RGB" and got.shape == (2, 4, 3)
    assert np.array_equal(got[..., 0], expected) and np.array_equal(got[..., 0], got[..., 2])
    assert info.rescaled_16bit and info.mode == "I;16"
    # a mid-grey 16-bit image stays mid-grey (Pillow's convert("RGB") clipped it to white)
    grey = Image.fromarray(np.full((8, 8), 30000, dtype=np.uint16))
    assert np.asarray(decode_image(png_bytes(grey))).max() == round(30000 * 255 / 65535)


@pytest.mark.parametrize("orientation, k", [(3, 2), (6, -1), (8, 1)])
def test_exif_orientation_is_applied(orientation, k):
    rng = np.random.default_rng(orientation)
    arr = rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)  # 10 wide, 6 high
    src = Image.fromarray(arr)
    exif = src.getexif()
    exif[0x0112] = orientation
    im, info = load_image(png_bytes(src, exif=exif.tobytes()))
    # EXIF 3: rotate 180; 6: rotate 90 clockwise; 8: rotate 90 counter-clockwise (np.rot90 k>0 is CCW)
    assert np.array_equal(np.asarray(im), np.rot90(arr, k=k))
    assert info.orientation == orientation


def test_exif_rotated_jpeg_keeps_panel_order():
    # 2 panels side by side (left black, right white), stored rotated with orientation 6
    upright = np.zeros((32, 64, 3), dtype=np.uint8)
    upright[:, 32:] = 255
    stored = Image.fromarray(np.rot90(upright, k=1))  # what a camera writes for orientation 6
    exif = stored.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    got = np.asarray(decode_image(buf.getvalue()), dtype=np.int16)
    assert got.shape == (32, 64, 3)
    assert got[:, :28].mean() < 10 and got[:, 36:].mean() > 245


def test_alpha_is_composited_onto_the_documented_background():
    rgba = np.array([[[200, 100, 50, 255], [200, 100, 50, 0], [0, 0, 0, 128], [10, 20, 30, 64]]], dtype=np.uint8)
    im, info = load_image(png_bytes(Image.fromarray(rgba, mode="RGBA")))
    a = rgba[..., 3:].astype(np.float64) / 255.0
    bg = np.array(ALPHA_BACKGROUND, dtype=np.float64)
    expected = a * rgba[..., :3] + (1.0 - a) * bg
    assert ALPHA_BACKGROUND == (255, 255, 255)
    assert np.abs(np.asarray(im, dtype=np.float64) - expected).max() <= 1.0
    assert np.asarray(im)[0, 1].tolist() == [255, 255, 255]  # fully transparent -> background, not black
    assert info.alpha_flattened


def test_opaque_alpha_is_not_reported_and_changes_nothing():
    arr = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    rgba = np.concatenate([arr, np.full((5, 7, 1), 255, np.uint8)], axis=2)
    im, info = load_image(png_bytes(Image.fromarray(rgba, mode="RGBA")))
    assert np.array_equal(np.asarray(im), arr) and not info.alpha_flattened


def test_palette_transparency_and_grey_alpha_are_flattened():
    la = Image.fromarray(np.array([[[0, 0], [100, 255]]], dtype=np.uint8), mode="LA")
    im, info = load_image(png_bytes(la))
    assert info.alpha_flattened and np.asarray(im)[0].tolist() == [[255, 255, 255], [100, 100, 100]]
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 9, 9, 9] + [0] * 762)
    p.putpixel((1, 0), 1)
    im, info = load_image(png_bytes(p, transparency=0))
    assert info.alpha_flattened and np.asarray(im)[0].tolist() == [[255, 255, 255], [9, 9, 9]]


def test_encode_image_scales_16bit_and_flattens_alpha():
    cell = encode_image(Image.fromarray(np.full((2, 2), 65535, dtype=np.uint16)))
    assert np.asarray(decode_image(cell)).min() == 255
    cell = encode_image(Image.fromarray(np.full((2, 2), 1000, dtype=np.uint16)))
    assert np.asarray(decode_image(cell)).max() == 4  # round(1000 * 255 / 65535)
    cell = encode_image(Image.new("RGBA", (2, 2), (0, 0, 0, 0)))
    assert np.asarray(decode_image(cell)).min() == 255


def test_float_image_is_refused_by_name():
    buf = io.BytesIO()
    Image.new("F", (3, 3), 0.5).save(buf, format="TIFF")
    with pytest.raises(UnsupportedImageModeError, match="composite c-1.*mode 'F'"):
        decode_image(buf.getvalue(), what="composite c-1")


def test_max_pixels_refuses_before_decoding():
    data = png_header_only(3000, 2000)  # no pixel data: decoding would fail, the guard fires first
    with pytest.raises(ImageTooLargeError, match=r"c-2: image is 3000x2000 = 6000000 pixels, more than max_pixels=5999999"):
        decode_image(data, what="c-2", max_pixels=5_999_999)
    ok = encode_image(random_image(size=(30, 20)))
    assert decode_image(ok, max_pixels=600).size == (30, 20)
    with pytest.raises(ImageTooLargeError):
        decode_image(ok, max_pixels=599)


def test_decompression_bomb_is_a_named_decode_error():
    data = png_header_only(20000, 20000)  # 400 Mpx: past Pillow's own hard limit
    for kwargs in ({}, {"max_pixels": 10**12}):
        with pytest.raises(ImageTooLargeError, match="composite big") as ei:
            decode_image(data, what="composite big", **kwargs)
        assert isinstance(ei.value, ImageDecodeError) and isinstance(ei.value, ArtifactError)


# --------------------------------------------------------------------------------------------
# text lines
# --------------------------------------------------------------------------------------------


def test_iter_text_lines_bom_newlines_and_bad_bytes(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf{\"a\": 1}\r\nok \xe2\x80\xa8 still\n\n bad \xff here\rlast")
    lines = list(iter_text_lines(path))
    assert [n for n, _, _ in lines] == [1, 2, 3, 4, 5]
    assert lines[0] == (1, '{"a": 1}', None)
    assert lines[1] == (2, "ok \u2028 still", None)  # U+2028 is not a line break here
    assert lines[2] == (3, "", None)
    n, text, err = lines[3]
    assert text is None and "\\xff" in err and "byte column 6" in err
    assert lines[4] == (5, "last", None)
    path.write_bytes(b"")
    assert list(iter_text_lines(path)) == []


# --------------------------------------------------------------------------------------------
# files a dataset names: confined to its folder
# --------------------------------------------------------------------------------------------


def _dataset(tmp_path):
    root = tmp_path / "ds"
    (root / "sub").mkdir(parents=True)
    Image.new("RGB", (4, 4), (1, 2, 3)).save(root / "sub" / "a.png")
    outside = tmp_path / "outside.png"
    Image.new("RGB", (4, 4), (9, 9, 9)).save(outside)
    return root, outside


def test_dataset_path_accepts_files_inside_the_folder(tmp_path):
    from paco.core.io import dataset_path, read_dataset_file

    root, _ = _dataset(tmp_path)
    assert dataset_path(root, "sub/a.png", what="row 1") == (root / "sub/a.png").resolve()
    assert dataset_path(root, "sub/../sub/a.png", what="row 1") == (root / "sub/a.png").resolve()
    (root / "link.png").symlink_to(root / "sub" / "a.png")  # a link that stays inside is fine
    assert read_dataset_file(root, "link.png", what="row 1", max_bytes=1 << 20) == (root / "sub/a.png").read_bytes()


@pytest.mark.parametrize("name", ["../outside.png", "sub/../../outside.png", "ABS", "out_link.png",
                                  "out_dir/outside.png"])
def test_dataset_path_refuses_what_leads_outside(tmp_path, name):
    from paco.core.io import OutsideDatasetError, dataset_path

    root, outside = _dataset(tmp_path)
    (root / "out_link.png").symlink_to(outside)
    (root / "out_dir").symlink_to(tmp_path)
    name = str(outside) if name == "ABS" else name
    with pytest.raises(OutsideDatasetError, match="row 7"):
        dataset_path(root, name, what="row 7")


@pytest.mark.parametrize("name", ["", "  ", None, 3, "missing.png", "sub", "/dev/zero", "zero"])
def test_dataset_path_refuses_what_is_not_a_regular_file_inside(tmp_path, name):
    from paco.core.io import ArtifactError, dataset_path

    root, _ = _dataset(tmp_path)
    (root / "zero").symlink_to("/dev/zero")
    with pytest.raises(ArtifactError, match="row 2"):
        dataset_path(root, name, what="row 2")


def test_read_dataset_file_is_bounded(tmp_path):
    from paco.core.io import ArtifactError, read_dataset_file

    root, _ = _dataset(tmp_path)
    size = (root / "sub/a.png").stat().st_size
    assert len(read_dataset_file(root, "sub/a.png", what="x", max_bytes=size)) == size
    with pytest.raises(ArtifactError, match=f"{size} bytes, more than the limit of {size - 1}"):
        read_dataset_file(root, "sub/a.png", what="x", max_bytes=size - 1)
