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


@pytest.mark.parametrize("failure", ["artifact", "params", "bug"])
def test_a_failed_run_leaves_no_previous_report(tmp_path, params, monkeypatch, failure):
    """The previous run's ``report.json`` (a stage run by hand has no engine to remove it) is gone once a run
    starts: a failed run cannot leave it looking like its own."""
    monkeypatch.delenv("RANK", raising=False)
    report = tmp_path / "out" / "report.json"
    assert _run(tmp_path, lambda a, p: StageOutput.headline({"n": 1}, "n")) == 0 and report.is_file()
    if failure == "params":
        (tmp_path / "params.yaml").write_text("nonsense: 1\n")

    def body(a, p):
        raise (ArtifactError("bad input") if failure == "artifact" else RuntimeError("a bug"))

    if failure == "bug":
        with pytest.raises(RuntimeError):
            _run(tmp_path, body)
    else:
        assert _run(tmp_path, body) == 2
    assert not report.exists()
    # a worker process (launcher RANK > 0) leaves it to the main process
    (tmp_path / "params.yaml").write_text("{}\n")
    report.write_text("{}")
    monkeypatch.setenv("RANK", "1")

    assert _run(tmp_path, lambda a, p: StageOutput.nothing()) == 0 and report.read_text() == "{}"


def test_only_the_process_whose_output_says_so_writes(tmp_path, params, monkeypatch):
    """A stage body returns whether its process writes (the main one) in its output, not through
    ``args``: a worker's output, even with figures and at launcher ``RANK`` 0, writes nothing."""
    monkeypatch.delenv("RANK", raising=False)
    metrics = tmp_path / "out" / "metrics.json"
    seen = []

    def worker(a, p):
        seen.append(a)
        return StageOutput({"n": 2}, {"detail": 1}, writes=False)

    assert _run(tmp_path, worker) == 0 and not metrics.exists() and not (tmp_path / "out" / "report.json").exists()
    assert seen[0].metrics == str(metrics)
    assert _run(tmp_path, lambda a, p: StageOutput({"n": 3}, {"detail": 1}, writes=True)) == 0
    assert json.loads(metrics.read_text()) == {"n": 3}
    assert _run(tmp_path, lambda a, p: StageOutput.nothing()) == 0 and json.loads(metrics.read_text()) == {"n": 3}


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


def test_stage_processes_let_idle_openmp_threads_sleep():
    """Every stage process (the stages package, first import of ``python -m stages.<name>``) runs
    ``OMP_WAIT_POLICY=PASSIVE`` unless the caller chose a policy; the bare interpreter gets none."""
    code = "import os, sys\nif sys.argv[1] == 'stage':\n    import stages\nprint(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    root = Path(__file__).resolve().parents[1]

    def policy(entry: str, **extra: str) -> str:
        return subprocess.run([sys.executable, "-c", code, entry], env={**env, **extra}, capture_output=True,
                              text=True, check=True, cwd=root).stdout.split()[-1]

    assert (policy("stage"), policy("bare"), policy("stage", OMP_WAIT_POLICY="ACTIVE")) == ("PASSIVE", "None", "ACTIVE")


