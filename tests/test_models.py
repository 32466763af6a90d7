"""The models library: tiny builds, materialise (tiny / local / hub cache), loaders, ClipScorer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from paco.models.fetch import materialise
from paco.models.loading import (
    ModelDirectoryError,
    load_clip,
    load_flux_pipeline,
    load_judge,
    load_qwen_vl_processor,
)
from paco.models.tiny import build_tiny

REPO = Path(__file__).resolve().parents[1]
TINY_NAME = {"judge_base": "qwen2_5_vl", "policy_t2is": "flux", "policy_kontext": "flux_kontext",
             "policy_qwen_edit": "qwen_image_edit", "clip": "clip"}


def _digests(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _image(seed: int, size: int = 128) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture
def offline(monkeypatch):
    """HF offline mode, set both in the environment and in huggingface_hub's constants (read
    at import time)."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


# --------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["judge_base", "policy_t2is", "policy_kontext", "policy_qwen_edit", "clip"])
def test_same_seed_gives_identical_files(tiny_model_dirs, tmp_path, role):
    again = build_tiny(TINY_NAME[role], tmp_path / "again", seed=0)
    first, second = _digests(tiny_model_dirs[role]), _digests(again)
    assert first == second
    assert any(name.endswith(".safetensors") for name in first)


@pytest.mark.parametrize("role", ["judge_base", "clip"])
def test_other_seed_changes_every_weight_file(tiny_model_dirs, tmp_path, role):
    other = build_tiny(TINY_NAME[role], tmp_path / "other", seed=1)
    first, second = _digests(tiny_model_dirs[role]), _digests(other)
    assert first.keys() == second.keys()
    weights = [k for k in first if k.endswith(".safetensors")]
    assert weights and all(first[k] != second[k] for k in weights)
    # the tokenizer does not depend on the seed
    assert first["tokenizer.json"] == second["tokenizer.json"]


def test_flux_other_seed_changes_every_component(tiny_model_dirs, tmp_path):
    other = build_tiny("flux", tmp_path / "other", seed=1)
    first, second = _digests(tiny_model_dirs["policy_t2is"]), _digests(other)
    weights = [k for k in first if k.endswith(".safetensors")]
    assert len(weights) == 4  # transformer, vae, text_encoder, text_encoder_2
    assert all(first[k] != second[k] for k in weights)


def test_build_is_identical_in_another_process(tiny_model_dirs, tmp_path):
    """Hash randomisation or thread scheduling must not leak into the files (a tokenizer trainer
    that breaks ties by hash-map order would pass the in-process tests and fail this one)."""
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    code = (
        "import sys; from pathlib import Path; from paco.models.tiny import build_tiny; "
        "build_tiny('clip', Path(sys.argv[1]), seed=0)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "clip")], check=True, env=env,
                   cwd=REPO, timeout=120)
    assert _digests(tmp_path / "clip") == _digests(tiny_model_dirs["clip"])


