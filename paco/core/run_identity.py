"""Run identity: what a stage's persisted state (checkpoints, resumable progress) must match to be
reused, computed from what the stage declares in the registry (``workflow/registry.py``; the
caller looks its member up there and passes it in: :class:`StageMember`).

A cached stage is a promise: what ``dvc repro`` (or Snakemake) leaves after any change equals what
a fresh run computes with the same inputs. Outputs are rewritten by every run, but a stage with
persisted state (``reward_train``'s and ``grpo@<subtask>``'s checkpoints, ``reasons``' progress)
would otherwise resume work done under other inputs. So every such stage computes its identity
from exactly the declarations that make DVC rerun it:

* ``dep:<path>``: sha256 of each data dependency the stage reads under its params (a file's
  bytes; a directory's sorted relative file names and bytes; ``absent`` if it does not exist),
  except one read only under a ``continuable`` key (below: ``reasons.sft_import``'s folder, which
  joins the table after the persisted teacher chunks);
* ``code:<path>``: sha256 of each declared code file (the stage's import closure);
* ``params:<key>``: sha256 of each declared params section after validation (defaults filled in,
  so writing a default explicitly changes nothing), *minus* the keys the stage declares as

  - ``continuable``: a persisted run may continue across a change (``epochs`` of GRPO, whose
    schedules do not depend on it; ``save_every``, ``checkpoint_every``),
  - ``evaluation``: they change only the evaluation, which is recomputed on the kept weights
    (``grpo.<subtask>.eval.*`` except ``every``, which decides which weights are kept),
  - ``launch``: how the stage is launched (``resources``), which changes no result;

  the ``evaluation`` keys have their own digest (:attr:`RunIdentity.evaluation`).

A trainer adds its own parts (:func:`launch_parts`: the process count, the device type and, on
CPU, the settings the CPU kernels round by) with :meth:`RunIdentity.extended` and stores
:meth:`RunIdentity.to_state` in every checkpoint; on the next start it resumes only a
checkpoint whose :attr:`RunIdentity.digest` equals the current one, and otherwise starts fresh and
says which parts changed (:meth:`RunIdentity.changed`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from paco.core.dotted import get_dotted

ABSENT = "absent"


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def path_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a declared dependency: a file's bytes, or for a directory the sorted
    ``(relative path, file sha256)`` of every file below it whose path has no component
    starting with ``.`` (temporary siblings of an atomic write); :data:`ABSENT` if ``path`` does
    not exist (an optional input such as an unused import folder).

    Every byte is hashed, like DVC's own ``md5`` of a dependency: a sampled hash could miss a
    change and resume stale state, and hashing even a multi-GB judge takes only seconds.

    Raises:
        OSError: a file cannot be read.
    """
    p = Path(path)
    if not p.exists():
        return ABSENT
    if p.is_file():
        return file_sha256(p)
    entries = []
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p)
        if f.is_file() and not any(part.startswith(".") for part in rel.parts):
            entries.append([rel.as_posix(), file_sha256(f)])
    return _sha256_json(entries)


def without_keys(tree: Any, dotted_keys: list[str]) -> Any:
    """A deep copy of ``tree`` without the given dotted keys (relative to ``tree``)."""
    if not isinstance(tree, Mapping):
        return tree
    out = {}
    for k, v in tree.items():
        if k in dotted_keys:
            continue
        sub = [d.split(".", 1)[1] for d in dotted_keys if "." in d and d.split(".", 1)[0] == k]
        out[k] = without_keys(v, sub) if sub else v
    return out


