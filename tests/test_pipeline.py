"""End-to-end: the embedded default's data stages under DVC and Snakemake in fresh clones.

These run real stage commands (tiny models, real photos) and take a minute or two each.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from paco.grpo.trainer import epoch_prompts

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: the stated GRPO margin: last-epochs minus first-epochs mean training reward (embedded default)
GRPO_MARGIN = 0.005

TABLES = [
    "data/prompts/prompts.parquet",
    "data/composites/composites.parquet",
    "data/subfigures/panels.parquet",
    "data/pairs/rank_instances.parquet",
    "data/pairs/pairs.parquet",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # stage commands say `python`: make it this interpreter
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def sh(args: list[str], cwd: Path, timeout: int = 1800) -> str:
    """Run a command; on a timeout kill its whole process group (stage processes included, so
    no orphan keeps the cores busy for the tests after it)."""
    proc = subprocess.Popen(args, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = stdout + stderr
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def clone(tmp: Path) -> Path:
    """A fresh clone of the committed tree (what a user gets; uncommitted edits are not in it)."""
    repo = tmp / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    return repo


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def report(repo: Path, stage: str) -> dict:
    """A stage's ``report.json`` (the details beside its headline ``metrics.json``)."""
    return json.loads((repo / f"data/{stage}/report.json").read_text())


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> tuple[Path, str]:
    repo = clone(tmp_path_factory.mktemp("dvc"))
    out = sh([sys.executable, "-m", "dvc", "repro"], repo)
    return repo, out


def test_dvc_repro_runs_every_stage(dvc_repo):
    from workflow.registry import STAGES

    repo, out = dvc_repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert sorted(ran_stages(out)) == sorted(m.dvc_name for s in STAGES for m in s.members(params))
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
    for name in ("models", "prompts", "composites", "subfigures", "pairs", "labels"):
        run = report(repo, name)["run"]
        assert run["peak_rss_mb"] < 4096, (name, run)
    for name in ("grpo/t2is", "final_samples/t2is"):
        run = report(repo, name)["run"]
        assert run["peak_rss_mb"] < 6144, (name, run)


def test_grpo_learns_and_sample_compares_with_and_without_the_lora(dvc_repo):
    """The embedded default's GRPO learning signal: the mean training reward (the weighted sum of
    consistency, CLIP-T and PickScore) of the last epochs exceeds that of the first epochs
    (5 vs 5 epochs; one-sided paired t-test over the 22 train prompts, each prompt's mean reward
    in either window: ``paco.grpo.trainer.learning_signal``).

    Measured with the committed params (2 CPU cores; the stages' AVX2 CPU paths, so any x86-64
    machine gives these bytes): +0.029, higher on 16 of 22 prompts, p 1e-4 (the unpaired Welch
    test on the 440 vs 440 samples: p 4e-12). The same code on other numeric paths (the judge
    trains differently): +0.015 (20 of 22, p 5e-8) and +0.020 (21 of 22, p 7e-8, an AVX-512
    machine). Earlier configs (Welch): +0.0113 / +0.0127 before any editing pairs, and that
    config with GRPO seeds 1 / 2 gave +0.002 (n.s.) / +0.013. The judge moves the margin, so
    the bound is p < 0.05."""
    repo, _ = dvc_repo
    m = report(repo, "grpo/t2is")
    sig = m["learning_signal"]
    assert m["first_update_ratio_max_abs_deviation"] == 0.0
    assert sig["improvement"] > GRPO_MARGIN and sig["p_value"] < 0.05, sig
    train = pd.read_csv(repo / "data/grpo/t2is/plots/train.csv")
    assert len(train) == m["epochs"] and train["reward"].notna().all()
    assert (repo / "data/grpo/t2is/lora/pytorch_lora_weights.safetensors").is_file()
    s = report(repo, "final_samples/t2is")
    seeds = yaml.safe_load((repo / "params.yaml").read_text())["final_samples"]["t2is"]["seeds_per_prompt"]
    assert set(s["rewards"]) == {"consistency", "clip_t", "pickscore"} and s["samples"] == 2 * s["prompts"] * seeds
    # the held-out test prompts at the eval resolution (256 px; trained at 128 px), 4 seeds each:
    # measured consistency +0.058 with the LoRA over 32 paired samples, p 0.017 (other numeric
    # paths: +0.057, p 2e-4; +0.196, p 4e-14)
    cons = s["rewards"]["consistency"]
    assert cons["lora_minus_base"] > 0.02 and cons["paired_t_p_value"] < 0.05, cons
    samples = pd.read_parquet(repo / "data/final_samples/t2is/samples.parquet")
    assert set(samples["variant"]) == {"base", "lora"}
    assert {p.name for p in (repo / "data/final_samples/t2is/sheets").iterdir()} == {"base.png", "lora.png"}


