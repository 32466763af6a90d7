"""paco.core.caching.BytesLRU: eviction by bytes, least recently used first; the bound's edges."""

from __future__ import annotations

import threading

import pytest

from paco.core.caching import BytesLRU


def test_the_least_recently_used_values_go_first_once_the_bytes_exceed_the_bound():
    lru = BytesLRU(10, sizeof=len)
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert lru.get("a") == b"aaaa"  # "a" is now the most recently used
    lru.put("c", b"cccc")  # 12 bytes > 10: "b" goes
    assert lru.get("b") is None and lru.get("a") == b"aaaa" and lru.get("c") == b"cccc"
    assert lru.nbytes == 8 and len(lru) == 2
    assert (lru.hits, lru.misses) == (3, 1)
    lru.put("a", b"zz")  # a key already held keeps its value
    assert lru.get("a") == b"aaaa"


def test_a_value_larger_than_the_bound_or_a_zero_bound_keeps_nothing():
    lru = BytesLRU(4, sizeof=len)
    lru.put("big", b"12345")
    assert lru.get("big") is None and lru.nbytes == 0
    off = BytesLRU(0, sizeof=len)
    off.put("a", b"a")
    assert off.get("a") is None and len(off) == 0
    lru.put("a", b"1234")
    lru.clear()
    assert lru.get("a") is None and lru.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        BytesLRU(-1, sizeof=len)


def test_threads_putting_and_getting_keep_the_bound():
    lru = BytesLRU(64, sizeof=len)

    def work(t: int) -> None:
        for i in range(500):
            lru.put((t, i % 40), bytes(8))
            lru.get((t, (i * 7) % 40))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert lru.nbytes <= 64 and len(lru) == lru.nbytes // 8
    assert lru.hits + lru.misses == 4 * 500
