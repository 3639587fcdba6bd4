"""The free block queue: an intrusive doubly linked list of blocks whose ref count is 0.

Its order is the eviction order: new blocks are taken from the head. Freed blocks that hold cached
content go to the tail (least recently used first); freed blocks with nothing cached go to the head,
so they are reused before any cached block is evicted. A prefix hit on a free block removes it from
the middle. All operations are O(1) per block and allocate nothing: the links live on the blocks.

This queue is also the LRU eviction policy (`kvpool.core.eviction`): the operations below are that
contract, which every policy implements.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvpool.core.block import KVCacheBlock


class FreeBlockQueue:
    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels avoid every None check on the hot path.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks left")
        nxt = first.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head  # type: ignore[union-attr]
        first.prev_free = first.next_free = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        cur = self._head.next_free
        for _ in range(n):
            out.append(cur)
            nxt = cur.next_free  # type: ignore[union-attr]
            cur.prev_free = cur.next_free = None  # type: ignore[union-attr]
            cur = nxt
        self._head.next_free = cur
        cur.prev_free = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        first.prev_free = block  # type: ignore[union-attr]
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append blocks at the tail in the given order (the first given is evicted first of them)."""
        for b in blocks:
            self.append(b)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head as one batch in the given order: afterwards the first given is the
        next one taken (vLLM's order; inserting them one by one at the head would reverse them)."""
        if not blocks:
            return
        first = self._head.next_free
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = first
        first.prev_free = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        cur = self._head.next_free
        while cur is not self._tail and cur is not None:
            yield cur
            cur = cur.next_free

    def __contains__(self, block: object) -> bool:
        return isinstance(block, KVCacheBlock) and block.prev_free is not None

    def block_ids(self) -> list[int]:
        """Block ids from head (next evicted) to tail; for tests and debugging."""
        return [b.block_id for b in self]
