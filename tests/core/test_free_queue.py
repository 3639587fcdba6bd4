from __future__ import annotations

import pytest

from kvpool.core.block import KVCacheBlock
from kvpool.core.free_queue import FreeBlockQueue


def blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def test_starts_in_given_order_and_pops_from_head() -> None:
    b = blocks(5)
    q = FreeBlockQueue(b)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft() is b[0]
    assert q.popleft_n(2) == [b[1], b[2]]
    assert q.block_ids() == [3, 4] and len(q) == 2


def test_remove_from_middle_and_ends() -> None:
    b = blocks(5)
    q = FreeBlockQueue(b)
    q.remove(b[2])
    q.remove(b[0])
    q.remove(b[4])
    assert q.block_ids() == [1, 3]
    assert b[2].prev_free is None and b[2].next_free is None
    assert b[2] not in q and b[1] in q
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b[2])


def test_append_goes_to_tail_appendleft_to_head() -> None:
    b = blocks(4)
    q = FreeBlockQueue(b[:2])
    q.append(b[2])
    q.appendleft(b[3])
    assert q.block_ids() == [3, 0, 1, 2]


def test_popping_more_than_free_raises_and_changes_nothing() -> None:
    b = blocks(2)
    q = FreeBlockQueue(b)
    with pytest.raises(ValueError, match="only 2 left"):
        q.popleft_n(3)
    assert q.block_ids() == [0, 1]
    q.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_operations_do_not_scan_the_list() -> None:
    # O(1): removing the middle of a 200k-block queue touches only its neighbours' links.
    b = blocks(200_000)
    q = FreeBlockQueue(b)
    mid = b[100_000]
    q.remove(mid)
    assert b[99_999].next_free is b[100_001] and b[100_001].prev_free is b[99_999]
    q.append(mid)
    assert q.block_ids()[-1] == 100_000 and len(q) == 200_000