def test_build_restores_global_rng(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny("clip", tmp_path / "clip", seed=7)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------------------------
# loading (from_pretrained, offline)
# --------------------------------------------------------------------------------------------


def test_judge_round_trip_offline(tiny_model_dirs, tmp_path, offline):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLImageProcessorPil

    model, processor = load_judge(tiny_model_dirs["judge_base"])
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    assert isinstance(processor.tokenizer, Qwen2Tokenizer)
    assert not hasattr(processor, "video_processor") or processor.video_processor is None
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert next(model.parameters()).dtype == torch.float32

    # save -> load again gives the same weights and processor config
    model.save_pretrained(tmp_path / "copy")
    processor.save_pretrained(tmp_path / "copy")
    model2, processor2 = load_judge(tmp_path / "copy")
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert processor2.image_processor.to_dict() == processor.image_processor.to_dict()
    assert processor2.chat_template == processor.chat_template


def test_yes_and_no_are_single_tokens(tiny_model_dirs, offline):
    tok = load_qwen_vl_processor(tiny_model_dirs["judge_base"]).tokenizer
    ids = {w: tok.encode(w, add_special_tokens=False) for w in ("Yes", "No", " Yes", " No")}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == 4
    # and the template's special tokens are single, distinct ids
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    special_ids = [tok.convert_tokens_to_ids(t) for t in specials]
    assert len(set(special_ids)) == len(specials) and tok.unk_token_id not in special_ids
    assert tok.decode(tok.encode("Yes. <reason>1. The style is the same.</reason>")) == (
        "Yes. <reason>1. The style is the same.</reason>"
    )


@pytest.mark.parametrize("name", ["t2is_theme", "criteria_cot", "rank_cot"])
def test_frozen_corpus_templates_still_cover_the_current_judge_templates(tiny_model_dirs, offline, name):
    """The tiny tokenizers were trained on frozen copies of two templates (paco.models.corpus), so a
    reworded judge template does not retrain them. The current T2IS questions must still encode
    compactly: every word of their literal text one or two tokens and at most a token per 4
    characters (measured: 0.20-0.22; the untrained edit_pf template needs 0.39, with 7 tokens for
    "Instruction"), decoding back to the text. A reworded template with new words fails here:
    update the frozen copies (which rebuilds the tiny models) or keep the wording."""
    import re
    import string

    from paco.core.templates import get_template

    tok = load_qwen_vl_processor(tiny_model_dirs["judge_base"]).tokenizer
    template = get_template(name)
    literal = "".join(part for part, *_ in string.Formatter().parse(template.text))
    too_long = {w: n for w in re.findall(r"[A-Za-z]+", literal)
                if (n := len(tok.encode(" " + w, add_special_tokens=False))) > 2}
    assert not too_long, too_long
    filled = template.format(**{f: "a red fox in the snow" for f in template.fields})
    ids = tok.encode(filled, add_special_tokens=False)
    assert len(ids) <= len(filled) / 4, (len(ids), len(filled))
    assert tok.decode(ids) == filled


def test_judge_forward_on_two_images(tiny_model_dirs, offline):
    from paco.models.corpus import PAIRWISE_TEMPLATE

    model, processor = load_judge(tiny_model_dirs["judge_base"])
    messages = [{
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": PAIRWISE_TEMPLATE.format(main_prompt="a red fox in the snow")},
        ],
    }]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert text.endswith("<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[_image(0), _image(1)], return_tensors="pt")
    # a 128 px panel -> 112x112 px -> 8x8 patches -> 16 merged visual tokens
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image_tokens == 2 * 16
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(out.logits).all()
    yes, no = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("Yes", "No"))
    assert torch.isfinite(out.logits[0, -1, [yes, no]].log_softmax(-1)).all()


def test_flux_generates_128px_image(tiny_model_dirs, offline):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
    assert isinstance(pipe, FluxPipeline)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    cfg = pipe.scheduler.config
    assert cfg.use_dynamic_shifting and (cfg.base_shift, cfg.max_shift) == (0.5, 1.15)
    assert (cfg.base_image_seq_len, cfg.max_image_seq_len) == (256, 4096)
    assert pipe.vae.config.latent_channels == 16 and pipe.vae_scale_factor == 8

    def generate():
        return pipe(
            "[TOP-LEFT] a red fox [TOP-RIGHT] the same fox running",
            height=128, width=128, num_inference_steps=2, guidance_scale=3.5,
            max_sequence_length=64, generator=torch.Generator().manual_seed(0),
        ).images[0]

    start = time.perf_counter()
    image = generate()
    elapsed = time.perf_counter() - start
    assert image.size == (128, 128) and image.mode == "RGB"
    assert np.array_equal(np.asarray(image), np.asarray(generate()))  # seeded -> reproducible
    assert elapsed < 10, f"tiny FLUX took {elapsed:.1f}s for 2 steps at 128x128"


