"""Stage ``models``: one Hugging Face-format directory per model role.

For each role in ``models`` (judge_base, policy_t2is, clip): ``tiny:<name>`` builds a tiny
random-init model offline from the seed (the embedded default), a hub id is fetched with
``huggingface_hub.snapshot_download``, a local directory is copied. Every later stage loads these
directories with ``from_pretrained`` only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paco.core.params import Params
from paco.core.stage import StageOutput, log, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="directory holding one folder per role")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.models.fetch import materialise

    cfg = params.models
    roles = {}
    for role, spec in cfg.roles().items():
        log.info("role %s <- %s", role, spec)
        path = materialise(
            role,
            spec,
            args.out / role,
            seed=cfg.seed,
            revision=cfg.revision.get(role),
            allow_patterns=cfg.allow_patterns.get(role),
        )
        roles[role] = {"source": spec, "megabytes": round(_dir_bytes(path) / 2**20, 3)}
    return StageOutput.headline({"roles": roles})


def main(argv: list[str] | None = None) -> int:
    return run("models", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