def test_fix_numerics_env_pins_the_cpu_paths_only_where_it_is_safe(monkeypatch):
    import paco.core.numerics as numerics

    flags = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma avx512f\n"
    assert numerics.cpu_has_avx2("x86_64", flags) and numerics.cpu_has_avx2("AMD64", flags)
    assert not numerics.cpu_has_avx2("x86_64", flags.replace(" avx2", ""))  # an older x86-64: would crash
    assert not numerics.cpu_has_avx2("aarch64", flags) and not numerics.cpu_has_avx2("x86_64", "no flags line")

    monkeypatch.setattr(numerics, "cpu_has_avx2", lambda: True)
    env = {"OMP_DYNAMIC": "true", "MKL_CBWR": "AUTO"}  # a user's own MKL setting is kept, threads are not
    set_now = numerics.fix_numerics_env(env)
    assert env == {"OMP_DYNAMIC": "false", "MKL_DYNAMIC": "false", "OMP_WAIT_POLICY": "PASSIVE",
                   "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_CBWR": "AUTO", "NPY_DISABLE_CPU_FEATURES": numerics.numpy_disabled_targets(),
                   "OPENBLAS_CORETYPE": "Haswell"}
    assert "MKL_CBWR" not in set_now and set_now["OMP_DYNAMIC"] == "false"
    assert numerics.fix_numerics_env(env) == {}  # what already has its value is not set again
    monkeypatch.setattr(numerics, "cpu_has_avx2", lambda: False)
    env = {"OMP_WAIT_POLICY": "ACTIVE"}  # a default: a user's wait policy is kept
    numerics.fix_numerics_env(env)
    assert env == {"OMP_DYNAMIC": "false", "MKL_DYNAMIC": "false", "OMP_WAIT_POLICY": "ACTIVE"}
    env = {}
    numerics.fix_numerics_env(env)
    assert env == {"OMP_DYNAMIC": "false", "MKL_DYNAMIC": "false", "OMP_WAIT_POLICY": "PASSIVE"}


_SGEMM = """
import sys
if sys.argv[1] == "stage":
    import stages  # noqa: F401  (what `python -m stages.<name>` imports first)
import torch
torch.nn.functional.linear(torch.ones(3, 8), torch.ones(5, 8))
"""


@pytest.mark.parametrize("entry", ["stage", "bare"])
def test_a_stage_process_runs_mkls_cross_vendor_gemm_branch(entry):
    """MKL honours a named ISA branch (``MKL_CBWR=AVX2``) on Intel CPUs only and runs ``AUTO``
    elsewhere, so a stage's GEMMs must run ``COMPATIBLE``, the branch MKL runs alike on every
    x86-64 CPU. MKL logs the branch of each call under ``MKL_VERBOSE``; the bare interpreter
    shows what runs without the stages package (``CNR:OFF``: the CPU's own fastest code)."""
    import torch

    from paco.core.numerics import cpu_has_avx2

    if not torch.backends.mkl.is_available() or not cpu_has_avx2():
        pytest.skip("no MKL in this torch build, or a CPU whose code paths are not pinned")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", _SGEMM, entry], env={**env, "MKL_VERBOSE": "1"}, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    branches = {w for line in out.splitlines() if "GEMM" in line for w in line.split() if w.startswith("CNR:")}
    assert branches == ({"CNR:COMPATIBLE"} if entry == "stage" else {"CNR:OFF"}), out


def test_numpy_dispatch_targets_are_named_as_each_numpy_names_them():
    from paco.core.numerics import numpy_disabled_targets

    assert numpy_disabled_targets("2.4.6") == numpy_disabled_targets("3.0.0") == "X86_V4 AVX512_ICL AVX512_SPR"
    legacy = numpy_disabled_targets("1.26.4").split()
    assert legacy == numpy_disabled_targets("2.3.5").split() and {"AVX512F", "AVX512_SKX", "AVX512_SPR"} <= set(legacy)


def test_a_variable_set_after_its_library_was_loaded_is_named():
    from paco.core.numerics import loaded_too_late

    set_now = {"NPY_DISABLE_CPU_FEATURES": "X86_V4", "OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2",
               "OMP_DYNAMIC": "false"}
    assert loaded_too_late(set_now, {}) == []
    # ATen reads its capability at the first op, not at import: never too late here
    assert loaded_too_late(set_now, {"scipy": 1, "torch": 1}) == ["OMP_DYNAMIC", "OPENBLAS_CORETYPE"]
    assert loaded_too_late(set_now, {"numpy": 1}) == ["NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE"]


