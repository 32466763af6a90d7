"""Dotted keys (``"grpo.t2is.rollout.noise_level"``) into nested mappings: the one walk that the
params file, the metrics files and the stage registry use (DVC names params the same way).

Imports nothing but the standard library, so the stage registry and the launcher read params
keys without loading the params schema.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

#: ``default`` of :func:`get_dotted` when a missing key is an error
_REQUIRED: Any = object()


class DottedKeyError(KeyError):
    """A dotted key that is not in the tree.

    Attributes:
        key: the whole dotted key (``"a.b.c"``).
        part: its first part that is missing (``"b"``).
        parent: the dotted key above ``part`` (``"a"``; ``""`` at the top).
    """

    def __init__(self, key: str, part: str, parent: str, node: Any) -> None:
        self.key, self.part, self.parent = key, part, parent
        where = f" under {parent!r}" if parent else ""
        why = "" if isinstance(node, Mapping) else f" ({parent!r} is a {type(node).__name__}, not a mapping)"
        super().__init__(f"{key!r}: no {part!r}{where}{why}")

    def __str__(self) -> str:
        return str(self.args[0])


def get_dotted(tree: Any, key: str, default: Any = _REQUIRED) -> Any:
    """The value at dotted ``key`` of ``tree`` (``get_dotted(t, "a.b")`` is ``t["a"]["b"]``).

    ``default``: returned when a part is missing or the value above it is not a mapping; without
    it, that is an error.

    Raises:
        DottedKeyError: (a ``KeyError``) no ``default`` and ``key`` is not in ``tree``; names the
            missing part and the key above it.
    """
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            if default is not _REQUIRED:
                return default
            raise DottedKeyError(key, part, ".".join(parts[:i]), node)
        node = node[part]
    return node


def set_dotted(tree: MutableMapping[str, Any], key: str, value: Any) -> None:
    """Set the value at dotted ``key`` of ``tree`` to ``value``, adding an empty ``dict`` for
    every missing mapping above it.

    Raises:
        DottedKeyError: a value above the key exists and is not a mapping.
    """
    *head, last = key.split(".")
    node: Any = tree
    for i, part in enumerate(head):
        if part not in node:
            node[part] = {}
        if not isinstance(node[part], MutableMapping):
            raise DottedKeyError(key, head[i + 1] if i + 1 < len(head) else last, ".".join(head[:i + 1]),
                                 node[part])
        node = node[part]
    node[last] = value
