"""The block pool and per-request block tables (bookkeeping only, no tensors).

A request's KV lives in fixed-size blocks; its block table lists them in order.
Blocks are only ever added (as the request grows, lookahead slots included) or
all freed at once (finish, abort, preemption): rejecting draft tokens frees
nothing, their slots are overwritten by later tokens.
"""
from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total; all or nothing."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        for _ in range(max(missing, 0)):
            table.append(self._free.popleft())
        return True

    def free(self, request_id: str) -> None:
        for block in self._tables.pop(request_id, []):
            self._free.append(block)

    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)
