"""PaCo-GRPO trainer: short runs of the real loop on the tiny FLUX policy (ratio == 1 on the first
update, resume == uninterrupted, learning a known reward, failures propagate), and its steps
called one at a time. The loss, KL and EMA: tests/test_grpo_losses.py; the seeded plan:
tests/test_grpo_plan.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from paco.grpo import rewards as R
from paco.core.checkpoints import list_checkpoints
from paco.grpo.checkpointing import CHECKPOINT_PREFIX
from paco.grpo.sde import ODE, SdeSettings
from paco.grpo.trainer import train_grpo
from paco.serving.judge_client import JudgeError
from paco.core.params import GrpoSubtaskParams
from paco.core.run_identity import params_identity
from workflow.registry import member


def _identity(cfg: GrpoSubtaskParams, **sections):
    """The params part of ``grpo@test``'s run identity (the registry's exclusions)."""
    return params_identity(member("grpo@test"), {"grpo.test": cfg.model_dump(mode="json"),
                                                 "judge_endpoint": sections.get("judge_endpoint", {}), "subfigures": {}})


def _train(cfg: GrpoSubtaskParams, prompts: pd.DataFrame, policy_dir, ctx, **kw) -> dict:
    """:func:`train_grpo` with the params identity; returns the report with the metrics under
    ``"metrics"`` and the resume decision flattened (``resumed_from``)."""
    out = train_grpo(cfg, prompts, policy_dir, ctx, identity=_identity(cfg), **kw)
    report = out["report"]
    return {**report, "metrics": out["metrics"], "resumed_from": report["run_identity"]["resumed_from"]}


class _Stop(Exception):
    pass


def _stop_after(epoch: int):
    """A callback interrupting training after ``epoch`` epochs (and their checkpoint)."""

    def callback(info):
        if info.epoch == epoch:
            raise _Stop

    return callback


def _checkpoints(path) -> list:
    return list_checkpoints(path, CHECKPOINT_PREFIX)


@R.register("test_red_minus_blue")
def _red_minus_blue(images, prompts, ctx):
    """A reward the tiny policy can move: mean red minus mean blue, in [-1, 1]."""
    out = []
    for im in images:
        a = np.asarray(im, dtype=np.float64) / 255.0
        out.append(a[..., 0].mean() - a[..., 2].mean())
    return np.array(out)


class _FailingJudge:
    def score(self, triples):
        raise JudgeError("judge request to http://127.0.0.1:9/v1/chat/completions failed (no HTTP response)")


_SERVED_THREADS: set[str] = set()


@R.register("test_red_minus_blue_served", served=True)
def _red_minus_blue_served(images, prompts, ctx):
    """test_red_minus_blue, registered as a served reward (scored on a worker thread, as the judge is)."""
    import threading

    _SERVED_THREADS.add(threading.current_thread().name)
    return _red_minus_blue(images, prompts, ctx)


@R.register("test_nan")
def _nan(images, prompts, ctx):
    return np.full(len(images), np.nan)


def _prompts(n: int = 6) -> pd.DataFrame:
    rows = []
    for i in range(n):
        rows.append({
            "prompt_id": f"p{i}", "split": "test" if i >= n - 2 else "train",
            "prompt": f"FOUR-PANEL Images with a 2x2 grid layout of object {i}. [TOP]-[LEFT]:a. [TOP]-[RIGHT]:b. "
                      "[BOTTOM]-[LEFT]:c. [BOTTOM]-[RIGHT]:d.",
            "global_prompt": f"object {i}", "rows": 2, "cols": 2, "panel_prompts": ["a.", "b.", "c.", "d."],
            "height": 1024, "width": 1024,
        })
    return pd.DataFrame(rows)


def _cfg(**over) -> GrpoSubtaskParams:
    cfg = dict(
        epochs=4, prompts_per_epoch=2, group_size=4,
        rollout=dict(num_steps=4, sde_indices=[1], noise_level=0.7, batch_size=4, max_sequence_length=32),
        train=dict(resolution=64, learning_rate=0.01, gradient_steps_per_epoch=2, batch_size=4, clip_range=0.2),
        lora=dict(rank=4, alpha=8),
        rewards={"test_red_minus_blue": 1.0}, aggregation=dict(method="weighted_sum"),
        eval=dict(resolution=64, num_steps=4, every=100, max_prompts=2), save_every=2,
    )
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and k in cfg and isinstance(cfg[k], dict) else v
    return GrpoSubtaskParams.model_validate(cfg)


@pytest.mark.parametrize("same", [False, True])
def test_group_initial_noise_is_shared_only_when_asked(tiny_model_dirs, same):
    from paco.grpo.rollout import sample_group
    from paco.models.loading import load_flux_pipeline
    from paco.grpo.policies import FluxPolicy

    cfg = _cfg(rollout=dict(sde_indices=[0], same_initial_noise=same))
    prompt = R.SubtaskItem.from_row(_prompts().iloc[0].to_dict())
    policy = FluxPolicy(load_flux_pipeline(tiny_model_dirs["policy_t2is"]), None, max_sequence_length=32)
    trajs, images = sample_group(policy, prompt, policy.condition([prompt], 64, 64), [0, 1, 2], cfg,
                                 SdeSettings(0.7), 0, 64, 64, base_index=0)
    x0 = [t.latents[0, 0] for t in trajs]  # the latent entering step 0: the initial noise
    assert torch.equal(x0[0], x0[1]) == same and torch.equal(x0[1], x0[2]) == same
    assert not torch.equal(trajs[0].latents[0, 1], trajs[1].latents[0, 1])  # the SDE noise always differs
    assert [t.index for t in trajs] == [0, 1, 2] and len(images) == 3


@pytest.fixture(scope="module")
def red_run(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    cfg = _cfg(epochs=8, group_size=8, save_every=4, train=dict(learning_rate=0.03))
    metrics = _train(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=out / "lora",
                         checkpoints_dir=out / "ck", plots_dir=out / "plots")
    return cfg, metrics, out


def test_ratio_is_exactly_one_on_the_first_update_of_every_epoch(red_run):
    _, metrics, _ = red_run
    assert metrics["first_update_ratio_max_abs_deviation"] == 0.0
    assert metrics["train_final"]["kl"] > 0  # the policy did move away from the reference


def test_the_trainer_climbs_a_learnable_reward(red_run):
    _, metrics, out = red_run
    sig = metrics["learning_signal"]
    # first 2 vs last 2 epochs, 32 samples each (measured: +0.03, p ~ 1e-9)
    assert sig["improvement"] > 0.01 and sig["p_value"] < 0.01, sig
    assert metrics["eval_final"]["reward"] > metrics["eval_first"]["reward"]
    train = pd.read_csv(out / "plots" / "train.csv")
    assert list(train["epoch"]) == list(range(1, 9))
    for col in ("reward", "test_red_minus_blue_mean", "advantage_abs_mean", "zero_std_group_fraction",
                "clip_fraction", "ratio_mean", "loss", "kl"):
        assert col in train and train[col].notna().all(), col
    assert set(pd.read_csv(out / "plots" / "eval.csv")["epoch"]) == {0, 8}


def test_saved_lora_loads_into_the_pipeline_and_reproduces_the_policy(red_run, tiny_model_dirs):
    from paco.models.loading import load_flux_pipeline
    from paco.grpo.policies import FluxPolicy

    _, _, out = red_run
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    prompt = "a red object"
    images = {}
    for with_lora in (False, True):
        pipe = load_flux_pipeline(tiny_model_dirs["policy_t2is"])
        if with_lora:
            pipe.load_lora_weights(str(out / "lora"))
        pol = FluxPolicy(pipe, None, max_sequence_length=32)
        roll = pol.generate(pol.condition([R.SubtaskItem("p", prompt, "", 1, 1, (prompt,))], 64, 64), height=64, width=64, num_steps=4, sde=ODE,
                          sde_indices=[], noise_generators=[torch.Generator().manual_seed(0)])
        images[with_lora] = np.asarray(pol.decode(roll.final_latents, 64, 64)[0], dtype=np.float64)
    assert np.abs(images[True] - images[False]).mean() > 0.5  # the LoRA changes the image
    redness = {k: (v[..., 0] - v[..., 2]).mean() for k, v in images.items()}
    assert redness[True] > redness[False]


def test_final_samples_score_the_base_samples_served_rewards_while_the_lora_samples_are_made(red_run,
                                                                                               tiny_model_dirs):
    """Each sample's served reward (on the worker thread) is the one of its own image and variant:
    the same function scored locally gives the same value on every row."""
    from paco.core.params import FinalSamplesParams
    from paco.grpo.final_samples import final_samples

    _, _, out = red_run
    cfg = FinalSamplesParams.model_validate(dict(
        lora="data/grpo/t2is/lora", resolution=64, num_steps=4, seeds_per_prompt=2, batch_size=2,
        max_sequence_length=32,
        rewards=["test_red_minus_blue_served", "test_red_minus_blue"]))
    _SERVED_THREADS.clear()
    table, _, metrics = final_samples(cfg, _prompts(), tiny_model_dirs["policy_t2is"], out / "lora", R.RewardContext())
    assert any(t.startswith("served-rewards") for t in _SERVED_THREADS), _SERVED_THREADS
    assert len(table) == 2 * 2 * 2 and list(table["variant"]) == ["base"] * 4 + ["lora"] * 4
    assert table["reward_test_red_minus_blue_served"].tolist() == table["reward_test_red_minus_blue"].tolist()
    assert metrics["rewards"]["test_red_minus_blue_served"]["lora_minus_base"] > 0  # the red LoRA


def test_resume_equals_uninterrupted(tiny_model_dirs, tmp_path):
    from safetensors.torch import load_file

    cfg = _cfg(epochs=4, save_every=2)
    prompts = _prompts()

    full = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
                      checkpoints_dir=tmp_path / "cka")
    with pytest.raises(_Stop):
        _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "b",
                   checkpoints_dir=tmp_path / "ckb", callback=_stop_after(2))
    assert [p.name for p in _checkpoints(tmp_path / "ckb")] == ["epoch-0002"]
    resumed = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "b",
                         checkpoints_dir=tmp_path / "ckb")
    assert resumed["resumed_from"] == "epoch-0002" and resumed["epochs_this_run"] == 2
    a = load_file(str(tmp_path / "a" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(tmp_path / "b" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert full["learning_signal"] == resumed["learning_signal"]
    # a changed param invalidates the checkpoints: a fresh start, not a wrong resume
    other = _train(_cfg(epochs=4, save_every=2, train=dict(learning_rate=0.005)), prompts,
                       tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=None, checkpoints_dir=tmp_path / "ckb")
    assert other["resumed_from"] is None and other["epochs_this_run"] == 4
    # raising `epochs` continues a finished run (the same LoRA as the uninterrupted 4 epochs) ...
    _train(_cfg(epochs=2, save_every=2), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
               lora_dir=tmp_path / "c2", checkpoints_dir=tmp_path / "ckc")
    longer = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "c",
                        checkpoints_dir=tmp_path / "ckc")
    assert longer["resumed_from"] == "epoch-0002" and longer["epochs_this_run"] == 2
    c = load_file(str(tmp_path / "c" / "pytorch_lora_weights.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)
    # ... and lowering it does not resume from past the new end
    again = _train(_cfg(epochs=2, save_every=2), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                       lora_dir=tmp_path / "c2b", checkpoints_dir=tmp_path / "ckc")
    assert again["resumed_from"] is None and again["epochs_this_run"] == 2
    assert [p.name for p in _checkpoints(tmp_path / "ckc")] == ["epoch-0002"]
    s2, s2b = (load_file(str(tmp_path / d / "pytorch_lora_weights.safetensors")) for d in ("c2", "c2b"))
    assert all(torch.equal(s2[k], s2b[k]) for k in s2)


def test_without_the_kl_log_the_reference_policy_is_not_run_and_the_lora_is_the_same(tiny_model_dirs, tmp_path,
                                                                                     monkeypatch):
    """``beta`` 0 with ``log_kl: false`` skips the reference policy's forward (adapters off), as the
    reference code does; the KL is then null in the log, and nothing else changes."""
    from safetensors.torch import load_file
    from paco.grpo.policies.base import OLD_ADAPTER, Policy

    active: list[str | None] = []
    using = Policy.using
    monkeypatch.setattr(Policy, "using", lambda self, adapter: (active.append(adapter), using(self, adapter))[1])
    prompts, runs = _prompts(), {}
    for log_kl in (True, False):
        active.clear()
        cfg = _cfg(epochs=2, train=dict(log_kl=log_kl))
        runs[log_kl] = (_train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                               lora_dir=tmp_path / str(log_kl), checkpoints_dir=tmp_path / f"ck{log_kl}",
                               plots_dir=tmp_path / f"plots{log_kl}"),
                        active.count(None), active.count(OLD_ADAPTER))
    (logged, ref_logged, old_logged), (unlogged, ref_unlogged, old_unlogged) = runs[True], runs[False]
    # one old-adapter and one reference forward per trained chunk; the old adapter also samples each of the 2 epochs
    assert ref_unlogged == 0 and old_unlogged == old_logged and ref_logged == old_logged - 2 > 0
    assert logged["train_final"]["kl"] > 0 and unlogged["train_final"]["kl"] is None
    assert pd.read_csv(tmp_path / "plotsTrue" / "train.csv")["kl"].gt(0).all()
    assert pd.read_csv(tmp_path / "plotsFalse" / "train.csv")["kl"].isna().all()
    a, b = (load_file(str(tmp_path / d / "pytorch_lora_weights.safetensors")) for d in ("True", "False"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged["learning_signal"] == unlogged["learning_signal"]


def test_a_failing_judge_stops_training_instead_of_scoring_zero(tiny_model_dirs, tmp_path):
    cfg = _cfg(epochs=1, rewards={"consistency": 1.0})
    with pytest.raises(JudgeError, match="127.0.0.1:9"):
        _train(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(judge=_FailingJudge()),
                   lora_dir=None, checkpoints_dir=tmp_path / "ck")


def test_a_nan_reward_is_an_error(tiny_model_dirs, tmp_path):
    cfg = _cfg(epochs=1, rewards={"test_nan": 1.0})
    with pytest.raises(R.RewardError, match="test_nan.*nan"):
        _train(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=None,
                   checkpoints_dir=tmp_path / "ck")


def _bytes(path) -> bytes:
    return (path / "pytorch_lora_weights.safetensors").read_bytes()


def test_an_evaluation_change_reevaluates_the_kept_weights_and_equals_a_fresh_run(tiny_model_dirs, tmp_path):
    """eval.* (but every) is evaluation-only: the rerun makes no optimizer step, evaluates the
    kept weights of every evaluation again, and leaves what a fresh run with the new eval params
    leaves, bit for bit (LoRA bytes, history, metrics)."""
    prompts = _prompts()
    cfg = _cfg(epochs=2, save_every=1, eval=dict(every=1))
    first = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
                   checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa")
    changed = _cfg(epochs=2, save_every=1, eval=dict(every=1, num_steps=2, resolution=48))
    again = _train(changed, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
                   checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa")
    assert again["epochs_this_run"] == 0 and again["resumed_from"] == "epoch-0002"
    assert again["run_identity"]["reevaluated_epochs"] == [0, 1, 2]
    assert again["eval_final"]["reward"] != first["eval_final"]["reward"]
    fresh = _train(changed, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "f",
                   checkpoints_dir=tmp_path / "ckf", plots_dir=tmp_path / "pf")
    assert fresh["resumed_from"] is None and fresh["epochs_this_run"] == 2
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "f")
    for name in ("train.csv", "eval.csv"):
        assert (tmp_path / "pa" / name).read_bytes() == (tmp_path / "pf" / name).read_bytes(), name
    assert again["metrics"] == fresh["metrics"]
    # the checkpoint now records the new evaluation: a third run is a no-op
    third = _train(changed, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
                   checkpoints_dir=tmp_path / "ck")
    assert third["run_identity"]["reevaluated_epochs"] == [] and third["epochs_this_run"] == 0


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tiny_model_dirs, tmp_path):
    prompts = _prompts()
    cfg = _cfg(epochs=3, save_every=1)
    _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
           checkpoints_dir=tmp_path / "cka")

    with pytest.raises(_Stop):
        _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "b",
               checkpoints_dir=tmp_path / "ckb", callback=_stop_after(2))
    assert [p.name for p in _checkpoints(tmp_path / "ckb")] == ["epoch-0001", "epoch-0002"]
    (tmp_path / "ckb" / "epoch-0002" / "trainer_state.json").write_text('{"epoch": 2, "hist')  # truncated
    resumed = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "b",
                     checkpoints_dir=tmp_path / "ckb")
    assert resumed["resumed_from"] == "epoch-0001" and resumed["epochs_this_run"] == 2
    assert resumed["run_identity"]["skipped_corrupt"][0].startswith("epoch-0002")
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")
    # a truncated weights file is skipped the same way
    with pytest.raises(_Stop):
        _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "c",
               checkpoints_dir=tmp_path / "ckc", callback=_stop_after(2))
    w = tmp_path / "ckc" / "epoch-0002" / "lora.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    resumed = _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "c",
                     checkpoints_dir=tmp_path / "ckc")
    assert resumed["resumed_from"] == "epoch-0001"
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "c")


def test_a_continued_run_keeps_only_the_evaluations_of_its_schedule(tiny_model_dirs, tmp_path):
    """epochs 2 -> 3 with eval.every 2: the 2-epoch run evaluated after epoch 2 (its last), which
    is also on the 3-epoch schedule {0, 2, 3}; 3 -> 4 drops the evaluation after epoch 3."""
    prompts = _prompts()
    common = dict(save_every=1, eval=dict(every=2))
    _train(_cfg(epochs=3, **common), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
           lora_dir=tmp_path / "a", checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa")
    longer = _train(_cfg(epochs=4, **common), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                    lora_dir=tmp_path / "a", checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa")
    assert longer["resumed_from"] == "epoch-0003" and longer["epochs_this_run"] == 1
    fresh = _train(_cfg(epochs=4, **common), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                   lora_dir=tmp_path / "f", checkpoints_dir=tmp_path / "ckf", plots_dir=tmp_path / "pf")
    assert list(pd.read_csv(tmp_path / "pa" / "eval.csv")["epoch"]) == [0, 2, 4]
    assert (tmp_path / "pa" / "eval.csv").read_bytes() == (tmp_path / "pf" / "eval.csv").read_bytes()
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "f") and longer["metrics"] == fresh["metrics"]


def test_the_loop_steps_one_at_a_time(tiny_model_dirs, tmp_path):
    """setup -> sample_groups -> reward -> advantages -> update, each called alone on one epoch."""
    from paco.grpo import trainer as T
    from paco.grpo.plan import epoch_prompts
    from paco.grpo.report import epoch_row
    from paco.grpo.rollout import sample_groups
    from paco.grpo.run import GrpoState

    cfg = _cfg(epochs=1)
    run = T.setup(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(), _identity(cfg),
                  checkpoints_dir=tmp_path / "ck", plots_dir=None, accelerator=None)
    assert (len(run.train_ids), len(run.eval_prompts), run.n_traj) == (4, 2, 8)
    # torch's fused AdamW over the trained LoRA (paco.core.host_independent.adamw): the for-each
    # step's CPU square root rounds differently on other CPUs
    assert isinstance(run.optimizer, torch.optim.AdamW) and all(g["fused"] for g in run.optimizer.param_groups)
    assert {id(p) for g in run.optimizer.param_groups for p in g["params"]} == {id(p) for p in run.trained.values()}
    roll = sample_groups(run, 0)
    assert [t.index for t in roll.trajectories] == list(range(8)) and len(roll.images) == 8
    assert roll.chosen == epoch_prompts(run.train_ids, 2, cfg.seed, 0)
    rewards = T.reward(run, roll)
    assert rewards["test_red_minus_blue"].shape == (8,)
    adv = T.advantages(run, rewards, roll.chosen)
    # weighted_sum with the batch std: zero mean within each group of 4
    np.testing.assert_allclose(adv.advantages.reshape(2, 4).mean(axis=1), 0.0, atol=1e-12)
    before = {n: p.detach().clone() for n, p in run.trained.items()}
    state = GrpoState()
    stats = T.update(run, roll, adv.advantages, 0, state)
    assert stats["n"] == 8 and state.first_update_ratio_dev and max(state.first_update_ratio_dev) == 0.0
    assert any(not torch.equal(before[n], p) for n, p in run.trained.items())  # the step moved the LoRA
    row = epoch_row(run, 0, rewards, adv, stats)
    assert row["epoch"] == 1 and "seconds" not in row  # plots hold deterministic figures only


def test_the_update_rescores_with_the_settings_the_rollout_sampled_with(tiny_model_dirs, tmp_path, monkeypatch):
    """The run's SDE settings are one value (``GrpoRun.sde``, from ``rollout.noise_level`` and
    ``sigma_max``), recorded on every sampled trajectory: re-scoring a kept transition under the old
    adapter gives its sampled log-prob exactly, and the update re-scores with the recorded settings
    even if the params and the run's settings change after the rollout (nothing below re-reads
    them). Trajectories sampled with different settings cannot be re-scored together."""
    from dataclasses import replace

    from paco.grpo import trainer as T
    from paco.grpo.policies import OLD_ADAPTER, Conditioning
    from paco.grpo.rollout import sample_groups, stack_transitions
    from paco.grpo.run import GrpoState

    cfg = _cfg(epochs=1, rollout=dict(noise_level=0.9, sde_indices=[0, 2]))  # step 0 uses sigma_max
    run = T.setup(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(), _identity(cfg),
                  checkpoints_dir=tmp_path / "ck", plots_dir=None, accelerator=None)
    sampled = SdeSettings(0.9, "schedule")
    assert run.sde == sampled
    roll = sample_groups(run, 0)
    assert all(t.sde == sampled for t in roll.trajectories)
    other = SdeSettings(0.3, 0.5)
    run.cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"noise_level": 0.3, "sigma_max": 0.5})})
    run.sde = other
    group = roll.trajectories[:4]  # prompt 0's group: one sampling batch (rollout.batch_size 4)
    emb = Conditioning.cat([t.embeds for t in group])
    with torch.no_grad(), run.policy.using(OLD_ADAPTER):
        for j in range(2):
            lp, _, _ = run.policy.transition_log_prob(stack_transitions(group, j, run.device), emb)
            assert torch.equal(lp, torch.stack([t.log_probs[j] for t in group]))
            lp_other, _, _ = run.policy.transition_log_prob(replace(stack_transitions(group, j, run.device),
                                                                    sde=other), emb)
            assert not torch.allclose(lp_other, lp)  # the settings do matter at both steps
    with pytest.raises(ValueError, match="different SDE settings"):
        stack_transitions([group[0], replace(group[1], sde=other)], 0, run.device)

    used = []
    rescore = run.policy.transition_log_prob
    monkeypatch.setattr(run.policy, "transition_log_prob",
                        lambda steps, cond: used.append(steps.sde) or rescore(steps, cond))
    rewards = T.reward(run, roll)
    T.update(run, roll, T.advantages(run, rewards, roll.chosen).advantages, 0, GrpoState())
    assert used and set(used) == {sampled}


def test_gradient_checkpointing_is_switched_on_in_setup_and_changes_no_update(tiny_model_dirs, tmp_path):
    """``train.gradient_checkpointing`` (default off, also in params.yaml) turns diffusers'
    checkpointing on in setup; one epoch's update from the same rollouts then runs each block
    once more per forward with gradients (the old adapter's and the reference's have none) and
    gives the same LoRA weights and statistics, bit for bit."""
    from pathlib import Path

    from paco.core.params import read_params_yaml
    from paco.grpo import trainer as T
    from paco.grpo.rollout import sample_groups
    from paco.grpo.run import GrpoState

    assert GrpoSubtaskParams.model_validate({}).train.gradient_checkpointing is False
    embedded = read_params_yaml(Path(__file__).resolve().parents[1] / "params.yaml")["grpo"]
    assert embedded and all(g["train"]["gradient_checkpointing"] is False for g in embedded.values())
    runs, calls = {}, {}
    for ckpt in (False, True):
        cfg = _cfg(epochs=1, train=dict(gradient_checkpointing=ckpt))
        runs[ckpt] = T.setup(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(), _identity(cfg),
                             checkpoints_dir=tmp_path / f"ck{ckpt}", plots_dir=None, accelerator=None)
        assert runs[ckpt].policy.transformer.gradient_checkpointing is ckpt
    roll = sample_groups(runs[False], 0)
    adv = T.advantages(runs[False], T.reward(runs[False], roll), roll.chosen)
    stats = {}
    for ckpt, run in runs.items():
        calls[ckpt] = []
        run.policy.transformer.transformer_blocks[0].attn.register_forward_pre_hook(
            lambda *_, c=calls[ckpt]: c.append(1))
        stats[ckpt] = T.update(run, roll, adv.advantages, 0, GrpoState())
    # per gradient step one chunk of 4: the old adapter's, the reference's (log_kl) and the trained forward
    assert len(calls[False]) == 3 * 2 and len(calls[True]) == 4 * 2
    assert stats[False] == stats[True] and stats[True]["n"] == 8
    assert all(torch.equal(p, runs[True].trained[n]) for n, p in runs[False].trained.items())


def test_an_evaluation_change_without_the_kept_weights_starts_fresh(tiny_model_dirs, tmp_path):
    prompts = _prompts()
    cfg = _cfg(epochs=2, save_every=1, eval=dict(every=1))
    _train(cfg, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
           checkpoints_dir=tmp_path / "ck")
    (tmp_path / "ck" / "eval-weights" / "epoch-0001.safetensors").unlink()
    changed = _cfg(epochs=2, save_every=1, eval=dict(every=1, num_steps=2))
    again = _train(changed, prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(), lora_dir=tmp_path / "a",
                   checkpoints_dir=tmp_path / "ck")
    assert again["resumed_from"] is None and again["epochs_this_run"] == 2
    assert "epochs [1] are missing" in again["run_identity"]["reason"]


def test_lowering_epochs_to_a_checkpoint_adds_its_final_evaluation(tiny_model_dirs, tmp_path):
    """A longer run's checkpoint at exactly the new epochs is resumed (epochs is continuable) but
    never held that epoch's evaluation: it is made on resume, and the result equals a fresh run."""
    prompts = _prompts()

    with pytest.raises(_Stop):
        _train(_cfg(epochs=4, save_every=1), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
               lora_dir=tmp_path / "a", checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa", callback=_stop_after(2))
    short = _train(_cfg(epochs=2, save_every=1), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                   lora_dir=tmp_path / "a", checkpoints_dir=tmp_path / "ck", plots_dir=tmp_path / "pa")
    assert short["resumed_from"] == "epoch-0002" and short["epochs_this_run"] == 0
    fresh = _train(_cfg(epochs=2, save_every=1), prompts, tiny_model_dirs["policy_t2is"], R.RewardContext(),
                   lora_dir=tmp_path / "f", checkpoints_dir=tmp_path / "ckf", plots_dir=tmp_path / "pf")
    assert list(pd.read_csv(tmp_path / "pa" / "eval.csv")["epoch"]) == [0, 2]
    assert (tmp_path / "pa" / "eval.csv").read_bytes() == (tmp_path / "pf" / "eval.csv").read_bytes()
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "f") and short["metrics"] == fresh["metrics"]


