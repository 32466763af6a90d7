"""Materialise a model role into a self-contained Hugging Face directory (the ``models`` stage).

A role's *spec* (``params.yaml`` ``models.<role>``) is one of:

* ``tiny:<name>`` - build a tiny random-init model offline (:func:`paco.models.tiny.build_tiny`);
* a path to an existing local directory - copy it (symlinks replaced by the files they point to);
* anything else - a Hugging Face hub id (``org/name``): ``huggingface_hub.snapshot_download``
  into the HF cache, then copy the snapshot. ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE``)
  and ``HF_HUB_CACHE`` / ``HF_HOME`` are read *at call time*, so a pre-populated cache works
  offline even when the variables are set after ``huggingface_hub`` was imported.

The output never contains symlinks into the HF cache, so DVC can hash and cache it, and it is
written atomically: built in a temporary sibling directory, then renamed over ``out_dir``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TINY_PREFIX = "tiny:"
_TRUE = {"1", "ON", "YES", "TRUE"}
_SKIP = {".git", ".cache", ".gitattributes"}  # VCS / hub bookkeeping, never model files


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set to a true value right now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def hub_cache_dir() -> str | None:
    """The HF hub cache directory from the environment right now (``HF_HUB_CACHE``, the legacy
    ``HUGGINGFACE_HUB_CACHE``, or ``$HF_HOME/hub``); ``None`` means huggingface_hub's default."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return os.path.expanduser(os.path.expandvars(os.environ[key]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None


def _copy_tree(src: Path, dst: Path, allow_patterns: list[str] | None = None) -> None:
    """Copy the files of ``src`` into ``dst`` (which must not exist), following symlinks.

    Skips ``.git``, ``.cache`` and ``.gitattributes``; with ``allow_patterns`` only files whose
    path relative to ``src`` matches one of the glob patterns (huggingface_hub semantics)."""
    from huggingface_hub.utils import filter_repo_objects

    files = sorted(
        p.relative_to(src).as_posix()
        for p in src.rglob("*")
        if p.is_file() and not (_SKIP & set(p.relative_to(src).parts))
    )
    if allow_patterns:
        files = list(filter_repo_objects(files, allow_patterns=allow_patterns))
    dst.mkdir(parents=True)
    for rel in files:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, target)  # follows symlinks: blobs are materialised


def _snapshot(role: str, spec: str, revision: str | None, allow_patterns: list[str] | None) -> Path:
    """``snapshot_download`` the hub id ``spec``; return the snapshot folder in the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError as exc:
        raise ValueError(
            f"models.{role}: {spec!r} is neither 'tiny:<name>', an existing local directory, "
            f"nor a valid hub id ({exc})"
        ) from exc
    offline = hub_offline()
    try:
        folder = snapshot_download(
            repo_id=spec,
            revision=revision,
            allow_patterns=allow_patterns,
            cache_dir=hub_cache_dir(),
            local_files_only=offline,
        )
    except Exception as exc:  # network, auth, missing repo/revision, incomplete cache ...
        where = "in the local HF cache (HF_HUB_OFFLINE is set)" if offline else "on the hub or in the HF cache"
        raise ValueError(
            f"models.{role}: hub model {spec!r} (revision {revision or 'main'}) is not available "
            f"{where}: {type(exc).__name__}: {exc}"
        ) from exc
    return Path(folder)


def materialise(
    role: str,
    spec: str,
    out_dir: Path,
    *,
    seed: int,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """Write the model for ``role`` described by ``spec`` into ``out_dir`` (fully replaced).

    Args:
        role: the role name (``judge_base``, ``policy_t2is``, ``clip`` ...), used in errors.
        spec: ``"tiny:<name>"``, a local directory, or a hub id (see the module docstring).
        out_dir: destination directory. Its parent is created; an existing ``out_dir`` is
            replaced only after the new one is complete (rename of a sibling temp directory).
        seed: weight-init seed for ``tiny:`` specs (ignored otherwise).
        revision: hub branch, tag or commit for hub ids (default ``main``); ignored otherwise.
        allow_patterns: glob patterns restricting which files are downloaded and copied (hub
            ids and local directories); ``None`` copies everything.

    Returns:
        ``out_dir``, a directory of regular files (no symlinks) loadable with
        ``from_pretrained``.

    Raises:
        ValueError: unknown tiny name, a path-like spec that is not an existing directory, an
            invalid hub id, or a hub id that cannot be downloaded / is not in the cache when
            offline. The message names ``models.<role>`` and the spec.
    """
    from paco.models.tiny import TINY_NAMES, build_tiny

    out_dir = Path(out_dir)
    spec = str(spec).strip()
    source: Path | None = None
    tiny_name: str | None = None
    if spec.startswith(TINY_PREFIX):
        tiny_name = spec[len(TINY_PREFIX):]
        if tiny_name not in TINY_NAMES:
            raise ValueError(
                f"models.{role}: unknown tiny model {spec!r}; expected one of "
                + ", ".join(TINY_PREFIX + n for n in TINY_NAMES)
            )
    elif Path(spec).expanduser().is_dir():
        source = Path(spec).expanduser().resolve()
    elif spec.startswith(("/", ".", "~")) or spec.count("/") > 1:  # a path, not "org/name"
        raise ValueError(f"models.{role}: local model directory {spec!r} does not exist")
    else:
        source = _snapshot(role, spec, revision, allow_patterns)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        staged = tmp_root / "new"
        if tiny_name is not None:
            build_tiny(tiny_name, staged, seed)
        else:
            _copy_tree(source, staged, allow_patterns)
            if not any(staged.iterdir()):
                raise ValueError(f"models.{role}: {spec!r} gave no files (allow_patterns={allow_patterns})")
        if out_dir.exists() or out_dir.is_symlink():
            old = tmp_root / "old"
            os.replace(out_dir, old)
        os.replace(staged, out_dir)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return out_dir
