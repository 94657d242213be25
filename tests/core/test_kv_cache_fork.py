"""KVCacheManager.fork (beam search): a child takes its parent's full blocks below a point by
reference, nothing else; freeing either keeps the other's blocks; prefix hashes follow."""
from __future__ import annotations

import pytest

from specserve.core.kv_cache_manager import KVCacheManager


def test_fork_shares_full_blocks_by_reference():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    assert kv.allocate_slots("p", 11)                       # 3 blocks
    tokens = list(range(11))
    kv.cache_full_blocks("p", tokens, 11)                   # blocks 0, 1 registered
    shared = kv.fork("p", "c", 10)                          # 2 full blocks below token 10
    assert shared == 8 and kv.block_table("c") == kv.block_table("p")[:2]
    assert kv.num_free_blocks == 7                          # nothing new taken
    assert kv.allocate_slots("c", 10)                       # its own third block
    assert kv.block_table("c")[2] not in kv.block_table("p") and kv.num_free_blocks == 6
    kv.free("p")                                            # the shared blocks stay the child's
    assert kv.num_free_blocks == 7 and len(kv.block_table("c")) == 3
    kv.cache_full_blocks("c", tokens[:8] + [99, 98, 97, 96], 12)   # its chain continues from the shared hashes
    kv.free("c")
    assert kv.num_free_blocks == 10
    assert kv.acquire_cached_prefix("again", tokens[:8] + [99, 98, 97, 96, 5]) == 12


def test_fork_below_one_block_shares_nothing_and_a_holder_is_refused():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("p", 6)
    assert kv.fork("p", "c", 3) == 0 and kv.block_table("c") == []
    kv.allocate_slots("d", 2)
    with pytest.raises(ValueError, match="already holds"):
        kv.fork("p", "d", 4)