@pytest.mark.parametrize("subtask", ["kontext_editing", "qwen_editing"])
def test_editing_subtasks_train_and_sample(dvc_repo, subtask):
    """The editing subtasks run end to end on the photo edits: GRPO with the editing reward from
    the served judge (ratio exactly 1 on each epoch's first update), a LoRA the family's pipeline
    loads, and final edits of the held-out items with and without it.

    Learning signals, measured with the committed params (2 CPU cores, the stages' AVX2 CPU
    paths, so any x86-64 machine gives these bytes; training reward: first 5 vs last 5 of 16
    epochs, one-sided paired t-test over the train items drawn in both windows):

    * Kontext (28 items per epoch): training reward 0.286 -> 0.342 (+0.057, higher on all 28
      items, p 1e-10), evaluation 0.304 -> 0.390 (192 px), final edits +0.078 with the LoRA
      (56 paired, 93 % better, p 4e-11). On an earlier machine's numeric path +0.061 (p 3e-15),
      final +0.043; on an AVX-512 path (another judge) only +0.001 (n.s.). GRPO seed 1: +0.022
      (21 of 28, p 2e-5) pinned, +0.018 (28 of 28, p 8e-11) on the AVX-512 path. So the margin
      is 0.015: three of these four draws clear it (the issue 10 note).
    * Qwen-Image-Edit (14 of the 28 items per epoch, the cost of 8 epochs of 28): training
      reward 0.328 -> 0.343 (+0.015, higher on all 27 items, p 2e-8; the unpaired Welch test
      on the samples, p 0.21, drowns it in the spread between items); other numeric paths
      +0.025 (p 2e-5) and +0.037 (p 2e-8), GRPO seed 1 +0.071. With 8 epochs of all 28 items
      (16 optimizer steps, not 32): +0.010. Asserted with a margin of 0.01 (the smallest
      measured gain is +0.015). The tiny Qwen-Image-Edit's LoRA does not carry across
      resolutions: the evaluation at 192 px goes 0.330 -> 0.327 and its final edits there gain
      -0.001 (28 paired, p 0.38; other paths +0.002 / -0.007), while at the 128 px training
      resolution the final edits gain +0.021 (better in 28 of 28, p 2e-7; earlier paths +0.013
      / +0.004). Not the conditioning, RoPE centring or the schedule shift (README), so the
      embedded default samples Qwen's final edits at 128 px; asserted with a margin of 0.01.

    The judge's editing reward is mostly its consistency question (it does not learn prompt
    following, issue 10 note), so the policies learn to stay consistent with the input."""
    repo, _ = dvc_repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    cfg = params["grpo"][subtask]
    m = report(repo, f"grpo/{subtask}")
    assert m["first_update_ratio_max_abs_deviation"] == 0.0 and m["judge"]["requests"] > 0
    assert m["train_prompts"] == 28 and m["eval_prompts"] == 14  # 4 train photos x 7 edits; 2 test photos
    train = pd.read_csv(repo / f"data/grpo/{subtask}/plots/train.csv")
    assert len(train) == cfg["epochs"] and train["consistency_for_editing_mean"].between(0, 1).all()
    assert (repo / f"data/grpo/{subtask}/lora/pytorch_lora_weights.safetensors").is_file()
    s = report(repo, f"final_samples/{subtask}")
    seeds = params["final_samples"][subtask]["seeds_per_prompt"]
    assert set(s["rewards"]) == {"consistency_for_editing"} and s["samples"] == 2 * 14 * seeds
    samples = pd.read_parquet(repo / f"data/final_samples/{subtask}/samples.parquet")
    assert set(samples["variant"]) == {"base", "lora"} and samples["reward_consistency_for_editing"].between(0, 1).all()
    assert {p.name for p in (repo / f"data/final_samples/{subtask}/sheets").iterdir()} == {
        "base.png", "lora.png", "compare.png"}
    assert report(repo, f"grpo/{subtask}")["run"]["peak_rss_mb"] < 6144
    sig, gain = m["learning_signal"], s["rewards"]["consistency_for_editing"]
    # the items drawn in both windows of the learning signal (the trainer's own draw)
    items = [str(i) for i in pd.read_parquet(repo / "data/edits/edits.parquet").query("split == 'train'")["item_id"]]
    w = sig["window_epochs"]
    drawn = [set(epoch_prompts(items, cfg["prompts_per_epoch"], cfg["seed"], e)) for e in range(cfg["epochs"])]
    assert sig["prompts_paired"] == len(set().union(*drawn[:w]) & set().union(*drawn[-w:])), sig
    if subtask == "kontext_editing":
        assert sig["improvement"] > 0.015 and sig["p_value"] < 1e-4, sig
        assert gain["lora_minus_base"] > 0.02 and gain["paired_t_p_value"] < 1e-3, gain
    else:  # final edits at the training resolution (128 px, params.yaml)
        assert sig["improvement"] > 0.01 and sig["p_value"] < 1e-3, sig
        assert s["resolution"] == cfg["train"]["resolution"] == 128, (s["resolution"], cfg["train"])
        assert gain["lora_minus_base"] > 0.01 and gain["paired_t_p_value"] < 1e-3, gain


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


