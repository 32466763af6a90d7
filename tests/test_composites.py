"""Composite sources: import (manifest + folder) and generate (tiny FLUX pipeline)."""

import json

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from paco import composites as C
from paco.io import ArtifactError, ImageDecodeError, decode_image, encode_image
from paco.params import GenerateParams, ImportParams


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
    df, skipped = C.import_composites(write_import_folder(tmp_path), {"p"})
    assert skipped == [] and list(df.columns) == C.COMPOSITE_COLUMNS
    assert df.composite_id.tolist() == ["p-s0", "p-s1", "p-s2"]
    assert (df.width.tolist(), df.height.tolist()) == ([64] * 3, [48] * 3)
    assert decode_image(df.image[2]).getpixel((0, 0)) == (80, 10, 200)


def test_import_corrupt_image_strict_and_lenient(tmp_path):
    cfg = write_import_folder(tmp_path, corrupt=(1,))
    with pytest.raises(ImageDecodeError, match="p-s1"):
        C.import_composites(cfg, {"p"})
    df, skipped = C.import_composites(cfg, {"p"}, strict=False)
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
