"""The content-hash encoder cache: identical media items are encoded once.

Keys are ``mm_hash`` values (item bytes + model identity, see
``encoder.hashing.mm_hash``); values are staged items (metadata + ObjectRef)
that entries share. The cache is bounded by the bytes of the embeddings it
holds and evicts the least recently used first.

Eviction only drops the cache's own reference: an entry that holds the same
item keeps the object alive (Ray counts references), so eviction never takes
bytes from a request that holds them; memory returns when the last holder lets
go. An item larger than the whole budget is not cached.

Plain Python, no Ray: the registry actor drives it from its event loop.
"""

from __future__ import annotations

from collections import OrderedDict

from registry.server.state import StagedItem


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StagedItem] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> StagedItem | None:
        """The cached item for ``key`` (now the most recently used), counting a hit or a miss."""
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: str, item: StagedItem) -> bool:
        """Cache ``item``; evict least recently used items to stay in budget. False: not cached."""
        size = int(item.meta.get("nbytes", 0))
        if size > self.max_bytes or key in self._items:
            return False
        self._items[key] = item
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= int(evicted.meta.get("nbytes", 0))
            self.evictions += 1
        return True

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def stats(self) -> dict[str, int]:
        return {
            "cache_items": len(self._items),
            "cache_bytes": self.bytes,
            "cache_hits_total": self.hits,
            "cache_misses_total": self.misses,
            "cache_evictions_total": self.evictions,
        }
