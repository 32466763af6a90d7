"""Run identity (paco.core.run_identity) and the checkpoint plumbing built on it (paco.core.checkpoints):
every declared dependency class changes the identity, the continuable / evaluation / launch keys
do not, resumes happen only under the same identity, unreadable checkpoints are skipped, and saved
weights have deterministic bytes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from paco.core import checkpoints as ckpt
from paco.core.run_identity import ABSENT, RunIdentity, params_identity, path_digest, stage_identity
from workflow import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def workspace(tmp_path):
    """A copy of params.yaml and fake dependency files/directories at the grpo@t2is paths."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    member = next(m for m in registry.by_name("grpo").members(params) if m.key == "t2is")
    for dep in member.deps(params):
        path = tmp_path / dep
        if path.suffix:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"table")
        else:
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"weights")
    for code in member.stage.code:
        (tmp_path / code).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / code).write_bytes((ROOT / code).read_bytes())
    return tmp_path


def _member(ws: Path):
    """``grpo@t2is`` as the registry gives it for the workspace's params."""
    return registry.member("grpo@t2is", yaml.safe_load((ws / "params.yaml").read_text()))


def _identity(ws: Path) -> RunIdentity:
    return stage_identity(_member(ws), ws / "params.yaml", root=ws)


def _edit(ws: Path, **paths) -> None:
    params = yaml.safe_load((ws / "params.yaml").read_text())
    for dotted, value in paths.items():
        node = params
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_every_dependency_class_changes_its_part(workspace):
    ws = workspace
    base = _identity(ws)
    assert base == _identity(ws)  # nothing changed: the same identity
    # a key of each declared params section
    for edit, part in ((dict(judge_endpoint__instruction="theme"), "params:judge_endpoint"),
                       (dict(subfigures__tolerance=0.11), "params:subfigures"),
                       (dict(grpo__t2is__train__learning_rate=0.5), "params:grpo.t2is"),
                       (dict(grpo__t2is__eval__every=3), "params:grpo.t2is")):
        _edit(ws, **edit)
        assert _identity(ws).changed(base.parts) == [part], edit
        (ws / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    # each declared model directory (a retrained judge), the upstream table, a code file
    for rel in ("data/reward_merge/model/model.safetensors", "data/models/clip/config.json",
                "data/models/policy_t2is/model.safetensors", "data/prompts/prompts.parquet"):
        old = (ws / rel).read_bytes()
        (ws / rel).write_bytes(old + b"!")
        dep = "/".join(rel.split("/")[:3]) if "models" in rel or "model/" in rel else rel
        assert _identity(ws).changed(base.parts) == [f"dep:{dep}"], rel
        (ws / rel).write_bytes(old)
    for code in ("paco/judge/model.py", "paco/serving/server/batching.py", "paco/grpo/trainer.py"):
        old = (ws / code).read_bytes()
        (ws / code).write_bytes(old + b"\n# edited\n")
        assert _identity(ws).changed(base.parts) == [f"code:{code}"], code
        (ws / code).write_bytes(old)
    assert _identity(ws) == base


def test_continuable_evaluation_and_launch_keys_keep_the_training_identity(workspace):
    ws = workspace
    base = _identity(ws)
    _edit(ws, grpo__t2is__epochs=99, grpo__t2is__save_every=7, grpo__t2is__resources={"processes": 4, "mem_mb": 999})
    assert _identity(ws).digest == base.digest
    _edit(ws, grpo__t2is__eval__resolution=512)
    changed = _identity(ws)
    assert changed.digest == base.digest and changed.evaluation_digest != base.evaluation_digest
    assert changed.changed_evaluation(base.evaluation) == ["grpo.t2is.eval.resolution"]


def test_a_default_written_out_changes_nothing(workspace):
    ws = workspace
    base = _identity(ws)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    del params["grpo"]["t2is"]["dtype"]  # float32 is the schema default
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert _identity(ws) == base


def test_deps_are_hashed_where_the_command_line_points(workspace, tmp_path_factory):
    ws = workspace
    other = tmp_path_factory.mktemp("elsewhere") / "prompts.parquet"
    other.write_bytes(b"another table")

    class Args:
        items = str(other)  # --items: the subtask dataset's table

    base = _identity(ws)
    moved = stage_identity(_member(ws), ws / "params.yaml", root=ws, args=Args())
    assert moved.changed(base.parts) == ["dep:data/prompts/prompts.parquet"]


def test_path_digest(tmp_path):
    assert path_digest(tmp_path / "missing") == ABSENT
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "a.bin").write_bytes(b"a")
    first = path_digest(d)
    (d / ".tmp-partial").write_bytes(b"ignored")  # hidden temp siblings are not content
    assert path_digest(d) == first
    (d / "sub" / "a.bin").write_bytes(b"b")
    assert path_digest(d) != first
    (d / "sub" / "a.bin").write_bytes(b"a")
    (d / "sub" / "a.bin").rename(d / "sub" / "b.bin")  # a renamed file is a change
    assert path_digest(d) != first


