"""Composite sources: import (manifest + folder) and generate (tiny FLUX pipeline)."""

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from paco.data import composites as C
from paco.core.io import (ArtifactError, ImageDecodeError, ImageTooLargeError, decode_image, encode_image,
                          image_file_byte_limit, write_parquet)
from paco.core.params import GenerateParams, ImportParams

ROOT = Path(__file__).resolve().parents[1]


def write_import_folder(tmp_path, n=3, corrupt=()):
    rows = []
    for i in range(n):
        name = f"c{i}.png"
        if i in corrupt:
            (tmp_path / name).write_bytes(encode_image(Image.new("RGB", (64, 64)))["bytes"][:40])
        else:
            Image.new("RGB", (64, 48), (i * 40, 10, 200)).save(tmp_path / name)
        rows.append({"composite_id": f"p-s{i}", "prompt_id": "p", "seed": i, "file": name})
    (tmp_path / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ImportParams(dir=str(tmp_path), manifest="manifest.jsonl")


def test_import_reads_manifest_and_images(tmp_path):
    df, skipped, conv = C.import_composites(write_import_folder(tmp_path), {"p"})
    assert skipped == [] and list(df.columns) == C.COMPOSITE_COLUMNS
    assert conv == {"exif_rotated": 0, "rescaled_16bit": 0, "alpha_flattened": 0, "alpha_flattened_ids": []}
    assert df.composite_id.tolist() == ["p-s0", "p-s1", "p-s2"]
    assert (df.width.tolist(), df.height.tolist()) == ([64] * 3, [48] * 3)
    assert decode_image(df.image[2]).getpixel((0, 0)) == (80, 10, 200)


def test_import_corrupt_image_strict_and_lenient(tmp_path):
    cfg = write_import_folder(tmp_path, corrupt=(1,))
    with pytest.raises(ImageDecodeError, match="p-s1"):
        C.import_composites(cfg, {"p"})
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["p-s0", "p-s2"]
    assert [s["composite_id"] for s in skipped] == ["p-s1"] and "cannot decode" in skipped[0]["reason"]


def test_import_manifest_errors(tmp_path):
    cfg = write_import_folder(tmp_path)
    with pytest.raises(ArtifactError, match="not in prompts"):
        C.import_composites(cfg, {"other"})
    (tmp_path / "manifest.jsonl").write_text('{"composite_id": "a", "prompt_id": "p", "seed": 0}\n')
    with pytest.raises(ArtifactError, match="file"):
        C.import_composites(cfg, {"p"})
    (tmp_path / "manifest.jsonl").write_text("{oops\n")
    with pytest.raises(ArtifactError, match="manifest.jsonl:1"):
        C.import_composites(cfg, {"p"})
    row = '{"composite_id": "a", "prompt_id": "p", "seed": 0, "file": "c0.png"}\n'
    (tmp_path / "manifest.jsonl").write_text(row * 2)
    with pytest.raises(ArtifactError, match="duplicate"):
        C.import_composites(cfg, {"p"})


def test_stable_seed():
    assert C.stable_seed(0, "p", 1) == C.stable_seed(0, "p", 1)
    assert len({C.stable_seed(0, "p", k) for k in range(100)}) == 100
    assert 0 <= C.stable_seed("x") < 2**63


def test_generate_with_tiny_flux_is_batch_invariant(tiny_model_dirs):
    from paco.models.loading import load_flux_pipeline

    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    pipe.set_progress_bar_config(disable=True)
    prompts = pd.DataFrame(
        {
            "prompt_id": ["a", "b"],
            "prompt": ["A cat. [LEFT]: a cat sitting. [RIGHT]: a cat sleeping.", "A rocket on a pad."],
            "height": [64, 64],
            "width": [64, 64],
        }
    )
    cfg = GenerateParams(num_inference_steps=2, max_sequence_length=32, batch_size=1)
    one = C.generate_composites(prompts, pipe, cfg, seeds_per_prompt=2, seed=5)
    four = C.generate_composites(prompts, pipe, cfg.model_copy(update={"batch_size": 4}), seeds_per_prompt=2, seed=5)
    assert one.composite_id.tolist() == ["a-s0", "a-s1", "b-s0", "b-s1"]
    assert (one.height == 64).all() and (one.width == 64).all()
    pixels = [np.asarray(decode_image(c), dtype=np.int16) for c in one.image]
    assert not np.array_equal(pixels[0], pixels[1]), "two seeds gave the same image"
    # a composite depends on (seed, prompt_id, k) only, not on the batch it was rendered in
    for a, b in zip(one.image, four.image):
        assert np.abs(np.asarray(decode_image(a), dtype=np.int16) - np.asarray(decode_image(b), dtype=np.int16)).max() <= 1


# --------------------------------------------------------------------------------------------
# import: decoding by real mode/orientation, size guard, manifest rows
# --------------------------------------------------------------------------------------------


def write_manifest(folder, rows, name="manifest.jsonl", **cfg):
    (folder / name).write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return ImportParams(dir=str(folder), manifest=name, **cfg)


def row(cid, file, seed=0, prompt_id="p"):
    return {"composite_id": cid, "prompt_id": prompt_id, "seed": seed, "file": file}


def png_header_only(width, height):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_import_decodes_16bit_exif_and_alpha_and_counts_them(tmp_path):
    grey16 = np.full((16, 16), 32768, dtype=np.uint16)  # mid grey
    Image.fromarray(grey16).save(tmp_path / "g16.png")
    panels = np.zeros((16, 32, 3), dtype=np.uint8)
    panels[:, 16:] = 255  # left panel black, right panel white
    stored = Image.fromarray(np.rot90(panels, k=1))  # stored rotated, EXIF orientation 6
    exif = stored.getexif()
    exif[0x0112] = 6
    stored.save(tmp_path / "rot.png", exif=exif.tobytes())
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "alpha.png")
    cfg = write_manifest(tmp_path, [row("a", "g16.png"), row("b", "rot.png", 1), row("c", "alpha.png", 2)])
    df, skipped, conv = C.import_composites(cfg, {"p"})
    assert skipped == []
    g16, rot, alpha = (np.asarray(decode_image(c)) for c in df.image)
    assert g16.min() == g16.max() == 128  # round(32768 * 255 / 65535), not clipped to 255
    assert np.array_equal(rot, panels) and (df.width[1], df.height[1]) == (32, 16)
    assert alpha.min() == 255  # transparent -> white background, not black
    assert conv == {"exif_rotated": 1, "rescaled_16bit": 1, "alpha_flattened": 1, "alpha_flattened_ids": ["c"]}


