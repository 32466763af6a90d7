"""The stage launcher (:mod:`paco.core.launch`): which launches need ``accelerate launch``, the
``OMP_NUM_THREADS`` a stage run in place gets, and a probe stage run both ways."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paco.core.launch import (LaunchError, accelerate_omp_threads, launcher_needed, main, params_path,
                              read_accelerate_config, split_command)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "workflow" / "accelerate"


def _config(name: str) -> dict:
    return read_accelerate_config(CONFIGS / f"{name}.yaml")


def test_only_one_plain_local_process_runs_in_place():
    """The shipped CPU and DDP configs at 1 process run in place; more processes, FSDP,
    DeepSpeed, mixed precision, a dynamo backend or several machines go to the launcher."""
    assert launcher_needed(_config("cpu"), 1) is None
    assert launcher_needed(_config("ddp"), 1) is None
    assert launcher_needed(_config("cpu"), 2) == "2 processes"
    assert launcher_needed(_config("fsdp"), 1) == "distributed_type FSDP"
    assert launcher_needed(_config("zero2"), 1) == "distributed_type DEEPSPEED"
    cpu = _config("cpu")
    assert launcher_needed({**cpu, "mixed_precision": "bf16"}, 1) == "mixed_precision bf16"
    assert launcher_needed({**cpu, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}, 1) == "dynamo backend INDUCTOR"
    assert launcher_needed({**cpu, "num_machines": 2}, 1) == "2 machines"
    assert launcher_needed({**cpu, "compute_environment": "AMAZON_SAGEMAKER"}, 1) == "compute_environment AMAZON_SAGEMAKER"
    assert launcher_needed({**cpu, "distributed_type": "XLA"}, 1) == "distributed_type XLA"
    assert launcher_needed({**cpu, "fp8_config": {"backend": "TE"}}, 1) == "fp8_config"
    assert launcher_needed({**cpu, "gpu_ids": "1"}, 1) == "gpu_ids 1"
    assert launcher_needed({**cpu, "dynamo_backend": "inductor"}, 1) == "dynamo backend INDUCTOR"
    assert launcher_needed({**cpu, "debug": True}, 1) == "debug"
    assert launcher_needed({**cpu, "ipex_config": {"ipex": True}}, 1) == "ipex_config"  # a key it does not know
    assert launcher_needed({**cpu, "fsdp_config": {}}, 1) is None  # empty: nothing asked
    assert launcher_needed({"distributed_type": "NO"}, 1) is None  # a minimal config


@pytest.mark.parametrize("name", ["cpu", "ddp"])
@pytest.mark.parametrize("processes", [1, 2, 3, 16])
def test_omp_threads_are_accelerates_own(monkeypatch, name, processes):
    """:func:`accelerate_omp_threads` gives what accelerate's launcher computes for the same
    config and process count (its ``_validate_launch_command``), on a machine of 8 physical
    cores."""
    import psutil
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if not logical else 16)
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"),
                                               "--num_processes", str(processes), "probe.py"])
    _validate_launch_command(args)
    ours = accelerate_omp_threads(_config(name), processes)
    assert ours == args.num_cpu_threads_per_process
    assert ours == (max(1, 8 // processes) if name == "cpu" else 1)


def test_command_parsing():
    assert split_command(["--config_file", "c.yaml", "-m", "stages.x", "--params", "p.yaml", "-m", "y"]) == (
        ["--config_file", "c.yaml"], "stages.x", ["--params", "p.yaml", "-m", "y"])
    with pytest.raises(LaunchError, match="usage"):
        split_command(["--config_file", "c.yaml", "-m"])
    assert params_path(["--out", "o", "--params", "p.yaml"]) == "p.yaml"
    assert params_path(["--params=q.yaml"]) == "q.yaml"
    assert params_path(["--out", "o"]) == "params.yaml"
    assert params_path(["--prompts", "x.parquet", "--par", "r.yaml"]) == "r.yaml"  # argparse's prefixes, as the stage


def test_a_missing_config_is_one_message(tmp_path, capsys):
    assert main(["--config_file", str(tmp_path / "none.yaml"), "-m", "stages.models"]) == 2
    assert "none.yaml" in capsys.readouterr().err


PROBE = '''
import json, os, sys
import torch
from accelerate import Accelerator

acc = Accelerator(cpu=not torch.cuda.is_available())
with open(os.path.join(os.environ["PROBE_DIR"], f"probe-{acc.process_index}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "processes": acc.num_processes, "index": acc.process_index,
               "mixed_precision": acc.mixed_precision, "type": str(acc.distributed_type),
               "omp": os.environ.get("OMP_NUM_THREADS"), "argv": sys.argv[1:], "name": __name__}, f)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


def _write_probe(tmp_path: Path) -> Path:
    """The probe module and a copy of the embedded params in ``tmp_path``; returns the params."""
    (tmp_path / "paco_launch_probe.py").write_text(PROBE)
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    return params


def _run(tmp_path: Path, launcher: list[str], processes: int, exit_code: int = 0) -> tuple[subprocess.Popen, list[dict], str]:
    """The probe under ``launcher``: the process, each rank's report (by rank), its stderr."""
    params = _write_probe(tmp_path)
    probes = tmp_path / "probes"
    shutil.rmtree(probes, ignore_errors=True)
    probes.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", PROBE_EXIT=str(exit_code), PROBE_DIR=str(probes),
               PACO_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [*launcher, "--config_file", str(CONFIGS / "cpu.yaml"), "--num_processes", str(processes),
           "-m", "paco_launch_probe", "--params", str(params), "--flag", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    return proc, [json.loads(f.read_text()) for f in sorted(probes.glob("probe-*.json"))], err


LAUNCH = [sys.executable, "-m", "paco.core.launch"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def test_one_process_runs_in_place_with_what_accelerate_launch_gives_it(tmp_path):
    """In place: the launcher's own process runs the module as ``__main__`` with its arguments,
    one process of rank 0, no mixed precision, and the ``OMP_NUM_THREADS`` that ``accelerate
    launch`` sets; only the distributed type differs (a gloo group of one under the launcher)."""
    proc, (here,), _ = _run(tmp_path, LAUNCH, 1)
    assert proc.returncode == 0 and here["pid"] == proc.pid
    proc2, (launched,), _ = _run(tmp_path, ACCELERATE, 1)
    assert proc2.returncode == 0 and launched["pid"] != proc2.pid
    same = ("processes", "index", "mixed_precision", "omp", "argv", "name")
    assert {k: here[k] for k in same} == {k: launched[k] for k in same}
    assert here["argv"] == ["--params", str(tmp_path / "params.yaml"), "--flag", "1"] and here["name"] == "__main__"
    assert (here["type"], launched["type"]) == ("DistributedType.NO", "DistributedType.MULTI_CPU")


def test_the_stage_exit_code_is_the_launch_exit_code(tmp_path):
    proc, probes, _ = _run(tmp_path, LAUNCH, 1, exit_code=2)
    assert proc.returncode == 2 and len(probes) == 1


def test_two_processes_are_handed_to_accelerate_launch(tmp_path):
    proc, probes, _ = _run(tmp_path, LAUNCH, 2)
    assert proc.returncode == 0, _
    assert sorted(p["index"] for p in probes) == [0, 1] and {p["processes"] for p in probes} == {2}
    assert all(p["pid"] != proc.pid for p in probes)


def test_invalid_params_stop_before_the_stage(tmp_path):
    _write_probe(tmp_path).write_text(yaml.safe_dump({"reward_train": {"epochs": -1}}))
    (tmp_path / "probes").mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PROBE_DIR": str(tmp_path / "probes")}
    bad = subprocess.run([*LAUNCH, "--config_file", str(CONFIGS / "cpu.yaml"), "--num_processes", "1", "-m",
                          "paco_launch_probe", "--params", str(tmp_path / "params.yaml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "reward_train.epochs" in bad.stderr and "Traceback" not in bad.stderr
    assert not list((tmp_path / "probes").iterdir())  # the stage never ran
