"""Stage ``models``: one Hugging Face-format directory per model role.

For each role in ``models`` (judge_base, policy_t2is, clip, pickscore, ...): ``tiny:<name>``
builds a tiny random-init model offline from the seed (the embedded default), a hub id is fetched
with ``huggingface_hub.snapshot_download``, a local directory is copied; ``models.processor_from``
replaces a role's processor and tokenizer files by another source's. Every later stage loads these
directories with ``from_pretrained`` only.

The only stage with hub access: every other stage process runs with ``HF_HUB_OFFLINE=1``
(``stages/__init__.py``); this one removes what the package set, so it downloads unless the
caller set ``HF_HUB_OFFLINE=1`` itself (then it reads the local HF cache). Under a SLURM profile
it runs on the submitting host (a Snakemake ``localrules`` entry).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import stages

# the one stage with hub access: undo the package's offline default (a caller's own
# HF_HUB_OFFLINE=1 stays) before anything imports huggingface_hub, which reads it once
stages.undo_hub_offline()

from paco.core.params import Params  # noqa: E402
from paco.core.stage import StageOutput, log, run  # noqa: E402


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
            processor_from=cfg.processor_from.get(role),
        )
        roles[role] = {"source": spec, "megabytes": round(_dir_bytes(path) / 2**20, 3)}
        if role in cfg.processor_from:
            roles[role]["processor_from"] = cfg.processor_from[role]
    return StageOutput.headline({"roles": roles})


def main(argv: list[str] | None = None) -> int:
    return run("models", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
