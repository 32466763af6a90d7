"""The params schema's common ground: the strict section base class, :class:`ParamsError`, the
error formatting that names each offending dotted key, and the YAML reader (YAML 1.2 floats).

The section models live in :mod:`paco.core.params.data`, :mod:`paco.core.params.judge`,
:mod:`paco.core.params.grpo` and :mod:`paco.core.params.resources`; the whole file is
:class:`paco.core.params.schema.Params` (the package docstring of :mod:`paco.core.params` states
the typing rules).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Strict, ValidationError


class ParamsError(ValueError):
    """``params.yaml`` is missing, not YAML, or does not match the schema."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


#: A pair of ints / floats: YAML gives a list, which a strict tuple would refuse; the elements
#: stay strict (no bools, no strings).
IntPair = Annotated[tuple[int, int], Strict(False)]
FloatPair = Annotated[tuple[float, float], Strict(False)]


#: a model role's name (``models.<role>``, the directory ``data/models/<role>``): lower-case
#: letters, digits and ``_``, starting with a letter
ROLE_NAME = r"[a-z][a-z0-9_]*"
#: a ``models`` stage output directory, ``data/models/<role>`` (group 1: the role); a released
#: checkpoint named as a path (``judge_endpoint.model``, ``final_samples.<k>.lora``)
ROLE_PATH = re.compile(rf"data/models/({ROLE_NAME})")


_ABSENT = object()


def _dotted_key(loc: tuple[Any, ...], raw: Any) -> str:
    """The dotted key of an error location, following ``raw``: a location part that names no key
    or index of the value reached so far (pydantic's union-member tags such as ``float`` or
    ``literal['mean','median']`` below a scalar) is dropped."""
    parts: list[str] = []
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, (dict, list)) or node is _ABSENT:
            node = _ABSENT  # not in the file (a default): keep the schema's name
        else:
            continue  # a union-member tag under a scalar
        parts.append(str(part))
    return ".".join(parts) or "<root>"


def _got(value: Any) -> str:
    """`` (got ...)`` for a scalar input, with a hint for a number written as a string."""
    if isinstance(value, (dict, list)):
        return ""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return f" (got {text})"
        return f" (got {text}, a string: write the number without quotes)"
    return f" (got {text})"


def _format_errors(exc: ValidationError, raw: Any = None) -> str:
    """One line per offending dotted key: ``  key: reason[, or reason] (got value)``."""
    by_key: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for err in exc.errors():
        key = _dotted_key(tuple(err["loc"]), raw)
        msgs = by_key.setdefault(key, [])
        if err["msg"] not in msgs:
            msgs.append(err["msg"])
        inputs.setdefault(key, err.get("input"))
    return "\n".join(f"  {key}: {', or '.join(msgs)}{_got(inputs[key])}" for key, msgs in by_key.items())


def format_validation_errors(exc: ValidationError, prefix: str = "", raw: Any = None) -> str:
    """A section's validation errors, one line per dotted key (``prefix.key: reason``)."""
    text = _format_errors(exc, raw)
    if prefix:
        text = "\n".join(line.replace("  ", f"  {prefix}.", 1) for line in text.splitlines())
    return f"invalid parameters\n{text}"


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus YAML 1.2's floats in exponent form without a dot (``3e-4``,
    ``1E+5``), which YAML 1.1 reads as strings but DVC (ruamel.yaml, YAML 1.2) as floats."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_params_yaml(path: str | Path) -> dict[str, Any] | None:
    """Parse a params file as :func:`paco.core.params.schema.load_params` does (``None`` for an empty file).

    Raises:
        ParamsError: missing or unreadable file, invalid YAML, or a top level that is not a mapping.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ParamsError(f"{path}: cannot read ({exc})") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML ({exc})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw
