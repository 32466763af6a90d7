"""The stage launcher (:mod:`paco.core.launch`): which launches need ``accelerate launch``, the
``OMP_NUM_THREADS`` a stage run in place gets, and a probe stage run both ways."""

from __future__ import annotations

import json
import re
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


class _Exec(Exception):
    """Raised by the fake ``os.execv``: the launcher would have replaced itself here."""


def _capture_exec(monkeypatch) -> dict:
    """Replace ``os.execv`` / ``os.execve`` with fakes that record ``path``, ``argv`` and the
    environment the launcher would have replaced itself with, then raise :class:`_Exec`; returns
    the (filled on each call) record."""
    captured: dict = {}

    def fake_exec(path, argv, env=None):
        captured.update(path=path, argv=list(argv), env=dict(env if env is not None else os.environ))
        raise _Exec

    monkeypatch.setattr(os, "execve", fake_exec)
    monkeypatch.setattr(os, "execv", fake_exec)
    return captured


def _judge_params(tmp_path: Path, processes: int, judge_gpus: int = 1) -> Path:
    """The embedded params with a served vLLM judge on ``judge_gpus`` GPUs of an 8-GPU grpo job."""
    from paco.core.params.base import read_params_yaml

    raw = read_params_yaml(ROOT / "params.yaml")
    raw["judge_endpoint"]["server"].update(engine="vllm", gpus=judge_gpus, dtype="bfloat16")
    for section, gpus in (("grpo", 8), ("final_samples", 2)):
        for item in raw[section].values():
            item["resources"] = {**item.get("resources", {}), "gpus": gpus,
                                 "processes": processes if section == "grpo" else gpus - judge_gpus}
    for item in raw["benchmark"].values():  # the benchmark serves its evaluators with vLLM too
        item["resources"] = {**item.get("resources", {}), "gpus": max(judge_gpus, 1)}
    path = tmp_path / f"params-{processes}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_gpu_split_on_a_fake_8_gpu_allocation(tmp_path, monkeypatch, capsys):
    """``--serves_judge`` with ``judge_endpoint.server.gpus: 1`` on an allocation of 8 GPUs listed
    out of order: the judge gets the first (4), the 7 trainer processes the rest in order, and
    ``accelerate launch`` inherits both. A process count that does not match is exit code 2 naming
    ``resources.processes`` (in the params check, and at launch); so is no allocation at all."""
    captured = _capture_exec(monkeypatch)
    for var in ("PACO_JUDGE_DEVICES", "CUDA_VISIBLE_DEVICES", "SLURM_NNODES", "PACO_NODE_TASK"):  # restored after
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")
    params = _judge_params(tmp_path, 7)
    command = ["--config_file", str(CONFIGS / "ddp.yaml"), "--num_processes", "7", "--serves_judge",
               "-m", "stages.grpo", "--params", str(params)]
    with pytest.raises(_Exec):
        main(command)
    assert captured["env"]["PACO_JUDGE_DEVICES"] == "4"
    assert captured["env"]["CUDA_VISIBLE_DEVICES"] == "5,6,7,0,1,2,3"
    assert captured["argv"][captured["argv"].index("--num_processes") + 1] == "7"
    assert "--serves_judge" not in captured["argv"]  # the launcher's own flag

    # without --serves_judge (a stage that serves no judge) nothing is split
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")
    monkeypatch.delenv("PACO_JUDGE_DEVICES")
    with pytest.raises(_Exec):
        main([a for a in command if a != "--serves_judge"])
    assert captured["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7,0,1,2,3" and "PACO_JUDGE_DEVICES" not in captured["env"]

    # 8 processes: the params check names the key, and so does the launch with params of 7
    captured.clear()
    capsys.readouterr()
    assert main(command[:3] + ["8"] + command[4:-1] + [str(_judge_params(tmp_path, 8))]) == 2
    assert re.search(r"grpo\.\w+\.resources\.processes 8: 7 processes expected", capsys.readouterr().err)
    assert main(command[:3] + ["8"] + command[4:]) == 2
    err = capsys.readouterr().err
    assert "resources.processes 8" in err and "7 GPUs are left" in err and not captured

    # an accelerate config that picks GPUs itself is refused
    cfg = tmp_path / "subset.yaml"
    cfg.write_text(yaml.safe_dump({**_config("ddp"), "gpu_ids": "0,1"}))
    assert main(["--config_file", str(cfg), *command[2:]]) == 2
    assert "gpu_ids '0,1'" in capsys.readouterr().err

    # no allocation: no CUDA_VISIBLE_DEVICES, no SLURM GPUs and no nvidia-smi on PATH
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("SLURM_STEP_GPUS", raising=False)
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(command) == 2
    assert "no GPU allocation found" in capsys.readouterr().err and not captured


def test_visible_gpus_sources(tmp_path):
    """CUDA_VISIBLE_DEVICES first, then SLURM_STEP_GPUS, SLURM_JOB_GPUS, then nvidia-smi's list;
    entries are kept as they are (UUIDs), in order."""
    from paco.core.launch import split_gpus, visible_gpus

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    smi.chmod(0o755)
    path = {"PATH": str(tmp_path)}
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2", "SLURM_JOB_GPUS": "0", **path}) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"SLURM_STEP_GPUS": "3,2", "SLURM_JOB_GPUS": "0", **path}) == ["3", "2"]
    assert visible_gpus({"SLURM_JOB_GPUS": "6,7", **path}) == ["6", "7"]
    assert visible_gpus(path) == ["0", "1", "2"]
    for bad in ("", "NoDevFiles", "-1"):
        with pytest.raises(LaunchError, match="names no GPU"):
            visible_gpus({"CUDA_VISIBLE_DEVICES": bad, **path})
    assert split_gpus(["3", "1", "2"], 2) == (["3", "1"], ["2"])
    with pytest.raises(LaunchError, match="none left"):
        split_gpus(["0"], 1)


def test_slurm_fan_out(tmp_path, monkeypatch):
    """Started once in a 2-node allocation, the launcher replaces itself with ``srun`` starting it
    on each node (one task per node) with the first host as the meeting point; each per-node
    launcher then runs ``accelerate launch`` with its machine rank, both machines and the total
    process count."""
    for name, body in (("scontrol", '[ "$1 $2 $3" = "show hostnames n[01-02]" ] && printf "n01\\nn02\\n"'),
                       ("srun", "exit 99")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    captured = _capture_exec(monkeypatch)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for var in ("PACO_NODE_TASK", "SLURM_NODEID", "PACO_MAIN_PROCESS_IP", "PACO_MAIN_PROCESS_PORT", "PACO_SRUN_ARGS",
                "PACO_NUM_MACHINES"):
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[01-02]")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")  # srun does not inherit it (Slurm >= 22.05): passed on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the batch host's: not the other node's
    monkeypatch.setenv("PACO_SRUN_ARGS", "--overlap")
    _write_probe(tmp_path)
    launcher_args = ["--config_file", str(CONFIGS / "ddp.yaml"), "--num_processes", "3",
                     "-m", "paco_launch_probe", "--params", str(tmp_path / "params.yaml")]
    with pytest.raises(_Exec):
        main(launcher_args)
    assert captured["path"] == str(tmp_path / "srun")
    assert captured["argv"] == [str(tmp_path / "srun"), "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task=6",
                                "--kill-on-bad-exit=1", "--overlap", sys.executable, "-m", "paco.core.launch",
                                *launcher_args]
    env = captured["env"]
    assert (env["PACO_NODE_TASK"], env["PACO_MAIN_PROCESS_IP"]) == ("1", "n01") and int(env["PACO_MAIN_PROCESS_PORT"]) > 0
    assert "CUDA_VISIBLE_DEVICES" not in env

    # the per-node launcher on the second node
    monkeypatch.setenv("PACO_NODE_TASK", "1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("PACO_MAIN_PROCESS_IP", "n01")
    monkeypatch.setenv("PACO_MAIN_PROCESS_PORT", "29511")
    with pytest.raises(_Exec):
        main(launcher_args)
    argv = captured["argv"]
    flags = dict(zip(argv[3:argv.index("-m", 3):2], argv[4:argv.index("-m", 3):2]))
    assert flags == {"--config_file": str(CONFIGS / "ddp.yaml"), "--num_processes": "6", "--num_machines": "2",
                     "--machine_rank": "1", "--main_process_ip": "n01", "--main_process_port": "29511"}
    assert argv[argv.index("-m", 3):] == ["-m", "paco_launch_probe", "--params", str(tmp_path / "params.yaml")]

    # explicit flags: no fan-out; a rank without its meeting point is refused
    monkeypatch.delenv("PACO_NODE_TASK")
    assert main(["--num_machines", "2", *launcher_args]) == 2
    with pytest.raises(_Exec):
        main(["--num_machines", "1", *launcher_args])
    assert "--num_machines" not in captured["argv"] and captured["path"] == sys.executable


def _fake_tools(tmp_path: Path, **bodies: str) -> None:
    """Shell scripts ``tmp_path/<name>`` (``nvidia-smi`` as ``nvidia_smi``) with the given bodies."""
    for name, body in bodies.items():
        tool = tmp_path / name.replace("_", "-")
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(0o755)


def _clean_launch_env(monkeypatch) -> None:
    """No allocation, SLURM or fan-out variable of this machine reaches the launcher under test,
    and what the launcher sets in ``os.environ`` (its exec faked) is undone after the test."""
    for var in [v for v in os.environ if v.startswith("SLURM_")] + [
            "CUDA_VISIBLE_DEVICES", "PACO_JUDGE_DEVICES", "PACO_NODE_TASK", "PACO_NUM_MACHINES", "PACO_SRUN_ARGS",
            "PACO_MAIN_PROCESS_IP", "PACO_MAIN_PROCESS_PORT", "OMP_NUM_THREADS"]:
        monkeypatch.setenv(var, "x")  # recorded: restored (or removed) after the test
        monkeypatch.delenv(var)


def test_a_member_takes_its_own_gpus_of_a_plain_8_gpu_machine(tmp_path, monkeypatch, capsys):
    """A machine without an allocation (no CUDA_VISIBLE_DEVICES, ``nvidia-smi`` lists 8 GPUs): the
    paper preset's ``final_samples`` member (``gpus: 2, processes: 1``, the judge on 1) takes the
    first 2 (a message says so): GPU 0 for the judge, GPU 1 for its process. Without
    ``--resources`` all 8 would be split (7 left for 1 process: exit 2); an allocation of fewer
    GPUs than the member's is exit code 2 naming its key."""
    captured = _capture_exec(monkeypatch)
    _clean_launch_env(monkeypatch)
    _fake_tools(tmp_path, nvidia_smi="printf '0\\n1\\n2\\n3\\n4\\n5\\n6\\n7\\n'")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    params = _judge_params(tmp_path, 7)
    key = f"final_samples.{next(iter(yaml.safe_load(params.read_text())['final_samples']))}.resources"
    config = tmp_path / "bf16.yaml"  # a config that needs accelerate launch: the split reaches the exec
    config.write_text(yaml.safe_dump({**_config("ddp"), "mixed_precision": "bf16"}))
    command = ["--config_file", str(config), "--num_processes", "1", "--resources", key, "--serves_judge",
               "-m", "stages.final_samples", "--params", str(params)]
    with pytest.raises(_Exec):
        main(command)
    assert (captured["env"]["PACO_JUDGE_DEVICES"], captured["env"]["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert f"{key}.gpus 2: taking the first 2 of the 8 visible GPUs" in capsys.readouterr().err
    assert "--resources" not in captured["argv"]  # the launcher's own flag

    captured.clear()
    for var in ("CUDA_VISIBLE_DEVICES", "PACO_JUDGE_DEVICES"):  # set by the launcher before its exec
        monkeypatch.delenv(var)
    assert main([a for a in command if a not in ("--resources", key)]) == 2  # every GPU nvidia-smi lists
    assert "7 GPUs are left" in capsys.readouterr().err and not captured
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert main(command) == 2
    assert f"{key}.gpus 2 but this node has 1 GPUs for the job (3)" in capsys.readouterr().err and not captured


def _nodes_params(tmp_path: Path, nodes: int, config: str = "ddp") -> Path:
    """The embedded params with reward_eval on ``nodes`` nodes of 8 GPUs (``config``)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["resources"]["stages"]["reward_eval"].update(nodes=nodes, gpus=8, processes=8, accelerate_config=config)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


#: ``scontrol show job 77``: a running 2-node job (Slurm 23's layout, abridged)
SCONTROL_JOB = """JobId=77 JobName=paco-reward_eval
   UserId=u(1) GroupId=g(1) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=n[01-02]
   BatchHost=n01
   NumNodes=2 NumCPUs=32 NumTasks=2 CPUs/Task=16 ReqB:S:C:T=0:0:*:*
   ReqNodeList=(null) ExcNodeList=(null)"""


def test_several_nodes_under_the_slurm_plugins_stripped_environment(tmp_path, monkeypatch, capsys):
    """snakemake-executor-plugin-slurm's jobstep runs an MPI-typed job's command with every
    ``SLURM_*`` variable dropped but the job id: the launcher takes the node count from the
    member's resources (``--resources``), the hosts and CPUs per task from ``scontrol show job``,
    and fans out over both nodes; an allocation of another node count, or none, is exit code 2
    naming the key."""
    _fake_tools(tmp_path, scontrol='case "$1 $2 $3" in\n'
                f'  "show job 77") cat <<EOF\n{SCONTROL_JOB}\nEOF\n;;\n'
                '  "show job 78") printf "JobId=78\\n   NodeList=n01\\n   NumNodes=1 CPUs/Task=4\\n";;\n'
                '  "show hostnames n[01-02]") printf "n01\\nn02\\n";;\n'
                '  "show hostnames n01") printf "n01\\n";;\n'
                '  *) exit 1;;\nesac', srun="exit 99")
    captured = _capture_exec(monkeypatch)
    _clean_launch_env(monkeypatch)
    # the allocation's variables as sbatch sets them, then what the jobstep keeps of them
    allocation = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[01-02]",
                  "SLURM_CPUS_PER_TASK": "16", "SLURM_NODEID": "0", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}
    keep = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST"}
    for var, value in allocation.items():
        if var in keep:
            monkeypatch.setenv(var, value)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _write_probe(tmp_path)
    params = _nodes_params(tmp_path, 2)
    key = "resources.stages.reward_eval"
    args = ["--config_file", str(CONFIGS / "ddp.yaml"), "--num_processes", "8", "--resources", key,
            "-m", "paco_launch_probe", "--params", str(params)]
    with pytest.raises(_Exec):
        main(args)
    assert captured["argv"] == [str(tmp_path / "srun"), "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task=16",
                                "--kill-on-bad-exit=1", sys.executable, "-m", "paco.core.launch", *args]
    env = captured["env"]
    assert (env["PACO_NODE_TASK"], env["PACO_NUM_MACHINES"], env["PACO_MAIN_PROCESS_IP"]) == ("1", "2", "n01")

    # without --resources the stripped environment says one node: the old silent single-node run
    with pytest.raises(_Exec):
        main([a for a in args if a not in ("--resources", key)])
    assert captured["path"] == sys.executable and "--num_machines" not in captured["argv"]

    # a 1-node allocation for a 2-node member, and no SLURM job at all: exit code 2 naming the key
    captured.clear()
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{key}.nodes 2 but the SLURM allocation has 1 node(s) (n01)" in err and not captured
    monkeypatch.delenv("SLURM_JOB_ID")
    assert main(args) == 2
    assert "not in a SLURM job" in capsys.readouterr().err and not captured

    # the per-node launcher (srun sets the step's variables): a machine of the member's two
    for var, value in {"PACO_NODE_TASK": "1", "PACO_NUM_MACHINES": "2", "SLURM_NODEID": "1",
                       "PACO_MAIN_PROCESS_IP": "n01", "PACO_MAIN_PROCESS_PORT": "29511"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(_Exec):
        main(args)
    argv = captured["argv"]
    assert argv[argv.index("--num_machines") + 1] == "2" and argv[argv.index("--num_processes") + 1] == "16"
    monkeypatch.setenv("PACO_NUM_MACHINES", "3")
    captured.clear()
    assert main(args) == 2
    assert f"{key}.nodes 2 but this per-node launcher is one of 3 machines" in capsys.readouterr().err


def test_deepspeed_on_several_machines_uses_the_standard_launcher():
    """``accelerate launch``'s argv: the total process count, the machine flags on several machines,
    and for DeepSpeed there ``--deepspeed_multinode_launcher standard`` (each node's launcher starts
    its own processes; accelerate's default, pdsh, would ssh to the others)."""
    from paco.core.launch import accelerate_command

    zero2, ddp = _config("zero2"), _config("ddp")
    head = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "z.yaml", "--num_processes"]
    machines = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "n01", "--main_process_port", "29500"]
    assert accelerate_command("z.yaml", zero2, 7, 2, 1, "n01", 29500) == [
        *head, "14", *machines, "--deepspeed_multinode_launcher", "standard"]
    assert accelerate_command("z.yaml", ddp, 7, 2, 1, "n01", 29500) == [*head, "14", *machines]
    assert accelerate_command("z.yaml", zero2, 8) == [*head, "8"]  # one machine: accelerate's own launcher
    # accelerate knows the value (DEEPSPEED_MULTINODE_LAUNCHERS[1] is the one that starts no remote process)
    from accelerate.utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS

    assert DEEPSPEED_MULTINODE_LAUNCHERS[1] == "standard"


NODE_PROBE = '''
import json, os
from accelerate import Accelerator
from accelerate.utils import gather_object
from paco.serving.endpoint import JudgeEndpoint

acc = Accelerator(cpu=True)

class Server:
    def wait_ready(self):
        return "http://" + os.environ["PROBE_NODE"] + "/v1"

url = JudgeEndpoint(acc, server=Server() if acc.is_local_main_process else None).url()
with open(os.path.join(os.environ["PROBE_DIR"], f"probe-{acc.process_index}.json"), "w") as f:
    json.dump({"index": acc.process_index, "processes": acc.num_processes, "url": url,
               "gathered": gather_object([acc.process_index * 10])}, f)
acc.wait_for_everyone()  # no rank leaves while another still talks to rank 0's store
acc.end_training()  # destroy the process group before the interpreter exits
'''


def test_two_launchers_form_one_group_with_a_judge_per_node(tmp_path):
    """Two launchers (``--num_machines 2``, ranks 0 and 1, one process each) make one process group
    of 2, as one launcher with 2 processes does; each process reaches its own node's judge server
    (the local main's), where one machine's two processes share one."""
    import socket

    (tmp_path / "paco_node_probe.py").write_text(NODE_PROBE)
    params = _write_probe(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PACO_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for var in ("SLURM_NNODES", "PACO_NODE_TASK", "OMP_NUM_THREADS"):
        env.pop(var, None)

    def launch(out: Path, processes: int, *machine: str, node: str) -> subprocess.Popen:
        out.mkdir(exist_ok=True)
        return subprocess.Popen([*LAUNCH, "--config_file", str(CONFIGS / "cpu.yaml"), "--num_processes", str(processes),
                                 *machine, "-m", "paco_node_probe", "--params", str(params)], cwd=tmp_path,
                                env={**env, "PROBE_DIR": str(out), "PROBE_NODE": node}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    two = [launch(tmp_path / "two", 1, "--num_machines", "2", "--machine_rank", rank, "--main_process_ip",
                  "127.0.0.1", "--main_process_port", port, node=f"node{rank}") for rank in ("0", "1")]
    outs = [p.communicate(timeout=300)[0] for p in two]
    assert [p.returncode for p in two] == [0, 0], outs
    one = launch(tmp_path / "one", 2, node="node0")
    out = one.communicate(timeout=300)[0]
    assert one.returncode == 0, out
    read = {name: [json.loads((tmp_path / name / f"probe-{i}.json").read_text()) for i in (0, 1)]
            for name in ("two", "one")}
    for name in read:
        assert [(p["index"], p["processes"], p["gathered"]) for p in read[name]] == [(0, 2, [0, 10]), (1, 2, [0, 10])]
    assert [p["url"] for p in read["two"]] == ["http://node0/v1", "http://node1/v1"]
    assert [p["url"] for p in read["one"]] == ["http://node0/v1", "http://node0/v1"]
