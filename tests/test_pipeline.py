"""End-to-end: the embedded default's whole ``dvc repro`` in a fresh clone (14-19 min on 2
cores), what it leaves and what a change of it reruns; Snakemake's stages beside it. The tests
that need a clone but not this repro are in tests/test_pipeline_clones.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from paco.grpo.plan import epoch_prompts

from pipeline_helpers import artifacts, clone, md5, ran_stages, report, set_param, sh, subprocess_env

pytestmark = pytest.mark.slow

TABLES = [
    "data/prompts/prompts.parquet",
    "data/composites/composites.parquet",
    "data/subfigures/panels.parquet",
    "data/pairs/rank_instances.parquet",
    "data/pairs/pairs.parquet",
]


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> tuple[Path, str]:
    repo = clone(tmp_path_factory.mktemp("dvc"))
    # the whole embedded default: 16-19 min alone on a 2-core AMD EPYC (the host's speed varies
    # between runs), 23-25 min beside the second test worker (CI's own limit, 90 min, bounds the
    # whole suite)
    out = sh([sys.executable, "-m", "dvc", "repro"], repo, timeout=3600)
    return repo, out


def test_dvc_repro_runs_every_stage(dvc_repo):
    from workflow.code_digests import CODE_STAGE
    from workflow.registry import STAGES

    repo, out = dvc_repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert sorted(ran_stages(out)) == sorted([CODE_STAGE] + [m.dvc_name for s in STAGES for m in s.members(params)])
    for table in TABLES:
        assert (repo / table).is_file(), table
    pairs = report(repo, "pairs")
    prompts = pd.read_parquet(repo / "data/prompts/prompts.parquet")
    panels = prompts["rows"] * prompts["cols"]
    # paper §3.1: seeds x panels x (panels - 1) instances per prompt (48 for 4 grids of 2x2)
    assert pairs["instances"] == int((4 * panels * (panels - 1)).sum())
    assert set(pairs["per_split"]) == {"train", "test"}
    sub = report(repo, "subfigures")
    assert sub["bbox_iou"]["mean"] > 0.95
    for name in ("models", "prompts", "composites", "subfigures", "pairs", "reasons"):
        run = report(repo, name)["run"]
        assert run["peak_rss_mb"] < 4096, (name, run)
    for name in ("grpo/t2is", "final_samples/t2is"):
        run = report(repo, name)["run"]
        assert run["peak_rss_mb"] < 6144, (name, run)


SUBTASK_REWARD = {"t2is": "consistency", "kontext_editing": "consistency_for_editing",
                  "qwen_editing": "consistency_for_editing"}


def _finite(obj) -> bool:
    """Every number in a JSON value is finite (``None`` is allowed: a test not applicable)."""
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_finite(v) for v in obj)
    return not isinstance(obj, float) or (obj == obj and abs(obj) != float("inf"))


@pytest.mark.parametrize("subtask", list(SUBTASK_REWARD))
def test_every_subtask_trains_and_samples(dvc_repo, subtask):
    """The invariants of each subtask's GRPO and final sampling, true on every host and draw: the
    policy ratio is exactly 1 on each epoch's first update (the sampled log-probs are the
    trained policy's), every epoch's reward is finite and logged, the LoRA is written and
    changes the samples (same prompts, seeds and noise with and without it), every metric is
    finite, and the sheets are drawn. Whether the reward rises is a learning claim
    (:data:`LEARNING_CLAIMS`)."""
    repo, _ = dvc_repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    cfg, reward = params["grpo"][subtask], SUBTASK_REWARD[subtask]
    m = report(repo, f"grpo/{subtask}")
    assert m["first_update_ratio_max_abs_deviation"] == 0.0
    assert _finite(json.loads((repo / f"data/grpo/{subtask}/metrics.json").read_text())) and _finite(m)
    train = pd.read_csv(repo / f"data/grpo/{subtask}/plots/train.csv")
    assert len(train) == cfg["epochs"] and train["reward"].notna().all()
    assert train[f"{reward}_mean"].between(0, 1).all()
    assert (repo / f"data/grpo/{subtask}/lora/pytorch_lora_weights.safetensors").is_file()
    assert m["run"]["peak_rss_mb"] < 6144
    sig = m["learning_signal"]
    assert sig["window_epochs"] >= 1 and sig["p_value"] is not None
    if subtask != "t2is":
        assert m["judge"]["requests"] > 0
        assert m["train_prompts"] == 28 and m["eval_prompts"] == 14  # 4 train photos x 7 edits; 2 test photos
        # the prompts paired by the learning signal are the trainer's own draw in both windows
        edits = pd.read_parquet(repo / "data/edits/edits.parquet")
        items = [str(i) for i in edits.query("split == 'train'")["item_id"]]
        w = sig["window_epochs"]
        drawn = [set(epoch_prompts(items, cfg["prompts_per_epoch"], cfg["seed"], e)) for e in range(cfg["epochs"])]
        assert sig["prompts_paired"] == len(set().union(*drawn[:w]) & set().union(*drawn[-w:])), sig
    s = report(repo, f"final_samples/{subtask}")
    assert _finite(json.loads((repo / f"data/final_samples/{subtask}/metrics.json").read_text()))
    seeds = params["final_samples"][subtask]["seeds_per_prompt"]
    prompts = 14 if subtask != "t2is" else s["prompts"]
    assert s["samples"] == 2 * prompts * seeds
    assert reward in s["rewards"] and (subtask != "t2is" or set(s["rewards"]) == {"consistency", "clip_t", "pickscore"})
    samples = pd.read_parquet(repo / f"data/final_samples/{subtask}/samples.parquet")
    assert set(samples["variant"]) == {"base", "lora"} and samples[f"reward_{reward}"].between(0, 1).all()
    pairs = samples[samples["variant"] == "base"].merge(samples[samples["variant"] == "lora"], on=["prompt_id", "seed"])
    assert len(pairs) == prompts * seeds
    changed = [a["bytes"] != b["bytes"] for a, b in zip(pairs["image_x"], pairs["image_y"], strict=True)]
    assert all(changed), f"the LoRA left {changed.count(False)} of {len(changed)} samples unchanged"
    sheets = {"base.png", "lora.png"} | ({"compare.png"} if subtask != "t2is" else set())
    assert {p.name for p in (repo / f"data/final_samples/{subtask}/sheets").iterdir()} == sheets
    # the reward-hacking monitors (paco.grpo.monitors): on every evaluation and both variants' final
    # samples, finite; the hacking gap against the zero-shot base judge
    kind = "input_ssim" if subtask != "t2is" else "panel_similarity"
    monitors = {"grid_artifact", "grid_artifact_2px", "high_frequency", kind}
    evals = pd.read_csv(repo / f"data/grpo/{subtask}/plots/eval.csv")
    assert monitors <= set(evals.columns) and np.isfinite(evals[sorted(monitors)].to_numpy()).all()
    assert monitors == set(s["monitors"]) and subtask_reward_gap(s, reward)
    fm = json.loads((repo / f"data/final_samples/{subtask}/metrics.json").read_text())
    assert {f"{k}_change" for k in monitors} | {"hacking_gap", "independent_gain"} <= set(fm)
    assert np.isfinite(samples[[f"monitor_{k}" for k in sorted(monitors)]].to_numpy()).all()
    if subtask == "qwen_editing":  # final edits at the training resolution (params.yaml)
        assert s["resolution"] == cfg["train"]["resolution"] == 128, (s["resolution"], cfg["train"])


def test_the_editing_benchmark_scores_every_judge(dvc_repo):
    repo, _ = dvc_repo
    editing = report(repo, "reward_eval")["editing"]
    assert editing["benchmark"] == "photos" and editing["items"] == 14
    for judge in ("paco_reward", "base_zero_shot", "clip_i"):
        dims = editing["judges"][judge]
        assert set(dims) == {"consistency", "prompt_following", "overall"}
        assert dims["prompt_following"]["n"] == 28 and dims["overall"]["n"] == 40
        for d in dims.values():
            assert 0 <= d["accuracy"] <= d["accuracy_ge"] <= 1 and 0 < d["p_value"] <= 1
    assert set(editing["paco_reward_vs"]) == {"base_zero_shot", "clip_i"}


def test_the_judge_evaluation_is_complete(dvc_repo):
    repo, _ = dvc_repo
    m = report(repo, "reward_eval")
    assert m["instances"] >= 200 and _finite(m)
    assert set(m["judges"]) == {"paco_reward", "base_zero_shot", "clip_i"}
    assert set(m["paco_reward_vs"]) == {"base_zero_shot", "clip_i"}
    for judge in m["judges"].values():
        assert 0 <= judge["accuracy"] <= 1 and -1 <= judge["kendall_tau"] <= 1


def subtask_reward_gap(summary: dict, reward: str) -> bool:
    """The final samples' hacking gap of ``reward`` is the run's judge's gain minus the independent
    judge's, both as reported beside it."""
    g = summary["hacking_gap"][reward]
    return (g["optimised_gain"] == summary["rewards"][reward]["lora_minus_base"]
            and g["independent_gain"] == summary["independent"][reward]["lora_minus_base"]
            and abs(g["gap"] - (g["optimised_gain"] - g["independent_gain"])) < 1e-12)


