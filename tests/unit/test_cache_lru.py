"""The content-hash cache's LRU budget (no Ray)."""

from registry.server.cache import EncoderCache
from registry.server.state import StagedItem


def item(nbytes, name="x"):
    return StagedItem({"nbytes": nbytes, "mm_hash": name}, f"ref-{name}")


def test_hit_miss_and_lru_eviction_by_bytes():
    cache = EncoderCache(max_bytes=300)
    assert cache.get("a") is None and cache.misses == 1
    assert cache.put("a", item(100, "a")) and cache.put("b", item(100, "b")) and cache.put("c", item(100, "c"))
    assert cache.get("a").ref == "ref-a"  # a is now the most recently used
    assert cache.put("d", item(100, "d"))  # over budget: evicts b, the least recently used
    assert "b" not in cache and {"a", "c", "d"} == {k for k in ("a", "b", "c", "d") if k in cache}
    assert (cache.bytes, cache.hits, cache.evictions) == (300, 1, 1)


def test_item_larger_than_budget_is_not_cached_and_evicts_nothing():
    cache = EncoderCache(max_bytes=100)
    cache.put("a", item(60, "a"))
    assert not cache.put("big", item(101, "big"))
    assert "a" in cache and cache.evictions == 0


def test_stats_and_clear():
    cache = EncoderCache(max_bytes=1000)
    cache.put("a", item(10))
    cache.get("a")
    cache.get("zzz")
    assert cache.stats() == {"cache_items": 1, "cache_bytes": 10, "cache_hits_total": 1, "cache_misses_total": 1,
                             "cache_evictions_total": 0}
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0
