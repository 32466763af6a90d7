"""One DAG, two engines: dvc.yaml is the registry's rendering, and DVC and Snakemake agree."""

import ast
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
        members = stage.members(params)
        assert members, stage.name
        for m in members:
            for key, value in m.params_sections(params).items():
                assert value is not None, f"{m.dvc_name}: params key {key} missing"
            # every placeholder resolves against params.yaml (and the foreach item)
            for text in (stage.cmd, *stage.deps, *stage.outs, *stage.out_dirs, *stage.plot_outs):
                assert "${" not in m.resolve(text, params), text
        # outputs live under data/<stage>/ (DESIGN.md §2)
        for out in stage.outs + stage.out_dirs + stage.metrics + stage.plot_outs + stage.persist:
            assert out.startswith(f"data/{stage.name}/"), out


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def _project_imports(path: Path) -> set[Path]:
    """Files of the ``paco`` / ``stages`` modules ``path`` imports (module or function level)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in ("paco", "stages") and (f := _module_file(name)) is not None:
                found.add(f)
    return found


def test_every_stage_declares_the_code_it_imports():
    """The transitive closure of project imports of ``stages/<name>.py`` is in its code deps, so
    editing any module a stage runs reruns the stage. Edges out of ``paco/params.py`` are not
    followed: its validators import the reward registry lazily, for the names only."""
    params_py = ROOT / "paco" / "params.py"
    for stage in registry.STAGES:
        seen, todo = set(), [ROOT / "stages" / f"{stage.name}.py"]
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                if f != params_py:
                    todo += _project_imports(f) - seen
        declared = [ROOT / d for d in stage.code]
        missing = sorted(str(f.relative_to(ROOT)) for f in seen if f.name != "__init__.py"
                         and not any(f == d or d in f.parents for d in declared))
        assert not missing, f"{stage.name} imports but does not declare {missing}"


def test_foreach_members_take_their_item():
    params = {"grpo": {"a": {"policy": "p1", "resources": {"processes": 3, "accelerate_config": "ddp"}},
                       "b": {"policy": "p2"}},
              "resources": {"default": {"processes": 1, "gpus": 0}}}
    stage = registry.by_name("grpo@a")
    assert stage.name == "grpo"
    a, b = stage.members(params)
    assert (a.dvc_name, a.rule_name, b.dvc_name) == ("grpo@a", "grpo_a", "grpo@b")
    assert "--num_processes 3" in a.resolve(stage.cmd, params)
    assert "workflow/accelerate/ddp.yaml" in a.resolve(stage.cmd, params)
    assert "data/models/p2" in b.resolve(" ".join(stage.deps), params)
    assert a.resources(params)["processes"] == 3 and b.resources(params) == {"processes": 1, "gpus": 0}
    assert a.params_sections({**params, "judge": {"x": 1}, "subfigures": {}})["grpo.a"]["policy"] == "p1"
    with pytest.raises(KeyError, match="sample"):
        registry.by_name("sample").members(params)


def test_interpolate_is_strict():
    assert registry.interpolate("--x ${a.b}", {"a": {"b": 3}}) == "--x 3"
    with pytest.raises(KeyError, match="c"):
        registry.interpolate("${a.c}", {"a": {"b": 3}})


def _dvc_edges() -> set[tuple[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "dag", "--dot"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    # foreach members are grpo@t2is in DVC and rule grpo_t2is in Snakemake
    edges = re.findall(r'"?([\w@.-]+)"?\s*->\s*"?([\w@.-]+)"?', out)
    return {(a.replace("@", "_"), b.replace("@", "_")) for a, b in edges}


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
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    names = {m.rule_name for s in registry.STAGES for m in s.members(params)}
    assert {n for e in dvc for n in e} == names
    assert {"grpo_t2is", "sample_t2is"} <= names
