"""What the end-to-end tests share: fresh clones of the committed tree, commands run in them with
this interpreter, stage reports and artifact digests."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """This process's environment for a command in a clone: hub offline, unbuffered output, this
    interpreter's ``bin`` first on ``PATH`` (stage commands say ``python``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def sh(args: list[str], cwd: Path, timeout: int = 1800) -> str:
    """Run a command; on a timeout kill its whole process group (stage processes included, so
    no orphan keeps the cores busy for the tests after it)."""
    proc = subprocess.Popen(args, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = stdout + stderr
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def clone(tmp: Path) -> Path:
    """A fresh clone of the committed tree (what a user gets; uncommitted edits are not in it)."""
    repo = tmp / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    return repo


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def report(repo: Path, stage: str) -> dict:
    """A stage's ``report.json`` (the details beside its headline ``metrics.json``)."""
    return json.loads((repo / f"data/{stage}/report.json").read_text())


#: what is compared bit for bit: every output under data/ but the reports (timings), the
#: persisted checkpoints / progress, and DVC's own files
SKIP = re.compile(r"(^|/)(report\.json|checkpoints/.*|progress/.*|\.gitignore)$")


def artifacts(repo: Path) -> dict[str, str]:
    """The md5 of every file under ``repo/data`` but ``data/raw`` and what :data:`SKIP` names, by
    path relative to ``repo``."""
    files = (p for p in (repo / "data").rglob("*") if p.is_file() and "raw" not in p.relative_to(repo).parts[:2])
    return {str(p.relative_to(repo)): md5(p) for p in files if not SKIP.search(str(p.relative_to(repo)))}


def set_param(repo: Path, section: str, key: str, value) -> None:
    """Set ``params.yaml``'s ``section.key`` in ``repo`` to ``value``."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
