"""reward_train: LoRA on the judge's language model only, learning on synthetic pairs, resume ==
uninterrupted, 2 CPU processes (gloo) == 1 process, the adapter reloads with PEFT, another run
identity starts fresh, accelerate configs.

Synthetic data (:func:`make_sft_table`): a *Yes* pair is two views (random crop, flip) of one
random texture with a warm tint; a *No* pair is a warm-tinted texture and another texture with a
cool tint. The tiny random-init judge (frozen random vision tower, LoRA on its 2-layer language
model) learns this within one epoch because the pair's pooled colour statistics differ linearly
with the label; chance is 0.5 on the balanced test split. (It does not learn a comparison
that needs A and B pooled separately -- e.g. complementary tints of random colours -- in this
few steps; that is a property of the tiny random model, not of the training loop.)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from PIL import Image

from paco.core.io import encode_image
from paco.core.params import LoraParams, RewardTrainParams
from paco.core.templates import judge_instruction
from paco.judge.response import format_response


def train_reward(cfg, sft, base, **kw) -> dict:
    """:func:`paco.judge.training.train_reward` with the params part of ``reward_train``'s run
    identity; returns the report with the headline metrics under ``"metrics_headline"``."""
    from paco.judge.training import train_reward as train
    from paco.core.run_identity import params_identity
    from workflow.registry import member

    out = train(cfg, sft, base, identity=params_identity(member("reward_train"), {"reward_train": cfg.model_dump(mode="json")}),
                **kw)
    return {**out["report"], "metrics_headline": out["metrics"]}


def list_checkpoints(ck):
    from paco.core.checkpoints import list_checkpoints as listed

    return listed(ck, "step-")

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# synthetic sft tables
# --------------------------------------------------------------------------------------------


def _texture(rng: np.random.Generator, colour: np.ndarray, size: int) -> np.ndarray:
    noise = rng.normal(0.0, 1.0, (size // 8, size // 8, 3))
    img = Image.fromarray(np.uint8(np.clip(128 + 60 * noise, 0, 255))).resize((size, size), Image.BILINEAR)
    x = np.asarray(img, np.float32) / 255.0
    out = (0.5 * x.mean(-1, keepdims=True) + 0.5 * colour[None, None]) * (0.6 + 0.8 * x)
    return np.uint8(np.clip(out * 255, 0, 255))


def _view(rng: np.random.Generator, arr: np.ndarray, size: int) -> Image.Image:
    s = int(rng.uniform(0.7, 0.95) * arr.shape[0])
    y0, x0 = rng.integers(0, arr.shape[0] - s + 1, size=2)
    im = Image.fromarray(arr[y0:y0 + s, x0:x0 + s]).resize((size, size), Image.BILINEAR)
    return im.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else im


def make_sft_table(n_train: int, n_test: int, *, seed: int = 0, size: int = 64) -> pd.DataFrame:
    """A balanced synthetic ``sft.parquet`` table (columns as the reasons stage writes them)."""
    rng = np.random.default_rng(seed)
    rows = []
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n):
            label = i % 2 == 0
            warm = np.array([rng.uniform(0.7, 0.95), rng.uniform(0.3, 0.6), rng.uniform(0.05, 0.25)])
            src_a = _texture(rng, warm, 2 * size)
            src_b = src_a if label else _texture(rng, warm[::-1].copy(), 2 * size)  # a cool tint
            reasons = ["the colours and textures match."] if label else ["the colour palettes differ clearly."]
            rows.append({
                "pair_id": f"{split}-{i:04d}", "instance_id": f"inst-{i // 2}", "prompt_id": f"p{i % 4}",
                "split": split, "instruction": judge_instruction("a textured wall"),
                "image_a": encode_image(_view(rng, src_a, size)), "image_b": encode_image(_view(rng, src_b, size)),
                "label": label, "reasons": reasons, "response": format_response(label, reasons),
                "teacher": "synthetic", "status": "ok", "error": None,
            })
    # a failed row and its train split twin must be ignored
    bad = dict(rows[0], pair_id="train-failed", status="failed", response="", error="teacher timeout")
    return pd.DataFrame(rows + [bad])


def _cfg(**kw) -> RewardTrainParams:
    base = dict(seed=0, learning_rate=1e-2, epochs=3, batch_size=8, first_token_weight=0.5,
                warmup_ratio=0.1, checkpoint_every=3)
    base.update(kw)
    return RewardTrainParams.model_validate(base)


def _adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


# --------------------------------------------------------------------------------------------
# LoRA placement
# --------------------------------------------------------------------------------------------


def test_lora_only_on_language_model(tiny_model_dirs):
    from paco.models.loading import load_judge
    from paco.judge.lora import apply_lora, language_model_prefix, lora_config, parameter_counts

    model, _ = load_judge(tiny_model_dirs["judge_base"])
    prefix = language_model_prefix(model)
    assert prefix == "model.language_model"
    targets = LoraParams().target_modules
    lm_linears = {n: m for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".") and n.rsplit(".", 1)[-1] in targets}
    # the vision tower has layers with the same names: the regex must leave them alone
    vision_same_name = [n for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")
                        and n.rsplit(".", 1)[-1] in targets]
    assert vision_same_name, "test premise: the vision MLPs reuse gate/up/down_proj names"

    rank = 4
    peft_model = apply_lora(model, LoraParams(rank=rank, alpha=8))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".language_model." in n and ".lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(lm_linears)
    expected = sum(rank * (m.in_features + m.out_features) for m in lm_linears.values())
    assert parameter_counts(peft_model)["trainable"] == expected
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if ".visual." in n)

    model2, _ = load_judge(tiny_model_dirs["judge_base"])
    with pytest.raises(ValueError, match="qproj"):
        lora_config(model2, LoraParams(target_modules=["qproj", "v_proj"]))


# --------------------------------------------------------------------------------------------
# batch plan and distributed loss scaling
# --------------------------------------------------------------------------------------------


def test_epoch_plan_shards_union_equals_single_process_batch():
    from paco.judge.batch_plan import epoch_plan, shard

    one = epoch_plan(50, seed=3, epoch=1, batch_size=8, num_processes=1, grad_accum=2)
    two = epoch_plan(50, seed=3, epoch=1, batch_size=4, num_processes=2, grad_accum=2)
    assert len(one) == len(two) == 50 // 16  # remainder (2 rows) dropped
    for s1, s2 in zip(one, two):
        for m1, m2 in zip(s1, s2):
            assert m1 == shard(m2, 0, 4) + shard(m2, 1, 4)
    flat = [i for step in one for mb in step for i in mb]
    assert len(set(flat)) == len(flat) == 48
    assert epoch_plan(50, seed=3, epoch=1, batch_size=8, num_processes=1, grad_accum=2) == one
    assert epoch_plan(50, seed=3, epoch=2, batch_size=8, num_processes=1, grad_accum=2) != one


@pytest.mark.parametrize("variant", ["paper", "reference"])
def test_distributed_loss_scaling_matches_global_batch(variant):
    from paco.judge.batch_plan import distributed_loss_scale
    from paco.judge.losses import first_token_weighted_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 12, 30, generator=g)
    labels = torch.full((8, 12), -100)
    for b in range(8):  # response lengths 2..9 at the end of each row
        n = 2 + b
        labels[b, 12 - n:] = torch.randint(0, 30, (n,), generator=g)
    full = first_token_weighted_loss(logits, labels, 0.3, variant)
    shards = [(logits[:4], labels[:4]), (logits[4:], labels[4:])]
    n_global = sum(int((lab != -100).sum()) for _, lab in shards)
    # DDP averages the processes' gradients, i.e. the mean of their scaled losses
    parts = [first_token_weighted_loss(lg, lab, 0.3, variant)
             * distributed_loss_scale(variant, int((lab != -100).sum()), n_global, 2) for lg, lab in shards]
    assert torch.allclose(sum(parts) / 2, full, atol=1e-6)


# --------------------------------------------------------------------------------------------
# training on the tiny judge (one uninterrupted run shared by several tests)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_path(tmp_path_factory) -> Path:
    from paco.core.io import write_parquet

    path = tmp_path_factory.mktemp("sft") / "sft.parquet"
    write_parquet(path, make_sft_table(96, 32), image_columns=["image_a", "image_b"])
    return path


@pytest.fixture(scope="module")
def baseline(tiny_model_dirs, sft_path, tmp_path_factory):
    """One uninterrupted run: 96 train pairs, batch 8, 3 epochs = 36 steps."""

    out = tmp_path_factory.mktemp("baseline")
    cfg = _cfg()
    metrics = train_reward(cfg, sft_path, tiny_model_dirs["judge_base"], adapter_dir=out / "adapter",
                           checkpoints_dir=out / "checkpoints", plots_dir=out / "plots", eval_at_start=True)
    return {"cfg": cfg, "out": out, "metrics": metrics}


def test_training_learns_the_synthetic_signal(baseline):
    m = baseline["metrics"]
    assert m["train_pairs"] == 96 and m["test_pairs"] == 32  # the failed row is ignored
    assert m["global_batch"] == 8 and m["steps_per_epoch"] == 12 and m["total_steps"] == 36
    assert m["parameters"]["trainable"] == 32768
    train = pd.read_csv(baseline["out"] / "plots" / "train.csv")
    assert list(train["step"]) == list(range(1, 37))
    assert {"loss", "first_token_accuracy", "lr", "grad_norm"} <= set(train.columns)
    assert train["loss"].iloc[-6:].mean() < train["loss"].iloc[:6].mean() - 0.3
    evals = pd.read_csv(baseline["out"] / "plots" / "eval.csv")
    assert list(evals["epoch"]) == [0, 1, 2, 3]
    before, after = m["eval"][0], m["eval_final"]
    assert before["first_token_accuracy"] <= 0.5  # the untrained judge does not even answer Yes/No
    # 32 balanced test pairs: >= 0.75 has probability < 0.3% under chance (binomial)
    assert after["first_token_accuracy"] >= 0.75
    assert after["p_yes_accuracy"] >= 0.75
    assert after["p_yes_mean_yes"] > after["p_yes_mean_no"] + 0.2
    assert after["loss"] < before["loss"]


def test_saved_adapter_reloads_with_peft(baseline, tiny_model_dirs, sft_path):
    from peft import PeftModel

    from paco.judge.model import check_answer_tokens
    from paco.models.loading import load_judge
    from paco.judge.sft_data import load_sft_rows
    from paco.judge.training import evaluate, make_accelerator

    adapter = baseline["out"] / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    keys = list(_adapter_tensors(adapter))
    assert keys and all(".language_model." in k and "lora_" in k for k in keys)
    base, processor = load_judge(tiny_model_dirs["judge_base"])
    model = PeftModel.from_pretrained(base, str(adapter))
    res = evaluate(model, processor, load_sft_rows(sft_path, "test"), baseline["cfg"],
                   make_accelerator(baseline["cfg"]), check_answer_tokens(processor.tokenizer))
    final = baseline["metrics"]["eval_final"]
    assert res["loss"] == pytest.approx(final["loss"], abs=1e-5)
    assert res["first_token_accuracy"] == final["first_token_accuracy"]
    assert res["p_yes_mean_yes"] == pytest.approx(final["p_yes_mean_yes"], abs=1e-5)


class _Stop(Exception):
    pass


def test_resume_equals_uninterrupted(baseline, tiny_model_dirs, sft_path, tmp_path):

    cfg, ck = baseline["cfg"], tmp_path / "checkpoints"
    runs: list[list] = []

    def stop_at(step):
        seen: list = []
        runs.append(seen)

        def cb(info):
            seen.append(info)
            if info.global_step == step:
                raise _Stop

        return cb

    kw = dict(adapter_dir=tmp_path / "adapter", checkpoints_dir=ck, plots_dir=tmp_path / "plots")
    # 12 steps per epoch, checkpoints every 3 steps and at epoch ends.
    # Stop mid-epoch 1 at step 5 (last checkpoint: step 3) ...
    with pytest.raises(_Stop):
        train_reward(cfg, sft_path, tiny_model_dirs["judge_base"], callback=stop_at(5), **kw)
    assert [i.global_step for i in runs[0]] == [1, 2, 3, 4, 5]
    assert runs[0][2].checkpoint.endswith("step-0000003") and runs[0][3].checkpoint is None
    assert [p.name for p in list_checkpoints(ck)] == ["step-0000003"]
    # ... resume there (mid-epoch: skips the 3 done batches) and stop at step 14 in epoch 2 ...
    with pytest.raises(_Stop):
        train_reward(cfg, sft_path, tiny_model_dirs["judge_base"], callback=stop_at(14), **kw)
    assert [i.global_step for i in runs[1]] == list(range(4, 15))
    assert (runs[1][8].epoch, runs[1][8].step_in_epoch) == (1, 12)  # step 12 ends epoch 1
    assert (runs[1][9].epoch, runs[1][9].step_in_epoch) == (2, 1)
    assert [p.name for p in list_checkpoints(ck)] == ["step-0000009", "step-0000012"]  # the last 2
    # ... and finish from the epoch-end checkpoint 12.
    m = train_reward(cfg, sft_path, tiny_model_dirs["judge_base"], **kw)
    assert m["resumed_from"] == "step-0000012" and m["steps_this_run"] == 24
    # the LoRA's targets as peft holds them: the language-model regex of lora_config
    assert isinstance(m["lora_target_modules"], str) and "q_proj" in m["lora_target_modules"]
    a, b = _adapter_tensors(baseline["out"] / "adapter"), _adapter_tensors(tmp_path / "adapter")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the logged history survives the interruptions: complete plots, the same numbers
    train = pd.read_csv(tmp_path / "plots" / "train.csv")
    assert list(train["step"]) == list(range(1, 37))
    base_train = pd.read_csv(baseline["out"] / "plots" / "train.csv")
    np.testing.assert_allclose(train["loss"], base_train["loss"], rtol=0, atol=1e-6)
    assert [e["loss"] for e in m["eval"]] == pytest.approx([e["loss"] for e in baseline["metrics"]["eval"][1:]])


def test_another_run_identity_starts_fresh(baseline, tiny_model_dirs, sft_path, tmp_path, caplog, monkeypatch):

    ck = tmp_path / "checkpoints"
    shutil.copytree(baseline["out"] / "checkpoints", ck)
    kw = dict(adapter_dir=tmp_path / "adapter", checkpoints_dir=ck)
    # same params and data: resumes from the final checkpoint, nothing left to train
    m = train_reward(baseline["cfg"], sft_path, tiny_model_dirs["judge_base"], **kw)
    assert m["resumed_from"] == "step-0000036" and m["steps_this_run"] == 0
    a, b = _adapter_tensors(baseline["out"] / "adapter"), _adapter_tensors(tmp_path / "adapter")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # checkpoint_every does not change the result: still resumable
    m = train_reward(_cfg(checkpoint_every=5), sft_path, tiny_model_dirs["judge_base"], **kw)
    assert m["resumed_from"] == "step-0000036"
    # another learning rate: the old checkpoints are not resumed but removed
    steps = []

    def cb(info):
        steps.append(info.global_step)
        raise _Stop

    with caplog.at_level(logging.WARNING, logger="paco.judge.training"), pytest.raises(_Stop):
        train_reward(_cfg(learning_rate=5e-3), sft_path, tiny_model_dirs["judge_base"], callback=cb, **kw)
    assert steps == [1]
    assert "another run identity" in caplog.text and "params:reward_train" in caplog.text
    assert list_checkpoints(ck) == []
    # the same params under another thread count (a resume on another machine, or with
    # PACO_NUM_THREADS changed): CPU kernels round otherwise, so the run starts fresh too
    shutil.copytree(baseline["out"] / "checkpoints", ck, dirs_exist_ok=True)
    threads, steps[:] = torch.get_num_threads(), []
    caplog.clear()
    try:
        monkeypatch.setenv("PACO_NUM_THREADS", str(threads + 1))
        with caplog.at_level(logging.WARNING, logger="paco.judge.training"), pytest.raises(_Stop):
            train_reward(baseline["cfg"], sft_path, tiny_model_dirs["judge_base"], callback=cb, **kw)
    finally:
        torch.set_num_threads(threads)
    assert steps == [1]
    assert "another run identity" in caplog.text and "extra:cpu_numerics" in caplog.text


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(baseline, tiny_model_dirs, sft_path,
                                                                       tmp_path, caplog):
    ck = tmp_path / "checkpoints"
    shutil.copytree(baseline["out"] / "checkpoints", ck)
    newest = list_checkpoints(ck)[-1]
    opt = newest / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[:64])  # truncated
    with caplog.at_level(logging.WARNING, logger="paco.judge.training"):
        m = train_reward(baseline["cfg"], sft_path, tiny_model_dirs["judge_base"], adapter_dir=tmp_path / "adapter",
                         checkpoints_dir=ck)
    assert m["resumed_from"] == list_checkpoints(baseline["out"] / "checkpoints")[-2].name
    assert m["run_identity"]["skipped_corrupt"][0].startswith(newest.name) and "unreadable" in caplog.text
    a, b = _adapter_tensors(baseline["out"] / "adapter"), _adapter_tensors(tmp_path / "adapter")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_too_few_pairs_is_an_error(tiny_model_dirs, tmp_path):

    with pytest.raises(ValueError, match="global batch"):
        train_reward(_cfg(batch_size=16), make_sft_table(8, 4), tiny_model_dirs["judge_base"],
                     adapter_dir=None, checkpoints_dir=tmp_path / "ck")


def test_max_test_pairs_evaluates_one_fixed_subsample_of_the_test_split(tiny_model_dirs, tmp_path):
    """``max_test_pairs`` keeps that many test rows, the same ones whatever the epoch (drawn once
    with the stage seed, in the table's order); ``null`` keeps the whole split; the train split is
    untouched, and the evaluation and its report see only the kept rows."""
    from paco.core.run_identity import params_identity
    from paco.judge import training as T
    from paco.judge.run import RewardState
    from paco.judge.sft_data import load_sft_rows, subsample
    from workflow.registry import member

    sft = make_sft_table(16, 12)
    all_test = load_sft_rows(sft, "test")
    assert len({r.pair_id for r in all_test}) == 12
    kept = {}
    for limit in (None, 5):
        cfg = _cfg(batch_size=4, max_test_pairs=limit)
        identity = params_identity(member("reward_train"), {"reward_train": cfg.model_dump(mode="json")})
        run = T.setup(cfg, sft, tiny_model_dirs["judge_base"], identity, accelerator=T.make_accelerator(cfg),
                      checkpoints_dir=tmp_path / f"ck{limit}", plots_dir=None)
        assert len(run.train_rows) == 16
        ids = [r.pair_id for r in run.test_rows]
        if limit is None:
            assert ids == [r.pair_id for r in all_test] and len(ids) == 12
        else:
            order = [r.pair_id for r in all_test]
            positions = [order.index(i) for i in ids]
            assert len(ids) == 5 and positions == sorted(positions) and len(set(positions)) == 5
            assert T.evaluate_epoch(run, RewardState(), 1)["pairs"] == 5
            assert T.evaluate_epoch(run, RewardState(), 2)["pairs"] == 5
            kept[limit] = ids
        for h in run.hooks:
            h.remove()
    # the subsample is a function of the stage seed: another seed keeps other rows
    assert kept[5] != [r.pair_id for r in subsample(all_test, 5, 1)]
    assert kept[5] == [r.pair_id for r in subsample(all_test, 5, _cfg().seed)]


def test_gradient_checkpointing_recomputes_the_layers_and_changes_no_step(tiny_model_dirs, tmp_path):
    """``gradient_checkpointing`` (default off, also in params.yaml) turns transformers'
    non-reentrant checkpointing on in setup: every decoder layer of the language model is flagged,
    a training forward runs each layer once more in the backward (counted at the first layer's
    MLP), evaluation (no gradients) once; two optimizer steps give the same losses, gradient
    norms and LoRA weights, bit for bit (CPU, float32)."""
    from paco.core.run_identity import params_identity
    from paco.judge import training as T
    from paco.judge.batch_plan import epoch_plan
    from paco.judge.run import RewardState
    from workflow.registry import member

    assert RewardTrainParams().gradient_checkpointing is False
    embedded = yaml.safe_load((REPO / "params.yaml").read_text())["reward_train"]
    assert embedded["gradient_checkpointing"] is False
    sft = make_sft_table(16, 4)
    out = {}
    for ckpt in (False, True):
        cfg = _cfg(batch_size=4, gradient_checkpointing=ckpt)
        identity = params_identity(member("reward_train"), {"reward_train": cfg.model_dump(mode="json")})
        run = T.setup(cfg, sft, tiny_model_dirs["judge_base"], identity, accelerator=T.make_accelerator(cfg),
                      checkpoints_dir=tmp_path / f"ck{ckpt}", plots_dir=None)
        layers = [m for m in run.model.modules() if type(m).__name__ == "Qwen2_5_VLDecoderLayer"]
        assert layers and all(m.gradient_checkpointing is ckpt for m in layers)
        calls = []
        layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        plan = epoch_plan(len(run.train_rows), seed=cfg.seed, epoch=0, batch_size=cfg.batch_size, num_processes=1,
                          grad_accum=cfg.gradient_accumulation_steps)
        state = RewardState()
        rows = [T.train_step(run, state, plan[s]) for s in range(2)]
        assert len(calls) == 2 * (2 if ckpt else 1)
        calls.clear()
        T.evaluate_epoch(run, state, 1)
        assert len(calls) == 1  # the 4 test pairs in one batch
        out[ckpt] = (rows, {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad})
        for h in run.hooks:
            h.remove()
    (rows0, lora0), (rows1, lora1) = out[False], out[True]
    assert rows0 == rows1 and rows0[0]["grad_norm"] > 0
    assert lora0.keys() == lora1.keys() and all(torch.equal(lora0[k], lora1[k]) for k in lora0)


def test_response_positions_cover_every_rows_response():
    """The positions whose hidden state predicts a response token of any row (labels shifted by
    one), ascending, each once."""
    from paco.judge.training import response_positions

    ig = -100
    labels = torch.tensor([[ig, ig, ig, 7, 8, ig, ig],
                           [ig, ig, ig, ig, ig, 7, 9],
                           [ig, ig, ig, 5, ig, ig, ig]])
    assert response_positions(labels).tolist() == [2, 3, 4, 5]
    assert response_positions(labels).dtype == torch.int64


def test_training_forward_at_response_positions_equals_the_whole_sequence(tiny_model_dirs):
    """The training forward computes logits only where a response token is predicted: at those
    positions they equal the whole sequence's logits (independently: the full forward, shifted),
    every response label is kept, and the first-token-weighted loss, the answer statistics and
    the LoRA gradients agree with the full forward's (prompts of different lengths, so the rows'
    responses sit at different positions)."""
    from paco.judge.lora import apply_lora
    from paco.judge.losses import first_token_weighted_loss
    from paco.judge.model import IGNORE_INDEX, check_answer_tokens
    from paco.judge.sft_data import encode_rows, load_sft_rows
    from paco.judge.training import _answer_stats, _forward
    from paco.models.loading import load_judge

    sft = make_sft_table(6, 0)
    sft["instruction"] = [judge_instruction(theme) for theme in
                          ["a wall", "a textured wall in the rain at night", "x", "a red brick wall", "a",
                           "two walls", "a wall"]]
    rows = load_sft_rows(sft, "train")
    model, processor = load_judge(tiny_model_dirs["judge_base"], dtype=torch.float32)
    answer = check_answer_tokens(processor.tokenizer)
    model = apply_lora(model, LoraParams())
    torch.manual_seed(0)
    lora = [p for p in model.parameters() if p.requires_grad]
    for p in lora:  # LoRA B starts at zero: move every factor so every gradient is non-zero
        p.data.add_(0.05 * torch.randn_like(p))
    batch = encode_rows(processor, rows, answer)
    assert len({int(m.sum()) for m in batch["attention_mask"]}) > 1

    def loss_and_grads(logits, labels):
        loss = first_token_weighted_loss(logits, labels, 0.5, "paper")
        grads = torch.autograd.grad(loss, lora)
        return loss.detach(), grads

    logits, labels = _forward(model, batch, torch.device("cpu"))
    full = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    full_labels = batch["labels"][:, 1:]
    assert logits.shape[1] < full.shape[1] // 2
    assert (labels != IGNORE_INDEX).sum() == (full_labels != IGNORE_INDEX).sum()
    assert sorted(labels[labels != IGNORE_INDEX].tolist()) == sorted(full_labels[full_labels != IGNORE_INDEX].tolist())
    keep = torch.nonzero((full_labels != IGNORE_INDEX).any(0)).squeeze(1)
    torch.testing.assert_close(logits, full[:, keep], rtol=1e-5, atol=1e-5)
    for a, b in zip(_answer_stats(logits.detach(), labels, answer), _answer_stats(full.detach(), full_labels, answer)):
        torch.testing.assert_close(a, b)
    loss, grads = loss_and_grads(logits, labels)
    loss_full, grads_full = loss_and_grads(full, full_labels)
    torch.testing.assert_close(loss, loss_full, rtol=1e-6, atol=0)
    assert all(g.abs().max() > 0 for g in grads)
    for g, h in zip(grads, grads_full):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------
# the stage under accelerate launch: 1 process == 2 processes (gloo) at the same global batch
# --------------------------------------------------------------------------------------------


def _launch(tmp: Path, name: str, processes: int, section: dict, sft: Path, base: Path) -> dict:
    import json

    params = tmp / f"{name}.yaml"
    params.write_text(yaml.safe_dump({"reward_train": section}))
    out = tmp / name
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "workflow" / "accelerate" / "cpu.yaml"), "--num_processes", str(processes),
           "-m", "stages.reward_train", "--params", str(params), "--sft", str(sft), "--base", str(base),
           "--adapter", str(out / "adapter"), "--checkpoints", str(out / "checkpoints"),
           "--plots", str(out / "plots"), "--metrics", str(out / "metrics.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PACO_NUM_THREADS")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    return {**report, "resumed_from": report["run_identity"]["resumed_from"],
            "metrics_headline": json.loads((out / "metrics.json").read_text())}


@pytest.mark.slow
def test_two_cpu_processes_equal_one_process(tiny_model_dirs, tmp_path):
    from paco.core.io import write_parquet

    sft = tmp_path / "sft.parquet"
    write_parquet(sft, make_sft_table(32, 8, seed=1), image_columns=["image_a", "image_b"])
    # with pair augmentation: its views are keyed by the global row index, not the process
    common = dict(seed=0, learning_rate=1e-2, epochs=1, first_token_weight=0.5, checkpoint_every=2,
                  augment=dict(enabled=True, crop_scale=[0.7, 1.0]))
    base = tiny_model_dirs["judge_base"]
    m1 = _launch(tmp_path, "one", 1, dict(common, batch_size=8, gradient_accumulation_steps=1), sft, base)
    # per process: batch 2 x 2 accumulation steps; global batch 2 x 2 processes x 2 = 8
    m2 = _launch(tmp_path, "two", 2, dict(common, batch_size=2, gradient_accumulation_steps=2), sft, base)
    assert (m1["processes"], m2["processes"]) == (1, 2)
    assert m1["global_batch"] == m2["global_batch"] == 8 and m1["total_steps"] == m2["total_steps"] == 4
    assert m2["torch_threads_per_process"] == max(1, m1["torch_threads_per_process"] // 2)
    a, b = _adapter_tensors(tmp_path / "one" / "adapter"), _adapter_tensors(tmp_path / "two" / "adapter")
    assert a.keys() == b.keys()
    assert all(float(a[k].abs().max()) > 1e-4 for k in a if "lora_B" in k)  # trained (lora_B starts at 0)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, f"1-process vs 2-process adapters differ by up to {worst}"
    assert m1["train_loss_final"] == pytest.approx(m2["train_loss_final"], abs=1e-5)
    assert m1["eval_final"]["loss"] == pytest.approx(m2["eval_final"]["loss"], abs=1e-5)
    assert m1["eval_final"]["pairs"] == m2["eval_final"]["pairs"] == 8
    # only rank 0 wrote: one metrics file, one adapter
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["adapter", "checkpoints", "metrics.json", "plots",
                                                                        "report.json"]
    # 2-process mid-epoch resume: drop the final checkpoint, relaunch from step 2 of 4
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step-0000004")
    m3 = _launch(tmp_path, "two", 2, dict(common, batch_size=2, gradient_accumulation_steps=2), sft, base)
    assert m3["resumed_from"] == "step-0000002" and m3["steps_this_run"] == 2
    c = _adapter_tensors(tmp_path / "two" / "adapter")
    assert all(torch.equal(b[k], c[k]) for k in b)


# --------------------------------------------------------------------------------------------
# accelerate configs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dist", [("cpu", "MULTI_GPU"), ("ddp", "MULTI_GPU"), ("zero2", "DEEPSPEED"),
                                       ("fsdp", "FSDP")])
def test_accelerate_configs_parse(name, dist):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / "workflow" / "accelerate" / f"{name}.yaml"))
    assert str(cfg.distributed_type).endswith(dist)
    assert cfg.compute_environment.name == "LOCAL_MACHINE"
    if name == "cpu":
        assert cfg.use_cpu
    if name == "zero2":
        assert cfg.deepspeed_config["zero_stage"] == 2
    if name == "fsdp":
        assert cfg.fsdp_config["fsdp_reshard_after_forward"] == "FULL_SHARD"
        assert "Qwen2_5_VLDecoderLayer" in cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]


# --------------------------------------------------------------------------------------------
# pair augmentation (reward_train.augment)
# --------------------------------------------------------------------------------------------


def _pair_images() -> tuple[Image.Image, Image.Image]:
    rng = np.random.default_rng(3)
    a = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    b = Image.fromarray(rng.integers(0, 256, (30, 30, 3), dtype=np.uint8))
    return a, b


def test_augment_swap_and_flip_are_exact():
    from paco.core.params import PairAugmentParams
    from paco.judge.sft_data import augment_pair

    a, b = _pair_images()
    rng = np.random.default_rng(0)
    va, vb = augment_pair(a, b, PairAugmentParams(enabled=True, swap=1.0, hflip=0.0), rng)
    assert np.array_equal(np.asarray(va), np.asarray(b)) and np.array_equal(np.asarray(vb), np.asarray(a))
    va, vb = augment_pair(a, b, PairAugmentParams(enabled=True, swap=0.0, hflip=1.0), rng)
    assert np.array_equal(np.asarray(va), np.asarray(a)[:, ::-1])
    assert np.array_equal(np.asarray(vb), np.asarray(b)[:, ::-1])


def test_augment_crop_follows_the_documented_draws():
    from paco.core.params import PairAugmentParams
    from paco.judge.sft_data import augment_pair

    a, b = _pair_images()
    aug = PairAugmentParams(enabled=True, swap=0.0, hflip=0.0, crop_scale=(0.25, 0.5))
    va, vb = augment_pair(a, b, aug, np.random.default_rng(7))
    draws = np.random.default_rng(7).random(9)  # swap, then (flip, area, x, y) per image
    for im, view, (area_u, fx, fy) in ((a, va, draws[2:5]), (b, vb, draws[6:9])):
        area = 0.25 + 0.25 * area_u
        w, h = im.size
        cw, ch = round(w * area ** 0.5), round(h * area ** 0.5)
        x0, y0 = int(fx * (w - cw + 1)), int(fy * (h - ch + 1))
        want = im.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.Resampling.BICUBIC)
        assert view.size == im.size
        assert np.array_equal(np.asarray(view), np.asarray(want))


def test_row_images_is_deterministic_per_row_and_epoch_and_off_by_default():
    from paco.core.params import PairAugmentParams
    from paco.judge.sft_data import SftRow, row_images

    a, b = _pair_images()
    row = SftRow("p0", encode_image(a)["bytes"], encode_image(b)["bytes"], "q", "Yes.", True)
    plain = row_images(row)
    assert np.array_equal(np.asarray(plain[0]), np.asarray(a))
    assert np.array_equal(np.asarray(row_images(row, PairAugmentParams())[1]), np.asarray(b))  # enabled: false
    aug = PairAugmentParams(enabled=True, crop_scale=(0.5, 0.9))
    first = [np.asarray(x) for x in row_images(row, aug, seed=1, epoch=2, index=5)]
    again = [np.asarray(x) for x in row_images(row, aug, seed=1, epoch=2, index=5)]
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    others = [[np.asarray(x) for x in row_images(row, aug, seed=1, epoch=e, index=5)] for e in range(3, 8)]
    assert any(o[0].shape != first[0].shape or not np.array_equal(o[0], first[0]) for o in others)


def test_augment_crop_scale_is_validated():
    from pydantic import ValidationError

    from paco.core.params import PairAugmentParams

    with pytest.raises(ValidationError, match="crop_scale"):
        PairAugmentParams(enabled=True, crop_scale=(0.9, 0.5))


def test_the_optimizer_is_torchs_fused_adamw_over_the_lora_weights(tiny_model_dirs, tmp_path):
    """reward_train steps with torch's fused AdamW (paco.core.host_independent.adamw): the for-each
    step's CPU square root (MKL's vector math) rounds differently on other CPUs, which made two
    hosts train two judges; the fused kernel's is exact."""
    from paco.core.run_identity import params_identity
    from paco.judge import training as T
    from workflow.registry import member

    cfg = _cfg(batch_size=4)
    identity = params_identity(member("reward_train"), {"reward_train": cfg.model_dump(mode="json")})
    run = T.setup(cfg, make_sft_table(8, 4), tiny_model_dirs["judge_base"], identity,
                  accelerator=T.make_accelerator(cfg), checkpoints_dir=tmp_path / "ck", plots_dir=None)
    try:
        inner = getattr(run.optimizer, "optimizer", run.optimizer)  # accelerate's wrapper
        assert isinstance(inner, torch.optim.AdamW) and all(g["fused"] for g in inner.param_groups)
        assert inner.defaults["lr"] == cfg.learning_rate and inner.defaults["weight_decay"] == cfg.weight_decay
        optimized = [p for group in inner.param_groups for p in group["params"]]
        assert {id(p) for p in optimized} == {id(p) for p in run.lora_params}
    finally:
        for h in run.hooks:
            h.remove()
