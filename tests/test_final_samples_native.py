"""final_samples at the benchmarks' own sizes and item sets (issue 27): ``resolution: native`` samples
each T2IS case at its own height x width, ``split: all`` takes every item, the area-rescale path
keeps its sizes, the schema refuses bad values, and the benchmark's row-major cut of a native
sample gives panels of the native panel size in the official ``{case_id}_{k:04d}.png`` layout.
The tiny FLUX policy (built offline), 2 ODE steps, a random LoRA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from paco.core.io import decode_image
from paco.core.params import FinalSamplesParams
from paco.core.seeding import stable_seed
from paco.grpo import rewards as R
from paco.grpo.sde import ODE

LORA = "data/grpo/t2is/lora"


@R.register("test_native_mean_red")
def _mean_red(images, prompts, ctx):
    """A reward that needs no model: each image's mean red channel in [0, 1]."""
    return np.array([np.asarray(im, dtype=np.float64)[..., 0].mean() / 255.0 for im in images])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny FLUX pipeline directory and a random LoRA on it in diffusers' layout."""
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    from paco.models.fetch import materialise
    from paco.models.loading import load_flux_pipeline

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("native")
    policy_dir = materialise("policy_t2is", "tiny:flux", root / "flux", seed=0)
    targets = ["attn.to_q", "attn.to_k"]
    model = get_peft_model(load_flux_pipeline(policy_dir).transformer,
                           LoraConfig(r=4, lora_alpha=8.0, init_lora_weights="gaussian", target_modules=targets))
    g = torch.Generator().manual_seed(3)
    weights = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in get_peft_model_state_dict(model).items()}
    set_peft_model_state_dict(model, weights)
    plain = {k.removeprefix("base_model.model."): v for k, v in weights.items()}
    FluxPipeline.save_lora_weights(str(root / "lora"), transformer_lora_layers=plain, safe_serialization=True,
                                   transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8.0,
                                                                      "target_modules": targets})
    return policy_dir, root / "lora"


#: prompt_id -> (rows, cols, height, width, split)
CASES = {
    "c0": (1, 2, 64, 128, "test"),    # a 1x2 strip
    "c1": (2, 1, 128, 64, "train"),   # a 2x1 column
    "c2": (2, 4, 64, 128, "test"),    # a 2x4 grid, 32 px panels
    "c3": (1, 2, 40, 120, "test"),    # no multiple of 16: rounded to 32 x 128 (40/16 = 2.5 -> 2, half to even)
}


def _prompts() -> pd.DataFrame:
    rows = []
    for pid, (r, c, h, w, split) in CASES.items():
        panels = [f"panel {k}." for k in range(r * c)]
        rows.append({"prompt_id": pid, "split": split, "prompt": f"a {r}x{c} grid of object {pid}. " + " ".join(panels),
                     "global_prompt": f"object {pid}", "rows": r, "cols": c, "panel_prompts": panels,
                     "height": h, "width": w})
    return pd.DataFrame(rows)


def _cfg(**over) -> FinalSamplesParams:
    return FinalSamplesParams.model_validate(dict(lora=LORA, num_steps=2, seeds_per_prompt=1, batch_size=2,
                                                  max_sequence_length=32, rewards=["test_native_mean_red"], **over))


def _run(tiny, cfg):
    from paco.grpo.final_samples import final_samples

    policy_dir, lora_dir = tiny
    table, _, _ = final_samples(cfg, _prompts(), policy_dir, lora_dir, R.RewardContext(split_method="equal"))
    return table


@pytest.fixture(scope="module")
def native(tiny) -> pd.DataFrame:
    return _run(tiny, _cfg(resolution="native", split="all"))


def test_native_samples_every_case_at_its_own_size(native):
    expected = {"c0": (64, 128), "c1": (128, 64), "c2": (64, 128), "c3": (32, 128)}  # (height, width)
    assert sorted(native["prompt_id"].unique()) == ["c0", "c1", "c2", "c3"]  # split all: the train case too
    assert len(native) == 4 * 2
    for row in native.to_dict("records"):
        image = decode_image(row["image"])
        assert (row["height"], row["width"]) == expected[row["prompt_id"]]
        assert image.size == expected[row["prompt_id"]][::-1]  # PIL: (width, height)


