"""DVC's ``code`` stage: one digest file per stage, ``data/code/<stage>.json``, holding the sha256
of every file of the stage's import closure (:attr:`workflow.stage.Stage.code`).

Each stage of ``dvc.yaml`` depends on its digest file instead of listing its closure file by file,
and the ``code`` stage depends on the ``paco`` and ``stages`` directories (and the registry
modules that decide the closures). Editing a module reruns ``code``, which
rewrites every digest file; DVC then reruns exactly the stages whose digest bytes changed, the
stages whose closure holds the module, as listing the files would. The closures are computed
when ``code`` runs, so an added import is tracked without regenerating ``dvc.yaml``, and DVC
checks one dependency per stage instead of every file of every closure on each ``dvc repro``.

Snakemake keeps the closure files themselves as each rule's inputs (``Snakefile``): its
modification-time check would rerun every stage after a rewrite of the digest files.

    python -m workflow.code_digests --out data/code
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from paco.core.run_identity import file_sha256
from workflow.code_deps import PROJECT_PACKAGES, ROOT
from workflow.stage import Stage

#: the ``code`` stage's name and output directory
CODE_STAGE = "code"
CODE_DIR = f"data/{CODE_STAGE}"
#: the modules that decide which files a stage's closure holds: deps of the ``code`` stage beside
#: the project packages (:data:`workflow.code_deps.PROJECT_PACKAGES`)
REGISTRY_MODULES = ("workflow/code_deps.py", "workflow/code_digests.py", "workflow/registry.py", "workflow/stage.py")


def digest_path(stage: Stage) -> str:
    """``data/code/<stage name>.json``: the digest file of ``stage`` (one for all members of a
    foreach stage, which share their module)."""
    return f"{CODE_DIR}/{stage.name}.json"


def code_digest(stage: Stage) -> dict[str, object]:
    """``{"stage": name, "entries": [...], "files": {path: sha256 hex}}`` for ``stage``: its entry
    files (:attr:`Stage.entries`) and every file of its import closure with the sha256 of its bytes,
    paths relative to the repository root, sorted.

    Raises:
        FileNotFoundError: an entry file does not exist.
        OSError: a closure file cannot be read.
    """
    return {"stage": stage.name, "entries": sorted(stage.entries),
            "files": {path: file_sha256(ROOT / path) for path in stage.code}}


def write_code_digests(out_dir: Path, stages: Iterable[Stage]) -> list[Path]:
    """Write every stage's digest file under ``out_dir``: :func:`code_digest` as key-sorted JSON,
    one closure file per line (so a diff of two digest files names the changed modules), each
    written atomically; the directory is created. Returns their paths, in ``stages``' order.

    Raises:
        ValueError: two stages share a name.
        FileNotFoundError, OSError: as :func:`code_digest`.
    """
    from paco.core.io import write_json  # pandas and PIL: not on the registry's import

    stages = list(stages)
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names are not unique: {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stage in stages:
        path = out_dir / f"{stage.name}.json"
        write_json(path, code_digest(stage))
        paths.append(path)
    return paths


def code_stage(stages: Iterable[Stage]) -> dict[str, object]:
    """The ``code`` stage's entry in ``dvc.yaml``: its command, its deps (the project packages and
    :data:`REGISTRY_MODULES`) and one output per stage (:func:`digest_path`)."""
    return {"cmd": f"python -m workflow.code_digests --out {CODE_DIR}",
            "deps": [*PROJECT_PACKAGES, *REGISTRY_MODULES],
            "outs": [digest_path(s) for s in stages]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory of the digest files (data/code)")
    args = p.parse_args(argv)
    from workflow.registry import STAGES

    for path in write_code_digests(args.out, STAGES):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
