"""The prompt-row cache (kvpool.runner.prompt_rows): complete entries only, rows in order, the first
writer's rows kept, least recently used out past its bytes."""

from __future__ import annotations

import pytest
import torch

from kvpool.runner.prompt_rows import PromptRowCache

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
    assert c.read([b"a"])[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0]
    c.write(b"b", 1, rows(3, 5.0))  # (no entry: rows not from its start are not kept)
    assert len(c) == 1 and c.rows_written == 4


def test_prefix_stops_at_the_first_missing_block() -> None:
    c = PromptRowCache(10 * ROW_BYTES, BS)
    for h in (b"a", b"c"):
        c.write(h, 0, rows(BS, 1.0))
    assert c.complete_prefix([b"a", b"b", b"c"]) == 1
    assert c.read([b"a", b"c"]).shape == (2 * BS, H)


def test_least_recently_used_goes_first_past_the_bytes() -> None:
    c = PromptRowCache(2 * ROW_BYTES, BS)
    c.write(b"a", 0, rows(BS, 1.0))
    c.write(b"b", 0, rows(BS, 2.0))
    c.read([b"a"])  # a is used: b is now the oldest
    c.write(b"c", 0, rows(BS, 3.0))
    assert c.complete_prefix([b"a"]) == 1 and c.complete_prefix([b"b"]) == 0 and c.complete_prefix([b"c"]) == 1
    assert c.nbytes == 2 * ROW_BYTES
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


def test_zero_bytes_keeps_nothing_and_bad_rows_are_refused() -> None:
    c = PromptRowCache(0, BS)
    c.write(b"a", 0, rows(BS, 1.0))
    assert len(c) == 0
    with pytest.raises(ValueError, match="do not fit"):
        PromptRowCache(ROW_BYTES, BS).write(b"a", 2, rows(3, 1.0))
    with pytest.raises(ValueError, match="prompt_rows_bytes"):
        PromptRowCache(-1, BS)