def test_trained_judge_beats_chance_and_the_base_judge(dvc_repo):
    """The embedded default's learning signal on held-out prompts (ConsistencyRank metrics).

    Unit of the tests: the ~400 held-out ranking instances (8 test prompts x 48, minus the
    smaller layouts), one-sided t-tests; per-prompt means are the conservative statement
    (8 clusters) and get the weaker threshold. Measured with the committed params (the judge
    also trained on the editing pairs; the stages' AVX2 CPU paths): accuracy 0.449 against the
    base judge's 0.32 (chance 0.25), Kendall tau 0.260; paired per-instance p 1e-9, per-prompt
    p 0.03 (an AVX-512 path: 0.446, tau 0.256). (T2IS pairs only,
    seeds 0 / 1: 0.48 / 0.45, tau 0.29 / 0.27, p 1e-14 / 8e-10, per prompt 0.006 / 0.02.)
    """
    repo, _ = dvc_repo
    m = report(repo, "reward_eval")
    trained, base = m["judges"]["paco_reward"], m["judges"]["base_zero_shot"]
    vs_base = m["paco_reward_vs"]["base_zero_shot"]
    assert m["instances"] >= 200
    # chance: accuracy 0.25, tau 0
    assert trained["accuracy_vs_chance"]["p_value"] < 1e-3, trained
    assert trained["kendall_tau_vs_chance"]["p_value"] < 1e-3, trained
    assert trained["accuracy_vs_chance_per_prompt"]["p_value"] < 0.05, trained
    # the zero-shot base judge, paired on the same instances
    assert vs_base["p_value"] < 1e-3, vs_base
    assert vs_base["per_prompt"]["p_value"] < 0.1, vs_base
    assert trained["accuracy"] > base["accuracy"] + 0.05, (trained["accuracy"], base["accuracy"])


def test_second_repro_is_a_noop(dvc_repro_noop):
    assert dvc_repro_noop == []


@pytest.fixture(scope="module")
def dvc_repro_noop(dvc_repo):
    repo, _ = dvc_repo
    return ran_stages(sh([sys.executable, "-m", "dvc", "repro"], repo))


#: an evaluation-only change of GRPO: ``dvc repro`` reruns grpo@t2is, which re-evaluates the kept
#: weights without an optimizer step (the LoRA bytes are unchanged, so final_samples@t2is is not rerun)
EVAL_CHANGE = ("grpo", "t2is", "eval", "num_steps", 6)
#: what is compared bit for bit: every output under data/ but the undeclared reports, the
#: persisted checkpoints / progress, and DVC's own files
SKIP = re.compile(r"(^|/)(report\.json|checkpoints/.*|progress/.*|\.gitignore)$")


