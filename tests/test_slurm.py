"""The DAG on a real SLURM cluster through both Snakemake profiles (issue 11).

Needs a running cluster: ``workflow/slurm/local-cluster.sh start`` (as root; ``.ci/run`` starts
one). Without one these tests skip, except where ``PACO_REQUIRE_SLURM=1`` (CI): there a missing
cluster is a failure. Every job must really go through ``sbatch``: the tests read the jobs back
from ``sacct`` (accounting is on in the local cluster). ``models``, the one stage that downloads,
is a Snakemake localrule (issue 28: compute nodes may have no internet): it runs on the
submitting host and must not appear in ``sacct``.
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
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

#: the stages run on the cluster, up to the SFT table (reasons runs as 2 accelerate processes)
TARGETS = ["data/reasons/sft.parquet", "data/models/metrics.json"]
RULES = {"models", "prompts", "edits", "composites", "subfigures", "pairs", "reasons"}
#: the rules that run on the submitting host (``workflow.registry.local_rules``), not through sbatch
LOCAL_RULES = {"models"}
#: byte-compared with `dvc repro`'s
ARTIFACTS = [
    "data/prompts/prompts.parquet",
    "data/edits/edits.parquet",
    "data/composites/composites.parquet",
    "data/subfigures/panels.parquet",
    "data/pairs/rank_instances.parquet",
    "data/pairs/pairs.parquet",
    "data/pairs/edit_pairs.parquet",
    "data/reasons/sft.parquet",
]
#: the first status query 1 s after a submission, not the profiles' 10 s (slurm plugin; it then
#: backs off by 10 s per query that finds nothing finished), and one query a second, not every
#: 10 s (cluster-generic): a local cluster answers at once, and the tests wait less
FAST_STATUS_CHECKS = {"slurm": ["--slurm-init-seconds-before-status-checks", "1"],
                      "sbatch": ["--seconds-between-status-checks", "1"]}
#: a Snakemake run on the cluster is killed after this long (a status-query problem fails, never hangs)
RUN_TIMEOUT_S = 900


def _env() -> dict[str, str]:
    """The environment of a submitting shell without an activated venv (this interpreter's bin
    directory is not on PATH): the Snakefile must bring it to every job."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != bindir)
    return env


