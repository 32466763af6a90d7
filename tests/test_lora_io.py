"""Released LoRAs (paco.grpo.policies.lora_io): the reference's PEFT layout and the diffusers layout
load to the same transformer, exactly the one PEFT itself runs; nothing is loaded in part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from paco.grpo.policies.lora_io import LoraLoadError, load_lora, lora_format, read_lora

TARGETS = ["attn.to_q", "attn.to_k", "attn.to_out.0", "ff.net.2"]
R, ALPHA = 4, 8.0  # scale alpha / r = 2, as the reference's r=64, lora_alpha=128


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    from paco.models.fetch import materialise

    return materialise("policy_t2is", "tiny:flux", tmp_path_factory.mktemp("lora_io") / "flux", seed=0)


def _pipe(flux_dir: Path):
    from paco.models.loading import load_flux_pipeline

    return load_flux_pipeline(flux_dir)


def _inputs(transformer) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    c = transformer.config
    seq, text = 16, 8
    return {"hidden_states": torch.randn(1, seq, c.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, text, c.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
            "timestep": torch.tensor([0.6]), "guidance": torch.tensor([3.5]),
            "img_ids": torch.randn(seq, 3, generator=g), "txt_ids": torch.zeros(text, 3)}


@torch.no_grad()
def _out(model, inputs) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0]


@pytest.fixture(scope="module")
def saved(flux_dir, tmp_path_factory):
    """The same random LoRA saved as the reference saves it (``get_peft_model``, a second adapter
    ``old``, ``PeftModel.save_pretrained``: train_flux.py l.736, l.834-842) and in diffusers'
    layout (``FluxPipeline.save_lora_weights`` with r / lora_alpha as metadata), and the PEFT
    model's own output on fixed inputs."""
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("loras")
    config = LoraConfig(r=R, lora_alpha=ALPHA, init_lora_weights="gaussian", target_modules=TARGETS)
    peft_model = get_peft_model(_pipe(flux_dir).transformer, config)
    g = torch.Generator().manual_seed(7)
    weights = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in get_peft_model_state_dict(peft_model).items()}
    set_peft_model_state_dict(peft_model, weights)
    peft_model.add_adapter("old", config)  # saved into old/, which the loader ignores
    peft_model.set_adapter("default")
    peft_model.eval()
    peft_model.save_pretrained(str(root / "peft"))
    assert (root / "peft" / "old" / "adapter_model.safetensors").is_file()
    inputs = _inputs(peft_model.base_model.model)
    reference = _out(peft_model, inputs)
    plain = {k.removeprefix("base_model.model."): v for k, v in weights.items()}
    FluxPipeline.save_lora_weights(str(root / "diffusers"), transformer_lora_layers=plain, safe_serialization=True,
                                   transformer_lora_adapter_metadata={"r": R, "lora_alpha": ALPHA,
                                                                      "target_modules": TARGETS})
    return root, inputs, reference


def test_peft_and_diffusers_layouts_give_the_reference_peft_model_exactly(flux_dir, saved):
    root, inputs, reference = saved
    assert lora_format(root / "peft") == "peft" and lora_format(root / "diffusers") == "diffusers"
    base = _out(_pipe(flux_dir).transformer, inputs)
    outs = {}
    for layout in ("peft", "diffusers"):
        pipe = _pipe(flux_dir)
        name = load_lora(pipe, root / layout)
        assert pipe.transformer.peft_config[name].lora_alpha / pipe.transformer.peft_config[name].r == 2.0
        outs[layout] = _out(pipe.transformer, inputs)
    assert torch.equal(outs["peft"], outs["diffusers"])
    assert torch.equal(outs["peft"], reference)  # alpha / r carried: the output PEFT itself computes
    assert (outs["peft"] - base).abs().max() > 1e-2  # the LoRA does change the transformer
    weights, meta = read_lora(root / "peft")
    assert {**meta, "target_modules": sorted(meta["target_modules"])} == {
        "r": R, "lora_alpha": ALPHA, "target_modules": sorted(TARGETS), "use_rslora": False}
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) and not k.startswith("base_model") for k in weights)


def _copy_peft(root: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / "peft", dst)
    weights = load_file(str(dst / "adapter_model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


def test_a_key_that_matches_no_module_is_refused(flux_dir, saved, tmp_path):
    root, _, _ = saved
    extra = _copy_peft(root, tmp_path / "extra", lambda w: w.update(
        {"base_model.model.transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(R, 32)}))
    with pytest.raises(LoraLoadError, match=r"partial load .* 1 LoRA weight\(s\) match no module .*attn\.nope"):
        load_lora(_pipe(flux_dir), extra)
    key = "base_model.model.transformer_blocks.0.attn.to_k.lora_A.weight"
    shape = _copy_peft(root, tmp_path / "shape", lambda w: w.update({key: torch.zeros(R, 5)}))
    with pytest.raises(LoraLoadError, match=r"1 weight\(s\) differ after loading, e\.g\. \['transformer_blocks\.0\.attn"
                       r"\.to_k\.lora_A\.weight'\]"):
        load_lora(_pipe(flux_dir), shape)  # diffusers kept a misfit shape out without a word
    dora = _copy_peft(root, tmp_path / "dora", lambda w: w.update(
        {"base_model.model.transformer_blocks.0.attn.to_q.lora_magnitude_vector": torch.ones(32)}))
    with pytest.raises(LoraLoadError, match="not of the form"):
        read_lora(dora)


def test_layouts_are_named_or_refused(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(LoraLoadError, match=r"no LoRA: neither .*found \['notes.txt'\]"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "notes.txt").write_text("")
        lora_format(tmp_path / "empty")
    both = tmp_path / "both"
    shutil.copytree(root / "peft", both)
    shutil.copy(root / "diffusers" / "pytorch_lora_weights.safetensors", both)
    with pytest.raises(LoraLoadError, match="both a diffusers LoRA"):
        lora_format(both)
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    bad = tmp_path / "dora_config"
    shutil.copytree(root / "peft", bad)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraLoadError, match="use_dora is set"):
        read_lora(bad)
