"""End-to-end tests that need a fresh clone but not the whole embedded default's ``dvc repro``
(tests/test_pipeline.py): DVC's run cache, the hosts' CPU code paths, the Snakemake profiles. A
file of their own, so a second test worker runs them beside the long repro."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_helpers import ROOT, artifacts, clone, md5, ran_stages, set_param, sh, subprocess_env
from workflow.code_digests import CODE_STAGE

pytestmark = pytest.mark.slow


def test_the_run_cache_restores_the_report_of_the_outputs_it_restores(tmp_path):
    """Params A -> B -> A: the last ``dvc repro`` restores A's outputs from DVC's run cache
    without running the stage, and ``report.json`` with them (it is a declared, cached output):
    byte for byte A's report (its wall time included, which no rerun reproduces), not B's left
    over. ``prompts`` is the cheapest stage with a seed."""
    repo = clone(tmp_path)
    committed = (repo / "params.yaml").read_text()
    parquet, rep = repo / "data/prompts/prompts.parquet", repo / "data/prompts/report.json"
    dvc = [sys.executable, "-m", "dvc", "repro", "prompts"]
    assert ran_stages(sh(dvc, repo)) == [CODE_STAGE, "prompts"]  # DVC's code stage first
    first = {"table": md5(parquet), "report": rep.read_bytes()}
    set_param(repo, "prompts", "seed", yaml.safe_load(committed)["prompts"]["seed"] + 1)
    assert ran_stages(sh(dvc, repo)) == ["prompts"]
    assert md5(parquet) != first["table"]  # another test split
    assert rep.read_bytes() != first["report"]
    (repo / "params.yaml").write_text(committed)
    out = sh(dvc, repo)
    assert ran_stages(out) == [] and "Stage 'prompts' is cached - skipping run" in out, out[-2000:]
    assert md5(parquet) == first["table"]
    assert rep.read_bytes() == first["report"]


#: a shortened judge training (64 pairs, 1 epoch, evaluated on 32 test pairs) for the numeric-path test
SHORT_JUDGE = {"max_train_pairs": 64, "max_test_pairs": 32, "epochs": 1}


def _host_has_avx512() -> bool:
    from paco.core.numerics import cpu_has_avx2

    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return cpu_has_avx2() and "avx512f" in flags.split()


def _run_on_path(tmp: Path, env_update: dict[str, str | None], target: str,
                 start_from: Path | None = None) -> tuple[dict[str, str], list[str]]:
    """``dvc repro target`` (shortened judge training) with the CPU code-path variables of
    ``env_update`` (``None``: unset), in a fresh clone or in a copy of ``start_from`` (a clone
    whose earlier stages ran; their outputs are kept where their inputs are unchanged): every
    artifact's md5 and the stages this ``dvc repro`` ran."""
    from paco.core.numerics import FIXED_CPU_ISA_ENV

    if start_from is None:
        repo = clone(tmp)
    else:
        repo = tmp / "repo"
        shutil.copytree(start_from, repo, symlinks=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["reward_train"].update(SHORT_JUDGE)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {k: v for k, v in subprocess_env().items() if k not in FIXED_CPU_ISA_ENV}
    env.update({k: v for k, v in env_update.items() if v is not None})
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", target], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return artifacts(repo), ran_stages(proc.stdout)


def test_the_hosts_numeric_paths_do_not_change_the_bytes(request, tmp_path):
    """Stage processes fix every CPU code path themselves (paco.core.numerics): the data stages
    and a shortened judge training, started with none of the code-path variables set (so each
    process must pin itself, on whatever CPU this is), give the same bytes as when started with
    the values an AVX2-only host runs with exported. On an AVX-512 host the control shows the
    test can fail: with numpy's and OpenBLAS's own AVX-512 paths opted into, the composites
    differ."""
    from paco.core.numerics import cpu_has_avx2, cpu_isa_env

    if not cpu_has_avx2():
        pytest.skip("not an x86-64 CPU with AVX2: the CPU paths are left to the libraries")
    bare, ran = _run_on_path(tmp_path / "bare", {}, "reward_train")
    assert "composites" in ran and "reward_train" in ran, ran
    # the AVX2-only values: data_stages_clone's data stages ran under them (this process exports
    # them, conftest), so only the judge training runs again; without them, a clone runs them all
    isa = cpu_isa_env()
    fixture_on_isa = all(os.environ.get(k) == v for k, v in isa.items())
    avx2, ran = _run_on_path(tmp_path / "avx2", isa, "reward_train",
                             start_from=request.getfixturevalue("data_stages_clone") if fixture_on_isa else None)
    assert "reward_train" in ran and (not fixture_on_isa or ran == ["reward_train"]), ran
    assert "data/reward_train/adapter/adapter_model.safetensors" in bare and "data/reasons/sft.parquet" in bare
    assert sorted(bare) == sorted(avx2)
    assert [k for k in bare if bare[k] != avx2[k]] == []
    if _host_has_avx512():
        own, _ = _run_on_path(tmp_path / "own", {**isa, "NPY_DISABLE_CPU_FEATURES": "",
                                                 "OPENBLAS_CORETYPE": "SkylakeX"}, "composites")
        assert own["data/composites/composites.parquet"] != bare["data/composites/composites.parquet"]


@pytest.mark.parametrize("profile", ["local", "slurm", "sbatch"])
def test_snakemake_profiles_dry_run(profile):
    out = sh([sys.executable, "-m", "snakemake", "-n", "--profile", f"workflow/profiles/{profile}"], ROOT)
    assert "pairs" in out