def _claim_figures(repo: Path) -> dict[str, float]:
    """The embedded default's learning claims as figures (improvements and p-values)."""
    ev = report(repo, "reward_eval")
    trained, base = ev["judges"]["paco_reward"], ev["judges"]["base_zero_shot"]
    f = {"judge_minus_base_accuracy": trained["accuracy"] - base["accuracy"],
         "judge_vs_base_p": ev["paco_reward_vs"]["base_zero_shot"]["p_value"],
         "judge_vs_chance_p": trained["accuracy_vs_chance"]["p_value"],
         "judge_tau_vs_chance_p": trained["kendall_tau_vs_chance"]["p_value"]}
    for subtask, reward in SUBTASK_REWARD.items():
        sig = report(repo, f"grpo/{subtask}")["learning_signal"]
        gain = report(repo, f"final_samples/{subtask}")["rewards"][reward]
        monitors = report(repo, f"final_samples/{subtask}")["monitors"]
        f |= {f"{subtask}_training_gain": sig["improvement"], f"{subtask}_training_p": sig["p_value"],
              f"{subtask}_final_gain": gain["lora_minus_base"], f"{subtask}_final_p": gain["paired_t_p_value"],
              **{f"{subtask}_{k}_change": m["lora_minus_base"] for k, m in monitors.items()}}
    return f


