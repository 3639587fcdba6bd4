"""An engine request: the cache's view of it (`CacheRequest`) plus sampling state, status and timings."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.core.hashing import BlockHasher
from kvpool.core.request import CacheRequest, MultiModalItem
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.structured import Grammar
from kvpool.runner.prompt_rows import PromptLogprobsStep, PromptRowCache
from kvpool.runner.sampler import TokenLogprobs


def check_prompt_length(num_tokens: int, max_model_len: int, what: str = "prompt") -> None:
    """A prompt (or a prefix to pin, which is computed as one) must leave the context room for one token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt_token_ids: the {what} has {num_tokens} tokens; the context holds "
                         f"{max_model_len}, and one must be left to generate")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_host_cached_tokens: int = 0  # of those, tokens copied in from the host tier

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Request(CacheRequest):
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                 hasher: BlockHasher | None = None, eos_token_ids: Sequence[int] = (),
                 max_model_len: int | None = None, lora_id: int | str | None = None,
                 lora_content: str | None = None, mm_items: Sequence[MultiModalItem] = (),
                 cache_salt: str | None = None, prompt: str | None = None, arrival_time: float | None = None,
                 num_encoder_tokens: int = 0) -> None:
        super().__init__(request_id, prompt_token_ids, hasher=hasher, lora_id=lora_id, lora_content=lora_content,
                         mm_items=mm_items, cache_salt=cache_salt, num_encoder_tokens=num_encoder_tokens)
        self.sampling_params = sampling_params
        self.prompt = prompt
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        mt = sampling_params.max_tokens
        if max_model_len is not None:
            check_prompt_length(self.num_prompt_tokens, max_model_len)
            room = max_model_len - self.num_prompt_tokens
            if mt is not None and mt > room:
                raise ValueError(f"max_tokens: {mt} new tokens after a {self.num_prompt_tokens}-token prompt "
                                 f"exceed the context of {max_model_len} tokens (at most {room})")
            mt = room if mt is None else mt
        if mt is None:
            raise ValueError("max_tokens: None (until the context is full) needs a known max_model_len")
        if sampling_params.min_tokens > mt:  # (max_tokens None: the room left, as vLLM fills it in)
            raise ValueError(f"min_tokens: must be <= max_tokens ({mt}: the context's room after the prompt), got "
                             f"{sampling_params.min_tokens}")
        self.max_tokens: int = mt
        self.stop_reason: int | str | None = None
        self.stopped_by_token = False  # its last token is a stop token (EOS or stop_token_ids)
        self.output_text = ""
        self.mm_inputs: Any = None  # its validated multimodal inputs (kvpool.runner.multimodal.PreparedInputs)
        self.lora_name: str | None = None  # the LoRA adapter it runs with (kvpool.engine.lora_request)
        self.lora_waits = 0  # steps the scheduler passed it over for its adapter (max_loras)
        # n > 1: the requests that run it, one per sequence (kvpool.engine.parallel_sampling); this one,
        # their template, is never scheduled itself.
        self.children: list[Request] = []
        # Each output token's log-probabilities, when the request asks for them (SamplingParams.logprobs).
        self.logprobs: list[TokenLogprobs] | None = [] if sampling_params.logprobs is not None else None
        # ... and each prompt token's (SamplingParams.prompt_logprobs): None for the first (nothing precedes
        # it), then filled as its rows are computed.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        # The engine's prompt-row cache, for such a request (None: no prefix hit until it has them all).
        self.prompt_rows: PromptRowCache | None = None
        self._stop_tokens = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            self._stop_tokens.update(eos_token_ids)
        # Its bad_words as token sequences (the engine tokenizes them: `bad_words_token_ids`).
        self.bad_words_ids: tuple[tuple[int, ...], ...] = ()
        # Its structured output's constraint, advanced by each token it takes (kvpool.engine.structured).
        self.grammar: Grammar | None = None

    @property
    def scoring_prompt(self) -> bool:
        """Whether it still needs some of its prompt's log-probabilities."""
        p = self.prompt_logprobs
        return p is not None and len(p) < self.num_prompt_tokens

    @property
    def max_hit_blocks(self) -> int | None:
        """A cached block holds keys and values, not logits: while it needs its prompt's log-probabilities, a
        request hits only the blocks whose last hidden states the prompt-row cache holds (none without one:
        it computes its prompt whole, as vLLM's). Once it has them (a preempted request resuming), any."""
        if not self.scoring_prompt:
            return None
        rows = self.prompt_rows
        return 0 if rows is None else rows.complete_prefix(self.prompt_blocks())

    def prompt_blocks(self, start: int = 0) -> list[bytes]:
        """The hashes of its full prompt blocks, from the one holding position `start` on, in the prompt-row
        cache's blocks (none without one)."""
        bs = self.prompt_rows.block_size if self.prompt_rows is not None else 0
        return self.block_hashes[start // bs:self.num_prompt_tokens // bs] if bs else []

    def prompt_logprobs_step(self, start: int, end: int) -> PromptLogprobsStep | None:
        """What the runner does for its prompt's log-probabilities when it computes positions [start, end)
        (PromptLogprobsStep); None when it needs none. Rows it lacks before `start` (a prefix hit) come from
        the prompt-row cache; rows it has already (a request preempted mid-prompt computes them again) are
        scored again and `add_prompt_logprobs` keeps the first."""
        if not self.scoring_prompt:
            return None
        p = self.prompt_logprobs
        assert p is not None
        n_prompt = self.num_prompt_tokens
        first = min(start, len(p) - 1)  # (the first row not scored yet, or this step's first)
        read: list[bytes] = []
        if first < start:
            bs = self.prompt_rows.block_size if self.prompt_rows is not None else 0
            if not bs or start % bs:
                raise RuntimeError(f"{self.request_id}: positions before {start} are neither scored nor cached")
            first -= first % bs
            read = self.block_hashes[first // bs:start // bs]
        write: list[tuple[bytes, int]] = []
        chain: list[bytes] = []
        if self.prompt_rows is not None:
            bs = self.prompt_rows.block_size
            write = [(self.block_hashes[i], i * bs) for i in range(start // bs, min(-(-end // bs), n_prompt // bs))]
            chain = self.block_hashes[:min(end, n_prompt) // bs]
        targets = self.all_token_ids[first + 1:min(end, n_prompt - 1) + 1] if first < n_prompt - 1 else []
        return PromptLogprobsStep(self.sampling_params.prompt_logprobs, first, targets, read, write,  # type: ignore[arg-type]
                                  chain)

    def add_prompt_logprobs(self, start: int, rows: Sequence[TokenLogprobs]) -> None:
        """Rows computed from position `start` on: entry start + 1 + j is row j's."""
        p = self.prompt_logprobs
        if p is None:
            return
        have = len(p) - (start + 1)  # (rows already kept, from an earlier computation of these positions)
        if have < 0:
            raise RuntimeError(f"{self.request_id}: prompt rows from position {start} skip entries up to {len(p)}")
        p.extend(rows[have:])

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end it: EOS (unless ignore_eos) and its stop_token_ids."""
        return frozenset(self._stop_tokens)

    @property
    def stop_tokens_banned(self) -> bool:
        """Whether its next token must not be a stop token (min_tokens not reached)."""
        return self.num_output_tokens < self.sampling_params.min_tokens

    def banned_tokens(self) -> list[int] | None:
        """The tokens its next token must not be (sorted; None: any may be): its stop tokens before min_tokens,
        and each bad word's last token where the output ends with the word's other tokens (vLLM's rule: the
        output's tokens only, not the prompt's)."""
        stops = self.stop_tokens_banned
        if not stops and not self.bad_words_ids:
            return None  # (the common case: every decode step asks)
        ban = set(self._stop_tokens) if stops else set()
        if self.bad_words_ids:
            out = self.all_token_ids
            n_out = self.num_output_tokens
            for word in self.bad_words_ids:
                k = len(word) - 1
                # (the output's last token first: most words fail there, without a slice)
                if k == 0 or (k <= n_out and out[-1] == word[k - 1] and tuple(out[len(out) - k:]) == word[:k]):
                    ban.add(word[-1])
        return sorted(ban) or None

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        super().append_output_token_ids(token_ids)
        if self.grammar is not None:
            for t in [token_ids] if isinstance(token_ids, int) else token_ids:
                self.grammar.accept(t)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def check_stop_token(self) -> bool:
        """After a token is appended: finished by a stop token or the length limit?"""
        last = self.all_token_ids[-1]
        # (no stop token ends it before min_tokens, as vLLM's: the sampler bans them, unless the ban would
        # leave nothing to draw, e.g. allowed_token_ids that are all stop tokens)
        if last in self._stop_tokens and self.num_output_tokens >= self.sampling_params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            # vLLM's stop_reason: the token when it is one of the request's stop_token_ids; None for EOS.
            self.stop_reason = last if last in self.sampling_params.stop_token_ids else None
            self.stopped_by_token = True
            return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
