"""``paco-compare`` (console script) and ``python -m paco.compare``: the ``queue`` and ``report``
commands (usage: :mod:`paco.compare`)."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import yaml

import paco.compare
from paco.compare.ablations import ABLATIONS, queue_commands
from paco.compare.errors import CompareError
from paco.compare.report import write_report


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``paco-compare`` with ``argv`` (``None``: ``sys.argv[1:]``); returns the exit status: 0, or 2
    after printing a :class:`~paco.compare.errors.CompareError`, a failed ``dvc`` command or an
    unreadable file to stderr."""
    ap = argparse.ArgumentParser(prog="paco-compare", description=paco.compare.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queue", help="queue the named ablations as DVC experiments")
    q.add_argument("ablations", nargs="+", help=f"any of {sorted(ABLATIONS)}")
    q.add_argument("--subtask", default="t2is")
    q.add_argument("--params", default="params.yaml")
    q.add_argument("--dry-run", action="store_true", help="print the commands only")
    q.add_argument("--target", action="append", dest="targets",
                   help="stage to reproduce (repeatable; default final_samples@<subtask> or reward_eval)")
    q.add_argument("--all-stages", action="store_true", help="reproduce the whole pipeline")
    r = sub.add_parser("report", help="compare the baseline with experiments")
    r.add_argument("--exp", action="append", dest="names", help="experiment name (repeatable; default all)")
    r.add_argument("--out", default="compare")
    r.add_argument("--subtask", default="t2is")
    r.add_argument("--window", type=int, default=5)
    r.add_argument("--section", action="append", dest="sections", choices=["grpo", "judge"])
    r.add_argument("--log", action="append", default=[], metavar="NAME=PATH",
                   help="a run's log (epoch timings), e.g. the baseline's `dvc repro` output")
    r.add_argument("--repo", default=".")
    r.add_argument("--commits", type=int, default=1,
                   help="also the experiments of the last N commits (dvc exp show -n N), compared with HEAD")
    a = ap.parse_args(argv)
    try:
        if a.command == "queue":
            params = yaml.safe_load(Path(a.params).read_text())
            targets = [] if a.all_stages else a.targets
            for cmd in queue_commands(a.ablations, params, a.subtask, targets):
                print(shlex.join(cmd))
                if not a.dry_run:
                    subprocess.run(cmd, check=True)
            if not a.dry_run:
                print("run them with: dvc queue start -j 1   (then: dvc queue status; paco-compare report)")
            return 0
        logs = {}
        for item in a.log:
            name, sep, path = item.partition("=")
            if not sep:
                raise CompareError(f"--log expects NAME=PATH, got {item!r}")
            logs[name] = Path(path).read_text(errors="replace")
        path = write_report(a.repo, a.names, a.out, a.subtask, a.window, a.sections, logs, commits=a.commits)
        print(f"wrote {path}")
        return 0
    except (CompareError, subprocess.CalledProcessError, OSError) as exc:
        print(f"paco-compare: error: {exc}", file=sys.stderr)
        return 2