_KERNELS = """
import hashlib, json, sys
if sys.argv[1] == "stage":
    import stages  # noqa: F401  (what `python -m stages.<name>` imports first)
import numpy as np
import torch
from paco.core.numerics import numerics_info
torch.manual_seed(0)
x = torch.randn(4, 8, 16, 16)
conv = torch.nn.Conv2d(8, 8, 3)
y = torch.cat([torch.softmax(x, -1).flatten(), torch.nn.functional.gelu(x).flatten(), conv(x).flatten()])
# numpy: transcendental ufuncs (SVML on AVX-512), a sort with ties, an OpenBLAS GEMM
a = np.random.default_rng(0).standard_normal(4096)
gemm = a[:1024].reshape(32, 32) @ a[1024:2048].reshape(32, 32)
z = np.concatenate([np.sin(a * 50), np.exp(a), np.log1p(np.abs(a)), np.tanh(a).astype(np.float32).astype(float),
                    np.argsort(np.round(a, 1)).astype(float), gemm.ravel()])
info = numerics_info()
print(json.dumps({"torch": [info["torch_cpu_capability"], hashlib.md5(y.detach().numpy().tobytes()).hexdigest()],
                  "numpy": [info["numpy_dispatch"], sorted(set(info["openblas"].values())),
                            hashlib.md5(z.tobytes()).hexdigest()]}))
"""


def test_stage_processes_run_the_same_cpu_code_paths_on_any_x86_64_cpu():
    """A stage process computes with the AVX2 kernels of torch, oneDNN, MKL, numpy and OpenBLAS
    wherever the CPU has AVX2, whatever wider paths it also has: the bytes equal those of a
    process told to use the AVX2 paths, and the libraries report those paths. (On an AVX-512 CPU
    the bare interpreter's softmax, GELU, convolution, sine and GEMM bytes differ from these; on
    an AVX2-only CPU they are the same.)"""
    from paco.core.numerics import FIXED_CPU_ISA_ENV, cpu_has_avx2, cpu_isa_env

    if not cpu_has_avx2():
        pytest.skip("not an x86-64 CPU with AVX2: the CPU paths are left to the libraries")
    bare = {k: v for k, v in os.environ.items() if k not in FIXED_CPU_ISA_ENV}
    root = Path(__file__).resolve().parents[1]

    def run_(entry: str, env: dict[str, str]) -> dict:
        return json.loads(subprocess.run([sys.executable, "-c", _KERNELS, entry], env=env, capture_output=True,
                                         text=True, check=True, cwd=root).stdout.splitlines()[-1])

    stage_out = run_("stage", bare)
    assert stage_out == run_("bare", {**bare, **cpu_isa_env()})
    assert stage_out["torch"][0] == "AVX2"
    dispatch, openblas, _ = stage_out["numpy"]
    assert not [t for t in dispatch if "512" in t or t == "X86_V4"], dispatch
    assert openblas == ["Haswell"]


_HUB_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

# `python -m stages.models` with its body replaced by one that only imports huggingface_hub (so
# the report reads the library's own HF_HUB_OFFLINE constant, fixed at import): the real entry,
# import order and report, without building the models
_MODELS = """
import importlib, sys
import stages.models as stage
from paco.core.stage import StageOutput
def body(args, params):
    importlib.import_module("huggingface_hub")
    return StageOutput({})
stage._body = body
sys.exit(stage.main(sys.argv[1:]))
"""


def _without_hub_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _HUB_ENV}