def test_import_size_guard_is_named_and_skippable(tmp_path):
    (tmp_path / "bomb.png").write_bytes(png_header_only(20000, 20000))  # past Pillow's own limit
    (tmp_path / "big.png").write_bytes(png_header_only(300, 300))
    Image.new("RGB", (20, 20), (1, 2, 3)).save(tmp_path / "ok.png")
    rows = [row("bomb", "bomb.png"), row("big", "big.png", 1), row("ok", "ok.png", 2)]
    cfg = write_manifest(tmp_path, rows, max_pixels=50_000)
    with pytest.raises(ImageTooLargeError, match=r"manifest.jsonl:1: composite 'bomb' \(file .*bomb.png\)"):
        C.import_composites(cfg, {"p"})
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["ok"]
    assert [s["composite_id"] for s in skipped] == ["bomb", "big"]
    assert "300x300 = 90000 pixels, more than max_pixels=50000" in skipped[1]["reason"]
    assert skipped[1]["file"] == "big.png" and skipped[1]["row"].endswith("manifest.jsonl:2")


def test_import_bad_seed_names_row_and_field(tmp_path):
    cfg = write_import_folder(tmp_path)
    cfg = write_manifest(tmp_path, [row("p-s0", "c0.png"), row("p-s1", "c1.png", seed="zero")])
    with pytest.raises(C.ManifestRowError, match=r"manifest.jsonl:2: composite 'p-s1' field 'seed' must be a non-negative integer, got str 'zero'"):
        C.import_composites(cfg, {"p"})
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["p-s0"]
    assert skipped[0]["field"] == "seed" and skipped[0]["composite_id"] == "p-s1"
    cfg = write_manifest(tmp_path, [row("p-s0", "c0.png", seed="7"), row("p-s1", "c1.png", seed=True)])
    with pytest.raises(C.ManifestRowError, match="'seed'.*got bool True"):
        C.import_composites(cfg, {"p"})


