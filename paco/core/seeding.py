"""Seeding: stable integer seeds derived from named parts, identical in every process and run.

Every random draw of the pipeline that must not depend on process count, batch composition or
resumption is seeded from its *name* (stage seed, stream, epoch, prompt id, index) through
:func:`stable_seed`, never from a shared global RNG. Python's ``hash()`` is salted per process,
so these use BLAKE2b.
"""

from __future__ import annotations

import hashlib
from typing import Any


def stable_hash(text: str) -> int:
    """A 64-bit unsigned hash of ``text`` (UTF-8, BLAKE2b with an 8-byte digest, little-endian),
    stable across processes and platforms (unlike ``hash()``). Range ``[0, 2**64)``."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def stable_seed(*parts: Any) -> int:
    """A 63-bit integer seed (range ``[0, 2**63)``, valid for ``torch.Generator.manual_seed``)
    from the parts' ``str()`` joined by the unit separator ``\\x1f``."""
    return stable_hash("\x1f".join(str(p) for p in parts)) >> 1