#: The learning claims the end-to-end test asserts: (figure, "gt" | "lt", bound). Each bound is
#: cleared by the weakest of the draws in docs/numerics.md (the pretrained Qwen-Image-Edit's: 3 GRPO
#: seeds on 14 items per epoch with each of the 3-epoch and the 2-epoch judge, and on 7 with the
#: 2-epoch one; the others: 19 draws): 3 GRPO seeds with each of three judges under the stages'
#: numerics (MKL COMPATIBLE; the judge trained for 3 epochs with its head over the whole sequence,
#: then only at the response positions, then for 2), MKL's AUTO branch (seed 0), and, before the
#: MKL pin, 3 GRPO seeds x numpy's and OpenBLAS's AVX2 and AVX-512 paths. A claim whose spread
#: swamps its effect is reported there and not asserted.
LEARNING_CLAIMS: list[tuple[str, str, float]] = [
    # the judge against its zero-shot self and chance (7 judges, the 2-epoch default's +0.145 and,
    # with the fused AdamW, +0.148: +0.110 to +0.160, paired p at most 9e-8; against chance,
    # accuracy p at most 6e-26, Kendall tau p at most 7e-16)
    ("judge_minus_base_accuracy", "gt", 0.05),
    ("judge_vs_base_p", "lt", 1e-5),
    ("judge_vs_chance_p", "lt", 1e-10),
    ("judge_tau_vs_chance_p", "lt", 1e-10),
    # Kontext's training gain (the pretrained tiny FLUX.1 Kontext, lr 3e-3, one SDE step on 14 items
    # per epoch), in the weighted reward with the guards grid_free and input_fidelity: +0.018 to
    # +0.039 over GRPO seeds 0-2 (p 6e-5 to 1e-3); without them +0.049 to +0.150 over four judges
    ("kontext_editing_training_gain", "gt", 0.01),
    ("kontext_editing_training_p", "lt", 0.01),
    # with the guards its held-out edits gain by the judge in every seed (+0.009 to +0.019, p at
    # most 1e-5) and stay clear of the grid texture and the input (grid artifact +0.000 to +0.004,
    # input SSIM -0.011 to +0.012; without the guards +0.096 to +0.125 and -0.072 to -0.141)
    ("kontext_editing_final_gain", "gt", 0.003),
    ("kontext_editing_final_p", "lt", 1e-3),
    ("kontext_editing_grid_artifact_change", "lt", 0.01),
    ("kontext_editing_input_ssim_change", "gt", -0.02),
    # Qwen-Image-Edit's training gain: the pretrained policy (the default, lr 1e-3, no true CFG, 7
    # items per epoch) +0.036 to +0.065 over GRPO seeds 0-2 with the 2-epoch judge (p at most
    # 0.023), +0.023 to +0.052 with the fused AdamW (p up to 0.062); on 14 items per epoch +0.006 to +0.035 with it, +0.023 to +0.050 with the 3-epoch
    # one; the random-init policy +0.008 to
    # +0.090 in every one of 22 draws (16 with true CFG); its p-value is reported, below
    ("qwen_editing_training_gain", "gt", 0.005),
    # with the KL guard (beta 0.04; training gain +0.015 to +0.040 over GRPO seeds 0-2) its held-out
    # edits' grid artifact rises by +0.001 to +0.006 (without it +0.008 to +0.021) and their input
    # SSIM moves by -0.002 to +0.005
    ("qwen_editing_grid_artifact_change", "lt", 0.01),
    ("qwen_editing_input_ssim_change", "gt", -0.02),
]
#: Reported, not asserted (the spread swamps the effect in at least one draw): the t2is
#: training gain on the pretrained tiny FLUX.1 (+0.008 to +0.018, p up to 0.09) and final
#: consistency gain (-0.023 to +0.008) and its grid artifact (+0.009 to +0.012, the grid_free
#: guard +0.006 to +0.009), the hacking gap against the zero-shot base judge (guarded Kontext
#: +0.010 to +0.020, the base judge's own gain -0.001; Qwen-Image-Edit -0.002 to +0.009, p at least
#: 0.07), Qwen-Image-Edit's training p-value (the pretrained policy: 2e-9 to
#: 0.023 in 9 draws; the random-init one up to 0.89) and its final edits (the pretrained policy:
#: +0.007 to +0.051, p 1e-6 to 0.066 in 9 draws with two judges on one numeric path, -0.003 to
#: +0.013 with the KL guard; the
#: random-init one -0.000 to +0.046, p up to 0.9), the judge against CLIP-I (CLIP-I ranks
#: better) and the editing benchmark (the judge is at its zero-shot self's level).