def _apply_eval_change(repo: Path) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    *path, key, value = EVAL_CHANGE
    node = params
    for k in path:
        node = node[k]
    assert node[key] != value
    node[key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _artifacts(repo: Path) -> dict[str, str]:
    files = (p for p in (repo / "data").rglob("*") if p.is_file() and "raw" not in p.relative_to(repo).parts[:2])
    return {str(p.relative_to(repo)): md5(p) for p in files if not SKIP.search(str(p.relative_to(repo)))}


@pytest.fixture(scope="module")
def changed_repro(dvc_repo, dvc_repro_noop):
    repo, _ = dvc_repo
    _apply_eval_change(repo)
    return ran_stages(sh([sys.executable, "-m", "dvc", "repro"], repo))


#: the stages whose outputs grpo@t2is reads (prompts, the policy and CLIP, the merged judge)
GRPO_T2IS_UPSTREAM = ["prompts", "models", "reward_merge"]


def test_cached_after_a_change_equals_a_fresh_clone_bit_for_bit(dvc_repo, changed_repro, tmp_path_factory):
    """The cache's promise: after an upstream change, what ``dvc repro`` leaves equals what a fresh
    clone computes with the same params, byte for byte. The changed stage (grpo@t2is: the repro
    above re-evaluated its kept weights) trains from scratch in a fresh clone, on the same inputs:
    the outputs of the stages upstream of it are checked out of the first clone's cache (with its
    ``dvc.lock``), not recomputed. That two fresh runs of those stages agree byte for byte is
    shown by the Snakemake and SLURM tests (data stages, models) and by the reward stages' own
    tests (resume equals uninterrupted, 2 processes equal 1)."""
    repo, _ = dvc_repo
    # the re-evaluation leaves the LoRA's bytes as they were: final_samples@t2is does not rerun
    assert sorted(changed_repro) == ["grpo@t2is", "params_check"]
    rep = report(repo, "grpo/t2is")
    assert rep["epochs_this_run"] == 0 and rep["run_identity"]["reevaluated_epochs"] == [0, 8, 16], rep["run_identity"]
    fresh = clone(tmp_path_factory.mktemp("fresh"))
    _apply_eval_change(fresh)
    shutil.copy(repo / "dvc.lock", fresh / "dvc.lock")
    sh([sys.executable, "-m", "dvc", "cache", "dir", "--local", str(repo / ".dvc" / "cache")], fresh)
    sh([sys.executable, "-m", "dvc", "checkout", *GRPO_T2IS_UPSTREAM], fresh)
    assert not (fresh / "data/grpo/t2is").exists()
    # computed, not restored: --force skips the run cache (which holds the re-evaluation)
    ran = ran_stages(sh([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "grpo@t2is"], fresh))
    assert ran == ["grpo@t2is"], ran
    assert report(fresh, "grpo/t2is")["epochs_this_run"] == 16
    cached, new = _artifacts(repo), _artifacts(fresh)
    assert set(new) <= set(cached)
    for path in ("data/grpo/t2is/lora/pytorch_lora_weights.safetensors", "data/grpo/t2is/metrics.json",
                 "data/reward_merge/model/model.safetensors"):
        assert path in new, path
    differ = sorted(k for k in new if cached[k] != new[k])
    assert not differ, differ


def _set(repo: Path, section: str, key: str, value) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_a_param_change_puts_only_its_stages_and_descendants_out_of_date(dvc_repo, dvc_repro_noop):
    repo, _ = dvc_repo
    original = (repo / "params.yaml").read_text()
    # a data-stage param: only the stages that read it are out of date (their descendants follow
    # once they rerun); grpo and sample cut their grids for the panel rewards the same way
    _set(repo, "subfigures", "method", "equal")
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
    _set(repo, "reward_eval", "instruction", "theme" if committed == "rank" else "rank")
    status = sh([sys.executable, "-m", "dvc", "status", "--json"], repo)
    assert set(json.loads(status[status.index("{"):])) == {"params_check", "reward_eval"}
    (repo / "params.yaml").write_text(original)
    # a misspelled top-level section, which no stage declares: params_check fails the repro
    (repo / "params.yaml").write_text(original + "\nreward_trian: {epochs: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "reward_trian: Extra inputs are not permitted" in proc.stdout + proc.stderr
    (repo / "params.yaml").write_text(original)


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


@pytest.mark.parametrize("profile", ["local", "slurm", "sbatch"])
def test_snakemake_profiles_dry_run(profile):
    out = sh([sys.executable, "-m", "snakemake", "-n", "--profile", f"workflow/profiles/{profile}"], ROOT)
    assert "pairs" in out
