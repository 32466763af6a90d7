"""A thread-safe in-memory LRU bounded by the bytes of its values (:class:`BytesLRU`): the judge
server's decoded images and per-image processor features, and the judge's vision-tower outputs.
The eviction is ``cachetools.LRUCache`` with a ``getsizeof``; this class adds the lock, the
hit / miss counts and the rule that a value larger than the whole bound is not kept."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from cachetools import LRUCache


class BytesLRU:
    """Least recently used values first out, while their ``sizeof`` sum exceeds ``max_bytes``.

    Args:
        max_bytes: the bound in bytes (0: nothing is kept, every :meth:`get` misses).
        sizeof: a value's size in bytes (e.g. ``numel x element_size`` of a tensor).

    Raises:
        ValueError: ``max_bytes`` < 0.
    """

    def __init__(self, max_bytes: int, sizeof: Callable[[Any], int]):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._sizeof = sizeof
        self._cache: LRUCache = LRUCache(maxsize=max(self.max_bytes, 1), getsizeof=sizeof)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The value under ``key`` (now the most recently used), or ``None``; counted as a hit or
        a miss."""
        with self._lock:
            value = self._cache.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` under ``key`` (a key already held keeps its value), evicting the least
        recently used values beyond the bound; a value larger than the bound is not kept."""
        if self.max_bytes == 0 or self._sizeof(value) > self.max_bytes:
            return
        with self._lock:
            if key not in self._cache:
                self._cache[key] = value

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    @property
    def nbytes(self) -> int:
        """The held values' bytes (by ``sizeof``)."""
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)