def test_import_ids_1_and_string_1_are_duplicates(tmp_path):
    write_import_folder(tmp_path)
    cfg = write_manifest(tmp_path, [row(1, "c0.png"), row("1", "c1.png", 1)])
    for strict in (True, False):
        with pytest.raises(C.ManifestError, match=r"duplicate composite_id '1': .*manifest.jsonl:1 and .*manifest.jsonl:2"):
            C.import_composites(cfg, {"p"}, strict=strict)


def test_import_missing_file_is_named(tmp_path):
    write_import_folder(tmp_path)
    cfg = write_manifest(tmp_path, [row("p-s0", "c0.png"), row("p-s9", "c9.png", 9)])
    with pytest.raises(C.CompositeFileMissingError, match=r"manifest.jsonl:2: composite 'p-s9' field 'file': 'c9.png' not found") as ei:
        C.import_composites(cfg, {"p"})
    assert "no bytes" not in str(ei.value) and ei.value.file == "c9.png"
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["p-s0"] and skipped[0]["file"] == "c9.png"


def test_import_manifest_bom_bad_bytes_and_nothing_left(tmp_path):
    write_import_folder(tmp_path)
    path = tmp_path / "manifest.jsonl"
    good = json.dumps(row("p-s0", "c0.png")).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + b'{"composite_id": "x\xff"}\n')
    cfg = ImportParams(dir=str(tmp_path), manifest="manifest.jsonl")
    with pytest.raises(C.ManifestRowError, match=r"manifest.jsonl:2: invalid UTF-8"):
        C.import_composites(cfg, {"p"})
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)  # the BOM costs no row
    assert df.composite_id.tolist() == ["p-s0"] and skipped[0]["row"].endswith(":2")
    cfg = write_manifest(tmp_path, [row("p-s0", "nope.png")])
    with pytest.raises(C.ManifestError, match=r"no composite could be imported \(1 row\(s\) skipped"):
        C.import_composites(cfg, {"p"}, strict=False)
    cfg = write_manifest(tmp_path, [""])
    with pytest.raises(C.ManifestError, match="no rows"):
        C.import_composites(cfg, {"p"}, strict=False)


def test_import_parquet_manifest_rows_are_named(tmp_path):
    write_import_folder(tmp_path)
    pd.DataFrame({"composite_id": ["a", "b"], "prompt_id": ["p", "p"], "seed": [0.0, float("nan")],
                  "file": ["c0.png", "c1.png"]}).to_parquet(tmp_path / "m.parquet")
    cfg = ImportParams(dir=str(tmp_path), manifest="m.parquet")
    with pytest.raises(C.ManifestRowError, match=r"m.parquet row 2: composite 'b' field 'seed' is missing"):
        C.import_composites(cfg, {"p"})
    df, _, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.seed.tolist() == [0] and str(df.seed.dtype) == "int64"


def run_composites_stage(tmp_path, strict):
    from stages import composites as stage

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["composites"].update(source="import", strict=strict)  # default max_pixels (64 Mpx)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    folder = tmp_path / "imp"
    folder.mkdir()
    (folder / "bomb.png").write_bytes(png_header_only(20000, 20000))
    Image.new("RGB", (20, 20)).save(folder / "ok.png")
    write_manifest(folder, [row("bomb", "bomb.png"), row("ok", "ok.png", 1)])
    write_parquet(tmp_path / "prompts.parquet", pd.DataFrame(
        {"prompt_id": ["p"], "prompt": ["x"], "rows": [1], "cols": [2], "height": [20], "width": [40]}))
    argv = ["--params", str(tmp_path / "params.yaml"), "--prompts", str(tmp_path / "prompts.parquet"),
            "--policy", str(tmp_path), "--import-dir", str(folder), "--out", str(tmp_path / "c.parquet"),
            "--metrics", str(tmp_path / "m.json")]
    return stage.main(argv)


