"""What the cache manager needs to know about a request: its tokens, its block hashes, its extra keys.

The engine's `Request` extends `CacheRequest` with sampling state; the core never sees more than this.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.core.hashing import BlockHasher


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input occupying `length` placeholder tokens from prompt position `offset`."""

    content_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.content_hash:
            raise ValueError("mm_items: content_hash must be a non-empty string")
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"mm_items: bad placement offset={self.offset} length={self.length}")


def token_array(token_ids: Sequence[int], field: str = "prompt_token_ids") -> array:
    """Token ids as a uint32 array, rejecting what no tokenizer produces (negatives, floats, > 2**32-1)."""
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"{field}: every token id must be an int in [0, 2**32): {e}") from None


class CacheRequest:
    """A request as the KV cache manager sees it.

    `block_hashes[i]` is the hash of full block i; it grows incrementally as tokens are appended,
    and no block is ever hashed twice. `num_computed_tokens` is owned by the scheduler.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hasher: BlockHasher | None = None,
        lora_id: int | str | None = None,
        lora_content: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
        num_encoder_tokens: int = 0,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids: the prompt must hold at least one token")
        buf = token_array(prompt_token_ids)
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        # Blocks of the longest prefix any layer group had cached at lookup: evidence that other requests
        # share this prefix, which hybrid managers keep for later hits even when the hit itself was cut.
        self.shared_prefix_blocks = 0
        # Freed by preemption before (it resumes): its admissions are counted apart in the prefix stats.
        self.preempted = False
        self.block_hashes: list[bytes] = []
        self.lora_id = lora_id
        # The adapter's content digest, hashed with its name: a name that later (another replica, a
        # restart: a store outlives both) stands for other weights never shares blocks with this one.
        self.lora_content = lora_content
        self.mm_items = tuple(sorted(mm_items, key=lambda m: m.offset))
        for m in self.mm_items:
            if m.offset + m.length > self.num_prompt_tokens:
                raise ValueError(
                    f"mm_items: item at offset {m.offset} with length {m.length} runs past the prompt "
                    f"({self.num_prompt_tokens} tokens)"
                )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt: must be a string")
        self.cache_salt = cache_salt or None
        if not isinstance(num_encoder_tokens, int) or isinstance(num_encoder_tokens, bool) or num_encoder_tokens < 0:
            raise ValueError(f"num_encoder_tokens: must be an int >= 0, got {num_encoder_tokens!r}")
        # Tokens the encoder produces for this request (image tokens for mllama): cross-attention
        # layers keep KV for these, not for the text.
        self.num_encoder_tokens = num_encoder_tokens
        self.has_extra_keys = lora_id is not None or bool(self.mm_items) or self.cache_salt is not None
        self.hasher = hasher
        if hasher is not None:
            hasher.extend(self, buf)

    @property
    def max_hit_blocks(self) -> int | None:
        """The most blocks its prefix hit may take (None: no limit): fewer for a request that needs prompt
        positions' outputs the KV cache does not hold (its prompt's log-probabilities). Its blocks are
        cached all the same."""
        return None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        hasher = self.hasher
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            hasher.extend(self)