def test_overlapped_rewards_equal_scoring_after_sampling(tiny_model_dirs, tmp_path):
    """Scoring each group's judge rewards while the next group is sampled gives the same
    rewards, advantages and LoRA bytes as scoring the epoch after sampling (the judge served by
    its own process, as the stage runs it, with the batch-invariant batching), and the served
    reward really ran on the worker thread."""
    import threading

    from safetensors.torch import load_file

    from paco.serving.judge_client import JudgeClient

    from paco.serving.local import LocalServer

    vocab = 100_000
    threads: set[str] = set()

    class Recording(JudgeClient):
        def score(self, triples):
            threads.add(threading.current_thread().name)
            return super().score(triples)

    runs = {}
    with LocalServer(tiny_model_dirs["judge_base"], "judge", max_logprobs=vocab, max_wait_ms=5) as url:
        for overlap in (False, True):
            threads.clear()
            ctx = R.RewardContext(judge=Recording(url, "judge", retries=0, top_logprobs=vocab), instruction="rank")
            cfg = _cfg(epochs=2, rewards={"consistency": 1.0, "test_red_minus_blue": 1.0},
                       rollout=dict(overlap_rewards=overlap))
            runs[overlap] = _train(cfg, _prompts(), tiny_model_dirs["policy_t2is"], ctx,
                                   lora_dir=tmp_path / f"lora{overlap}", checkpoints_dir=tmp_path / f"ck{overlap}",
                                   plots_dir=tmp_path / f"plots{overlap}")
            assert any(t.startswith("served-rewards") for t in threads) == overlap, threads
    off, on = runs[False], runs[True]
    # every epoch's rewards, advantages, ratios and losses, and the evaluations
    for name in ("train.csv", "eval.csv"):
        assert (tmp_path / "plotsFalse" / name).read_bytes() == (tmp_path / "plotsTrue" / name).read_bytes()
    assert off["metrics"] == on["metrics"] and off["train_final"] == on["train_final"]
    a, b = (load_file(str(tmp_path / f"lora{o}" / "pytorch_lora_weights.safetensors")) for o in (False, True))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert 0.0 < on["train_final"]["consistency_mean"] < 1.0


