"""Stage ``params_check``: validate the whole ``params.yaml`` on every change of the file and write
the effective parameters (every default filled in).

Each stage validates the whole file when it runs, but ``dvc repro`` runs a stage only when one of
its declared params sections changes: a misspelled top-level section (``reward_trian:``) would
otherwise pass unnoticed. This stage depends on the file itself, so any edit reruns it (about a
second) and an invalid file fails ``dvc repro`` with the offending dotted keys. The same check
without a stage: ``python -m paco.core.params params.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paco.core.io import write_json
from paco.core.params import Params
from paco.core.stage import StageOutput, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the effective params (JSON) to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    write_json(args.out, params.model_dump(mode="json", by_alias=True))
    return StageOutput({}, {})


def main(argv: list[str] | None = None) -> int:
    return run("params_check", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
