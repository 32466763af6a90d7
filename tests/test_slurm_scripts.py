"""The sbatch profile's submit and status scripts (workflow/slurm/) against stand-in SLURM
commands on PATH: what they submit, and how every job state maps to running / success / failed.
(The real-cluster runs are the ``slurm``-marked tests, issue 11.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "workflow/slurm/submit.sh"
STATUS = ROOT / "workflow/slurm/status.sh"


def _bin(tmp: Path, **commands: str) -> dict[str, str]:
    """An environment whose PATH starts with ``tmp/bin`` holding ``name -> shell body`` stubs
    (and nothing else of SLURM: the real commands, if any, are shadowed or absent)."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in commands.items():
        path = bindir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    # a PATH with the stubs and the basic tools only (no real sacct/squeue/scontrol)
    return {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}


def _status(env: dict[str, str], jobid: str = "42") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(STATUS), jobid], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("state,expected", [
    ("COMPLETED", "success"), ("RUNNING", "running"), ("PENDING", "running"), ("COMPLETING", "running"),
    ("FAILED", "failed"), ("TIMEOUT", "failed"), ("OUT_OF_MEMORY", "failed"), ("NODE_FAIL", "failed"),
    ("CANCELLED by 1000", "failed"), ("PREEMPTED", "failed"),
])
def test_status_from_sacct(tmp_path, state, expected):
    # scontrol stubbed too: a real one on PATH would ask a controller (18 s when none answers)
    env = _bin(tmp_path, sacct=f'[ "$2" = 42 ] && echo "{state}"', scontrol="exit 1")
    assert _status(env).stdout.strip() == expected


def test_status_without_accounting_falls_back_to_scontrol_then_squeue(tmp_path):
    # accounting off: sacct errors out; the controller still remembers the finished job
    env = _bin(tmp_path, sacct="echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1",
               scontrol='echo "JobId=42 JobName=paco-pairs UserId=root(0) JobState=TIMEOUT Reason=TimeLimit"')
    assert _status(env).stdout.strip() == "failed"
    env = _bin(tmp_path, scontrol="echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
               squeue='echo RUNNING')
    assert _status(env).stdout.strip() == "running"


def test_a_job_nobody_knows_is_failed_with_the_reason(tmp_path):
    env = _bin(tmp_path, sacct="exit 0", scontrol="exit 1", squeue="exit 0")
    proc = _status(env, "77;cluster")
    assert proc.stdout.strip() == "failed" and "no SLURM record of job 77" in proc.stderr