# --------------------------------------------------------------------------------------------
# an editing subtask: FLUX.1 Kontext on photo edits
# --------------------------------------------------------------------------------------------


@R.register("test_match_reference")
def _match_reference(images, prompts, ctx):
    """A reward an editing policy can move: minus the mean absolute difference to the input image."""
    out = []
    for im, p in zip(images, prompts, strict=True):
        a = np.asarray(im, dtype=np.float64) / 255.0
        b = np.asarray(p.reference.convert("RGB").resize(im.size), dtype=np.float64) / 255.0
        out.append(-np.abs(a - b).mean())
    return np.array(out)


def _edits() -> pd.DataFrame:
    from paco.data.edits import photo_edits

    return photo_edits(["cat", "coffee", "rocket"], ["greyscale", "mirror"], 64, 1, 0)


def _kontext_cfg(**over) -> GrpoSubtaskParams:
    base = _cfg(policy="policy_kontext", family="flux_kontext", dataset="edits", rewards={"test_match_reference": 1.0},
                rollout=dict(guidance_scale=2.5), train=dict(global_std=False))
    return GrpoSubtaskParams.model_validate({**base.model_dump(), **over})


def test_an_editing_subtask_trains_resumes_and_saves_a_kontext_lora(tiny_model_dirs, tmp_path):
    from diffusers import FluxKontextPipeline
    from safetensors.torch import load_file

    cfg, edits, policy = _kontext_cfg(), _edits(), tiny_model_dirs["policy_kontext"]
    full = _train(cfg, edits, policy, R.RewardContext(), lora_dir=tmp_path / "a", checkpoints_dir=tmp_path / "cka")
    assert full["first_update_ratio_max_abs_deviation"] == 0.0
    assert full["train_prompts"] == 4 and full["eval_prompts"] == 2  # 2 train photos x 2 edits; the test photo's
    with pytest.raises(_Stop):
        _train(cfg, edits, policy, R.RewardContext(), lora_dir=tmp_path / "b", checkpoints_dir=tmp_path / "ckb",
               callback=_stop_after(2))
    resumed = _train(cfg, edits, policy, R.RewardContext(), lora_dir=tmp_path / "b", checkpoints_dir=tmp_path / "ckb")
    assert resumed["resumed_from"] == "epoch-0002"
    a = load_file(str(tmp_path / "a" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(tmp_path / "b" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full["learning_signal"] == resumed["learning_signal"]
    # the LoRA is Kontext's: the pipeline's own loader takes it and it changes the edit
    pipe = FluxKontextPipeline.from_pretrained(str(policy), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    photo = R.SubtaskItem.from_edit_row(edits.iloc[0].to_dict()).reference
    kw = dict(image=photo, prompt="make it grey", height=64, width=64, num_inference_steps=3, guidance_scale=2.5,
              max_sequence_length=32, output_type="np", _auto_resize=False, max_area=64 * 64)
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(tmp_path / "a"))
    after = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    assert np.abs(after - before).mean() > 1e-3


def test_a_text_to_image_family_cannot_take_edits():
    with pytest.raises(ValueError, match="family 'flux' needs dataset 'prompts'"):
        _cfg(dataset="edits")


def test_the_policy_gradient_can_use_a_subset_of_the_sde_steps(tiny_model_dirs, tmp_path):
    """The released Qwen-Image-Edit trainer samples SDE steps 1-4 and trains on step 1: the
    same rollouts, fewer transitions in the update, a different LoRA; the ratio is still 1."""
    from safetensors.torch import load_file

    common = dict(epochs=1, rollout=dict(sde_indices=[1, 2]))
    runs = {}
    for name, steps in (("all", None), ("first", [1])):
        cfg = _cfg(**common, train=dict(trained_sde_steps=steps, ema=dict(enabled=False)))  # the raw LoRA
        runs[name] = _train(cfg, _prompts(), tiny_model_dirs["policy_t2is"], R.RewardContext(),
                            lora_dir=tmp_path / name, checkpoints_dir=tmp_path / f"ck-{name}")
    assert runs["all"]["trained_transitions_per_epoch"] == 2 * runs["first"]["trained_transitions_per_epoch"]
    assert runs["first"]["first_update_ratio_max_abs_deviation"] == 0.0
    a, b = (load_file(str(tmp_path / n / "pytorch_lora_weights.safetensors")) for n in ("all", "first"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="trained_sde_steps"):
        _cfg(rollout=dict(sde_indices=[1, 2]), train=dict(trained_sde_steps=[3]))


@pytest.mark.parametrize("family", ["flux", "flux_kontext", "qwen_image_edit"])
def test_the_kl_penalty_acts_in_every_policy_family(tiny_model_dirs, tmp_path, family):
    """``train.beta`` > 0 (a guard against reward hacking) runs the reference policy (adapters off)
    for every family: the KL is logged positive and the penalty changes the LoRA; the first
    update's ratio is still exactly 1."""
    from safetensors.torch import load_file

    if family == "flux":
        make, items, policy = _cfg, _prompts(), tiny_model_dirs["policy_t2is"]
    else:
        role = "policy_kontext" if family == "flux_kontext" else "policy_qwen_edit"
        items, policy = _edits(), tiny_model_dirs[role]

        qwen = {"policy": role, "family": family, "lora": {"rank": 4, "alpha": 8, "target_modules": [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.net.0.proj", "txt_mlp.net.0.proj"]}}

        def make(**over):
            cfg = _kontext_cfg(**(qwen if family == "qwen_image_edit" else {}))
            merged = cfg.model_dump()
            for k, v in over.items():
                merged[k] = {**merged[k], **v} if isinstance(v, dict) else v
            return GrpoSubtaskParams.model_validate(merged)
    runs = {}
    for beta in (0.0, 50.0):
        cfg = make(epochs=2, train=dict(beta=beta, log_kl=True, ema=dict(enabled=False)))  # the trained weights
        runs[beta] = _train(cfg, items, policy, R.RewardContext(), lora_dir=tmp_path / f"b{beta}",
                            checkpoints_dir=tmp_path / f"ck{beta}")
    assert runs[50.0]["train_final"]["kl"] > 0 and runs[0.0]["train_final"]["kl"] > 0
    assert runs[50.0]["first_update_ratio_max_abs_deviation"] == 0.0
    a, b = (load_file(str(tmp_path / f"b{beta}" / "pytorch_lora_weights.safetensors")) for beta in (0.0, 50.0))
    assert any(not torch.equal(a[k], b[k]) for k in a)
