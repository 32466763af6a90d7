"""``python -m paco.pretrain``: the recipe file, the atomic replacement of each built
directory and its manifest. The builders themselves are tested in ``tests/test_pretrain_*.py``."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import pydantic
import pytest

from paco.pretrain import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_recipe_validates_and_covers_every_section():
    recipes = cli.load_recipe(ROOT / cli.DEFAULT_RECIPE)
    assert set(recipes) == set(cli.BUILDERS)
    for section, recipe in recipes.items():
        assert isinstance(recipe, pydantic.BaseModel), section


def test_recipe_errors_are_named(tmp_path):
    bad = tmp_path / "recipe.yaml"
    with pytest.raises(cli.RecipeError, match="does not exist"):
        cli.load_recipe(bad)
    bad.write_text("flux: {}\nvae_only: {}\n")
    with pytest.raises(cli.RecipeError, match="vae_only"):
        cli.load_recipe(bad)
    bad.write_text("- 1\n")
    with pytest.raises(cli.RecipeError, match="mapping"):
        cli.load_recipe(bad)
    bad.write_text("clip: {no_such_field: 1}\n")
    with pytest.raises(pydantic.ValidationError, match="no_such_field"):
        cli.load_recipe(bad)


class _FakeRecipe(pydantic.BaseModel, extra="forbid"):
    value: int = 1
    fail: bool = False


def _fake_module(monkeypatch) -> None:
    mod = types.ModuleType("paco_fake_builder")

    def build(out_root: Path, recipe: _FakeRecipe) -> dict:
        d = out_root / "fake"
        d.mkdir()
        (d / "weights.bin").write_bytes(bytes([recipe.value]) * 8)
        (d / "pretrain.json").write_text(json.dumps({"recipe": recipe.model_dump()}))
        if recipe.fail:
            raise RuntimeError("diverged")
        return {"value": recipe.value}

    mod.build = build
    monkeypatch.setitem(sys.modules, "paco_fake_builder", mod)
    monkeypatch.setitem(cli.BUILDERS, "fake", ("paco_fake_builder", ("fake",)))


def test_a_build_replaces_its_directory_whole_and_writes_a_manifest(tmp_path, monkeypatch):
    _fake_module(monkeypatch)
    out = tmp_path / "pretrained"
    (out / "fake").mkdir(parents=True)
    (out / "fake" / "stale.bin").write_bytes(b"old")
    figures = cli.build_section("fake", _FakeRecipe(value=7), out)
    assert figures["value"] == 7 and figures["seconds"] >= 0
    assert sorted(p.name for p in (out / "fake").iterdir()) == ["MANIFEST.json", "pretrain.json", "weights.bin"]
    manifest = json.loads((out / "fake" / "MANIFEST.json").read_text())
    assert manifest["weights.bin"] == hashlib.sha256(bytes([7]) * 8).hexdigest()
    info = json.loads((out / "fake" / "pretrain.json").read_text())
    assert info["recipe"] == {"value": 7, "fail": False} and "torch" in info["environment"]
    assert [p.name for p in out.iterdir()] == ["fake"]  # no temporary directory left


def test_a_failed_build_leaves_the_previous_directory(tmp_path, monkeypatch):
    _fake_module(monkeypatch)
    out = tmp_path / "pretrained"
    cli.build_section("fake", _FakeRecipe(value=3), out)
    before = {p.name: p.read_bytes() for p in (out / "fake").iterdir()}
    with pytest.raises(RuntimeError, match="diverged"):
        cli.build_section("fake", _FakeRecipe(value=9, fail=True), out)
    assert {p.name: p.read_bytes() for p in (out / "fake").iterdir()} == before
    assert [p.name for p in out.iterdir()] == ["fake"]


def test_the_shipped_directories_are_the_recipes_output():
    """Every shipped model directory is one the command writes, holds exactly the files of its
    manifest with their sha256 (no hand edits, no partial copies), and was built from the shipped
    recipe file's section (its ``pretrain.json`` records the validated recipe)."""
    root = ROOT / cli.DEFAULT_OUT
    recipes = cli.load_recipe(ROOT / cli.DEFAULT_RECIPE)
    section_of = {name: section for section, (_, names) in cli.BUILDERS.items() for name in names}
    shipped = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert shipped and set(shipped) <= set(section_of), shipped
    for name in shipped:
        manifest = json.loads((root / name / "MANIFEST.json").read_text())
        files = {p.relative_to(root / name).as_posix() for p in (root / name).rglob("*")
                 if p.is_file() and p.name != "MANIFEST.json"}
        assert files == set(manifest), name
        for rel, digest in manifest.items():
            assert hashlib.sha256((root / name / rel).read_bytes()).hexdigest() == digest, (name, rel)
        recorded = json.loads((root / name / "pretrain.json").read_text())["recipe"]
        assert recorded == recipes[section_of[name]].model_dump(mode="json"), name


def test_a_prompt_row_without_its_size_is_refused(tmp_path):
    """The composite's height and width set the aspect a pretraining view is drawn at: a row
    without them is a named error, not a silent 1024 x 1024."""
    from paco.pretrain.views import load_t2is_prompts

    rows = (ROOT / "data/raw/t2is_prompts.jsonl").read_text().splitlines()
    assert len(load_t2is_prompts(ROOT / "data/raw/t2is_prompts.jsonl")) == len([r for r in rows if r.strip()])
    row = json.loads(rows[0])
    del row["width"]
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: row without \['width'\]"):
        load_t2is_prompts(bad)
