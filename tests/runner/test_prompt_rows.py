"""The prompt-row cache (kvpool.runner.prompt_rows): complete entries only, rows in order, the first
writer's rows kept, least recently used out past its bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.runner.prompt_rows import PromptRowCache
from kvpool.runner.sampler import TokenLogprobs

BS, H = 4, 3
ROW_BYTES = BS * H * 4  # one entry, float32


def rows(n: int, v: float) -> torch.Tensor:
    return torch.full((n, H), v)


def test_an_entry_is_usable_once_every_row_is_in() -> None:
    c = PromptRowCache(10 * ROW_BYTES, BS)
    c.write(b"a", 0, rows(3, 1.0))
    assert c.complete_prefix([b"a"]) == 0
    with pytest.raises(KeyError, match="incomplete"):
        c.read([b"a"])
    c.write(b"a", 2, rows(2, 2.0))  # (row 2 again: the first writer's stays)
    assert c.complete_prefix([b"a", b"b"]) == 1
    assert c.read([b"a"])[0].rows[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0]
    c.write(b"b", 1, rows(3, 5.0))  # (no entry: rows not from its start are not kept)
    assert len(c) == 1 and c.rows_written == 4


def test_prefix_stops_at_the_first_missing_block() -> None:
    c = PromptRowCache(10 * ROW_BYTES, BS)
    for h in (b"a", b"c"):
        c.write(h, 0, rows(BS, 1.0))
    assert c.complete_prefix([b"a", b"b", b"c"]) == 1
    assert [b.rows.shape for b in c.read([b"a", b"c"])] == [(BS, H), (BS, H)]


def test_least_recently_touched_goes_first_past_the_bytes() -> None:
    c = PromptRowCache(2 * ROW_BYTES, BS, entry_bytes=ROW_BYTES)
    c.write(b"a", 0, rows(BS, 1.0))
    c.write(b"b", 0, rows(BS, 2.0))
    c.touch([b"a", b"x"])  # a is used (x is not there): b is now the oldest
    c.write(b"c", 0, rows(BS, 3.0))
    assert c.nbytes == 3 * ROW_BYTES  # (over the bytes until the step's end)
    c.shrink()
    assert c.complete_prefix([b"a"]) == 1 and c.complete_prefix([b"b"]) == 0 and c.complete_prefix([b"c"]) == 1
    assert c.nbytes == 2 * ROW_BYTES and c.fits(2) and not c.fits(3)
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


def test_two_prompts_that_do_not_both_fit_keep_the_head_of_the_older() -> None:
    """Touched tail first after each step, a prompt loses its last blocks first: the older prompt keeps its
    first block (a hit of one block), the newer one is whole."""
    c = PromptRowCache(4 * ROW_BYTES, BS, entry_bytes=ROW_BYTES)
    for chain in ([b"a1", b"a2", b"a3"], [b"b1", b"b2", b"b3"]):
        for h in chain:
            c.write(h, 0, rows(BS, 1.0))
        c.touch(chain[::-1])
        c.shrink()
    assert c.complete_prefix([b"a1", b"a2", b"a3"]) == 1 and c.complete_prefix([b"b1", b"b2", b"b3"]) == 3


def test_zero_bytes_keeps_nothing_and_bad_rows_are_refused() -> None:
    c = PromptRowCache(0, BS)
    c.write(b"a", 0, rows(BS, 1.0))
    assert len(c) == 0
    with pytest.raises(ValueError, match="do not fit"):
        PromptRowCache(ROW_BYTES, BS).write(b"a", 2, rows(3, 1.0))
    with pytest.raises(ValueError, match="prompt_rows_bytes"):
        PromptRowCache(-1, BS)


def score(t: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(t, -float(t), tuple((i, -float(i)) for i in range(k)), t)


def test_the_scores_of_all_but_the_last_row_are_kept_and_cut_to_the_k_asked() -> None:
    c = PromptRowCache(10 * ROW_BYTES, BS)
    c.write(b"a", 0, rows(2, 1.0), [score(1, 3), score(2, 3)], k=3)
    c.write(b"a", 2, rows(2, 1.0), [score(3, 3), score(4, 3)], k=3)  # (row 3's score is not the block's)
    [block] = c.read([b"a"])
    assert block.k == 3 and [t.token_id for t in block.scores] == [1, 2, 3]  # type: ignore[union-attr]
    assert [len(t.top) for t in block.scores_for(1)] == [1, 1, 1]  # type: ignore[union-attr, arg-type]
    assert block.scores_for(1)[0].rank == 1 and block.scores_for(4) is None  # type: ignore[index, union-attr]
    # A row without a score (its writer had none): the block's rows are scored again.
    c.write(b"b", 0, rows(BS, 1.0), [score(1, 1), None, score(3, 1), None], k=1)
    assert c.read([b"b"])[0].scores is None
    # Two writers: the scores hold the smaller top count.
    c.write(b"c", 0, rows(1, 1.0), [score(1, 5)], k=5)
    c.write(b"c", 0, rows(BS, 2.0), [score(i, 2) for i in range(1, 5)], k=2)
    [c_block] = c.read([b"c"])
    assert c_block.k == 2 and c_block.scores[0].top == score(1, 5).top  # type: ignore[index, union-attr]
    assert c_block.rows[:, 0].tolist() == [1.0, 2.0, 2.0, 2.0]






@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5), st.lists(st.tuples(st.integers(0, 5), st.integers(0, BS - 1), st.integers(1, BS)),
                                   max_size=40))
def test_whatever_the_writes_complete_entries_hold_their_own_rows(capacity: int, writes) -> None:
    """Writers that compute a block front to back, in any interleaving, over a cache of 0-5 entries: the bytes
    stay within the capacity and are the entries' own, and a complete entry's rows are its block's."""
    c = PromptRowCache(capacity * ROW_BYTES, BS)

    def truth(h: int, a: int, b: int) -> torch.Tensor:
        return torch.arange(a, b, dtype=torch.float32)[:, None] + 100.0 * h + torch.zeros(1, H)

    for h, offset, n in writes:
        n = min(n, BS - offset)
        c.write(bytes([h]), offset, truth(h, offset, offset + n))
        c.touch([bytes([h])])
        c.shrink()
        assert c.nbytes <= c.capacity_bytes and c.nbytes == len(c) * ROW_BYTES
        done = [bytes([x]) for x in range(6) if c.complete_prefix([bytes([x])])]
        for block, key in zip(c.read(done), done, strict=True):
            assert torch.equal(block.rows, truth(key[0], 0, BS))
