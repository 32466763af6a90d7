"""``python -m paco.core.params [params.yaml] [--out FILE]``: validate a whole params file
without running a stage (``dvc repro`` runs no stage when only a section that no stage declares
changed, e.g. a misspelled ``reward_trian:``).

Everything is checked but the reward names of ``grpo.<subtask>.rewards`` and
``final_samples.<subtask>.rewards``, which the schema checks for shape only: the ``params_check``
stage and the stages that compute the rewards check the names
(:func:`paco.grpo.rewards.check_reward_names`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paco.core.params.base import ParamsError
from paco.core.params.schema import load_params


def main(argv: list[str] | None = None) -> int:
    """``python -m paco.core.params [params.yaml] [--out FILE]``: validate the whole file (all
    but the reward names, see the module docstring).

    Prints one ``<path>: OK ...`` line and returns 0, or prints the :class:`ParamsError` (every
    offending dotted key) to stderr and returns 2 (removing ``--out``), without a traceback.
    ``--out`` also writes ``{"params": <path>, "valid": true}`` (the same bytes whatever the valid
    values, so a pipeline stage can depend on it without rerunning when the params change).
    """
    parser = argparse.ArgumentParser(prog="python -m paco.core.params",
                                     description="Validate a params file against paco.core.params.Params (everything "
                                     "but the reward names, which the params_check stage and the stages that "
                                     "compute the rewards check).")
    parser.add_argument("params", nargs="?", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--out", default=None, help="on success, also write a small JSON marker here")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
    except ParamsError as exc:
        if args.out:
            Path(args.out).unlink(missing_ok=True)  # no stale marker of an earlier valid file
        print(exc, file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"params": str(args.params), "valid": True}) + "\n")
    print(f"{args.params}: OK ({len(type(params).model_fields)} sections; grpo subtasks "
          f"{sorted(params.grpo)}, final_samples subtasks {sorted(params.final_samples)})")
    return 0
