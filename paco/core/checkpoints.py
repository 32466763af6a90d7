"""Checkpoint plumbing shared by the resumable training stages (``reward_train``,
``grpo@<subtask>``): numbered checkpoint directories written atomically and pruned
(:func:`write_checkpoint`), resuming only under the same run identity (:func:`find_resumable`,
skipping unreadable checkpoints), atomic directory replacement, deterministic safetensors and
adapter bytes, and the per-stage ``plots/*.csv`` files.

A checkpoint is ``<dir>/<prefix><N>/`` holding a JSON state file; it is written to a hidden
``.tmp-<prefix><N>`` sibling and renamed into place, so a crash leaves either the previous
checkpoints or a stray temp directory (removed on the next start), never a half checkpoint.
Each trainer adds only its own files (weights, optimizer, RNG states) through
:func:`write_checkpoint`'s callbacks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from paco.core.distributed import wait_for_everyone
from paco.core.io import write_json
from paco.core.run_identity import RunIdentity

STATE_FILE = "trainer_state.json"


def list_checkpoints(checkpoints_dir: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Complete checkpoints (``<prefix><N>`` directories holding ``trainer_state.json``),
    oldest (smallest ``N``) first."""
    d = Path(checkpoints_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)", p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``.

    Raises:
        OSError: unreadable. ValueError (``json.JSONDecodeError``): not JSON.
    """
    return json.loads((Path(path) / STATE_FILE).read_text())


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished directory ``tmp`` to ``target`` (replacing it)."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)



def fsync_tree(path: str | os.PathLike[str]) -> None:
    """``os.fsync`` every file and directory under ``path`` (``path`` included), so a directory
    renamed into place afterwards holds its data after a power loss too (a kill needs only the
    rename). A directory the filesystem cannot fsync (``EINVAL``, ``EBADF``) is skipped.

    Raises:
        OSError: a file cannot be opened or synced.
    """
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not openable as a directory on this platform
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_checkpoint(checkpoints_dir: str | os.PathLike[str], name: str, state: Mapping[str, Any], *,
                     prefix: str, keep: int, accelerator: Any, main: bool,
                     write_each: Callable[[Path], None] | None = None,
                     write_main: Callable[[Path], None] | None = None,
                     plots_dir: Path | None = None) -> Path:
    """Write checkpoint ``<checkpoints_dir>/<name>/`` atomically; every process of the run calls it.

    1. The main process removes the temp directory ``.tmp-<name>`` (left by an interrupted
       attempt) and creates it (and ``checkpoints_dir``); barrier.
    2. Every process calls ``write_each(tmp)``: its own files (its RNG state) or a collective save
       (``accelerator.save_state``); barrier.
    3. The main process calls ``write_main(tmp)`` (the shared weights, the optimizer), writes
       ``state`` (JSON, the run identity among it) as :data:`STATE_FILE` (what
       :func:`list_checkpoints` takes as a complete checkpoint), fsyncs the directory's files
       (:func:`fsync_tree`), renames it to ``<name>`` (:func:`replace_dir`; an existing one is
       replaced), fsyncs ``checkpoints_dir``, keeps the newest ``keep`` checkpoints
       (:func:`prune`) and rewrites ``plots_dir/*.csv`` from ``state["history"]``
       (:func:`write_plot_csvs`; ``None``: none); barrier.

    A kill before the rename leaves the previous checkpoints untouched and the hidden temp
    directory, which :func:`list_checkpoints` ignores and :func:`find_resumable` (or the next write
    of ``name``) removes. The temp directory's name is fixed, not random, so every process finds it
    without a broadcast.

    Args:
        name: ``<prefix><N>`` (``N`` decimal digits, zero-padded as the trainer chooses).
        accelerator: the run's ``accelerate.Accelerator`` for the barriers (``None``: one process).
        main: whether this is the main process.

    Returns:
        ``<checkpoints_dir>/<name>``.

    Raises:
        ValueError: ``name`` is not ``<prefix><N>`` or ``keep`` < 1. OSError: a write fails.
        TypeError / ValueError: ``state`` is not JSON-serialisable.
    """
    if not re.fullmatch(rf"{re.escape(prefix)}\d+", name):
        raise ValueError(f"checkpoint name {name!r} is not {prefix!r} followed by digits")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ckdir = Path(checkpoints_dir)
    tmp, target = ckdir / f".tmp-{name}", ckdir / name
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    wait_for_everyone(accelerator)
    if write_each is not None:
        write_each(tmp)
    wait_for_everyone(accelerator)
    if main:
        if write_main is not None:
            write_main(tmp)
        write_json(tmp / STATE_FILE, state)
        fsync_tree(tmp)
        replace_dir(tmp, target)
        _fsync_dir(ckdir)
        prune(ckdir, prefix, keep)
        write_plot_csvs(plots_dir, state.get("history", {}))
    wait_for_everyone(accelerator)
    return target


@dataclass(frozen=True)
class Resume:
    """What :func:`find_resumable` found: the checkpoint to resume (``path``, ``state``; both
    ``None`` for a fresh start) and why, for the log and the stage report (``reason``), plus
    whether the evaluation params changed since the checkpoint (``evaluation_changed``: the
    evaluation is recomputed on the kept weights)."""

    path: Path | None
    state: dict[str, Any] | None
    reason: str
    evaluation_changed: tuple[str, ...] = ()
    skipped_corrupt: tuple[str, ...] = ()
    #: what ``find_resumable``'s ``load`` returned for ``path`` (not compared; drop it with
    #: :meth:`without_loaded` before sending the decision to other processes)
    loaded: Any = field(default=None, compare=False, repr=False)

    def without_loaded(self) -> Resume:
        return replace(self, loaded=None)

    def to_report(self) -> dict[str, Any]:
        return {"resumed_from": self.path.name if self.path else None, "reason": self.reason,
                "evaluation_changed": list(self.evaluation_changed), "skipped_corrupt": list(self.skipped_corrupt)}


def find_resumable(checkpoints_dir: str | os.PathLike[str], prefix: str, identity: RunIdentity, *, main: bool,
                   log: logging.Logger, required_files: Sequence[str] = (),
                   load: Callable[[Path, dict[str, Any]], Any] | None = None) -> Resume:
    """The newest readable checkpoint if it was written under ``identity``, else a fresh start.

    Checkpoints are tried newest first; one whose ``trainer_state.json`` is not valid JSON, lacks
    an ``identity`` or lacks one of ``required_files``, or for which ``load(path, state)`` (the
    trainer reading its files) raises, is skipped with a warning naming it (the main process
    removes it); ``load``'s result is :attr:`Resume.loaded`. If the newest readable checkpoint's
    identity differs, the run
    changed: the main process logs which parts differ and removes every checkpoint (a fresh start,
    never a wrong resume). Leftover ``.tmp-<prefix>*`` / ``.<prefix>*.old-*`` directories of an
    interrupted write or replacement are removed too.
    """
    d = Path(checkpoints_dir)
    skipped: list[str] = []
    result = Resume(None, None, "no checkpoint")
    existing = list_checkpoints(d, prefix)
    for path in reversed(existing):
        try:
            state = read_state(path)
            if not isinstance(state, dict) or "identity" not in state:
                raise ValueError("no run identity recorded")
            missing = [f for f in required_files if not (path / f.format(**state)).is_file()]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            if main:
                log.warning("checkpoint %s is unreadable (%s): skipping it", path, exc)
            skipped.append(f"{path.name}: {exc}")
            continue
        if state["identity"] == identity.digest:
            try:
                loaded = load(path, state) if load is not None else None
            except Exception as exc:  # noqa: BLE001 - any failure to read it (SafetensorError, pickle, ...)
                if main:
                    log.warning("checkpoint %s is unreadable (%s: %s): skipping it", path, type(exc).__name__, exc)
                skipped.append(f"{path.name}: {type(exc).__name__}: {exc}")
                continue
            changed_eval = identity.changed_evaluation(state.get("evaluation_parts"))
            result = Resume(path, state, f"same run identity {identity.digest[:12]}", tuple(changed_eval),
                            loaded=loaded)
        else:
            why = identity.changed(state.get("identity_parts"))
            result = Resume(None, None, f"run identity changed since {path.name}: {RunIdentity.describe_change(why)}")
            if main:
                log.warning("checkpoint %s was written under another run identity (changed: %s): starting fresh, "
                            "removing %d checkpoint(s)", path, RunIdentity.describe_change(why), len(existing))
        break
    if main:
        drop = existing if result.path is None else [p for p in existing if p.name in {s.split(":")[0] for s in skipped}]
        for p in drop:
            shutil.rmtree(p, ignore_errors=True)
        if d.is_dir():  # an interrupted write or replacement (replace_dir's two renames)
            for p in [*d.glob(f".tmp-{prefix}*"), *d.glob(f".{prefix}*.old-*")]:
                shutil.rmtree(p, ignore_errors=True)
    return replace(result, skipped_corrupt=tuple(skipped))


#: the marker a persisted directory keeps of the run identity it was written under
IDENTITY_MARKER = "run_identity.json"


def keep_under_identity(directory: str | os.PathLike[str], identity: str, *, what: str,
                        log: logging.Logger | None = None) -> Path:
    """Make ``directory`` (a persisted, resumable output: ``reasons``' progress chunks, a
    benchmark's answer cache) hold only what was written under run identity ``identity`` (a
    digest), and return it.

    A directory whose marker (:data:`IDENTITY_MARKER`) names another identity, or is missing or
    unreadable, is cleared whole (a warning for an unreadable one): its content may come from
    other params, inputs, weights or code. Temporary ``.*.tmp`` files an interrupted atomic write
    left are removed, so DVC never hashes them. The marker is then (re)written.

    Raises:
        OSError: the directory cannot be cleared or written.
    """
    path = Path(directory)
    marker = path / IDENTITY_MARKER
    log = log or logging.getLogger(__name__)
    if path.exists():
        old = None
        if marker.is_file():
            try:
                meta = json.loads(marker.read_text(encoding="utf-8"))
                old = meta.get("identity") if isinstance(meta, dict) else None
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                log.warning("%s is unreadable (%s): discarding the persisted %s", marker, exc, what)
        if old != identity:
            if old is not None:
                log.info("%s %s was written under another run identity (%s): starting over", what, path, old[:12])
            shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    for stray in path.glob(".*.tmp"):  # a kill during an atomic write left it
        log.info("%s %s: removing the temporary file %s of an interrupted write", what, path, stray.name)
        stray.unlink(missing_ok=True)
    write_json(marker, {"identity": identity})
    return path


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` (tensors made contiguous on the CPU), then
    :func:`canonicalise_safetensors`: equal tensors and metadata give equal bytes."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
              metadata=dict(metadata) if metadata else None)
    canonicalise_safetensors(path)


def canonicalise_safetensors(path: str | os.PathLike[str]) -> None:
    """Rewrite a safetensors file's header so its bytes depend only on its tensors and metadata
    values: the ``__metadata__`` map is written with sorted keys (the Rust writer keeps it in a
    hash map, so its order changes from process to process), JSON-valued metadata is
    re-serialised with sorted keys and sorted string lists (diffusers builds ``target_modules``
    from a ``set``). The tensor entries and data bytes are kept as they are; the header is padded
    with spaces to a multiple of 8 bytes, as the safetensors writer does.

    Raises:
        ValueError: not a safetensors file.
    """
    p = Path(path)
    blob = p.read_bytes()
    if len(blob) < 8:
        raise ValueError(f"{p}: not a safetensors file")
    n = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError as exc:
        raise ValueError(f"{p}: not a safetensors file ({exc})") from exc
    meta = header.pop("__metadata__", None)
    out: dict[str, Any] = {}
    if meta:
        canon = {}
        for k in sorted(meta):
            v = meta[k]
            try:
                obj = json.loads(v)
            except ValueError:
                canon[k] = v
                continue
            canon[k] = json.dumps(_sorted_json(obj), sort_keys=True) if isinstance(obj, (dict, list)) else v
        out["__metadata__"] = canon
    out.update(header)
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = len(text).to_bytes(8, "little") + text + blob[8 + n:]
    if data != blob:
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, p)


def canonicalise_adapter_dir(directory: str | os.PathLike[str]) -> None:
    """Make a saved adapter directory's bytes deterministic: every ``*.safetensors`` through
    :func:`canonicalise_safetensors`, and every ``*.json`` rewritten with sorted keys (2-space
    indent) and its ``target_modules`` list sorted (peft writes it from a ``set``)."""
    d = Path(directory)
    for f in sorted(d.glob("*.safetensors")):
        canonicalise_safetensors(f)
    for f in sorted(d.glob("*.json")):
        obj = json.loads(f.read_text())
        if isinstance(obj, dict) and isinstance(obj.get("target_modules"), list):
            obj["target_modules"] = sorted(obj["target_modules"])
        f.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _sorted_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted_json(v) for k, v in obj.items()}
    if isinstance(obj, list) and all(isinstance(x, str) for x in obj):
        return sorted(obj)
    if isinstance(obj, list):
        return [_sorted_json(x) for x in obj]
    return obj


def prune(checkpoints_dir: str | os.PathLike[str], prefix: str, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints."""
    for old in list_checkpoints(checkpoints_dir, prefix)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_plot_csvs(plots_dir: Path | None, history: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """``<plots_dir>/<name>.csv`` for every ``history[name]`` (rows of a table), each replaced
    atomically; columns ``epoch``, ``step`` first, the rest sorted (the same bytes whether the rows
    come from this run or a checkpoint's JSON); ``plots_dir=None`` writes nothing."""
    if plots_dir is None:
        return
    plots_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in history.items():
        tmp = plots_dir / f".{name}.csv.tmp-{os.getpid()}"
        frame = pd.DataFrame(list(rows))
        lead = [c for c in ("epoch", "step") if c in frame.columns]
        frame[lead + sorted(c for c in frame.columns if c not in lead)].to_csv(tmp, index=False)
        os.replace(tmp, plots_dir / f"{name}.csv")