@pytest.mark.parametrize("figure,op,bound", LEARNING_CLAIMS, ids=[f"{f}-{o}" for f, o, _ in LEARNING_CLAIMS])
def test_learning_claim(dvc_repo, figure, op, bound):
    repo, _ = dvc_repo
    value = _claim_figures(repo)[figure]
    assert (value > bound) if op == "gt" else (value < bound), (figure, value, op, bound)


def test_second_repro_is_a_noop(dvc_repro_noop):
    assert dvc_repro_noop == []


@pytest.fixture(scope="module")
def dvc_repro_noop(dvc_repo):
    repo, _ = dvc_repo
    return ran_stages(sh([sys.executable, "-m", "dvc", "repro"], repo))


#: an evaluation-only change of GRPO: ``dvc repro`` reruns grpo@t2is, which re-evaluates the kept
#: weights without an optimizer step (the LoRA bytes are unchanged, so final_samples@t2is is not rerun);
#: 2 of the 8 test prompts, so that the changed evaluation costs a quarter of the committed one
EVAL_CHANGE = ("grpo", "t2is", "eval", "max_prompts", 2)
#: the outputs of grpo@t2is that an evaluation change rewrites (and a return to the committed
#: params writes back)
GRPO_T2IS_EVALUATION = ["data/grpo/t2is/metrics.json", "data/grpo/t2is/plots/eval.csv"]


