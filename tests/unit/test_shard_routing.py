"""Routing req_ids to registry shards, the limits each shard gets, and stats summed over them."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest

from deployments import AppConfig
from registry.routing import shard_name, shard_of, sum_stats


def test_a_req_id_s_shard_is_crc32_of_its_utf8_mod_n_the_same_in_every_process():
    # Written out so that a client in another language can check its own routing against it.
    assert shard_of("chat-42", 4) == zlib.crc32(b"chat-42") % 4 == 3
    assert shard_of("\u00e9t\u00e9", 3) == zlib.crc32("\u00e9t\u00e9".encode()) % 3
    assert all(shard_of(f"req-{i}", 1) == 0 for i in range(100))


def test_req_ids_spread_evenly_over_shards():
    counts = Counter(shard_of(f"req-{i:06d}", 4) for i in range(40_000))
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) / min(counts.values()) < 1.1, counts


def test_shard_zero_keeps_the_registry_s_name_so_one_shard_is_today_s_registry():
    assert shard_name("epd_registry", 0) == "epd_registry"
    assert shard_name("epd_registry", 3) == "epd_registry.3"


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_each_shard_gets_an_even_share_of_the_app_wide_limits(shards):
    config = AppConfig(registry_shards=shards, max_pending_requests=10, max_staged_bytes=1001, max_tombstones=7,
                       cache_max_bytes=100, max_object_store_fraction=0.6)
    app = config.registry_settings("epd")
    for shard in range(shards):
        own = app.for_shard(shard)
        assert own.shard == shard and own.registry_shards == shards and own.name == app.name
        assert own.limits.max_pending_requests == -(-10 // shards)
        assert own.limits.max_staged_bytes == -(-1001 // shards)
        assert own.limits.max_tombstones == -(-7 // shards)
        assert own.cache_max_bytes == -(-100 // shards)
        assert own.max_object_store_fraction == pytest.approx(0.6 / shards)
        # What is not a shared budget stays as configured.
        assert own.limits.ttl_s == app.limits.ttl_s and own.registry_max_concurrency == app.registry_max_concurrency
    # The shares cover the whole budget and round up by less than one per shard.
    assert 10 <= sum(app.for_shard(i).limits.max_pending_requests for i in range(shards)) < 10 + shards


def test_registry_shards_is_validated_like_every_setting():
    with pytest.raises(ValueError, match="registry_shards"):
        AppConfig(registry_shards=0)


def test_stats_are_summed_over_shards():
    one = {"pending": 1, "staged": 2, "staged_bytes": 100, "max_staged_bytes": 50, "released_total": 3}
    two = {"pending": 0, "staged": 5, "staged_bytes": 7, "max_staged_bytes": 50, "released_total": 1}
    total = sum_stats([one, two])
    assert total == {"pending": 1, "staged": 7, "staged_bytes": 107, "max_staged_bytes": 100, "released_total": 4}
    assert sum_stats([one]) == one