def test_a_native_sample_is_sampled_at_that_size_not_resized(tiny, native):
    """The base sample of c0 is exactly the policy's own 64 x 128 ODE sample from the case's noise."""
    from paco.grpo.policies import load_policy

    cfg = _cfg(resolution="native", split="all")
    policy = load_policy("flux", tiny[0], None, cfg, dtype=torch.float32, device=torch.device("cpu"))
    info = R.SubtaskItem.from_row(_prompts().iloc[0].to_dict())
    gen = torch.Generator().manual_seed(stable_seed(cfg.seed, "final", "c0", 0))
    roll = policy.generate(policy.condition([info], 64, 128), height=64, width=128, num_steps=2, sde=ODE,
                           sde_indices=[], noise_generators=[gen])
    direct = np.asarray(policy.decode(roll.final_latents, 64, 128)[0])
    rows = native.set_index(["prompt_id", "variant"])
    base = np.asarray(decode_image(rows.loc[("c0", "base"), "image"]))
    lora = np.asarray(decode_image(rows.loc[("c0", "lora"), "image"]))
    assert np.array_equal(base, direct)
    assert not np.array_equal(lora, base)  # the LoRA variant is another sample (same noise)


def test_the_area_rescale_path_keeps_its_sizes(tiny):
    """resolution 64: each case at its aspect with area 64**2, sides rounded to 16 (grid_size):
    64 x 128 -> 64 / sqrt(8192) = 0.7071 -> 45.25 x 90.51 -> 48 x 96; 40 x 120 -> 0.9238 ->
    36.95 x 110.85 -> 32 x 112. Only the test split (c1 is train)."""
    table = _run(tiny, _cfg(resolution=64))
    sizes = {r["prompt_id"]: (r["height"], r["width"]) for r in table.to_dict("records")}
    assert sizes == {"c0": (48, 96), "c2": (48, 96), "c3": (32, 112)}
    assert all(decode_image(c).size == (sizes[p][1], sizes[p][0]) for p, c in zip(table["prompt_id"], table["image"]))


def test_the_benchmark_cut_of_a_native_sample_gives_native_panels(native, tmp_path):
    """The benchmark's row-major equal cut (paco.benchmark.t2is_panels.cut_panels) of native 1x2,
    2x1, 2x4 and non-square samples: panels of height/rows x width/cols px, written as
    ``{case_id}_{k:04d}.png``, each the crop of its cell."""
    from PIL import Image

    from paco.benchmark.t2is_panels import cut_panels, write_official_layout

    panel_size = {"c0": (64, 64), "c1": (64, 64), "c2": (32, 32), "c3": (32, 64)}  # (height, width)
    for row in native[native["variant"] == "lora"].to_dict("records"):
        r, c, *_ = CASES[row["prompt_id"]]
        image = decode_image(row["image"])
        ph, pw = panel_size[row["prompt_id"]]
        panels = cut_panels(image, f"{r}x{c}")
        paths = write_official_layout(panels, row["prompt_id"], tmp_path)
        assert [p.name for p in paths] == [f"{row['prompt_id']}_{k:04d}.png" for k in range(r * c)]
        for k, path in enumerate(paths):
            i, j = divmod(k, c)
            written = Image.open(path)
            assert written.size == (pw, ph)
            cell = image.crop((j * pw, i * ph, (j + 1) * pw, (i + 1) * ph))
            assert np.array_equal(np.asarray(written.convert("RGB")), np.asarray(cell))


@pytest.mark.parametrize(("over", "message"), [
    (dict(resolution="nativ"), "Input should be 'native'"),
    (dict(resolution=8), "greater than or equal to 16"),
    (dict(resolution=True), "valid integer"),
    (dict(resolution="1024"), "Input should be 'native'"),
    (dict(split="val"), "Input should be 'train', 'test' or 'all'"),
    (dict(resolution="native", dataset="edits", family="flux_kontext"),
     "resolution native is for dataset prompts"),
])
def test_the_schema_refuses_bad_values(over, message):
    with pytest.raises(ValidationError, match=message):
        FinalSamplesParams.model_validate(dict(lora=LORA, **over))


def test_the_schema_takes_native_and_all_and_keeps_numbers():
    cfg = FinalSamplesParams.model_validate(dict(lora=LORA, resolution="native", split="all"))
    assert (cfg.resolution, cfg.split) == ("native", "all")
    cfg = FinalSamplesParams.model_validate(dict(lora=LORA))
    assert (cfg.resolution, cfg.split) == (1024, "test") and cfg.model_dump(mode="json")["resolution"] == 1024


def test_sample_size():
    from paco.grpo.final_samples import sample_size

    assert sample_size(1024, 2048, "native") == (1024, 2048)  # T2IS-Bench 2x4, 512 px panels
    assert sample_size(1024, 2048, 1024) == (720, 1456)  # the area rescale: 360 x 364 px panels
    assert sample_size(520, 1000, "native") == (512, 992)  # 32.5 -> 32 (half to even), 62.5 -> 62
    assert sample_size(8, 8, "native") == (16, 16)  # at least one multiple
    assert sample_size(100, 100, "native", multiple=32) == (96, 96)
    with pytest.raises(ValueError, match="'native'"):
        sample_size(64, 64, "full")
    with pytest.raises(ValueError, match="positive"):
        sample_size(0, 64, "native")
