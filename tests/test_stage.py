"""The stage runner (paco.core.stage.run): headline metrics and report written apart, and expected
failures (params, artifacts, a full disk) as one clear line with exit code 2; the thread
environment every stage process runs with."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paco.core.io import ArtifactError
from paco.core.stage import StageOutput, run


def _run(tmp_path, body):
    return run("t", ["--params", str(tmp_path / "params.yaml"), "--metrics", str(tmp_path / "out" / "metrics.json")],
               lambda p: p.add_argument("--metrics"), body, description="test")


@pytest.fixture()
def params(tmp_path):
    (tmp_path / "params.yaml").write_text("{}\n")
    (tmp_path / "out").mkdir()


def test_metrics_and_report_are_written_apart(tmp_path, params):
    assert _run(tmp_path, lambda a, p: StageOutput.headline({"n": 3, "detail": [1, 2]}, "n")) == 0
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == {"n": 3}
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["detail"] == [1, 2] and report["run"]["peak_rss_mb"] > 0  # timings only in the report


def test_the_report_says_how_the_stage_was_launched(tmp_path, params, monkeypatch):
    for var in ("WORLD_SIZE", "SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    assert _run(tmp_path, lambda a, p: {"n": 1}) == 0
    run_info = json.loads((tmp_path / "out" / "report.json").read_text())["run"]
    assert run_info["processes"] == 1 and "slurm" not in run_info
    # an accelerate worker inside a SLURM job
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu07")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    monkeypatch.setenv("PACO_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_DYNAMIC", "false")
    import torch  # a stage that imported torch reports its thread count

    assert _run(tmp_path, lambda a, p: {"n": 1}) == 0
    run_info = json.loads((tmp_path / "out" / "report.json").read_text())["run"]
    assert run_info["processes"] == 2
    assert run_info["threads"]["torch"] == torch.get_num_threads()
    assert run_info["threads"]["PACO_NUM_THREADS"] == "3" and run_info["threads"]["OMP_DYNAMIC"] == "false"
    assert run_info["slurm"] == {"job_id": "417", "node": "gpu07", "cpus_per_task": 8}


@pytest.mark.parametrize("exc,expected", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/x.parquet"), "No space left on device (/data/x.parquet)"),
    (ArtifactError("prompts.parquet: no column split"), "no column split"),
])
def test_expected_failures_are_one_line_and_exit_2(tmp_path, params, caplog, exc, expected):
    def body(a, p):
        raise exc

    with caplog.at_level(logging.ERROR, logger="paco"):
        assert _run(tmp_path, body) == 2
    assert expected in caplog.text and not (tmp_path / "out" / "metrics.json").exists()


def test_a_bug_is_not_hidden(tmp_path, params):
    def body(a, p):
        raise OSError(errno.EBADF, "bad file descriptor")

    with pytest.raises(OSError):
        _run(tmp_path, body)


_DYNAMIC = """
import ctypes, sys
from pathlib import Path
if sys.argv[1] == "stage":
    import stages  # noqa: F401  (what `python -m stages.<name>` imports first)
import torch
gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
print(ctypes.CDLL(str(gomp)).omp_get_dynamic() if gomp.is_file() else "no-libgomp")
"""


@pytest.mark.parametrize("entry,expected", [("stage", "0"), ("bare", "1")])
def test_stage_processes_turn_openmp_dynamic_team_sizes_off(entry, expected):
    """OMP_DYNAMIC=true (libgomp then sizes each parallel region from the load average) must not
    reach a stage's torch: its bytes would depend on the machine's load. The bare interpreter
    shows that the variable does take effect without the stages package."""
    env = {**os.environ, "OMP_DYNAMIC": "true", "MKL_DYNAMIC": "true"}
    out = subprocess.run([sys.executable, "-c", _DYNAMIC, entry], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout.split()[-1]
    if out == "no-libgomp":
        pytest.skip("this torch build has no bundled libgomp")
    assert out == expected