def _apply_eval_change(repo: Path) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    *path, key, value = EVAL_CHANGE
    node = params
    for k in path:
        node = node[k]
    assert node[key] != value
    node[key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def fresh_artifacts(dvc_repo, dvc_repro_noop) -> dict[str, str]:
    """The md5 of every artifact the fresh clone's ``dvc repro`` wrote (before any test edits a param)."""
    repo, _ = dvc_repo
    return artifacts(repo)


@pytest.fixture(scope="module")
def changed_repro(dvc_repo, fresh_artifacts) -> dict:
    """An evaluation change and back, each reproduced: the stages each ``dvc repro`` ran, the
    grpo@t2is report after each, and the artifacts after the change. The way back is computed
    (``--no-run-cache``: the run cache holds the first run's outputs for these params)."""
    repo, _ = dvc_repo
    committed = (repo / "params.yaml").read_text()
    _apply_eval_change(repo)
    ran = ran_stages(sh([sys.executable, "-m", "dvc", "repro"], repo))
    changed = {"ran": ran, "report": report(repo, "grpo/t2is"), "artifacts": artifacts(repo)}
    (repo / "params.yaml").write_text(committed)
    ran = ran_stages(sh([sys.executable, "-m", "dvc", "repro", "--no-run-cache"], repo))
    return {"changed": changed, "back": {"ran": ran, "report": report(repo, "grpo/t2is")}}


def test_cached_after_a_change_equals_a_fresh_clone_bit_for_bit(dvc_repo, fresh_artifacts, changed_repro):
    """The cache's promise: what ``dvc repro`` leaves after a change equals what a fresh clone
    computes with the same params, byte for byte. grpo@t2is keeps its weights across an
    evaluation change (its checkpoints persist under the same training identity) and re-evaluates
    them; changed back to the committed params it re-evaluates them again, and every artifact
    under ``data/`` must then equal the fresh clone's own ``dvc repro`` (the module's first run),
    which trained those weights from scratch. That training from scratch twice gives the same
    bytes is shown by the trainer's tests (resume equals uninterrupted, 2 processes equal 1, an
    evaluation change equals a fresh run) and the numeric-path test."""
    repo, _ = dvc_repo
    changed, back = changed_repro["changed"], changed_repro["back"]
    t2is = yaml.safe_load((repo / "params.yaml").read_text())["grpo"]["t2is"]
    # evaluated before the first epoch, every eval.every epochs and after the last
    evaluated = sorted({0, *range(t2is["eval"]["every"], t2is["epochs"] + 1, t2is["eval"]["every"]), t2is["epochs"]})
    # the re-evaluation leaves the LoRA's bytes as they were: final_samples@t2is does not rerun
    for step in (changed, back):
        assert sorted(step["ran"]) == ["grpo@t2is", "params_check"], step["ran"]
        rep = step["report"]
        assert rep["epochs_this_run"] == 0, rep["run_identity"]
        assert rep["run_identity"]["reevaluated_epochs"] == evaluated, rep["run_identity"]
    # the change took effect (other evaluation bytes), the weights did not move
    for path in GRPO_T2IS_EVALUATION:
        assert changed["artifacts"][path] != fresh_artifacts[path], path
    lora = "data/grpo/t2is/lora/pytorch_lora_weights.safetensors"
    assert changed["artifacts"][lora] == fresh_artifacts[lora]
    now = artifacts(repo)
    assert sorted(now) == sorted(fresh_artifacts)
    differ = sorted(k for k in now if now[k] != fresh_artifacts[k])
    assert not differ, differ


def test_a_param_change_puts_only_its_stages_and_descendants_out_of_date(dvc_repo, dvc_repro_noop):
    repo, _ = dvc_repo
    original = (repo / "params.yaml").read_text()
    # a data-stage param: only the stages that read it are out of date (their descendants follow
    # once they rerun); grpo and sample cut their grids for the panel rewards the same way
    set_param(repo, "subfigures", "method", "equal")
    status = sh([sys.executable, "-m", "dvc", "status", "--json"], repo)
    # (params_check reruns on any edit of params.yaml: it validates the whole file)
    # every subtask cuts its samples into panels (an edit is one panel, still trimmed by `refine`)
    params = yaml.safe_load(original)
    subtasks = {f"{stage}@{k}" for stage in ("grpo", "final_samples") for k in params[stage]}
    assert set(json.loads(status[status.index("{"):])) == {"params_check", "subfigures"} | subtasks
    (repo / "params.yaml").write_text(original)
    # an evaluation param: only reward_eval is out of date, nothing upstream (the value must differ
    # from the committed default, or nothing is out of date); that `dvc repro` then reruns only
    # the out-of-date stages is the bit-for-bit test's (grpo@t2is after an evaluation param)
    committed = yaml.safe_load(original)["reward_eval"]["instruction"]
    set_param(repo, "reward_eval", "instruction", "theme" if committed == "rank" else "rank")
    status = sh([sys.executable, "-m", "dvc", "status", "--json"], repo)
    assert set(json.loads(status[status.index("{"):])) == {"params_check", "reward_eval"}
    (repo / "params.yaml").write_text(original)
    # a misspelled top-level section, which no stage declares: params_check fails the repro
    (repo / "params.yaml").write_text(original + "\nreward_trian: {epochs: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "reward_trian: Extra inputs are not permitted" in proc.stdout + proc.stderr
    (repo / "params.yaml").write_text(original)


def test_a_code_edit_puts_only_the_stages_that_import_it_out_of_date(dvc_repo, dvc_repro_noop):
    """With real DVC: after an edit of one module, the code stage rewrites the digests, and
    exactly the stages whose import closure holds the module are out of date; undoing the edit
    brings back the digests' bytes, and with them the status before the edit (which other tests
    of this module may have left with a stage out of date: params_check after a failed repro)."""
    from workflow.code_digests import CODE_STAGE
    from workflow.registry import STAGES

    def out_of_date() -> set[str]:
        status = sh([sys.executable, "-m", "dvc", "status", "--json"], repo)
        return set(json.loads(status[status.index("{"):]))

    def rerun_code() -> str:  # the code stage alone (run, or restored from DVC's run cache)
        return sh([sys.executable, "-m", "dvc", "repro", "--single-item", CODE_STAGE], repo)

    repo, _ = dvc_repo
    edited = repo / "paco/data/photos.py"
    original = edited.read_text()
    params = yaml.safe_load((repo / "params.yaml").read_text())
    importers = {m.dvc_name for s in STAGES if "paco/data/photos.py" in s.code for m in s.members(params)}
    assert importers and importers != {m.dvc_name for s in STAGES for m in s.members(params)}
    before = out_of_date()
    assert CODE_STAGE not in before and not importers & before, before
    try:
        edited.write_text(original + "\n# an edit\n")
        assert out_of_date() == before | {CODE_STAGE}
        rerun_code()
        assert out_of_date() == before | importers
    finally:
        edited.write_text(original)
    rerun_code()
    assert out_of_date() == before


def test_snakemake_runs_the_same_stages_with_identical_outputs(dvc_repo, tmp_path):
    dvc_dir, _ = dvc_repo
    repo = clone(tmp_path)
    # targets before options: snakemake 9's `--quiet` takes a list and would swallow them
    # (pairs with the ground-truth ranking reads no model: the models stage is its own target)
    sh([sys.executable, "-m", "snakemake", "data/pairs/pairs.parquet", "data/models/metrics.json", "--cores", "2",
        "--quiet", "rules"], repo)
    # identical commands => identical, deterministic artifacts
    for table in TABLES:
        assert md5(repo / table) == md5(dvc_dir / table), table
    for role in ("judge_base", "policy_t2is", "clip"):
        for f in sorted((dvc_dir / "data/models" / role).rglob("*.safetensors")):
            assert md5(repo / f.relative_to(dvc_dir)) == md5(f), f


def _judge_server_pid(repo: Path, timeout_s: float = 300.0) -> int:
    """The pid of the project's judge server a stage in ``repo`` started (its working directory
    is ``repo``: other tests' stages run elsewhere), once its log says it serves."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                if b"paco.serving.server" in cmd and Path(os.readlink(proc / "cwd")) == repo:
                    return int(proc.name)
            except (OSError, ValueError):
                continue
        time.sleep(0.5)
    raise AssertionError(f"no judge server of {repo} within {timeout_s:g} s")


def test_a_judge_server_killed_mid_stage_is_restarted_and_the_bytes_are_unchanged(dvc_repo):
    """SIGKILL the judge server 20 s after it starts serving grpo@qwen_editing (trained from scratch:
    its checkpoints removed): the stage restarts it on its port, asks the requests in flight again
    and writes the bytes of the uninterrupted run (the module's first ``dvc repro``)."""
    import signal
    import threading
    import time

    repo, _ = dvc_repo
    outs = ["data/grpo/qwen_editing/lora/pytorch_lora_weights.safetensors", "data/grpo/qwen_editing/metrics.json",
            "data/grpo/qwen_editing/plots/train.csv", "data/grpo/qwen_editing/plots/eval.csv"]
    before = {p: md5(repo / p) for p in outs}
    shutil.rmtree(repo / "data/grpo/qwen_editing/checkpoints")
    log = repo / "data/grpo/qwen_editing/checkpoints/judge_server.log"
    killed: list[int] = []

    def kill() -> None:
        pid = _judge_server_pid(repo)
        end = time.monotonic() + 300
        while time.monotonic() < end and "serving" not in (log.read_text() if log.is_file() else ""):
            time.sleep(0.5)
        time.sleep(20)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    out = sh([sys.executable, "-m", "dvc", "repro", "-f", "-s", "--no-run-cache", "grpo@qwen_editing"], repo)
    killer.join(timeout=5)
    assert killed, "the judge server was not killed"
    assert ran_stages(out) == ["grpo@qwen_editing"]
    rep = report(repo, "grpo/qwen_editing")
    assert rep["judge"]["server_restarts"] == 1 and rep["epochs_this_run"] == rep["epochs"], rep["judge"]
    assert "exited with code -9; restart 1 of 2" in log.read_text()
    assert not log.with_name(log.name + ".port").exists()
    assert {p: md5(repo / p) for p in outs} == before
