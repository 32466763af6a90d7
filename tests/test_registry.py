"""One DAG, two engines: dvc.yaml is the registry's rendering, and DVC and Snakemake agree."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflow import registry

ROOT = Path(__file__).resolve().parents[1]


def test_committed_dvc_yaml_is_the_rendered_registry():
    assert (ROOT / "dvc.yaml").read_text() == registry.dump_dvc(), (
        "dvc.yaml is stale: run `python -m workflow.registry > dvc.yaml`"
    )


def test_every_stage_declares_existing_code_and_params_sections():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for stage in registry.STAGES:
        assert (ROOT / "stages" / f"{stage.name}.py").is_file()
        for dep in stage.code:
            assert (ROOT / dep).exists(), f"{stage.name}: code dep {dep} missing"
        for section in stage.params:
            assert section in params, f"{stage.name}: params section {section} missing"
        # every placeholder resolves against params.yaml
        for text in (stage.cmd, *stage.deps):
            registry.interpolate(text, params)
        # outputs live under data/<stage>/ (DESIGN.md §2)
        for out in stage.outs + stage.out_dirs + stage.metrics:
            assert out.startswith(f"data/{stage.name}/"), out


def test_interpolate_is_strict():
    assert registry.interpolate("--x ${a.b}", {"a": {"b": 3}}) == "--x 3"
    with pytest.raises(KeyError, match="c"):
        registry.interpolate("${a.c}", {"a": {"b": 3}})


def _dvc_edges() -> set[tuple[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "dag", "--dot"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return set(re.findall(r'"?([\w@.-]+)"?\s*->\s*"?([\w@.-]+)"?', out))


def _snakemake_edges() -> set[tuple[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--rulegraph", "--cores", "1", "--quiet", "all"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    labels = dict(re.findall(r'(\d+)\[label = "([^"]+)"', out))
    edges = {(labels[a], labels[b]) for a, b in re.findall(r"(\d+) -> (\d+)", out)}
    return {(a, b) for a, b in edges if "all" not in (a, b)}


def test_dvc_and_snakemake_have_the_same_edges():
    dvc, smk = _dvc_edges(), _snakemake_edges()
    assert dvc, "dvc dag printed no edges"
    assert dvc == smk
    names = {s.name for s in registry.STAGES}
    assert {n for e in dvc for n in e} == names