@dataclass(frozen=True)
class RunIdentity:
    """A stage run's identity (see the module docstring).

    Attributes:
        member: the stage member (``grpo@t2is``, ``reward_train``).
        parts: component name -> sha256 hex: what persisted training state must match.
        evaluation: evaluation-only params key -> sha256 hex: a change re-runs the evaluation
            on kept weights, never the training.
    """

    member: str
    parts: Mapping[str, str]
    evaluation: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """sha256 over :attr:`parts` (sorted JSON)."""
        return _sha256_json(dict(self.parts))

    @property
    def evaluation_digest(self) -> str:
        """sha256 over :attr:`evaluation` (sorted JSON)."""
        return _sha256_json(dict(self.evaluation))

    def extended(self, **extra: Any) -> RunIdentity:
        """The identity with trainer-specific parts ``extra:<name>`` (values ``str()``-ed)."""
        return replace(self, parts={**self.parts, **{f"extra:{k}": str(v) for k, v in extra.items()}})

    def changed(self, recorded: Mapping[str, str] | None) -> list[str]:
        """Names of the parts that differ from ``recorded`` (added, removed or changed), sorted."""
        recorded = recorded or {}
        return sorted(k for k in set(self.parts) | set(recorded) if self.parts.get(k) != recorded.get(k))

    def changed_evaluation(self, recorded: Mapping[str, str] | None) -> list[str]:
        recorded = recorded or {}
        return sorted(k for k in set(self.evaluation) | set(recorded)
                      if self.evaluation.get(k) != recorded.get(k))

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint records: ``identity``, ``identity_parts``, ``evaluation_identity``,
        ``evaluation_parts``."""
        return {"identity": self.digest, "identity_parts": dict(self.parts),
                "evaluation_identity": self.evaluation_digest, "evaluation_parts": dict(self.evaluation)}

    @staticmethod
    def describe_change(names: list[str], limit: int = 6) -> str:
        """``"dep:data/x, params:grpo.t2is (+3 more)"`` for a log line."""
        shown = ", ".join(names[:limit])
        return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def launch_parts(num_processes: int, device_type: str) -> dict[str, Any]:
    """A trainer's own identity parts (for :meth:`RunIdentity.extended`): ``num_processes``,
    ``device`` (``"cpu"``, ``"cuda"``, ...) and, on CPU, ``cpu_numerics``: torch's intra-op
    threads in this process (call it after the trainer set them) and the CPU code-path variables
    of :data:`paco.core.numerics.FIXED_CPU_ISA_ENV` (``unset`` where unset), e.g.
    ``"threads=2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE
    NPY_DISABLE_CPU_FEATURES=X86_V4 AVX512_ICL AVX512_SPR OPENBLAS_CORETYPE=Haswell"``.

    CPU reductions are split per thread and each code path rounds its own way
    (:mod:`paco.core.numerics`), so a checkpoint written under other settings would continue on
    numbers that neither an uninterrupted run under the old settings nor one under the new ones
    computes: it is not resumed. (GPU kernels do not read these settings.)"""
    parts: dict[str, Any] = {"num_processes": num_processes, "device": device_type}
    if device_type == "cpu":
        import torch

        from paco.core.numerics import FIXED_CPU_ISA_ENV

        parts["cpu_numerics"] = " ".join([f"threads={torch.get_num_threads()}",
                                          *(f"{k}={os.environ.get(k, 'unset')}" for k in FIXED_CPU_ISA_ENV)])
    return parts


class StageMember(Protocol):
    """What the run identity reads of a stage member of the registry (``workflow.stage.Member``,
    looked up by the caller, e.g. ``workflow.registry.member("grpo@t2is", config)``).

    Attributes:
        dvc_name: the member's name (``grpo@t2is``, ``reward_train``).
        stage: its stage's declarations: ``params``, ``continuable``, ``evaluation`` and
            ``launch`` (dotted params keys, possibly with ``${key}``), ``args`` (``(flag,
            value)`` pairs of its command line) and ``code`` (source files).
    """

    dvc_name: str
    stage: Any

    def resolve(self, text: str, config: Mapping[str, Any]) -> str:
        """``text`` with the member's ``${key}`` / ``${item.<path>}`` and the params values of
        ``config`` substituted."""

    def identity_deps(self, config: Mapping[str, Any]) -> list[str]:
        """The data dependencies read under ``config`` (resolved), except those read only under a
        ``continuable`` key."""


def params_identity(member: StageMember, sections: Mapping[str, Any]) -> RunIdentity:
    """The params part of ``member``'s identity: ``params:<key>`` for each declared section key
    in ``sections`` (dotted key -> its validated value as JSON-able data), without the stage's
    continuable, evaluation and launch keys; the evaluation keys' own digests.

    Raises:
        KeyError: a declared section is missing from ``sections``.
    """
    m = member
    stage = m.stage
    excluded = [m.resolve(k, {}) for k in stage.continuable + stage.evaluation + stage.launch]
    parts: dict[str, str] = {}
    for section in stage.params:
        key = m.resolve(section, {})
        if key not in sections:
            raise KeyError(f"{m.dvc_name}: params section {key!r} not given")
        rel = [e[len(key) + 1:] for e in excluded if e.startswith(key + ".")]
        parts[f"params:{key}"] = _sha256_json(without_keys(sections[key], rel))
    evaluation = {}
    for k in stage.evaluation:
        key = m.resolve(k, {})
        section = next(s for s in sections if key.startswith(s + "."))
        evaluation[key] = _sha256_json(get_dotted(sections[section], key[len(section) + 1:], None))
    return RunIdentity(m.dvc_name, parts, evaluation)


def stage_identity(member: StageMember, params_path: str | os.PathLike[str], *, root: str | os.PathLike[str] = ".",
                   params: Any = None, args: Any = None) -> RunIdentity:
    """The run identity of a registry member (``reward_train``, ``grpo@t2is``): the digests of
    its declared deps and code files and :func:`params_identity`.

    Args:
        member: the stage member (:class:`StageMember`), as the registry gives it.
        params_path: the params file the stage runs with (``params.yaml``).
        root: the directory the registry's relative paths are resolved against.
        params: the already validated :class:`paco.core.params.Params` of ``params_path`` (loaded
            here if ``None``).
        args: the stage's parsed command line: a declared dep passed as ``--flag`` is hashed at
            the path the command line gives (the part keeps the declared name), so a stage run by
            hand on other paths hashes what it reads.

    Raises:
        paco.core.params.ParamsError: the params file is invalid.
        OSError: a dependency cannot be read.
    """
    from paco.core.params import load_params

    params = params if params is not None else load_params(params_path)
    m = member
    tree = params.model_dump(mode="json", by_alias=True)
    root = Path(root)
    # paths resolve against the validated params, so a key left to its default resolves too
    actual: dict[str, Path] = {}
    for flag, value in m.stage.args:
        attr = flag.lstrip("-").replace("-", "_")
        if args is not None and getattr(args, attr, None) is not None:
            actual[m.resolve(value, tree)] = Path(getattr(args, attr))
    parts: dict[str, str] = {}
    for path in m.identity_deps(tree):
        parts[f"dep:{path}"] = path_digest(actual.get(path, root / path))
    for code in m.stage.code:
        parts[f"code:{code}"] = path_digest(root / code)
    sections = {m.resolve(k, {}): get_dotted(tree, m.resolve(k, {}), None) for k in m.stage.params}
    from_params = params_identity(m, sections)
    return RunIdentity(m.dvc_name, {**parts, **from_params.parts}, from_params.evaluation)


def stage_identity_on_main(member: StageMember, args: Any, params: Any, accelerator: Any) -> RunIdentity:
    """:func:`stage_identity` computed by the main process only (hashing model directories once,
    not once per process) and broadcast to the others (``accelerate``)."""
    from paco.core.distributed import broadcast_from_main

    identity = stage_identity(member, args.params, params=params, args=args) if accelerator.is_main_process else None
    return broadcast_from_main(accelerator, identity)