def test_clip_scorer_embeddings(tiny_model_dirs, offline):
    from paco.models.clip import ClipScorer

    scorer = ClipScorer(tiny_model_dirs["clip"])
    images = [_image(i, size=64 + 16 * i) for i in range(3)]
    emb = scorer.image_embeddings(images + [images[0]], batch_size=2)
    assert emb.shape == (4, scorer.dim) and emb.dtype == torch.float32
    assert torch.allclose(emb.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert scorer.cosine(emb[:1], emb[3:]).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(scorer.cosine(emb, emb), torch.ones(4), atol=1e-5)
    assert scorer.cosine(emb[0], emb[1]).item() < 1.0 - 1e-6

    texts = ["a red fox in the snow", "an astronaut on the moon " * 30]  # second one truncated
    temb = scorer.text_embeddings(texts)
    assert temb.shape == (2, scorer.dim)
    assert torch.allclose(temb.norm(dim=-1), torch.ones(2), atol=1e-5)
    sims = scorer.similarity_matrix(emb, temb)
    assert sims.shape == (4, 2) and (sims.abs() <= 1).all()
    assert torch.allclose(sims[:, 0], scorer.cosine(emb, temb[:1]), atol=1e-6)
    scores = scorer.image_text_scores(images, ["a red fox"])
    assert scores.shape == (3,) and (scores.abs() <= scorer.logit_scale + 1e-4).all()
    assert scorer.image_embeddings([]).shape == (0, scorer.dim)


def test_clip_round_trip_offline(tiny_model_dirs, offline):
    from transformers import CLIPImageProcessorPil, CLIPModel

    model, processor = load_clip(tiny_model_dirs["clip"])
    assert isinstance(model, CLIPModel)
    assert isinstance(processor.image_processor, CLIPImageProcessorPil)
    ids = processor.tokenizer("a photo of a cat").input_ids
    assert ids[0] == processor.tokenizer.bos_token_id and ids[-1] == processor.tokenizer.eos_token_id
    pixels = processor(images=[_image(0)], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 32, 32)


def test_loaders_reject_missing_or_incomplete_dirs(tiny_model_dirs, tmp_path):
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        load_judge(tmp_path / "nope")
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        load_flux_pipeline(tmp_path / "nope")
    broken = materialise("clip", str(tiny_model_dirs["clip"]), tmp_path / "broken", seed=0)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelDirectoryError, match="incomplete"):
        load_clip(broken)
    flux = materialise("policy_t2is", str(tiny_model_dirs["policy_t2is"]), tmp_path / "flux", seed=0,
                       allow_patterns=["model_index.json", "transformer/*", "scheduler/*"])
    with pytest.raises(ModelDirectoryError, match="vae"):
        load_flux_pipeline(flux)


