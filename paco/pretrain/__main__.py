"""Pretrain the embedded default's tiny models on the shipped photographs.

    python -m paco.pretrain [--recipe data/raw/pretrained/recipe.yaml] [--out data/raw/pretrained]
                                   [--only flux,clip,...]

Builds each tiny model (:mod:`paco.models.tiny`), pretrains it (:mod:`paco.pretrain.flux`,
``.qwen_image``, ``.clip``, ``.judge_vision``, ``.judge_vlm``) with the recipe's seeds, step counts and learning
rates, and writes one Hugging Face / diffusers directory per model under ``--out`` with a
``pretrain.json`` (the recipe section, the figures, the seconds, the library versions). Each
directory is written to a temporary sibling and renamed over the old one, so an interrupted run
leaves the previous build intact. The embedded default's ``models`` roles name these directories
(``params.yaml``: ``policy_t2is: data/raw/pretrained/flux`` ...); the ``models`` stage copies them and
every stage loads them with ``from_pretrained``, as a hub checkpoint at paper scale.

A recipe is fixed-step training from fixed seeds: the same recipe gives the same bytes run to run
on one host. Across CPUs the floating-point kernels differ, so a rebuild elsewhere gives other
weights; the shipped files are the reference (their sha256 is in ``pretrain.json``'s sibling
``MANIFEST.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import platform
import shutil
import sys
import tempfile
import time
import typing
from pathlib import Path

import yaml

from paco.pretrain.record import RECORD_FILE

#: recipe section -> (module, the directories its ``build`` writes)
BUILDERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "flux": ("paco.pretrain.flux", ("flux", "flux_kontext")),
    "qwen_image_edit": ("paco.pretrain.qwen_image", ("qwen_image_edit",)),
    "clip": ("paco.pretrain.clip", ("clip",)),
    "qwen2_5_vl": ("paco.pretrain.judge_vision", ("qwen2_5_vl",)),
    "qwen2_5_vl_pairs": ("paco.pretrain.judge_vlm", ("qwen2_5_vl_pairs",)),
}
DEFAULT_RECIPE = Path("data/raw/pretrained/recipe.yaml")
DEFAULT_OUT = Path("data/raw/pretrained")


class RecipeError(ValueError):
    """The recipe file is missing, not a mapping, or names an unknown section."""


def _recipe_class(module) -> type:
    hints = typing.get_type_hints(module.build)
    if "recipe" not in hints:
        raise TypeError(f"{module.__name__}.build has no annotated 'recipe' parameter")
    hint = hints["recipe"]
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # Recipe | None -> Recipe
    return args[0] if args else hint


def load_recipe(path: Path) -> dict[str, object]:
    """The recipe file as ``section -> validated recipe object`` (a missing section takes the
    module's defaults).

    Raises:
        RecipeError: the file is missing, is not a YAML mapping, or names an unknown section.
        pydantic.ValidationError: a section's fields are invalid.
    """
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist (the shipped one: {DEFAULT_RECIPE})")
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections {sorted(BUILDERS)}")
    unknown = sorted(set(raw) - set(BUILDERS))
    if unknown:
        raise RecipeError(f"{path}: unknown recipe section(s) {unknown}; known: {sorted(BUILDERS)}")
    out = {}
    for section, (module_name, _) in BUILDERS.items():
        cls = _recipe_class(importlib.import_module(module_name))
        out[section] = cls.model_validate(raw.get(section) or {})
    return out


def _manifest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "MANIFEST.json"}


def build_section(section: str, recipe: object, out: Path) -> dict:
    """Run one section's ``build`` into a temporary directory beside ``out`` and move its
    directories into ``out`` (each replaced whole). Returns the build's figures plus ``seconds``."""
    module_name, names = BUILDERS[section]
    module = importlib.import_module(module_name)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{section}-", dir=out))
    try:
        start = time.perf_counter()
        figures = dict(module.build(tmp, recipe))
        figures["seconds"] = round(time.perf_counter() - start, 1)
        for name in names:
            built = tmp / name
            if not (built / RECORD_FILE).exists():
                raise RuntimeError(f"{module_name}.build wrote no {name}/{RECORD_FILE}")
            info = json.loads((built / RECORD_FILE).read_text())
            info["environment"] = {"python": platform.python_version(), "machine": platform.machine(),
                                   "processor": platform.processor(), **_versions()}
            (built / RECORD_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            (built / "MANIFEST.json").write_text(json.dumps(_manifest(built), indent=2, sort_keys=True) + "\n")
            target = out / name
            old = out / f".{name}.old"
            if target.exists():
                target.rename(old)
            built.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _versions() -> dict[str, str]:
    import diffusers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "diffusers": diffusers.__version__,
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paco.pretrain", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="recipe YAML (seeds, steps, rates)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory holding one folder per model")
    ap.add_argument("--only", default=None, help=f"comma list of sections (default all: {','.join(BUILDERS)})")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    recipes = load_recipe(args.recipe)
    sections = list(BUILDERS) if not args.only else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(BUILDERS))
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; known: {sorted(BUILDERS)}")
    for section in sections:
        print(f"[pretrain] {section} ...", flush=True)
        figures = build_section(section, recipes[section], args.out)
        print(f"[pretrain] {section}: {json.dumps(figures, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
