"""DVC's ``code`` stage: one digest file per stage stands for the files of its import closure."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from workflow import code_deps, code_digests, registry
from workflow.stage import Stage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A two-stage project: ``a`` imports ``paco.shared`` and ``paco.only_a``, ``b`` imports
    ``paco.shared``; the closures are computed under ``tmp_path``."""
    pkg = tmp_path / "paco"
    pkg.mkdir()
    (tmp_path / "stages").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "shared.py").write_text("X = 1\n")
    (pkg / "only_a.py").write_text("Y = 2\n")
    (tmp_path / "stages" / "a.py").write_text("from paco import only_a, shared\n")
    (tmp_path / "stages" / "b.py").write_text("import paco.shared\n")
    monkeypatch.setattr(code_deps, "ROOT", tmp_path)
    monkeypatch.setattr(code_digests, "ROOT", tmp_path)

    def clear():
        code_deps.code_closure.cache_clear()
        code_deps._lazy_exports.cache_clear()
        code_deps._project_imports.cache_clear()

    clear()
    yield tmp_path, clear
    clear()


def _stages():
    return [Stage(name="a", args=()), Stage(name="b", args=())]


def test_a_digest_holds_the_sha256_of_every_closure_file(project):
    root, _ = project
    digest = code_digests.code_digest(_stages()[0])
    assert digest["stage"] == "a" and digest["entries"] == ["stages/a.py"]
    expected = {p: hashlib.sha256((root / p).read_bytes()).hexdigest()
                for p in ("paco/__init__.py", "paco/only_a.py", "paco/shared.py", "stages/a.py")}
    assert digest["files"] == expected


def test_an_edit_changes_exactly_the_digests_of_the_stages_that_import_it(project, tmp_path):
    root, clear = project
    out = tmp_path / "out"
    paths = code_digests.write_code_digests(out, _stages())
    assert [p.name for p in paths] == ["a.json", "b.json"]
    before = {p.name: p.read_bytes() for p in paths}
    assert json.loads(before["a.json"]) == code_digests.code_digest(_stages()[0])
    # rewriting with nothing edited gives the same bytes
    code_digests.write_code_digests(out, _stages())
    assert {p.name: p.read_bytes() for p in paths} == before
    # an edit of a module only a imports: a's digest changes, b's bytes do not
    (root / "paco" / "only_a.py").write_text("Y = 3\n")
    clear()
    code_digests.write_code_digests(out, _stages())
    after = {p.name: p.read_bytes() for p in paths}
    assert after["a.json"] != before["a.json"] and after["b.json"] == before["b.json"]
    # an added import joins the closure when the stage runs, with no dvc.yaml to regenerate
    (root / "stages" / "b.py").write_text("import paco.shared\nimport paco.only_a\n")
    clear()
    code_digests.write_code_digests(out, _stages())
    assert "paco/only_a.py" in json.loads((out / "b.json").read_text())["files"]


def test_stage_names_must_be_unique(project, tmp_path):
    with pytest.raises(ValueError, match="not unique"):
        code_digests.write_code_digests(tmp_path / "out", [Stage(name="a", args=()), Stage(name="a", args=())])


def test_a_missing_entry_file_is_an_error(project, tmp_path):
    with pytest.raises(FileNotFoundError, match="stages/c.py"):
        code_digests.write_code_digests(tmp_path / "out", [Stage(name="c", args=())])


def test_every_dvc_stage_depends_on_its_digest_and_on_no_code_file():
    stages = registry.render_dvc()["stages"]
    code = stages[code_digests.CODE_STAGE]
    assert code["outs"] == [code_digests.digest_path(s) for s in registry.STAGES]
    assert set(code_deps.PROJECT_PACKAGES) | set(code_digests.REGISTRY_MODULES) == set(code["deps"])
    for s in registry.STAGES:
        entry = stages[s.name].get("do", stages[s.name])
        assert code_digests.digest_path(s) in entry["deps"], s.name
        assert not [d for d in entry["deps"] if d.endswith(".py") and not d.startswith("workflow/")], s.name


def test_the_code_stage_command_writes_one_digest_per_registry_stage(tmp_path):
    cmd = registry.render_dvc()["stages"][code_digests.CODE_STAGE]["cmd"].split()
    out = tmp_path / "code"
    assert cmd[:3] == ["python", "-m", "workflow.code_digests"] and cmd[3:] == ["--out", code_digests.CODE_DIR]
    subprocess.run([sys.executable, *cmd[1:4], str(out)], cwd=ROOT, check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s.name}.json" for s in registry.STAGES)
    grpo = json.loads((out / "grpo.json").read_text())
    assert sorted(grpo["files"]) == list(registry.by_name("grpo").code)