def test_stage_skips_a_decompression_bomb_when_not_strict(tmp_path):
    assert run_composites_stage(tmp_path, strict=False) == 0
    metrics = json.loads((tmp_path / "report.json").read_text())  # the details; m.json: the headline
    assert metrics["composites"] == 1 and metrics["skipped_composites"] == 1
    assert metrics["skipped"][0]["composite_id"] == "bomb"
    assert metrics["import_conversions"] == {"exif_rotated": 0, "rescaled_16bit": 0, "alpha_flattened": 0}


def test_stage_refuses_a_decompression_bomb_cleanly_when_strict(tmp_path, caplog):
    assert run_composites_stage(tmp_path, strict=True) == 2  # a clean stage error, no traceback
    assert "bomb" in caplog.text and not (tmp_path / "c.parquet").exists()


# --------------------------------------------------------------------------------------------
# import: files outside the folder, grid size, (prompt_id, seed) duplicates, photo subjects
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_import_refuses_a_file_outside_the_folder(tmp_path, how):
    from paco.core.io import OutsideDatasetError

    folder = tmp_path / "imp"
    folder.mkdir()
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "outside.png")
    Image.new("RGB", (32, 32)).save(folder / "ok.png")
    name = {"absolute": str(tmp_path / "outside.png"), "dotdot": "../outside.png", "symlink": "link.png"}[how]
    if how == "symlink":
        (folder / "link.png").symlink_to(tmp_path / "outside.png")
    (folder / "alias.png").symlink_to("ok.png")  # a symlink inside the folder is fine
    cfg = write_manifest(folder, [row("ok", "alias.png"), row("out", name, 1)])
    with pytest.raises(OutsideDatasetError, match=r"manifest.jsonl:2: composite 'out' field 'file'") as ei:
        C.import_composites(cfg, {"p"})
    assert isinstance(ei.value, C.ManifestRowError) and ei.value.field == "file"
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["ok"] and df.image[0]["path"] == "alias.png"  # the manifest's name
    assert [s["composite_id"] for s in skipped] == ["out"] and "outside" in skipped[0]["reason"]


@pytest.mark.parametrize("manifest", ["../m.jsonl", "ABS"])
def test_import_refuses_a_manifest_outside_the_folder(tmp_path, manifest):
    from paco.core.io import OutsideDatasetError

    folder = tmp_path / "imp"
    folder.mkdir()
    Image.new("RGB", (32, 32)).save(folder / "ok.png")
    (tmp_path / "m.jsonl").write_text(json.dumps(row("ok", "imp/ok.png")) + "\n")
    name = str(tmp_path / "m.jsonl") if manifest == "ABS" else manifest
    with pytest.raises(OutsideDatasetError, match="m.jsonl"):
        C.import_composites(ImportParams(dir=str(folder), manifest=name), {"p"})


def test_import_bounds_the_bytes_it_reads(tmp_path):
    cfg = write_manifest(tmp_path, [row("big", "big.png"), row("ok", "ok.png", 1)], max_pixels=1000)
    (tmp_path / "big.png").write_bytes(b"\0" * (image_file_byte_limit(1000) + 1))
    Image.new("RGB", (10, 10)).save(tmp_path / "ok.png")
    with pytest.raises(C.ManifestRowError, match=r"manifest.jsonl:1: composite 'big'.*more than the limit of"):
        C.import_composites(cfg, {"p"})
    df, skipped, _ = C.import_composites(cfg, {"p"}, strict=False)
    assert df.composite_id.tolist() == ["ok"] and skipped[0]["composite_id"] == "big"