def test_submit_creates_the_log_directory_and_asks_for_gpus_only_when_needed(tmp_path):
    """``submit.sh GPUS NODES [sbatch options] JOBSCRIPT`` (the sbatch profile's submit command)."""
    env = _bin(tmp_path, sbatch=f'echo "$@" > {tmp_path}/args; echo 1234')
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(["bash", str(SUBMIT), "0", "1", "--job-name=paco-pairs", "--output=logs/slurm/pairs-%j.out",
                           "job.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "1234"
    assert (work / "logs/slurm").is_dir()
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--job-name=paco-pairs",
                                                       "--output=logs/slurm/pairs-%j.out", "job.sh"]
    subprocess.run(["bash", str(SUBMIT), "2", "1", "job.sh"], cwd=work, env=env, check=True, timeout=30)
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--gpus=2", "job.sh"]
    # several nodes: GPUS per node, one task (one launcher) per node
    subprocess.run(["bash", str(SUBMIT), "8", "2", "job.sh"], cwd=work, env=env, check=True, timeout=30)
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--nodes=2", "--ntasks-per-node=1",
                                                       "--gres=gpu:8", "job.sh"]
    for args, message in ((["x", "1"], "GPUS must be a non-negative integer"), (["1", "0"], "NODES must be a positive"),
                          (["0", "2"], "NODES 2 needs GPUS > 0")):
        bad = subprocess.run(["bash", str(SUBMIT), *args, "job.sh"], cwd=work, env=env, capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_a_failed_job_reports_its_state_exit_code_and_log(tmp_path):
    """The cluster-generic executor names only the rule's log: status.sh puts the SLURM state,
    exit code and the job's own log on Snakemake's terminal (stderr)."""
    env = _bin(tmp_path, sacct='[ "$2" = 42 ] && echo "FAILED|1:0"',
               scontrol='echo "JobId=42 JobState=FAILED StdOut=/w/logs/slurm/pairs-42.out ExitCode=1:0"')
    proc = _status(env)
    assert proc.stdout.strip() == "failed"
    assert "job 42 ended FAILED (exit code 1:0); job log: /w/logs/slurm/pairs-42.out" in proc.stderr
    # a job that succeeded says nothing
    env = _bin(tmp_path, sacct='echo "COMPLETED|0:0"', scontrol="exit 1")
    proc = _status(env)
    assert proc.stdout.strip() == "success" and proc.stderr == ""


WHEELHOUSE = ROOT / "scripts/wheelhouse.sh"


def test_wheelhouse_script_parses():
    subprocess.run(["bash", "-n", str(WHEELHOUSE)], check=True, timeout=30)


def test_wheelhouse_dry_run_prints_the_offline_install_and_runs_nothing(tmp_path):
    """WHEELHOUSE_DRY_RUN=1 prints every command and runs none (the interpreter, a stub that
    would leave a file, is never called): the wheels exclude torch's stack, constraints.txt pins
    the torch found, and the last step installs from the wheel directory alone."""
    stub = tmp_path / "python-stub"
    stub.write_text(f"#!/usr/bin/env bash\ntouch {tmp_path}/called\n")
    stub.chmod(0o755)
    env = {**os.environ, "WHEELHOUSE_DRY_RUN": "1", "PYTHON": str(stub), "WHEEL_DIR": str(tmp_path / "wh"),
           "WHEELHOUSE_TMP": str(tmp_path / "tmp")}
    proc = subprocess.run(["bash", str(WHEELHOUSE)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "called").exists() and not (tmp_path / "wh").exists() and not (tmp_path / "tmp").exists()
    lines = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    wh, build, check = tmp_path / "wh", tmp_path / "tmp/build-venv", tmp_path / "tmp/check-venv"
    # resolved without installing, then one wheel per resolved requirement and the build backend
    assert (f"{build}/bin/python -m pip install --dry-run --quiet --ignore-installed --report {wh}/resolution.json "
            f"-c {tmp_path}/tmp/resolve-constraints.txt -e .[test]") in lines
    assert f"{build}/bin/python -m pip wheel --quiet --no-deps --wheel-dir {wh} -r {wh}/requirements.txt" in lines
    assert f"{build}/bin/python -m pip wheel --quiet --wheel-dir {wh} -r {wh}/build-requirements.txt" in lines
    drop = next(line for line in lines if line.startswith("find ") and "-delete" in line)
    for pattern in ("torch-*.whl", "torchvision-*.whl", "triton-*.whl", "nvidia_*.whl"):
        assert f"-iname '{pattern}'" in drop
    assert any("'torch==$TORCH_VERSION'" in line and line.endswith(f"> '{wh}/constraints.txt'") for line in lines)
    install = f"{check}/bin/python -m pip install --quiet --no-index --find-links {wh} -c {wh}/constraints.txt -e .[test]"
    assert install in lines
    assert lines.index(install) > lines.index(drop)  # the check installs what is left
    assert lines[lines.index(install) + 1].startswith(f"{check}/bin/python -c 'import stages, paco, workflow, torch, ")


def _requirements_filter() -> str:
    """The script's own filter of pip's resolution report (its ``<<'PY'`` block)."""
    text = WHEELHOUSE.read_text()
    return text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


def test_wheelhouse_requirements_leave_out_the_project_and_torchs_stack(tmp_path):
    import json
    import sys

    def item(name, version, **extra):
        return {"metadata": {"name": name, "version": version}, "is_direct": False, **extra}

    report = {"install": [
        item("paco-pipeline", "0.1.0", is_direct=True, download_info={"url": "file:///x", "dir_info": {"editable": True}}),
        item("torch", "2.5.1"), item("torchvision", "0.20.1"), item("Triton", "3.1.0"),
        item("nvidia_cudnn-cu12", "9.1.0.70"), item("nvidia-nccl-cu12", "2.21.5"),
        item("Jinja2", "3.1.4"), item("typing_extensions", "4.12.2"), item("torchmetrics-not", "1.0"),
    ]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    stack = WHEELHOUSE.read_text().split("TORCH_STACK='", 1)[1].split("'", 1)[0]
    assert stack.split() == ["torch", "torchvision", "torchaudio", "triton", "pytorch-triton", "nvidia-*"]
    subprocess.run([sys.executable, "-", str(tmp_path / "r.json"), str(tmp_path / "req.txt"), stack],
                   input=_requirements_filter(), text=True, check=True, capture_output=True, timeout=60)
    assert (tmp_path / "req.txt").read_text().split() == [
        "jinja2==3.1.4", "torchmetrics-not==1.0", "typing-extensions==4.12.2"]