def test_stages_after_models_run_offline(tmp_path):
    """With HF_HUB_OFFLINE unset by the caller, a stage after ``models`` (prompts, launched as the
    registry launches the accelerate stages: paco.core.launch, in place) runs with the hub off,
    and the stages package turns it off before huggingface_hub reads it; ``models`` runs with
    the hub on, unless the caller set HF_HUB_OFFLINE=1 itself."""
    root = Path(__file__).resolve().parents[1]
    env = _without_hub_env()
    cmd = [sys.executable, "-m", "paco.core.launch", "--config_file", "workflow/accelerate/cpu.yaml",
           "--num_processes", "1", "-m", "stages.prompts", "--params", "params.yaml",
           "--jsonl", "data/raw/t2is_prompts.jsonl", "--out", str(tmp_path / "p" / "prompts.parquet"),
           "--metrics", str(tmp_path / "p" / "metrics.json")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "p" / "report.json").read_text())["run"]["hub_offline"] is True

    # the library's constant, not only the variable: set before huggingface_hub is imported
    probe = "import stages, huggingface_hub.constants as c, os; print(c.HF_HUB_OFFLINE, os.environ['TRANSFORMERS_OFFLINE'])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "1"]
    # a caller's own choice is kept: HF_HUB_OFFLINE=0 gives a later stage hub access
    out = subprocess.run([sys.executable, "-c", probe.replace(", os.environ['TRANSFORMERS_OFFLINE']", "")], cwd=root,
                         env={**env, "HF_HUB_OFFLINE": "0"}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]

    def models(extra: dict[str, str]) -> bool:
        out = tmp_path / "m" / "metrics.json"
        proc = subprocess.run([sys.executable, "-c", _MODELS, "--params", "params.yaml", "--out", str(tmp_path / "m"),
                               "--metrics", str(out)], cwd=root, env={**env, **extra}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(out.with_name("report.json").read_text())["run"]["hub_offline"]

    assert models({}) is False
    assert models({"HF_HUB_OFFLINE": "1"}) is True


def test_the_stages_package_undoes_only_what_it_set():
    import stages

    env: dict[str, str] = {}
    assert stages.hub_offline_by_default(env) == _HUB_ENV and env == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for caller in ({"HF_HUB_OFFLINE": "1"}, {"TRANSFORMERS_OFFLINE": "0"}, {"HF_HUB_OFFLINE": ""}):
        env = dict(caller)
        assert stages.hub_offline_by_default(env) == () and env == caller
    saved = stages.OFFLINE_SET_HERE
    try:
        stages.OFFLINE_SET_HERE = _HUB_ENV
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/x"}
        assert stages.undo_hub_offline(env) == _HUB_ENV and env == {"HF_HOME": "/x"}
        assert stages.undo_hub_offline(env) == () and stages.OFFLINE_SET_HERE == ()  # once
        stages.OFFLINE_SET_HERE = ()  # the caller had set them: kept
        env = {"HF_HUB_OFFLINE": "1"}
        assert stages.undo_hub_offline(env) == () and env == {"HF_HUB_OFFLINE": "1"}
    finally:
        stages.OFFLINE_SET_HERE = saved


def test_the_launcher_imports_no_hub_library_before_the_stage():
    """paco.core.launch checks the params in its own process, then runs the stage in place: if
    that check imported huggingface_hub, the stages package would set HF_HUB_OFFLINE too late."""
    probe = ("import sys; from paco.core.launch import main; from paco.core.params.cli import main as check; "
             "check(['params.yaml']); print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('huggingface_hub', 'transformers', 'diffusers')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split()[-1] == "[]"


_EXIT_PROBE = """
import atexit, gc, sys
# registered first, so it runs last (atexit is last in, first out): what the teardown after it sees
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
freezes = []
register = atexit.register
atexit.register = lambda f, *a, **k: (freezes.append(f) if f is gc.freeze else None, register(f, *a, **k))[1]
root = sys.argv[2]
if sys.argv[1] == "stage":
    from paco.core.stage import run
    for _ in range(2):  # a process that runs several stage bodies registers the handler once
        assert run("t", ["--params", root + "/params.yaml"], lambda p: None, lambda a, p: {}, description="t") == 0
elif sys.argv[1] == "judge server":
    import stages  # noqa: F401  (the numeric environment a stage gives the server it starts)
    from paco.serving.server.cli import main
    # no model there: the server logs why and exits 1
    assert main(["--model", root + "/no-model", "--served-model-name", "t", "--port", "0"]) == 1
print("gc.freeze handlers:", len(freezes), flush=True)
"""


@pytest.mark.parametrize("entry", ["stage", "judge server", "bare"])
def test_a_stage_process_freezes_its_heap_at_exit(tmp_path, params, entry):
    """A stage or judge-server process freezes its heap at exit (gc.freeze in an atexit handler,
    paco.core.teardown), so the teardown's collections skip it: the handler is in place when the
    stage (or the server's main) has run, once however many stage bodies the process ran, and has
    run by the time the earlier-registered handlers run; a bare interpreter is the control."""
    out = subprocess.run([sys.executable, "-c", _EXIT_PROBE, entry, str(tmp_path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert f"gc.freeze handlers: {int(entry != 'bare')}" in out, out
    assert f"frozen at exit: {entry != 'bare'}" in out, out
