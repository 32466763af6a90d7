"""Stage ``params_check``: validate the whole ``params.yaml`` on every change of the file and write
the effective parameters (every default filled in).

Each stage validates the whole file when it runs, but ``dvc repro`` runs a stage only when one of
its declared params sections changes: a misspelled top-level section (``reward_trian:``) would
otherwise pass unnoticed. This stage depends on the file itself, so any edit reruns it (about a
second) and an invalid file fails ``dvc repro`` with the offending dotted keys. It also checks the
reward names of every ``grpo.<subtask>`` and ``final_samples.<subtask>``
(:func:`paco.grpo.rewards.check_reward_names`), which the schema checks for shape only. The same
check without a stage, reward names aside: ``python -m paco.core.params params.yaml``.

It also checks that ``dvc.yaml`` is the registry's rendering for these params: which inputs a
stage reads depends on its params (``composites.source``, ``pairs.ranking``,
``reward_eval.baselines``), so after switching them ``dvc.yaml`` must be regenerated, or DVC would
miss a change of an input the stage now reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paco.core.io import write_json
from paco.core.params import Params, ParamsError
from paco.core.stage import StageOutput, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the effective params (JSON) to write")
    p.add_argument("--dvc-yaml", type=Path, default=None, help="dvc.yaml to check against the registry's rendering")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.core.params import read_params_yaml
    from paco.grpo.rewards import check_reward_names
    from workflow import registry

    for section in ("grpo", "final_samples"):
        for subtask, cfg in getattr(params, section).items():
            check_reward_names(cfg.rewards, f"{section}.{subtask}.rewards", source=str(args.params))
    if args.dvc_yaml is not None and args.dvc_yaml.is_file():
        if args.dvc_yaml.read_text() != registry.dump_dvc(read_params_yaml(args.params) or {}):
            raise ParamsError(f"{args.dvc_yaml} is not the registry's rendering for {args.params} (which inputs a "
                              "stage reads depends on its params): run `python -m workflow.registry > dvc.yaml`")
    write_json(args.out, params.model_dump(mode="json", by_alias=True))
    return StageOutput({}, {})


def main(argv: list[str] | None = None) -> int:
    return run("params_check", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
