"""Materialise a model role into a self-contained Hugging Face directory (the ``models`` stage).

A role's *spec* (``params.yaml`` ``models.<role>``) is one of:

* ``tiny:<name>`` - build a tiny random-init model offline (:func:`paco.models.tiny.build_tiny`);
* a path to an existing local directory - copy it (symlinks replaced by the files they point to);
* anything else - a Hugging Face hub id (``org/name``): ``huggingface_hub.snapshot_download``
  into the HF cache, then copy the snapshot. ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE``)
  and ``HF_HUB_CACHE`` / ``HF_HOME`` are read *at call time*, so a pre-populated cache works
  offline even when the variables are set after ``huggingface_hub`` was imported.

A role may take its processor and tokenizer from a second source (``models.processor_from``,
same three forms): the files of :data:`PROCESSOR_FILES` in the role's directory are replaced by
that source's (only those files are downloaded from a hub id). The reference's PickScore pairs
``yuvalkirstain/PickScore_v1``'s weights with the processor of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (X-GenGroup/PaCo-RL
``PaCo-GRPO/paco_grpo/rewards/pickscore_scorer.py`` l.8-14).

The output never contains symlinks into the HF cache, so DVC can hash and cache it, and it is
written atomically: built in a temporary sibling directory, then renamed over ``out_dir``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from paco.core.stage import hub_offline  # also paco.models.hub_offline

TINY_PREFIX = "tiny:"
_SKIP = {".git", ".cache", ".gitattributes"}  # VCS / hub bookkeeping, never model files
#: the processor and tokenizer files (top level of a model directory) ``processor_from`` replaces:
#: image preprocessing config, processor config, and the (BPE) tokenizer's files
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")


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


def _resolve(label: str, spec: str, revision: str | None,
             allow_patterns: list[str] | None) -> tuple[Path | None, str | None]:
    """``(source directory, None)`` for a local directory or a hub id (downloaded here), or
    ``(None, tiny name)`` for ``tiny:<name>``; errors name ``models.<label>`` and the spec."""
    from paco.models.tiny import TINY_NAMES

    if spec.startswith(TINY_PREFIX):
        tiny_name = spec[len(TINY_PREFIX):]
        if tiny_name not in TINY_NAMES:
            raise ValueError(
                f"models.{label}: unknown tiny model {spec!r}; expected one of "
                + ", ".join(TINY_PREFIX + n for n in TINY_NAMES)
            )
        return None, tiny_name
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser().resolve(), None
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:  # a path, not "org/name"
        raise ValueError(f"models.{label}: local model directory {spec!r} does not exist")
    return _snapshot(label, spec, revision, allow_patterns), None


def _overlay_processor(staged: Path, label: str, spec: str, source: Path) -> None:
    """Replace the :data:`PROCESSOR_FILES` of ``staged`` by those of ``source`` (a model's own
    processor files that ``source`` lacks are removed too, so none of them is left over).

    Raises:
        ValueError: ``source`` holds none of :data:`PROCESSOR_FILES` (names ``models.<label>``).
    """
    found = [name for name in PROCESSOR_FILES if (source / name).is_file()]
    if not found:
        raise ValueError(f"models.{label}: {spec!r} holds none of the processor files {list(PROCESSOR_FILES)}")
    for name in PROCESSOR_FILES:
        (staged / name).unlink(missing_ok=True)
    for name in found:
        shutil.copyfile(source / name, staged / name)  # follows symlinks into the HF cache


def materialise(
    role: str,
    spec: str,
    out_dir: Path,
    *,
    seed: int,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    processor_from: str | None = None,
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
        processor_from: ``None``, or a second spec (same three forms) whose
            :data:`PROCESSOR_FILES` replace the role's own; from a hub id only those files are
            downloaded (its ``main`` revision).

    Returns:
        ``out_dir``, a directory of regular files (no symlinks) loadable with
        ``from_pretrained``.

    Raises:
        ValueError: unknown tiny name, a path-like spec that is not an existing directory, an
            invalid hub id, or a hub id that cannot be downloaded / is not in the cache when
            offline. The message names ``models.<role>`` and the spec
            (``models.processor_from.<role>`` for the processor source, also when it holds no
            processor file).
    """
    from paco.models.tiny import build_tiny

    out_dir = Path(out_dir)
    spec = str(spec).strip()
    source, tiny_name = _resolve(role, spec, revision, allow_patterns)
    overlay: tuple[Path | None, str | None] | None = None
    if processor_from is not None:
        processor_from = str(processor_from).strip()
        overlay = _resolve(f"processor_from.{role}", processor_from, None, list(PROCESSOR_FILES))

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
        if overlay is not None:
            processor_dir, processor_tiny = overlay
            if processor_tiny is not None:
                processor_dir = build_tiny(processor_tiny, tmp_root / "processor", seed)
            _overlay_processor(staged, f"processor_from.{role}", processor_from, processor_dir)
        if out_dir.exists() or out_dir.is_symlink():
            old = tmp_root / "old"
            os.replace(out_dir, old)
        os.replace(staged, out_dir)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return out_dir