def test_import_refuses_a_composite_too_small_for_its_grid(tmp_path):
    Image.new("RGB", (1, 1)).save(tmp_path / "tiny.png")
    Image.new("RGB", (2 * C.MIN_PANEL_PX, 2 * C.MIN_PANEL_PX - 1)).save(tmp_path / "short.png")
    Image.new("RGB", (2 * C.MIN_PANEL_PX, 2 * C.MIN_PANEL_PX)).save(tmp_path / "ok.png")
    cfg = write_manifest(tmp_path, [row("tiny", "tiny.png"), row("short", "short.png", 1), row("ok", "ok.png", 2)])
    with pytest.raises(C.ManifestRowError, match=r"manifest.jsonl:1: composite 'tiny'.*1x1 px.*2x2 grid"):
        C.import_composites(cfg, {"p"}, layouts={"p": (2, 2)})
    df, skipped, _ = C.import_composites(cfg, {"p"}, layouts={"p": (2, 2)}, strict=False)
    assert df.composite_id.tolist() == ["ok"]
    assert [s["composite_id"] for s in skipped] == ["tiny", "short"] and skipped[1]["field"] == "file"


def test_import_refuses_two_composites_of_one_prompt_and_seed(tmp_path):
    write_import_folder(tmp_path)
    cfg = write_manifest(tmp_path, [row("a", "c0.png", 0), row("b", "c1.png", 1), row("c", "c2.png", 1)])
    for strict in (True, False):
        with pytest.raises(C.ManifestError, match=r"prompt_id 'p' and seed 1: .*manifest.jsonl:2 \(composite 'b'\) "
                                                  r"and .*manifest.jsonl:3 \(composite 'c'\)"):
            C.import_composites(cfg, {"p"}, strict=strict)


def run_stage(tmp_path, source, prompts, strict=True, rows=()):
    from stages import composites as stage

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["composites"].update(source=source, strict=strict)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    folder = tmp_path / "imp"
    folder.mkdir(exist_ok=True)
    if rows:
        write_manifest(folder, list(rows))
    write_parquet(tmp_path / "prompts.parquet", pd.DataFrame(prompts))
    argv = ["--params", str(tmp_path / "params.yaml"), "--prompts", str(tmp_path / "prompts.parquet"),
            "--policy", str(tmp_path), "--import-dir", str(folder), "--out", str(tmp_path / "c.parquet"),
            "--metrics", str(tmp_path / "m.json")]
    return stage.main(argv)


PROMPT_2X2 = {"prompt_id": ["p"], "prompt": ["x"], "rows": [2], "cols": [2], "height": [64], "width": [64]}


def test_stage_refuses_or_skips_a_composite_too_small_for_its_prompt(tmp_path, caplog):
    (tmp_path / "imp").mkdir()
    Image.new("RGB", (1, 1)).save(tmp_path / "imp" / "tiny.png")
    Image.new("RGB", (64, 64)).save(tmp_path / "imp" / "ok.png")
    rows = [row("tiny", "tiny.png"), row("ok", "ok.png", 1)]
    assert run_stage(tmp_path, "import", PROMPT_2X2, rows=rows) == 2
    assert "composite 'tiny'" in caplog.text and not (tmp_path / "c.parquet").exists()
    assert run_stage(tmp_path, "import", PROMPT_2X2, strict=False, rows=rows) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["composites"] == 1 and report["skipped"][0]["composite_id"] == "tiny"


def test_stage_photos_refuses_an_unknown_subject_by_prompt(tmp_path, caplog):
    from paco.data.photos import SUBJECTS

    prompts = {**PROMPT_2X2, "prompt_id": ["p", "q"], "prompt": ["x", "y"], "rows": [2, 2], "cols": [2, 2],
               "height": [64, 64], "width": [64, 64], "subject": [None, "unicorn"]}
    assert run_stage(tmp_path, "photos", prompts) == 2  # a clean stage error, no traceback
    assert "prompt 'q'" in caplog.text and "'unicorn'" in caplog.text and repr(sorted(SUBJECTS)) in caplog.text
    assert not (tmp_path / "c.parquet").exists()