def _edit_weights(path: Path, drop: int = 0, where: str = "", extra: str | None = None) -> list[str]:
    """Rewrite the safetensors file ``path`` without its first ``drop`` tensors whose name
    contains ``where`` (and with an ``extra`` tensor); the names dropped."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path)
    gone = sorted(k for k in weights if where in k)[:drop]
    for k in gone:
        del weights[k]
    if extra:
        weights[extra] = torch.zeros(2)
    save_file(weights, path, metadata={"format": "pt"})
    return gone


def _load_family(family: str, path: Path):
    from paco.grpo.policies import policy_class
    from paco.models.loading import load_pipeline

    cls = policy_class(family)
    return load_pipeline(path, cls.pipeline_class, cls.components, overrides=cls.component_overrides(path))


def test_weights_that_do_not_match_the_model_are_refused_by_name(tiny_model_dirs, tmp_path):
    """A missing tensor used to be random-initialised with a log line ('newly initialized') and
    an unexpected one dropped; every role refuses both now, naming them (the list capped)."""
    from paco.models.loading import WeightsMismatchError

    judge = materialise("judge_base", str(tiny_model_dirs["judge_base"]), tmp_path / "judge", seed=0)
    gone = _edit_weights(judge / "model.safetensors", 12, ".mlp.", extra="model.surplus.weight")
    with pytest.raises(WeightsMismatchError) as err:
        load_judge(judge)
    msg = str(err.value)
    assert str(judge) in msg and "12 missing" in msg and "1 unexpected" in msg and "surplus" in msg
    assert sum(k.split(".", 1)[1] in msg for k in gone) == 10 and "and 2 more" in msg, msg
    clip = materialise("clip", str(tiny_model_dirs["clip"]), tmp_path / "clip", seed=0)
    gone = _edit_weights(clip / "model.safetensors", 1, "vision_model.encoder.layers.0.")
    with pytest.raises(WeightsMismatchError, match=rf"clip.*1 missing.*{gone[0]}"):
        load_clip(clip)
    cases = [("flux", "policy_t2is", "transformer/diffusion_pytorch_model.safetensors", 1, None),
             ("flux_kontext", "policy_kontext", "vae/diffusion_pytorch_model.safetensors", 0, "decoder.surplus"),
             ("flux", "policy_t2is", "text_encoder_2/model.safetensors", 1, None),
             ("qwen_image_edit", "policy_qwen_edit", "text_encoder/model.safetensors", 1, None),
             ("qwen_image_edit", "policy_qwen_edit", "transformer/diffusion_pytorch_model.safetensors", 0, "x.y")]
    for i, (family, role, file, drop, extra) in enumerate(cases):
        pipe_dir = materialise(role, str(tiny_model_dirs[role]), tmp_path / f"pipe{i}", seed=0)
        gone = _edit_weights(pipe_dir / file, drop, "", extra)
        component = file.split("/")[0]
        with pytest.raises(WeightsMismatchError) as err:
            _load_family(family, pipe_dir)
        msg = str(err.value)
        assert str(pipe_dir / component) in msg and all(k.rsplit(".", 2)[-2] in msg for k in gone), msg
        assert (extra or "") in msg


def test_intentionally_absent_tied_weights_are_not_reported(tiny_model_dirs, tmp_path):
    """Tied weights are written once: T5's encoder embedding (FLUX's text_encoder_2) and a
    judge whose lm_head is its embedding. Neither is a missing tensor; every default loads."""
    judge = materialise("judge_base", str(tiny_model_dirs["judge_base"]), tmp_path / "judge", seed=0)
    config = json.loads((judge / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config.setdefault("text_config", {})["tie_word_embeddings"] = True
    (judge / "config.json").write_text(json.dumps(config))
    assert _edit_weights(judge / "model.safetensors", 1, "lm_head.") == ["lm_head.weight"]
    model, _ = load_judge(judge)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    load_judge(tiny_model_dirs["judge_base"])
    load_clip(tiny_model_dirs["clip"])
    for family, role in (("flux", "policy_t2is"), ("flux_kontext", "policy_kontext"),
                         ("qwen_image_edit", "policy_qwen_edit")):
        assert _load_family(family, tiny_model_dirs[role]).transformer is not None


def _sharded(model: Path) -> Path:
    """Turn ``model``'s single weights file into a one-shard index; the shard's path."""
    from safetensors import safe_open

    shard = model / "model-00001-of-00001.safetensors"
    (model / "model.safetensors").rename(shard)
    with safe_open(str(shard), "pt") as fh:
        keys = list(fh.keys())
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: shard.name for k in keys}}))
    return shard


def test_unreadable_or_truncated_weights_are_named_with_the_reason(tiny_model_dirs, tmp_path):
    """The file and the real reason, not 'No such device (os error 19)' or a header error that
    names no file."""
    def fresh(name: str) -> Path:
        return materialise("judge_base", str(tiny_model_dirs["judge_base"]), tmp_path / name, seed=0)

    model = fresh("truncated")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelDirectoryError, match=rf"{model / 'model.safetensors'}.*truncated"):
        load_judge(model)
    model = fresh("garbage")
    (model / "model.safetensors").write_bytes(b"hello, not weights")
    with pytest.raises(ModelDirectoryError, match=rf"{model / 'model.safetensors'}.*not a safetensors file"):
        load_judge(model)
    model = fresh("dir")
    shard = _sharded(model)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(ModelDirectoryError, match=rf"cannot read weights file {shard}.*Is a directory"):
        load_judge(model)
    model = fresh("gone")
    shard = _sharded(model)
    shard.unlink()
    with pytest.raises(ModelDirectoryError, match=rf"{shard.name}.*named by {model / 'model.safetensors.index.json'}"):
        load_judge(model)
    model = fresh("badindex")
    _sharded(model)
    (model / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ModelDirectoryError, match=rf"{model / 'model.safetensors.index.json'}.*not valid JSON"):
        load_judge(model)
    flux = materialise("policy_t2is", str(tiny_model_dirs["policy_t2is"]), tmp_path / "flux", seed=0)
    vae = flux / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:100])
    with pytest.raises(ModelDirectoryError, match=rf"{vae}"):
        load_flux_pipeline(flux)
    if os.geteuid() != 0:  # root reads anything
        model = fresh("unreadable")
        (model / "model.safetensors").chmod(0)
        with pytest.raises(ModelDirectoryError, match=rf"{model / 'model.safetensors'}.*Permission denied"):
            load_judge(model)


# --------------------------------------------------------------------------------------------
# materialise
# --------------------------------------------------------------------------------------------


def test_unknown_tiny_name_errors(tmp_path):
    with pytest.raises(ValueError, match=r"models\.judge_base.*tiny:gpt5"):
        materialise("judge_base", "tiny:gpt5", tmp_path / "out", seed=0)
    with pytest.raises(ValueError, match="unknown tiny model"):
        build_tiny("gpt5", tmp_path / "out", seed=0)
    assert not (tmp_path / "out").exists()


def test_missing_local_path_errors(tmp_path):
    with pytest.raises(ValueError, match=r"models\.clip.*does not exist"):
        materialise("clip", str(tmp_path / "no" / "such" / "dir"), tmp_path / "out", seed=0)


def test_local_copy_replaces_out_dir_atomically(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["clip"]
    out = tmp_path / "models" / "clip"
    out.mkdir(parents=True)
    (out / "stale.bin").write_bytes(b"old")
    # a symlinked source file is materialised as a regular file
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in src.iterdir():
        (linked / f.name).symlink_to(f)
    assert materialise("clip", str(linked), out, seed=0) == out
    assert not (out / "stale.bin").exists()
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert _digests(out) == _digests(src)
    assert sorted(p.name for p in out.parent.iterdir()) == ["clip"]  # no temp dirs left behind


def _fake_hub_cache(cache: Path, repo_id: str, src: Path, commit: str) -> Path:
    """Lay out ``src`` as huggingface_hub's cache would after a download of ``repo_id``:
    blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def test_hub_id_from_offline_cache(tiny_model_dirs, tmp_path, monkeypatch, offline):
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf_cache"
    _fake_hub_cache(cache, "paco-test/tiny-clip", tiny_model_dirs["clip"], commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    out = materialise("clip", "paco-test/tiny-clip", tmp_path / "out", seed=0)
    assert _digests(out) == _digests(tiny_model_dirs["clip"])
    assert not any(p.is_symlink() for p in out.rglob("*"))
    model, _ = load_clip(out)
    assert isinstance(model, torch.nn.Module)

    # an explicit commit revision and allow_patterns
    only_json = materialise("clip", "paco-test/tiny-clip", tmp_path / "json", seed=0,
                            revision=commit, allow_patterns=["*.json"])
    assert sorted(p.name for p in only_json.iterdir()) == sorted(
        f for f in _digests(tiny_model_dirs["clip"]) if f.endswith(".json"))

    with pytest.raises(ValueError, match=r"models\.clip.*paco-test/not-cached.*not available"):
        materialise("clip", "paco-test/not-cached", tmp_path / "missing", seed=0)
    with pytest.raises(ValueError, match=r"models\.clip.*'paco-test/tiny-clip'.*not available"):
        materialise("clip", "paco-test/tiny-clip", tmp_path / "missing", seed=0, revision="v9")
    assert not (tmp_path / "missing").exists()


def _processor_source(tiny_model_dirs, root: Path) -> Path:
    """A CLIP directory standing for ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: another seed's
    weights, a changed image processor (mean 0.5), an extra weights file and no
    ``tokenizer_config.json``."""
    src = build_tiny("clip", root, seed=1)
    config = json.loads((src / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (src / "processor_config.json").write_text(json.dumps(config))
    (src / "tokenizer_config.json").unlink()
    (src / "open_clip_pytorch_model.bin").write_bytes(b"not a processor file")
    return src


def test_processor_from_copies_only_the_processor_files(tiny_model_dirs, tmp_path, monkeypatch, offline):
    """``models.processor_from``: the role keeps its own weights and config and takes exactly the
    processor files the second source has (PickScore_v1 + the ViT-H processor); from a hub id only
    those files are fetched."""
    from paco.models.fetch import PROCESSOR_FILES

    model = tiny_model_dirs["clip"]
    src = _processor_source(tiny_model_dirs, tmp_path / "laion")
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    cache = tmp_path / "hf_cache"
    _fake_hub_cache(cache, "paco-test/laion", src, commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub

    asked = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: asked.append(kw) or real(**kw))
    for source in (str(src), "paco-test/laion"):
        out = materialise("pickscore", str(model), tmp_path / "out" / "pickscore", seed=0, processor_from=source)
        got, mine, theirs = _digests(out), _digests(model), _digests(src)
        assert set(got) == {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"}
        assert got["config.json"] == mine["config.json"]
        assert got["model.safetensors"] == mine["model.safetensors"] != theirs["model.safetensors"]
        for name in ("processor_config.json", "tokenizer.json"):
            assert name in PROCESSOR_FILES and got[name] == theirs[name]
        assert got["processor_config.json"] != mine["processor_config.json"]
        _, processor = load_clip(out)
        assert list(processor.image_processor.image_mean) == [0.5, 0.5, 0.5]
        assert sorted(p.name for p in out.parent.iterdir()) == ["pickscore"]  # no temp dirs left behind
    # the hub source is asked for the processor files only (the laion repo holds GBs of weights)
    assert [(kw["repo_id"], kw["allow_patterns"]) for kw in asked] == [("paco-test/laion", list(PROCESSOR_FILES))]


def test_processor_from_errors_are_named(tiny_model_dirs, tmp_path):
    from paco.core.params import ParamsError, validate_params

    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["models"]["processor_from"] = {"pickscroe": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"}
    with pytest.raises(ParamsError, match=r"models\.processor_from names unknown role\(s\) \['pickscroe'\]"):
        validate_params(raw, source="params.yaml")
    raw["models"]["processor_from"] = {"pickscore": " "}
    with pytest.raises(ParamsError, match=r"models\.processor_from\.pickscore: an empty source"):
        validate_params(raw, source="params.yaml")
    model = tiny_model_dirs["clip"]
    with pytest.raises(ValueError, match=r"models\.processor_from\.pickscore: local model directory .* does not exist"):
        materialise("pickscore", str(model), tmp_path / "out", seed=0, processor_from=str(tmp_path / "no" / "dir"))
    empty = tmp_path / "weights_only"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"models\.processor_from\.pickscore: .* holds none of the processor files"):
        materialise("pickscore", str(model), tmp_path / "out", seed=0, processor_from=str(empty))
    assert not (tmp_path / "out").exists()


def test_models_stage_builds_every_role_the_params_name(tmp_path):
    """A further ``models:`` role (here a second FLUX policy) is built like the required ones."""
    from pathlib import Path

    import yaml

    from stages import models as stage

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["models"]["policy_extra"] = "tiny:flux"
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    code = stage.main(["--params", str(params), "--out", str(tmp_path / "models"), "--metrics", str(tmp_path / "m.json")])
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir()) == [
        "clip", "judge_base", "pickscore", "policy_extra", "policy_kontext", "policy_qwen_edit", "policy_t2is"]
    # the embedded default's pickscore role is the clip role's bytes (same tiny build, same seed)
    assert _digests(tmp_path / "models/pickscore") == _digests(tmp_path / "models/clip")
    assert (tmp_path / "models/policy_extra/model_index.json").is_file()
    index = json.loads((tmp_path / "models/policy_qwen_edit/model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == ["transformers", "Qwen2VLProcessor"]