def test_launch_parts_name_the_settings_cpu_kernels_round_by(monkeypatch):
    from paco.core.run_identity import launch_parts

    threads = torch.get_num_threads()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "X86_V4")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    cpu = launch_parts(2, "cpu")
    assert cpu == {"num_processes": 2, "device": "cpu",
                   "cpu_numerics": f"threads={threads} ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=unset "
                                   "NPY_DISABLE_CPU_FEATURES=X86_V4 OPENBLAS_CORETYPE=unset"}
    # GPU kernels read none of them
    assert launch_parts(2, "cuda") == {"num_processes": 2, "device": "cuda"}
    base = RunIdentity("grpo@t2is", {"params:grpo.t2is": "x"})
    digest = base.extended(**cpu).digest
    try:
        torch.set_num_threads(threads + 1)
        more_threads = base.extended(**launch_parts(2, "cpu"))
    finally:
        torch.set_num_threads(threads)
    assert more_threads.digest != digest and base.extended(**launch_parts(2, "cpu")).digest == digest
    assert more_threads.changed(base.extended(**cpu).parts) == ["extra:cpu_numerics"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert base.extended(**launch_parts(2, "cpu")).changed(base.extended(**cpu).parts) == ["extra:cpu_numerics"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "")  # numpy's AVX-512 paths: another run
    assert base.extended(**launch_parts(2, "cpu")).changed(base.extended(**cpu).parts) == ["extra:cpu_numerics"]


def test_params_identity_needs_every_declared_section():
    with pytest.raises(KeyError, match="judge_endpoint"):
        params_identity(registry.member("grpo@x"), {"grpo.x": {}, "subfigures": {}})


def test_registry_members_for_the_identity():
    """The registry gives the member (the run identity imports nothing of ``workflow``): a foreach
    member without its section in the config gets a one-member config, enough for its params
    keys; a dep read only under a continuable key (reasons' imported SFT folder) is no identity
    dep."""
    m = registry.member("grpo@test")
    assert (m.dvc_name, m.key, m.resolve("grpo.${key}.epochs", {})) == ("grpo@test", "test", "grpo.test.epochs")
    with pytest.raises(KeyError, match="no stage"):
        registry.member("nonsense")
    with pytest.raises(KeyError, match="not a member"):
        registry.member("grpo@absent", {"grpo": {"t2is": {}}})
    from paco.core.params import validate_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["reasons"]["sft_import"]["enabled"] = True
    tree = validate_params(raw).model_dump(mode="json", by_alias=True)
    reasons = registry.member("reasons", tree)
    folder = tree["reasons"]["sft_import"]["dataset_dir"]
    assert folder in reasons.deps(tree) and folder not in reasons.identity_deps(tree)
    assert reasons.identity_deps(tree) == [d for d in reasons.deps(tree) if d != folder]


def _write_checkpoint(d: Path, name: str, identity: RunIdentity, **extra) -> Path:
    p = d / name
    p.mkdir(parents=True)
    (p / ckpt.STATE_FILE).write_text(json.dumps({**identity.to_state(), **extra}))
    (p / "weights.bin").write_bytes(b"w")
    return p


def test_find_resumable_rules(tmp_path, caplog):
    log = logging.getLogger("test")
    ident = RunIdentity("x", {"params:x": "1", "dep:a": "2"}, {"x.eval.r": "3"})
    d = tmp_path / "ck"
    assert ckpt.find_resumable(d, "s-", ident, main=True, log=log).path is None
    _write_checkpoint(d, "s-1", ident, epoch=1)
    _write_checkpoint(d, "s-2", ident, epoch=2)
    (d / ".tmp-s-3").mkdir()  # an interrupted write
    found = ckpt.find_resumable(d, "s-", ident, main=True, log=log, required_files=["weights.bin"])
    assert found.path.name == "s-2" and found.state["epoch"] == 2 and found.evaluation_changed == ()
    assert not (d / ".tmp-s-3").exists()
    # only the evaluation changed: resumable, flagged
    evaluated = RunIdentity("x", ident.parts, {"x.eval.r": "4"})
    assert ckpt.find_resumable(d, "s-", evaluated, main=True, log=log).evaluation_changed == ("x.eval.r",)
    # a corrupt newest checkpoint: skipped (and removed), the previous one resumed
    (d / "s-2" / ckpt.STATE_FILE).write_text('{"identity": ')
    with caplog.at_level(logging.WARNING, logger="test"):
        found = ckpt.find_resumable(d, "s-", ident, main=True, log=log)
    assert found.path.name == "s-1" and found.skipped_corrupt[0].startswith("s-2")
    assert "s-2" in caplog.text and "unreadable" in caplog.text and not (d / "s-2").exists()
    # a missing required file is unreadable too
    (d / "s-1" / "weights.bin").unlink()
    assert ckpt.find_resumable(d, "s-", ident, main=True, log=log, required_files=["weights.bin"]).path is None
    # another identity: a fresh start that names the changed parts and removes every checkpoint
    _write_checkpoint(d, "s-5", ident, epoch=5)
    other = RunIdentity("x", {"params:x": "1", "dep:a": "9"})
    with caplog.at_level(logging.WARNING, logger="test"):
        found = ckpt.find_resumable(d, "s-", other, main=True, log=log)
    assert found.path is None and "dep:a" in found.reason and "dep:a" in caplog.text
    assert ckpt.list_checkpoints(d, "s-") == []


_SAVE = """
import sys, torch
from paco.core.checkpoints import save_safetensors
save_safetensors({"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(2, dtype=torch.float16)}, sys.argv[1],
                 {"z": "1", "m": '{"target_modules": ["q", "b", "k"], "r": 4}', "a": "x"})
"""


def test_safetensors_bytes_do_not_depend_on_the_process(tmp_path):
    """The Rust writer keeps metadata in a hash map: without canonicalisation two processes write
    the same tensors with the metadata in different orders."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    blobs = set()
    for i in range(4):
        subprocess.run([sys.executable, "-c", _SAVE, str(tmp_path / f"{i}.st")], check=True, cwd=ROOT)
        blobs.add((tmp_path / f"{i}.st").read_bytes())
    assert len(blobs) == 1
    loaded = load_file(str(tmp_path / "0.st"))
    assert torch.equal(loaded["b"], torch.arange(6.0).reshape(2, 3)) and loaded["a"].dtype == torch.float16
    meta = safe_open(str(tmp_path / "0.st"), "pt").metadata()
    assert json.loads(meta["m"]) == {"r": 4, "target_modules": ["b", "k", "q"]} and meta["a"] == "x"
    with pytest.raises(ValueError, match="not a safetensors"):
        (tmp_path / "bad.st").write_bytes(b"\x05")
        ckpt.canonicalise_safetensors(tmp_path / "bad.st")
