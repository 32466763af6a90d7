"""The grpo / final_samples stage CLIs: a dead judge fails the stage with its URL, a short real run
through the locally served judge writes every declared output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from paco.core.io import write_parquet

ROOT = Path(__file__).resolve().parents[1]



def _prompts(path: Path) -> Path:
    rows = []
    for i in range(5):
        rows.append({
            "prompt_id": f"p{i}", "split": "test" if i >= 3 else "train",
            "prompt": f"FOUR-PANEL Images with a 2x2 grid layout of thing {i}. [TOP]-[LEFT]:a. [TOP]-[RIGHT]:b. "
                      "[BOTTOM]-[LEFT]:c. [BOTTOM]-[RIGHT]:d.",
            "global_prompt": f"thing {i}", "rows": 2, "cols": 2, "panel_prompts": ["a.", "b.", "c.", "d."],
            "height": 512, "width": 512,
        })
    write_parquet(path, pd.DataFrame(rows))
    return path


def _params(tmp: Path, **judge) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    g = params["grpo"]["t2is"]
    g.update(epochs=2, prompts_per_epoch=2, group_size=4, save_every=1)
    g["rollout"].update(num_steps=3, sde_indices=[1, 2], max_sequence_length=32)
    g["train"].update(resolution=64, batch_size=8)
    g["eval"].update(resolution=64, num_steps=3, every=100)
    params["final_samples"]["t2is"].update(resolution=64, num_steps=3, seeds_per_prompt=1, max_sequence_length=32)
    params["judge_endpoint"].update(judge)
    params["judge_endpoint"]["server"]["max_logprobs"] = 100_000  # the untrained tiny judge: serve every token
    params["judge_endpoint"]["top_logprobs"] = 100_000
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def _run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def _launch_grpo(processes: int, params: Path, prompts: Path, dirs: dict, out: Path,
                 timeout: int = 900) -> subprocess.CompletedProcess:
    """``accelerate launch`` (CPU config) of the grpo stage with ``processes`` processes."""
    cmd = ["accelerate", "launch", "--config_file", "workflow/accelerate/cpu.yaml", "--num_processes", str(processes),
           "-m", "stages.grpo", "--params", str(params), "--subtask", "t2is", "--items", str(prompts),
           "--policy", str(dirs["policy_t2is"]), "--judge", str(dirs["judge_base"]), "--clip", str(dirs["clip"]),
           "--pickscore", str(dirs["clip"]),
           "--lora", str(out / "lora"), "--checkpoints", str(out / "ck"), "--plots", str(out / "plots"),
           "--metrics", str(out / "metrics.json")]
    env = {**os.environ, "PACO_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_dead_judge_url_fails_the_stage_with_the_url(tiny_model_dirs, tmp_path, dead_url):
    url = dead_url
    params = _params(tmp_path, url=url, retries=1, timeout_s=2)
    out = tmp_path / "grpo"
    proc = _run("stages.grpo", [
        "--params", str(params), "--subtask", "t2is", "--items", str(_prompts(tmp_path / "prompts.parquet")),
        "--policy", str(tiny_model_dirs["policy_t2is"]), "--judge", str(tmp_path / "unused"),
        "--clip", str(tiny_model_dirs["clip"]), "--pickscore", str(tiny_model_dirs["clip"]),
        "--lora", str(out / "lora"), "--checkpoints", str(out / "ck"),
        "--plots", str(out / "plots"), "--metrics", str(out / "metrics.json")])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert url in proc.stderr and "2 attempt(s)" in proc.stderr
    assert not (out / "metrics.json").exists() and not (out / "lora").exists()


def test_unknown_subtask_is_a_params_error(tiny_model_dirs, tmp_path):
    proc = _run("stages.grpo", [
        "--params", str(_params(tmp_path)), "--subtask", "no_such_subtask", "--items", "x", "--policy", "x",
        "--judge", "x", "--clip", "x", "--pickscore", "x", "--lora", "x", "--checkpoints", "x", "--plots", "x",
        "--metrics", "x"])
    assert proc.returncode == 2 and "grpo.no_such_subtask does not exist" in proc.stderr


def test_a_split_typo_is_one_clear_message(tiny_model_dirs, tmp_path):
    params = _params(tmp_path)
    raw = yaml.safe_load(params.read_text())
    raw["grpo"]["t2is"]["split"] = "trian"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _run("stages.grpo", [
        "--params", str(params), "--subtask", "t2is", "--items", str(_prompts(tmp_path / "prompts.parquet")),
        "--policy", "x", "--judge", "x", "--clip", "x", "--pickscore", "x", "--lora", "x", "--checkpoints", "x",
        "--plots", "x",
        "--metrics", str(tmp_path / "m.json")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "grpo.t2is.split 'trian' has no prompts (the prompts' splits: ['test', 'train'])" in proc.stderr


@pytest.mark.slow
def test_grpo_then_sample_through_the_local_judge_server(tiny_model_dirs, tmp_path):
    params = _params(tmp_path)
    prompts = _prompts(tmp_path / "prompts.parquet")
    g, s = tmp_path / "grpo", tmp_path / "sample"
    common = ["--params", str(params), "--subtask", "t2is", "--items", str(prompts),
              "--policy", str(tiny_model_dirs["policy_t2is"]), "--judge", str(tiny_model_dirs["judge_base"]),
              "--clip", str(tiny_model_dirs["clip"]), "--pickscore", str(tiny_model_dirs["clip"])]
    proc = _run("stages.grpo", common + ["--lora", str(g / "lora"), "--checkpoints", str(g / "ck"),
                                         "--plots", str(g / "plots"), "--metrics", str(g / "metrics.json")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((g / "report.json").read_text())
    assert m["epochs_this_run"] == 2 and m["judge"]["requests"] > 0
    metrics = json.loads((g / "metrics.json").read_text())
    monitors = {k for k in metrics if k.endswith("_change")}
    assert set(metrics) - monitors == {"train_gain", "train_gain_p", "eval_reward", "lora_epoch", "eval_gain",
                                       "eval_train_gain"}
    assert monitors == {"grid_artifact_change", "grid_artifact_2px_change", "high_frequency_change",
                        "panel_similarity_change"}
    assert all(np.isfinite(metrics[k]) for k in monitors) and metrics["lora_epoch"] == 2
    evals = pd.read_csv(g / "plots" / "eval.csv")
    assert {"grid_artifact", "grid_artifact_2px", "high_frequency", "panel_similarity"} <= set(evals.columns)
    # eval.train_prompts: the training prompts evaluated beside the held-out ones
    assert {"train_reward", "train_prompts"} <= set(evals.columns) and (evals["train_prompts"] > 0).all()
    assert metrics["eval_train_gain"] == pytest.approx(evals["train_reward"].iloc[-1] - evals["train_reward"].iloc[0])
    assert (g / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (g / "ck" / "judge_server.log").is_file() and len(list((g / "ck").glob("epoch-*"))) == 2
    for name in ("train.csv", "eval.csv"):
        assert (g / "plots" / name).is_file()
    proc = _run("stages.final_samples", common + ["--lora", str(g / "lora"), "--base-judge",
                                                  str(tiny_model_dirs["judge_base"]), "--out", str(s / "samples.parquet"),
                                           "--sheets", str(s / "sheets"), "--metrics", str(s / "metrics.json")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = pd.read_parquet(s / "samples.parquet")
    assert len(samples) == 2 * 2 and set(samples["variant"]) == {"base", "lora"}
    assert all(len(p) == 4 for p in samples["panels"])
    sm = json.loads((s / "report.json").read_text())
    assert set(sm["rewards"]) == {"consistency", "clip_t", "pickscore"}
    fm = json.loads((s / "metrics.json").read_text())
    assert {"consistency_gain", "consistency_p", "independent_gain", "hacking_gap", "high_frequency_change",
            "panel_similarity_change"} <= set(fm)
    # the run's judge is the base judge here: served or in process, the independent scores are its own
    assert abs(fm["hacking_gap"]) < 1e-5 and abs(fm["independent_gain"] - fm["consistency_gain"]) < 1e-5
    assert {"monitor_high_frequency", "monitor_panel_similarity", "independent_consistency"} <= set(samples.columns)
    assert {p.name for p in (s / "sheets").iterdir()} == {"base.png", "lora.png"}


@pytest.mark.slow
def test_two_gloo_processes_give_the_one_process_result(tiny_model_dirs, tmp_path):
    """2 CPU processes (gloo) at the same global batch equal 1 process, up to float
    summation order: the same samples (per-trajectory generators), gathered rewards, summed
    gradients."""
    from safetensors.torch import load_file

    params = _params(tmp_path)
    raw = yaml.safe_load(params.read_text())
    raw["grpo"]["t2is"]["rewards"] = {"clip_t": 1.0, "pickscore": 1.0}  # no judge needed for the check
    # a large eps keeps Adam from normalising near-zero gradients (where float-order noise between
    # the two runs is all there is) into full-size steps
    raw["grpo"]["t2is"]["train"]["adam_eps"] = 1e-3
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    prompts = _prompts(tmp_path / "prompts.parquet")
    out = {}
    for n in (1, 2):
        d = tmp_path / f"p{n}"
        proc = _launch_grpo(n, params, prompts, tiny_model_dirs, d)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[n] = (load_file(str(d / "lora" / "pytorch_lora_weights.safetensors")),
                  pd.read_csv(d / "plots" / "train.csv"), json.loads((d / "report.json").read_text()))
    (w1, t1, m1), (w2, t2, m2) = out[1], out[2]
    assert m2["processes"] == 2 and m1["processes"] == 1
    # same samples up to batch-size float effects (row batches of 4 vs 2), so the same rewards
    pd.testing.assert_series_equal(t1["reward"], t2["reward"], rtol=1e-4)
    # the learned updates (weights minus the seeded initial LoRA) agree up to float summation order
    from paco.core.seeding import stable_seed
    from paco.models.loading import load_flux_pipeline
    from paco.core.params import load_params
    from paco.grpo.policies import FluxPolicy

    cfg = load_params(params).grpo["t2is"]
    init = FluxPolicy(load_flux_pipeline(tiny_model_dirs["policy_t2is"]), cfg.lora,
                      seed=stable_seed(cfg.seed, "lora")).lora_state_dict()
    for k in w1:
        w0 = init[k.removeprefix("transformer.")].numpy()
        a, b = w1[k].numpy() - w0, w2[k].numpy() - w0
        assert np.linalg.norm(a) > 0, k
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(a), (k, np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.slow
def test_a_judge_server_that_cannot_start_fails_every_process(tiny_model_dirs, tmp_path):
    """With 2 processes, rank 0's server failure reaches rank 1 too (no rank waits forever). The
    server cannot start because the judge's weights are truncated: it exits while loading, whatever
    the machine's load (a start-up timeout races the trainer's own policy load)."""
    import shutil

    judge = tmp_path / "judge"
    shutil.copytree(tiny_model_dirs["judge_base"], judge)
    weights = judge / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "grpo"
    dirs = {**tiny_model_dirs, "judge_base": judge}
    proc = _launch_grpo(2, _params(tmp_path), _prompts(tmp_path / "prompts.parquet"), dirs, out, timeout=300)
    assert proc.returncode != 0
    # both ranks report the server's failure (a hang would have hit the timeout instead)
    assert proc.stderr.count("before it was ready") >= 2, proc.stderr[-3000:]
    assert not (out / "metrics.json").exists()