def _cluster_problem() -> str | None:
    if not shutil.which("sbatch") or not shutil.which("sacct"):
        return "no SLURM client commands (sbatch, sacct) on PATH"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"no SLURM controller answers: {(ping.stdout + ping.stderr).strip()}"
    acct = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=30)
    if acct.returncode != 0:
        return f"sacct fails (accounting off?): {acct.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        msg = f"{problem}; start one with `workflow/slurm/local-cluster.sh start` (as root)"
        if os.environ.get("PACO_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def _clone(tmp: Path, name: str) -> Path:
    repo = tmp / name
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    return repo


def _job_ids(profile: str, output: str) -> list[str]:
    """The SLURM job ids Snakemake reports having submitted."""
    pattern = (r"has been submitted with SLURM jobid (\d+)" if profile == "slurm"
               else r"Submitted job \d+ with external jobid '(\d+)")
    return re.findall(pattern, output)


def _sacct(job_ids: list[str]) -> list[dict[str, str]]:
    fields = ["JobID", "JobName", "Comment", "State", "ExitCode", "AllocCPUS", "ReqMem", "Elapsed"]
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", ",".join(fields)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line]


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _set_resources(repo: Path, every_stage: dict | None = None, **stages: dict) -> None:
    """Edit ``params.yaml``'s ``resources``: ``every_stage`` into the default and every stage's
    entry, then ``stages[name]`` into stage ``name``'s (made from the default where absent)."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    resources = params["resources"]
    entries = resources.setdefault("stages", {})
    for entry in (resources["default"], *entries.values()):
        entry.update(every_stage or {})
    for name, values in stages.items():
        entries[name] = {**resources["default"], **entries.get(name, {}), **values}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def dvc_reference(data_stages_clone) -> Path:
    """The same stages under ``dvc repro`` (one process each), outside SLURM (conftest)."""
    return data_stages_clone


def _start(args: list[str], cwd: Path) -> tuple[subprocess.Popen, float]:
    return subprocess.Popen(args, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True), time.monotonic()


def _finish(proc: subprocess.Popen, t0: float, what: str, timeout: int) -> tuple[int, str, float]:
    """Wait for a started run; kill its process group and fail after ``timeout`` s in all."""
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - t0


@pytest.fixture(scope="module")
def profile_runs(cluster, tmp_path_factory) -> dict[str, tuple[Path, int, str, float]]:
    """The DAG up to the SFT table through both profiles at once, in two fresh clones, with
    ``reasons`` as 2 accelerate processes: profile -> (clone, exit code, output, seconds)."""
    started = {}
    for profile in ("slurm", "sbatch"):
        repo = _clone(tmp_path_factory.mktemp(f"profile-{profile}"), "repo")
        # every job on 1 CPU (two at once on the 2-CPU node: the two profiles' runs share it),
        # reasons as 2 accelerate processes in its job
        _set_resources(repo, every_stage={"cpus_per_task": 1}, reasons={"processes": 2})
        args = [sys.executable, "-m", "snakemake", *TARGETS, "--profile", f"workflow/profiles/{profile}",
                *FAST_STATUS_CHECKS[profile]]
        started[profile] = (repo, *_start(args, repo))
    return {profile: (repo, *_finish(proc, t0, profile, RUN_TIMEOUT_S)) for profile, (repo, proc, t0) in started.items()}


@pytest.mark.parametrize("profile", ["slurm", "sbatch"])
def test_profile_runs_every_job_through_sbatch_with_dvc_identical_outputs(profile_runs, dvc_reference, profile,
                                                                          record_property):
    repo, code, out, seconds = profile_runs[profile]
    assert code == 0, out[-6000:]

    jobs = _sacct(_job_ids(profile, out))
    record_property("sacct", json.dumps(jobs))
    print(f"{profile}: {seconds:.0f} s\n" + "\n".join("|".join(j.values()) for j in jobs))
    # one SLURM job per rule, every one completed
    if profile == "slurm":
        rules = [j["Comment"].removeprefix("rule_") for j in jobs]
    else:
        rules = [j["JobName"].removeprefix("paco-") for j in jobs]
    assert sorted(rules) == sorted(RULES - LOCAL_RULES), jobs
    assert all(j["State"] == "COMPLETED" and j["ExitCode"] == "0:0" for j in jobs), jobs
    # each job got the CPUs its stage asked for (resources: cpus_per_task 1 here, 2 by default)
    assert all(j["AllocCPUS"] == "1" for j in jobs), jobs

    # reasons ran as 2 accelerate processes inside its one SLURM job
    reasons_job = next(j for j, r in zip(jobs, rules) if r == "reasons")
    run = json.loads((repo / "data/reasons/report.json").read_text())["run"]
    assert run["processes"] == 2, run
    assert run["slurm"] == {"job_id": reasons_job["JobID"], "node": run["slurm"]["node"], "cpus_per_task": 1}, run

    # job logs are kept (the slurm plugin deletes successful jobs' logs unless told otherwise)
    for rule in RULES:
        assert (repo / f"logs/{rule}.log").stat().st_size > 0, rule
    assert len(list((repo / "logs/slurm").rglob("*"))) >= len(RULES - LOCAL_RULES)

    for artifact in ARTIFACTS:
        assert _md5(repo / artifact) == _md5(dvc_reference / artifact), artifact
    for f in sorted((dvc_reference / "data/models").rglob("*.safetensors")):
        assert _md5(repo / f.relative_to(dvc_reference)) == _md5(f), f


def _break_prompts(repo: Path) -> None:
    with (repo / "data/raw/t2is_prompts.jsonl").open("a") as f:
        f.write('{"prompt": "a broken row\n')
    _set_resources(repo, prompts={"cpus_per_task": 1})  # two of the four jobs at once on the 2-CPU node


def _starve_prompts_of_memory(repo: Path) -> None:
    """``resources.stages.prompts.mem_mb: 60``: the job exceeds it and SLURM kills it
    (OverMemoryKill in the local cluster; cgroups on a real one)."""
    _set_resources(repo, prompts={"cpus_per_task": 1, "mem_mb": 60})


@pytest.fixture(scope="module")
def failed_runs(cluster, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, str]]:
    """The prompts rule through both profiles, in clones broken two ways: ``stage`` (a malformed
    prompts row: the stage fails) and ``memory`` (60 MB: SLURM kills the job); the four runs at
    once, each job on 1 CPU. Each must exit non-zero within 300 s. (profile, how) -> (clone,
    output)."""
    started = {}
    for how, breaks in (("stage", _break_prompts), ("memory", _starve_prompts_of_memory)):
        for profile in ("slurm", "sbatch"):
            repo = _clone(tmp_path_factory.mktemp(f"fail-{how}-{profile}"), "repo")
            breaks(repo)
            # a failed job's outputs are waited for latency-wait s, in the job and in Snakemake
            # (the profiles' 30 s is for a cluster's shared filesystem; here it is local)
            args = [sys.executable, "-m", "snakemake", "data/prompts/prompts.parquet", "--profile",
                    f"workflow/profiles/{profile}", "--latency-wait", "3", *FAST_STATUS_CHECKS[profile]]
            started[profile, how] = (repo, *_start(args, repo))
    results = {}
    for key, (repo, proc, t0) in started.items():
        code, out, seconds = _finish(proc, t0, f"{key}: a failed job left Snakemake waiting", 300)
        print(f"{key}: failed after {seconds:.0f} s")
        assert code != 0, out[-4000:]
        assert "Error in rule prompts" in out, out[-4000:]
        results[key] = (repo, out)
    return results


@pytest.mark.parametrize("profile", ["slurm", "sbatch"])
def test_a_failing_stage_fails_the_run_promptly_with_its_log(failed_runs, profile):
    """A stage that fails inside its SLURM job (a malformed prompts row) ends Snakemake with a
    non-zero exit, naming the rule's log, which holds the stage's error."""
    repo, out = failed_runs[profile, "stage"]
    assert "logs/prompts.log" in out, out[-4000:]
    log = (repo / "logs/prompts.log").read_text()
    assert "stage prompts failed" in log and "t2is_prompts.jsonl" in log, log
    job = _job_ids(profile, out)
    assert len(job) == 1 and _sacct(job)[0]["State"] == "FAILED", out[-4000:]


@pytest.mark.parametrize("profile", ["slurm", "sbatch"])
def test_a_job_slurm_kills_for_memory_fails_the_run_with_the_job_log(failed_runs, profile):
    """A job SLURM kills (over its memory; a time limit or node failure looks the same to
    Snakemake) fails the run promptly, and Snakemake's output leads to the job's SLURM log."""
    repo, out = failed_runs[profile, "memory"]
    job = _job_ids(profile, out)
    assert len(job) == 1, out[-4000:]
    row = _sacct(job)[0]
    assert row["State"] in ("FAILED", "OUT_OF_MEMORY") and row["ReqMem"] == "60M", row
    # the job's own log: named by the slurm plugin's error, by status.sh for cluster-generic
    logs = re.findall(r"(/\S+/logs/slurm/\S+?\.(?:log|out))", out)
    assert logs, out[-4000:]
    assert "exceeded memory limit" in Path(logs[-1]).read_text().lower(), logs


def test_a_job_cancelled_by_scancel_fails_the_sbatch_profile(cluster, tmp_path):
    """``scancel`` while the stage's job waits behind a job holding the node's CPUs: sacct says
    "CANCELLED by <uid>", which workflow/slurm/status.sh reports failed. (The slurm executor
    plugin 2.8 compares the state string whole and keeps waiting on it: the profile's notes.)"""
    blocker = subprocess.run(["sbatch", "--parsable", "--job-name=paco-test-blocker", "--cpus-per-task=2",
                              "--mem=100", "--wrap=sleep 600", f"--output={tmp_path}/blocker.out"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    try:
        repo = _clone(tmp_path, "sbatch")
        args = [sys.executable, "-m", "snakemake", "data/prompts/prompts.parquet", "--profile",
                "workflow/profiles/sbatch", *FAST_STATUS_CHECKS["sbatch"]]
        proc = subprocess.Popen(args, cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            # the stage's job is submitted and pends behind the blocker
            deadline = time.monotonic() + 120
            pending = ""
            while not pending and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(1)
                queue = subprocess.run(["squeue", "-h", "-t", "PENDING", "-o", "%i %j"], capture_output=True,
                                       text=True, timeout=30).stdout.splitlines()
                pending = next((line.split()[0] for line in queue if "paco-prompts" in line), "")
            assert pending, "the stage's job never showed up pending"
            subprocess.run(["scancel", pending], check=True, timeout=30)
            t0 = time.monotonic()
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("a cancelled job left Snakemake waiting for 300 s")
        print(f"sbatch: exited {time.monotonic() - t0:.0f} s after scancel")
        assert proc.returncode != 0, out[-4000:]
        assert "Error in rule prompts" in out and f"SLURM job {pending} ended CANCELLED" in out, out[-4000:]
        assert _sacct([pending])[0]["State"].startswith("CANCELLED by")
    finally:
        subprocess.run(["scancel", blocker], timeout=30)
