"""Stages that shard their work over ``accelerate launch`` processes write the same bytes with 1
and 2 processes (gloo on CPU): ``composites`` (source ``generate``), ``reward_merge`` and
``reward_eval`` here, on the embedded default's real ranking
instances and photo edits (``reasons``: tests/test_reasons.py; ``reward_train``, ``grpo``: their
own tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PACO_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _sh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def workspace(data_stages_clone) -> Path:
    """The clone with the data stages run (``data_stages_clone``); the tests write their params
    files beside ``params.yaml`` and their outputs under tmp paths."""
    return data_stages_clone


def _stage_command(repo: Path, stage: str, processes: int, edit) -> tuple[str, dict]:
    """The registry's command of ``stage`` with ``processes``, its params written to
    ``params-<stage>-<processes>.yaml`` after ``edit(params)``."""
    from workflow.registry import by_name

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["resources"]["stages"][stage]["processes"] = processes
    edit(params)
    name = f"params-{stage}-{processes}.yaml"
    (repo / name).write_text(yaml.safe_dump(params, sort_keys=False))
    member = by_name(stage).members(params)[0]
    cmd = member.resolve(by_name(stage).cmd, params).replace("params.yaml", name)
    assert f"--num_processes {processes}" in cmd, cmd
    return cmd, params


def test_composites_generate_two_processes_equal_one_byte_for_byte(workspace, tmp_path):
    def generate(params):
        params["composites"]["source"] = "generate"
        params["composites"]["seeds_per_prompt"] = 2
        # 3 render batches per output size, the last one short
        params["composites"]["generate"].update(height=64, width=64, num_inference_steps=2, batch_size=5)

    outs = {}
    for processes in (1, 2):
        cmd, _ = _stage_command(workspace, "composites", processes, generate)
        out = tmp_path / str(processes)
        cmd = cmd.replace("data/composites/", f"{out}/")
        assert f"{out}/composites.parquet" in cmd and "--policy data/models/policy_t2is" in cmd, cmd
        log = _sh(["bash", "-c", cmd], workspace).stderr
        outs[processes] = out
    assert "process 2/2" in log
    assert (outs[1] / "composites.parquet").read_bytes() == (outs[2] / "composites.parquet").read_bytes()
    assert (outs[1] / "metrics.json").read_bytes() == (outs[2] / "metrics.json").read_bytes()
    assert not list(outs[2].glob(".*parts*"))  # the part files are gone
    assert json.loads((outs[2] / "report.json").read_text())["run"]["processes"] == 2


def test_reward_merge_two_processes_equal_one_byte_for_byte(workspace, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    from paco.models.loading import load_judge

    # an adapter with non-zero B (a fresh LoRA would merge to the base itself)
    torch.manual_seed(0)
    model, _ = load_judge(workspace / "data/models/judge_base")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")

    def check(params):
        params["reward_merge"]["check_pairs"] = 11  # 2 check batches of 8 (the Judge's), the last short

    outs = {}
    for processes in (1, 2):
        cmd, _ = _stage_command(workspace, "reward_merge", processes, check)
        out = tmp_path / str(processes)
        cmd = (cmd.replace("--adapter data/reward_train/adapter", f"--adapter {tmp_path}/adapter")
                  .replace("data/reward_merge/", f"{out}/"))
        assert f"--out {out}/model" in cmd, cmd
        _sh(["bash", "-c", cmd], workspace)
        outs[processes] = out
    files = sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file() and p.name != "report.json")
    assert any(str(f).endswith(".safetensors") for f in files), files
    assert files == sorted(p.relative_to(outs[2]) for p in outs[2].rglob("*") if p.is_file() and p.name != "report.json")
    for f in files:
        assert (outs[1] / f).read_bytes() == (outs[2] / f).read_bytes(), f
    metrics = json.loads((outs[2] / "report.json").read_text())
    assert metrics["run"]["processes"] == 2 and metrics["check_pairs"] == 11 and max(metrics["max_abs_diff"].values()) <= metrics["tolerance"]
    assert not list(outs[2].glob(".model.*"))  # the temporary save was moved or removed


def _reward_eval(repo: Path, processes: int, out: Path, instances: Path) -> subprocess.CompletedProcess:
    """The stage's registry command with ``processes``, the ranking ``instances`` and outputs
    under ``out``; the untrained base judge stands in for the merged one (the scores are what must
    agree, not their quality)."""
    return _sh(["bash", "-c", _reward_eval_cmd(repo, processes, out, instances)], repo)


def _reward_eval_cmd(repo: Path, processes: int, out: Path, instances: Path) -> str:
    """The command :func:`_reward_eval` runs."""
    from workflow.registry import by_name

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["resources"]["stages"]["reward_eval"]["processes"] = processes
    params["reward_eval"]["batch_size"] = 6  # several batches per call, the last one short
    params["reward_eval"]["baselines"] = ["clip_i"]  # one transformer judge is enough here
    (repo / f"params-{processes}.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    member = by_name("reward_eval").members(params)[0]
    cmd = member.resolve(by_name("reward_eval").cmd, params)
    cmd = (cmd.replace("params.yaml", f"params-{processes}.yaml")
              .replace("--judge data/reward_merge/model", "--judge data/models/judge_base")
              .replace("--instances data/pairs/rank_instances.parquet", f"--instances {instances}")
              .replace("data/reward_eval/", f"{out}/"))
    assert f"--num_processes {processes}" in cmd and f"{out}/predictions.parquet" in cmd, cmd
    assert f"--instances {instances}" in cmd, cmd
    return cmd


def _two_launchers(repo: Path, out: Path, instances: Path) -> None:
    """:func:`_reward_eval` with 1 process per launcher on 2 "machines" (two launchers on this host,
    ``--num_machines 2``, ranks 0 and 1, meeting on a free loopback port): one gloo group of 2."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = _reward_eval_cmd(repo, 1, out, instances)
    env = {k: v for k, v in _env().items() if k not in ("SLURM_NNODES", "PACO_NODE_TASK")}
    procs = [subprocess.Popen(["bash", "-c", cmd.replace(
        "--num_processes 1", f"--num_processes 1 --num_machines 2 --machine_rank {rank} --main_process_ip 127.0.0.1 "
        f"--main_process_port {port}")], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)


def test_reward_eval_two_processes_equal_one_byte_for_byte(workspace, tmp_path):
    """1 process, 2 processes on one machine, and 2 launchers of one process each on two "machines"
    (``paco.core.launch --num_machines 2``, resources.nodes: 2) write the same bytes."""
    import pandas as pd

    # the held-out instances of 3 of the 8 test prompts (every prompt's instances whole: the
    # per-prompt figures too must agree), and all the photo edits
    table = pd.read_parquet(workspace / "data/pairs/rank_instances.parquet")
    test = table[table["split"] == "test"]
    kept = sorted(test["prompt_id"].unique())[:3]
    instances = tmp_path / "rank_instances.parquet"
    test[test["prompt_id"].isin(kept)].to_parquet(instances, index=False)
    one, two = tmp_path / "one", tmp_path / "two"
    _reward_eval(workspace, 1, one, instances)
    _reward_eval(workspace, 2, two, instances)
    machines = tmp_path / "two_machines"
    _two_launchers(workspace, machines, instances)
    for name in ("predictions.parquet", "metrics.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes() == (machines / name).read_bytes(), name
    assert json.loads((machines / "report.json").read_text())["run"]["processes"] == 2
    report_one = json.loads((one / "report.json").read_text())
    report_two = json.loads((two / "report.json").read_text())
    assert report_two["run"]["processes"] == 2 and report_one["run"]["processes"] == 1
    for report in (report_one, report_two):
        del report["run"]
    assert report_one == report_two  # every figure, the editing benchmark's included
    assert report_one["prompts"] == 3 and report_one["instances"] == int(test["prompt_id"].isin(kept).sum()) > 12
    assert report_one["editing"]["instances"] > 0
