"""The checkpoint-writing mechanism both trainers use (paco.core.checkpoints.write_checkpoint):
the order of the per-process and main-process writes between the barriers, the temp directory
renamed into place only when complete (a kill before the rename leaves the previous checkpoint
intact and the temp one ignored, then removed), the data synced before the rename, and pruning to
the newest ``keep``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from paco.core import checkpoints as ckpt
from paco.core.run_identity import RunIdentity

ROOT = Path(__file__).resolve().parents[1]
IDENT = RunIdentity("x", {"params:x": "1"})


class _Barriers:
    """A stand-in accelerator that records each barrier among the writes in ``events``."""

    def __init__(self, events: list):
        self.events = events

    def wait_for_everyone(self) -> None:
        self.events.append("barrier")


def _write(d: Path, n: int, *, keep: int = 2, events: list | None = None, main: bool = True, **kw) -> Path:
    events = [] if events is None else events

    def each(tmp: Path) -> None:
        events.append(("each", tmp.name, sorted(p.name for p in tmp.iterdir())))
        (tmp / "rng-0.pt").write_bytes(b"rng %d" % n)

    def main_files(tmp: Path) -> None:
        events.append(("main", tmp.name, sorted(p.name for p in tmp.iterdir())))
        (tmp / "weights.bin").write_bytes(b"w %d" % n)

    return ckpt.write_checkpoint(d, f"s-{n:03d}", {**IDENT.to_state(), "epoch": n, "history": {"train": [
        {"epoch": n, "step": 0, "loss": 0.5}]}}, prefix="s-", keep=keep, accelerator=_Barriers(events), main=main,
        write_each=each, write_main=main_files if main else None, **kw)


def test_write_checkpoint_writes_in_order_renames_and_prunes_to_the_newest_keep(tmp_path):
    d, events = tmp_path / "ck", []
    path = _write(d, 1, events=events, plots_dir=tmp_path / "plots")
    assert path == d / "s-001"
    # every process's files, then the main process's, each after a barrier, in the hidden temp dir
    assert events == ["barrier", ("each", ".tmp-s-001", []), "barrier", ("main", ".tmp-s-001", ["rng-0.pt"]),
                      "barrier"]
    assert sorted(p.name for p in path.iterdir()) == ["rng-0.pt", ckpt.STATE_FILE, "weights.bin"]
    assert json.loads((path / ckpt.STATE_FILE).read_text())["epoch"] == 1
    assert sorted(p.name for p in d.iterdir()) == ["s-001"]  # no temp left
    assert pd.read_csv(tmp_path / "plots" / "train.csv").to_dict("records") == [{"epoch": 1, "step": 0, "loss": 0.5}]
    for n in (2, 3, 10):
        _write(d, n, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(d, "s-")] == ["s-003", "s-010"]
    assert sorted(p.name for p in d.iterdir()) == ["s-003", "s-010"]
    assert (d / "s-010" / "weights.bin").read_bytes() == b"w 10"
    _write(d, 11, keep=1)
    assert [p.name for p in ckpt.list_checkpoints(d, "s-")] == ["s-011"]
    # rewriting an existing checkpoint replaces it whole
    (d / "s-011" / "stale").write_bytes(b"x")
    _write(d, 11, keep=1)
    assert sorted(p.name for p in (d / "s-011").iterdir()) == ["rng-0.pt", ckpt.STATE_FILE, "weights.bin"]


def test_a_process_other_than_the_main_one_writes_only_its_own_files(tmp_path):
    d, events = tmp_path / "ck", []
    (d / ".tmp-s-004").mkdir(parents=True)  # the main process created it before the first barrier
    assert _write(d, 4, events=events, main=False) == d / "s-004"
    assert events == ["barrier", ("each", ".tmp-s-004", []), "barrier", "barrier"]
    assert sorted(p.name for p in (d / ".tmp-s-004").iterdir()) == ["rng-0.pt"] and not (d / "s-004").exists()


def test_a_stale_temp_directory_is_not_part_of_the_next_write(tmp_path):
    d = tmp_path / "ck"
    (d / ".tmp-s-005").mkdir(parents=True)
    (d / ".tmp-s-005" / "half-written.bin").write_bytes(b"x")
    _write(d, 5)
    assert sorted(p.name for p in (d / "s-005").iterdir()) == ["rng-0.pt", ckpt.STATE_FILE, "weights.bin"]


def test_the_files_are_synced_before_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    d = tmp_path / "ck"
    _write(d, 1)
    tmp = str(d / ".tmp-s-001")
    for name in ("rng-0.pt", "weights.bin", ckpt.STATE_FILE):
        assert f"{tmp}/{name}" in synced, name
    assert tmp in synced and synced[-1] == str(d)  # then the directory holding the renamed checkpoint


@pytest.mark.parametrize(("name", "keep"), [("t-001", 2), ("s-1a", 2), ("s-", 2), ("s-001", 0)])
def test_a_name_outside_the_prefix_or_keep_below_one_is_an_error(tmp_path, name, keep):
    with pytest.raises(ValueError):
        ckpt.write_checkpoint(tmp_path, name, {}, prefix="s-", keep=keep, accelerator=None, main=True)
    assert list(tmp_path.iterdir()) == []


_KILLED = """
import os, signal, sys
import stages  # noqa: F401
from paco.core import checkpoints as ckpt

def killed(tmp):
    (tmp / "weights.bin").write_bytes(b"new")
    os.kill(os.getpid(), signal.SIGKILL)  # between the temp write and the rename

ckpt.write_checkpoint(sys.argv[1], "s-002", {"identity": "x"}, prefix="s-", keep=1, accelerator=None, main=True,
                      write_main=killed)
"""


def test_a_kill_before_the_rename_leaves_the_previous_checkpoint_and_a_temp_one_resume_ignores(tmp_path, caplog):
    d = tmp_path / "ck"
    _write(d, 1, keep=1)
    before = {p.name: p.read_bytes() for p in (d / "s-001").iterdir()}
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(d)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in d.iterdir()) == [".tmp-s-002", "s-001"]
    assert (d / ".tmp-s-002" / "weights.bin").read_bytes() == b"new"
    assert {p.name: p.read_bytes() for p in (d / "s-001").iterdir()} == before  # pruning never ran
    assert [p.name for p in ckpt.list_checkpoints(d, "s-")] == ["s-001"]
    found = ckpt.find_resumable(d, "s-", IDENT, main=True, log=logging.getLogger("test"))
    assert found.path == d / "s-001" and found.state["epoch"] == 1
    assert sorted(p.name for p in d.iterdir()) == ["s-001"]  # the temp one removed
