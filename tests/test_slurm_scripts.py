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
    env = _bin(tmp_path, sbatch=f'echo "$@" > {tmp_path}/args; echo 1234')
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(["bash", str(SUBMIT), "0", "--job-name=paco-pairs", "--output=logs/slurm/pairs-%j.out",
                           "job.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "1234"
    assert (work / "logs/slurm").is_dir()
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--job-name=paco-pairs",
                                                       "--output=logs/slurm/pairs-%j.out", "job.sh"]
    subprocess.run(["bash", str(SUBMIT), "2", "job.sh"], cwd=work, env=env, check=True, timeout=30)
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--gpus=2", "job.sh"]
    bad = subprocess.run(["bash", str(SUBMIT), "x", "job.sh"], cwd=work, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "non-negative integer" in bad.stderr


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
