"""The engine: tokenizer, scheduler, KV cache manager and model runner, driven one step at a time.

`add_request` validates and queues; `step` schedules, runs one forward over the whole batch, appends
the sampled tokens, applies stop conditions and returns the outputs of the requests that progressed.
The engine knows nothing of HTTP: the server drives it from its own thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvpool.core.events import KVCacheEvent
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import MambaSpec
from kvpool.core.pins import Pin, PinSet, PrefixNotCached
from kvpool.core.request import CacheRequest, MultiModalItem
from kvpool.core.stats import PrefixCacheStats
from kvpool.engine.chat_template import ChatOptions, load_chat_template, render_chat
from kvpool.engine.config import SERVING_MAX_NUM_BATCHED_TOKENS, EngineConfig, parse_size
from kvpool.engine.generation_defaults import read_defaults
from kvpool.engine.lora_request import LoRARegistry, LoRARequest
from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.engine.parallel_sampling import ParentRequest, child_id, child_params
from kvpool.engine.prompts import normalize_prompt
from kvpool.engine.request import Request, RequestStatus, check_prompt_length
from kvpool.engine.sampling_params import (
    MAX_BAD_WORD_SEQUENCES,
    MAX_BAD_WORD_TOKENS,
    SamplingParams,
    StructuredOutputsParams,
)
from kvpool.engine.scheduler import Scheduler, SchedulerOutput
from kvpool.engine.stage_outputs import StageOutputCollector
from kvpool.engine.stop import Detokenizer, StopChecker
from kvpool.engine.structured import Grammars
from kvpool.runner.image_inputs import ImageInputs
from kvpool.runner.model_files import resolve_model
from kvpool.runner.model_runner import ModelRunner, SeqStep
from kvpool.runner.multimodal import MMInput

log = logging.getLogger(__name__)


def _message_list(messages: Any) -> list[Any]:
    """A conversation as a list of messages (one message dict is a conversation of one); ValueError
    naming `messages` for anything else, or an empty one."""
    if isinstance(messages, dict):
        return [messages]
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages: a non-empty list of {'role': ..., 'content': ...} dicts")
    return list(messages)


def _model_json(model_dir: Path, name: str) -> dict[str, Any]:
    """A JSON file of the model folder ({} where there is none); ValueError naming one that is not JSON."""
    f = model_dir / name
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"model: {f} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _eos_ids(configs: Sequence[dict[str, Any]], tokenizer: Any = None) -> list[int]:
    """The tokens that end a request (unless `ignore_eos`): the model's `eos_token_id` (the first of
    `configs` naming one: generation config, else config) and the tokenizer's own EOS, as vLLM stops on both
    (a chat model whose configs name none would otherwise run past the end of its answer to `max_tokens`)."""
    ids: list[int] = []
    for data in configs:
        v = data.get("eos_token_id")
        if v is not None:
            ids += v if isinstance(v, list) else [v]
            break
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


@dataclass
class EngineStats:
    """A snapshot of the engine's load and its counters (totals since start)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    host_usage: float | None  # None: no host tier
    num_generation_tokens: int
    num_preemptions: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    bytes_per_block: int
    num_blocks: int
    num_pins: int
    num_pinned_blocks: int
    # The prompt-row cache (kvpool.runner.prompt_rows): prompt rows scored from it, and its bytes.
    prompt_rows_read: int = 0
    prompt_rows_bytes: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kw: Any) -> None:
        config = config or EngineConfig(**kw)
        config.validate()
        if config.max_num_batched_tokens is None:  # (LLM gives the offline default; a server has this one)
            config.max_num_batched_tokens = SERVING_MAX_NUM_BATCHED_TOKENS
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.tokenizer = None
        # A fast tokenizer may refuse concurrent use ("Already borrowed"); the server encodes on its
        # handler threads while the engine thread decodes.
        self._tokenizer_lock = threading.Lock()
        self._special_spaced: bool | None = None  # (`_spaces_special`)
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            except (OSError, ValueError) as e:  # (transformers' advice to install sentencepiece names neither)
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"model: {self.model_dir} has no tokenizer kvpool can load ({first}); add its "
                                 "tokenizer.json, or pass token ids with skip_tokenizer_init=True") from None
            if config.chat_template is not None:  # (in place of the model's, for every chat)
                self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.runner = ModelRunner(self.model_dir, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
                                  block_size=config.block_size,
                                  kv_cache_memory=config.kv_cache_bytes(), device=config.device,
                                  num_blocks=config.num_blocks, hybrid=config.hybrid_allocator,
                                  stage_outputs=config.stage_outputs, stage_output_layers=config.stage_output_layers,
                                  stage_output_cache=config.enable_prefix_caching,
                                  batch_invariant=config.batch_invariant, native_kernels=config.native_kernels,
                                  prompt_rows_bytes=config.prompt_rows_bytes() if config.enable_prefix_caching else 0)
        # LoRA adapters (kvpool.runner.lora): None when off
        self.loras = (LoRARegistry(self.runner.enable_lora(config.max_loras, config.max_lora_rank,
                                                           config.max_cpu_loras))
                      if config.enable_lora else None)
        bs = config.block_size
        asked = config.max_model_len
        if asked is not None and asked > self.runner.max_model_len:
            # (Quietly capping would leave a user who set it believing requests that long are served.)
            raise ValueError(f"max_model_len: {asked} is more than the model's context of {self.runner.max_model_len} "
                             "tokens")
        self.max_model_len = self._longest_fitting_request(asked or self.runner.max_model_len)
        if asked is not None and self.max_model_len < asked:
            # (Lowered, not refused: the pool's bound depends on the block size and the step budget, which a
            # caller sets beside it; a longer request is then refused with both numbers in its error.)
            log.warning("max_model_len: %d tokens, not %d: a request must fit the KV cache alone (%d blocks)",
                        self.max_model_len, asked, self.runner.num_blocks)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Unchunked, a prompt (or a preempted request's prompt and output) must fit one step, or it
            # would wait for ever: the longest request the engine takes is one step's budget.
            if config.max_model_len is not None:
                raise ValueError(f"max_num_batched_tokens: {config.max_num_batched_tokens} is less than max_model_len "
                                 f"({self.max_model_len}); without chunked prefill a request must fit one step "
                                 "(raise it, lower max_model_len, or set enable_chunked_prefill=True)")
            log.info("max_model_len: %d, one step's token budget (max_num_batched_tokens), as chunked prefill "
                     "is off", config.max_num_batched_tokens)
            self.max_model_len = config.max_num_batched_tokens
        num_host, swap_bytes = config.num_host_blocks, config.swap_space_bytes()
        if num_host is None and not config.enable_prefix_caching:
            if swap_bytes:
                raise ValueError("swap_space: the host tier keeps cached blocks, so it needs prefix caching "
                                 "(enable_prefix_caching=True), or set swap_space=0")
            num_host = 0
        elif num_host is None:
            num_host = self.runner.allocate_host_cache(swap_bytes)
            if swap_bytes and not num_host:
                raise ValueError(f"swap_space: {config.swap_space!r} holds no KV block "
                                 f"({self.runner.bytes_per_block} bytes each)")
        elif num_host:
            self.runner.allocate_host_cache(num_host * self.runner.host_bytes_per_block)
        has_state = any(isinstance(s, MambaSpec) for s in self.runner.kv_cache_specs)
        if has_state and config.state_retention_tokens % bs:  # (only state layers keep states)
            raise ValueError(f"state_retention_tokens: must be a multiple of block_size ({bs}) >= 0, "
                             f"got {config.state_retention_tokens}")
        self.kv = KVCacheManager(self.runner.num_blocks, bs, specs=self.runner.kv_cache_specs,
                                 enable_caching=config.enable_prefix_caching,
                                 enable_kv_events=config.enable_kv_events, num_host_blocks=num_host,
                                 host_eviction=config.host_eviction, write_through=config.write_through,
                                 page_sizes=self.runner.page_sizes, eviction_policy=config.eviction_policy,
                                 state_retention_interval=config.state_retention_tokens // bs,
                                 state_retention_budget=config.state_retention_budget)
        self.pins = PinSet(self.kv.block_pool, self._pin_budget_blocks(),
                           id_prefix=f"pin-{uuid.uuid4().hex[:8]}-")  # ids unique to this engine
        self._pins_lost: list[Pin] = []  # pins a failed step kept from being made again (tried at the next reset)
        self.kv.external_holders.append(self.pins.held_blocks)
        self.hasher = (BlockHasher(bs, config.hash_algo, config.hash_seed)
                       if config.enable_prefix_caching else None)
        self.detokenizer = (Detokenizer(self.tokenizer, self._tokenizer_lock)
                            if self.tokenizer is not None else None)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   stop_checker=StopChecker(self.detokenizer),
                                   max_loras=config.max_loras if config.enable_lora else 0)
        generation = _model_json(self.model_dir, "generation_config.json")
        self.eos_token_ids = _eos_ids([generation, _model_json(self.model_dir, "config.json")], self.tokenizer)
        # Structured outputs' constraints, compiled against the tokenizer (its first use builds llguidance's view
        # of the vocabulary).
        self.grammars = (Grammars(self.tokenizer, self.runner.num_logits, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        # The model's sampling defaults for fields a request leaves out (kvpool.engine.generation_defaults).
        self.sampling_defaults = read_defaults(generation, config.generation_config)
        self._generators: dict[str, torch.Generator] = {}
        # Requests with n > 1 in flight, by their id and by their sequences' (kvpool.engine.parallel_sampling).
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        # The model's own input processor: placeholder embeddings, or images read by cross-attention layers.
        self.mm = self.runner.make_input_processor(config.vision_encoder,
                                                   parse_size(config.encoder_cache_size, "encoder_cache_size"))
        # Pictures (decoded, e.g. by the HTTP server) into mm_inputs by the model's own image processor;
        # None: this engine takes no images, or only preprocessed ones through the Python API.
        token = getattr(self.mm, "image_token_id", None)
        self.images = ImageInputs.load(self.model_dir, token, self.tokenizer) if token is not None else None
        self.stage_outputs = StageOutputCollector(self.runner.stage_cache) if config.stage_outputs else None
        # The store tier below the host tier (kvpool.store): reads while a request waits, write-through
        # of sheltered blocks; all of its I/O on its own thread.
        self.store = None
        if config.kv_store:
            from kvpool.store.engine_store import EngineStore

            layout = self.runner.layout
            self.store = EngineStore(config.kv_store, self.kv, self.runner.host_kv_caches, self.model_dir, bs,
                                     deadline_s=config.kv_store_deadline_s, kv_layout=self.runner.kv_layout,
                                     host_pages=self.runner.host_pages, group_of_layer=layout.group_of_layer,
                                     tensor_of_layer=layout.tensor_of_layer,
                                     compute=str(self.runner.dtype).removeprefix("torch.")
                                     + ("+batch-invariant" if config.batch_invariant else ""),
                                     kv_events=config.enable_kv_events)

    def _pin_budget_blocks(self) -> int:
        """The blocks pinned prefixes may hold: `pin_budget` of the pool, but never so many that the longest
        request the engine accepts (`max_model_len`) could not fit beside them. Pinned blocks are never
        preempted, so such a request would wait forever, and every request queued behind it. None where pins
        are refused (prefix caching off, or several layer groups)."""
        if not self.config.enable_prefix_caching or len(self.runner.kv_cache_specs) != 1:
            return 0
        usable = self.runner.num_blocks - 1
        share = int(self.config.pin_budget * usable)
        room = usable - self._blocks_held(self.max_model_len)
        if room < share:
            log.info("pin budget: %d blocks, not %d (pin_budget %g): a %d-token request (max_model_len) holds %d "
                     "of the pool's %d; lower max_model_len to pin more", max(room, 0), share,
                     self.config.pin_budget, self.max_model_len, usable - room, usable)
        return max(0, min(share, room))

    def _blocks_held(self, n: int) -> int:
        """The pool blocks (large pages in a two-level pool) an n-token request holds at most, alone, over every
        KV cache group (sliding-window groups hold only their window)."""
        specs = self.runner.kv_cache_specs
        held = [s.max_blocks_held(n, self.config.max_num_batched_tokens) for s in specs]
        retention = self.config.state_retention_tokens if self.config.enable_prefix_caching else 0
        if retention:
            # States retained along the prompt are held until the request ends (see MambaManager).
            extra = min(self.config.state_retention_budget, n // retention)
            held = [h + extra if isinstance(s, MambaSpec) else h for h, s in zip(held, specs, strict=True)]
        page_sizes = self.runner.page_sizes
        if page_sizes is None:
            return sum(held)
        # Two-level pool: the blocks are large pages; each page size packs lcm / size pages in one.
        large = math.lcm(*page_sizes)
        by_size: dict[int, int] = {}
        for p, h in zip(page_sizes, held, strict=True):
            by_size[p] = by_size.get(p, 0) + h
        return sum(-(-h * p // large) for p, h in by_size.items())

    def _longest_fitting_request(self, limit: int) -> int:
        """A request must fit the pool alone, so it can always finish once the others are preempted: the
        longest that does."""
        usable = self.runner.num_blocks - 1  # block 0 is the null block
        lo, hi = 0, limit
        while lo < hi:  # the largest n <= limit that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._blocks_held(mid) <= usable else (lo, mid - 1)
        if lo < 2:
            raise ValueError(f"kv_cache_memory: {self.runner.num_blocks} blocks cannot hold even a 2-token request")
        return lo

    # -- pinned prefixes (kvpool.core.pins) ------------------------------------------------------------

    def pin_prefix(self, prompt: str | Sequence[int], *, ttl: float | None = None,
                   cache_salt: str | None = None) -> Pin:
        """Pin the cached full blocks of `prompt` for `ttl` seconds (None: until unpinned). Raises
        PrefixNotCached when some block is not cached (compute the prefix, then pin again; `LLM.pin_prefix`
        does both) and ValueError over the budget."""
        if not self.config.enable_prefix_caching or self.hasher is None:
            raise ValueError("pin_prefix: prefix caching is off")
        if self.kv.num_groups != 1:
            raise ValueError(f"pin_prefix: supported for models with one layer group (this one has "
                             f"{self.kv.num_groups})")
        prompt = normalize_prompt(prompt)
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise ValueError("pin_prefix: empty prompt")
        # What a request's prompt must satisfy: the prefix is computed as one when it is not cached, and
        # a prefix no request can reach is not worth the budget (checked before the budget, so the
        # answer says what is wrong with it, not that it does not fit).
        self._check_prompt_ids(ids)
        check_prompt_length(len(ids), self.max_model_len, "prefix")
        n_full = len(ids) // self.kv.block_size
        hashes = CacheRequest("pin", ids, hasher=self.hasher, cache_salt=cache_salt).block_hashes[:n_full]
        n_tokens = n_full * self.kv.block_size
        # (The tokens and salt go with the pin: a reset forgets its blocks, and they are computed again.)
        return self.pins.pin(hashes, now=time.monotonic(), ttl=ttl, num_tokens=n_tokens,
                             source=(tuple(ids[:n_tokens]), cache_salt))

    def _check_prompt_ids(self, ids: Sequence[int]) -> None:
        vocab = self.runner.num_embeddings  # special tokens (an image token) may follow the vocab
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab})")

    def unpin(self, pin_id: str) -> bool:
        lost = [p for p in self._pins_lost if p.pin_id != pin_id]
        if len(lost) < len(self._pins_lost):  # waiting to be made again: it will not be
            self._pins_lost = lost
            return True
        return self.pins.unpin(pin_id)

    def expire_pins(self) -> int:
        """Release expired pins now (steps do it too); the number of blocks still pinned."""
        self.pins.expire(time.monotonic())
        return self.pins.num_pinned_blocks

    # -- state, for the server and the async engine (call on the engine's thread) ----------------------

    def stats(self) -> EngineStats:
        """Totals since start and the current load (the async engine turns them into per-step deltas)."""
        kv, sched = self.kv, self.scheduler
        # (requests held for their store reads wait too: the load a router reads must count them)
        held = self.store.num_held() if self.store is not None else 0
        rows = self.runner.prompt_rows
        return EngineStats(num_running=len(sched.running), num_waiting=len(sched.waiting) + held, kv_usage=kv.usage,
                           host_usage=kv.host_pool.usage if kv.host_pool is not None else None,
                           num_generation_tokens=sched.stats.num_generation_tokens,
                           num_preemptions=sched.stats.num_preemptions,
                           num_blocks_swapped_out=kv.swap_stats.blocks_out,
                           num_blocks_swapped_in=kv.swap_stats.blocks_in,
                           bytes_per_block=self.runner.bytes_per_block, num_blocks=self.runner.num_blocks,
                           num_pins=len(self.pins), num_pinned_blocks=self.pins.num_pinned_blocks,
                           prompt_rows_read=rows.rows_read if rows is not None else 0,
                           prompt_rows_bytes=rows.nbytes if rows is not None else 0)

    @property
    def has_host_tier(self) -> bool:
        return self.kv.host_pool is not None

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix cache queries, hits and host hits (in tokens) since the last call (see PrefixCacheStats)."""
        return self.kv.take_prefix_cache_stats()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call (empty unless enable_kv_events): the tiers' own, then the
        blocks the store took (written on its own thread, so they may come a step or more after the host
        tier's event of the same block)."""
        events = self.kv.take_events()
        if self.store is not None:
            events += self.store.take_events()
        return events

    def has_kv_events(self) -> bool:
        """Events wait that no step would report: the store took blocks while the engine is idle."""
        return self.store is not None and self.store.has_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in every tier; refused (False), changing nothing, while requests run.
        Pinned prefixes stay pinned, under the same ids: forgotten with the rest and computed again (after
        new weights are loaded, a pin holds what the model computes now; with a store tier, what the store
        holds comes back from it, as for any request). Host-tier copies still owed are dropped with the
        blocks they were for."""
        if self.has_unfinished_requests():
            return False
        self._pin_again(self._forget_everything())
        return True

    def list_pins(self) -> list[Pin]:
        """The live pins (expired ones released first)."""
        self.expire_pins()
        return list(self.pins.pins.values())

    # -- LoRA adapters (kvpool.engine.lora_request) -----------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (else at its first request); ValueError if it cannot serve. Past
        max_cpu_loras, the least recently used idle adapter is unloaded (this adapter was checked and stays
        registered; it is read again when asked for). On the engine's thread, as every engine call."""
        self._register_lora(lora_request)
        self._unload_idle_loras()
        return True

    def _register_lora(self, lora_request: LoRARequest) -> None:
        """(any thread: a request being made registers its adapter, the engine thread alone unloads)"""
        if self.loras is None:
            raise ValueError("lora_request: LoRA is off; build the engine with enable_lora=True")
        self.loras.add(lora_request)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.loras is None else list(self.loras.requests.values())

    def remove_lora(self, lora: int | str) -> bool:
        """Unload an adapter (by its int id or its name), freeing its weights and its slot; False if no
        such adapter is loaded. Refused (ValueError) while requests of it are queued, running or held: they
        would lose their weights mid-flight. Its cached KV blocks stay, keyed by its name and files: added
        again from the same files, it hits them again."""
        if self.loras is None:
            return False
        name = self.loras.name_of(lora)
        if name is None:
            return False
        live = sum(r.lora_name == name for r in self._requests_in_flight())
        if live:
            raise ValueError(f"lora_request: adapter {name!r} has {live} requests in flight; remove it once they "
                             f"have finished (or abort them)")
        self.loras.remove(name)
        return True

    # -- requests --------------------------------------------------------------------------------------

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; pass token ids")
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as the token sequences the sampler bans, by vLLM's rule: each word (its leading spaces
        dropped) as it stands, and after a space where that makes a different first token of the same count
        (the word inside a text, for tokenizers that fold a space into the next word)."""
        if self.tokenizer is None:
            raise ValueError("bad_words: need the tokenizer (this engine was made with skip_tokenizer_init=True)")
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:  # (a word the tokenizer drops whole: nothing to ban)
                raise ValueError(f"bad_words: {word!r:.40} has no tokens")
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        if len(out) > MAX_BAD_WORD_SEQUENCES or sum(map(len, out)) > MAX_BAD_WORD_TOKENS:
            # (every step of the request matches them against its output's tail, on the engine's thread)
            raise ValueError(f"bad_words: at most {MAX_BAD_WORD_SEQUENCES} token sequences of "
                             f"{MAX_BAD_WORD_TOKENS} tokens in all, got {len(out)} of {sum(map(len, out))}")
        # (A word with a token past the LM head, an added token it never gives, can never be generated.)
        return tuple(w for w in out if max(w) < self.runner.num_logits)

    def grammars_compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether a structured output's constraint is compiled already (making its request costs little)."""
        return self.grammars is not None and self.grammars.compiled(params)

    def _spaces_special(self) -> bool:
        """Whether the tokenizer's decoder puts a space between two special tokens (then
        spaces_between_special_tokens=False would need a text of its own: refused). Asked once."""
        if self._special_spaced is None:
            tok = self.tokenizer
            ids = list(tok.all_special_ids[:2])
            with self._tokenizer_lock:
                joined = tok.decode(ids, skip_special_tokens=False)
            self._special_spaced = len(ids) == 2 and joined != "".join(tok.convert_ids_to_tokens(ids))
        return self._special_spaced

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (any of the model's vocabulary); ValueError naming `tokens` for others."""
        if self.tokenizer is None:
            raise ValueError("tokens: this engine has no tokenizer")
        n = len(self.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < n), None)
        if bad is not None:
            raise ValueError(f"tokens: {bad} is not a token id of this model (0 to {n - 1})")
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text decoded alone (what OpenAI's logprobs show as a token)."""
        with self._tokenizer_lock:
            return list(self.tokenizer.batch_decode([[t] for t in token_ids]))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own string in the vocabulary (vLLM's token_strs)."""
        with self._tokenizer_lock:
            return list(self.tokenizer.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            options: ChatOptions | None = None) -> list[int]:
        """The chat's token ids under the model's template; `options` (kvpool.engine.chat_template) over
        `add_generation_prompt`."""
        if self.tokenizer is None or not (getattr(self.tokenizer, "chat_template", None)
                                          or (options is not None and options.template)):
            raise ValueError("messages: this model has no chat template (give one: --chat-template, or "
                             "LLM(chat_template=...))")
        flat = []
        for i, m in enumerate(_message_list(messages)):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs a string 'role' and a 'content'")
            content = m["content"] if m["content"] is not None else ""  # (OpenAI's null content: an empty one)
            if m["role"] == "developer":
                m = {**m, "role": "system"}  # (OpenAI's newer name for a system message, which templates know)
            if isinstance(content, list):  # content parts
                if not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
                    raise ValueError(f"messages[{i}].content: parts are dicts with a 'type'")
                if all(p["type"] == "text" and isinstance(p.get("text"), str) for p in content):
                    # Text only: what every template reads, the parts a line apart (as vLLM joins them).
                    content = "\n".join(p["text"] for p in content)
                # (else image parts, for a template that places them: passed on as they are)
            elif not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: a string or a list of text parts, "
                                 f"got {type(content).__name__}")
            flat.append({**m, "content": content})
        messages = flat
        from jinja2 import TemplateError  # (transformers renders templates with jinja2)

        try:
            return render_chat(self.tokenizer, messages,
                               options or ChatOptions(add_generation_prompt=add_generation_prompt),
                               lock=self._tokenizer_lock, max_chars=max(1 << 20, 64 * self.max_model_len))
        except TemplateError as e:  # the template's own check (`raise_exception`): roles that must alternate
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None
        except ValueError as e:  # transformers' own (continue_final_message: a last message it cannot find)
            raise ValueError(f"messages: {e}") from None

    def chat_prefix(self, messages: list[dict[str, str]], template_kwargs: Mapping[str, Any] | None = None
                    ) -> list[int]:
        """The token ids that every chat starting with `messages` (a system prompt, few-shot turns) starts
        with: what to pin for them. Templates differ in where a system prompt goes (a turn of its own, or
        inside the first user turn), so this renders `messages` followed by two different next turns (a
        user's; an answer after a user's message) and keeps what the two renderings have in common.
        `template_kwargs`: the template variables the chats will be sent with (chat_template_kwargs)."""
        options = ChatOptions(template_kwargs=template_kwargs or {})
        messages = _message_list(messages)
        # The turn that follows: a user's, or after a user's message the answer (templates that check the
        # roles alternate refuse two user turns in a row).
        last = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        role = "assistant" if last == "user" else "user"
        a = self.apply_chat_template([*messages, {"role": role, "content": "A"}], options=options)
        b = self.apply_chat_template([*messages, {"role": role, "content": "Z"}], options=options)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its generation_config.json; vLLM's
        `get_default_sampling_params`)."""
        return SamplingParams(**self.sampling_defaults)

    def truncated_length(self, num_tokens: int, params: SamplingParams) -> int:
        """A prompt's length after `truncate_prompt_tokens` (its last k tokens; -1: what the context holds, one
        token left to generate); a k the context cannot hold is refused, as vLLM's."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return num_tokens
        if keep >= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: must be below the context's length ({self.max_model_len}; "
                             f"-1 keeps {self.max_model_len - 1}), got {keep}")
        return min(num_tokens, self.max_model_len - 1 if keep == -1 else keep)

    def make_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None, lora_id: int | str | None = None,
                     cache_salt: str | None = None, mm_items: Sequence[MultiModalItem] = (),
                     mm_inputs: Sequence[MMInput] = (), lora_request: LoRARequest | None = None) -> Request:
        """Validate, tokenize and hash a request without queueing it (safe off the engine's thread)."""
        params = self.default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.validate()  # again: the caller may have changed a field since it was made
        if params.logit_bias and max(params.logit_bias) >= self.runner.num_logits:
            raise ValueError(f"logit_bias: token ids must be in [0, {self.runner.num_logits}), got "
                             f"{max(params.logit_bias)}")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.runner.num_logits:
            raise ValueError(f"allowed_token_ids: token ids must be in [0, {self.runner.num_logits}), got "
                             f"{max(params.allowed_token_ids)}")
        if params.stop and self.detokenizer is None:
            raise ValueError("stop: stop strings need the tokenizer to read the output (this engine was made with "
                             "skip_tokenizer_init=True); use stop_token_ids")
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else ()
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs: need the tokenizer (this engine was made with "
                             "skip_tokenizer_init=True)")
        if (not params.spaces_between_special_tokens and not params.skip_special_tokens
                and self.tokenizer is not None and self._spaces_special()):
            raise ValueError("spaces_between_special_tokens: False is not supported with this model's tokenizer, "
                             "which puts a space between special tokens")
        prompt = normalize_prompt(prompt)
        lora_name = lora_content = None
        if lora_request is not None and lora_id is not None:
            raise ValueError("lora_request: give lora_request or lora_id, not both")
        if lora_id is not None:
            # An adapter registered before (add_lora, --lora-modules), by its name or int id: it runs. (A bare
            # cache key once ran the base model under the adapter's name.)
            name = None if self.loras is None else self.loras.name_of(lora_id)
            lora_request = None if name is None else self.loras.requests.get(name)  # type: ignore[union-attr]
            if lora_request is None:
                raise ValueError(f"lora_id: no adapter {lora_id!r} is registered (add_lora first, or pass "
                                 "lora_request)")
        if lora_request is not None:
            self._register_lora(lora_request)
            # Its blocks are hashed under the adapter's name and the digest of its files.
            lora_name = lora_id = lora_request.lora_name
            lora_content = self.loras.content_digest(lora_name)  # type: ignore[union-attr]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text: str | None = prompt
            ids = self.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if params.truncate_prompt_tokens is not None:
            if mm_inputs or mm_items:
                raise ValueError("truncate_prompt_tokens: not with images (it would cut their tokens)")
            keep = self.truncated_length(len(ids), params)
            if len(ids) > keep:  # (vLLM's: the prompt's last `keep` tokens; the text is no longer the prompt's)
                text, ids = None, ids[-keep:]
        self._check_prompt_ids(ids)
        rid = request_id
        if rid is None:
            rid = str(next(self._ids))
            while self._in_use(rid):  # (an id a caller chose, in use)
                rid = str(next(self._ids))
        if self._in_use(rid):  # checked before hashing the prompt
            raise ValueError(f"request_id: {rid!r} is already in use")
        if not isinstance(mm_inputs, list | tuple):
            raise ValueError(f"mm_inputs: a list of the prompt's inputs (LLM.generate: one list per prompt), got "
                             f"{type(mm_inputs).__name__}")
        prepared = self.mm.prepare_request(ids, mm_inputs, mm_items, cache_salt)
        if prepared is not None:
            mm_items = prepared.items
        if params.n > 1 and self.stage_outputs is not None:
            raise ValueError("n: the omni pipeline's stages run one sequence per prompt; n must be 1")

        def build(request_id: str, sp: SamplingParams) -> Request:
            r = Request(request_id, ids, sp, hasher=self.hasher, eos_token_ids=self.eos_token_ids,
                        max_model_len=self.max_model_len, lora_id=lora_id, lora_content=lora_content,
                        mm_items=mm_items, cache_salt=cache_salt, prompt=text,
                        num_encoder_tokens=prepared.num_encoder_tokens if prepared is not None else 0)
            r.mm_inputs = prepared
            r.lora_name = lora_name
            r.bad_words_ids = bad_words
            if sp.structured_outputs is not None:  # (each sequence its own: they take different tokens)
                r.grammar = self.grammars.grammar(sp.structured_outputs)  # type: ignore[union-attr]
            if sp.prompt_logprobs is not None:
                r.prompt_rows = self.runner.prompt_rows
            return r

        req = build(rid, params)
        if params.n > 1:
            req.children = [build(child_id(rid, i), child_params(params, i)) for i in range(params.n)]
        return req

    def _in_use(self, request_id: str) -> bool:
        """Whether a request with this id is queued, running, held for its store reads, or is (or is a
        sequence of) a request with n > 1 in flight."""
        return (request_id in self.scheduler.requests or request_id in self._parents
                or request_id in self._parent_of or (self.store is not None and self.store.is_held(request_id)))

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, lora_id: int | str | None = None,
                    cache_salt: str | None = None, mm_items: Sequence[MultiModalItem] = (),
                    mm_inputs: Sequence[MMInput] = (), lora_request: LoRARequest | None = None) -> Request:
        req = self.make_request(prompt, sampling_params, request_id=request_id, lora_id=lora_id,
                                cache_salt=cache_salt, mm_items=mm_items, mm_inputs=mm_inputs,
                                lora_request=lora_request)
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        """Hand a request made by `make_request` to the scheduler (after its store reads, if any); one with
        n > 1, its sequences."""
        if req.children:
            self._enqueue_parent(req)
            return
        if self._in_use(req.request_id):
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        if req.lora_name is not None and self.loras is not None:
            if self.loras.name_of(req.lora_name) is None:
                # (made on another thread while the adapter was removed on this one: its weights are gone)
                raise ValueError(f"lora_request: adapter {req.lora_name!r} was removed; add it again")
            self.loras.reload(req.lora_name)  # (unloaded since it was made: max_cpu_loras)
        seed = req.sampling_params.seed
        g = None
        if seed is not None:  # (before the request goes anywhere: nothing to undo if this fails)
            g = torch.Generator(device=self.runner.device)
            g.manual_seed(seed)
        if not self._held_for_store(req):
            self.scheduler.add_request(req)
        if g is not None:
            self._generators[req.request_id] = g
        if req.lora_name is not None:
            self._unload_idle_loras()

    def _enqueue_parent(self, req: Request) -> None:
        for rid in (req.request_id, *(c.request_id for c in req.children)):
            if self._in_use(rid):
                raise ValueError(f"request_id: {rid!r} is already in use")
        parent = ParentRequest(req.request_id, len(req.children))
        queued: list[str] = []
        try:
            for c in req.children:
                self.enqueue(c)
                queued.append(c.request_id)
        except BaseException:
            for rid in queued:  # all or none
                self._abort_one(rid)
            raise
        self._parents[parent.request_id] = parent
        for rid in parent.child_ids:
            self._parent_of[rid] = parent

    def _drop_parent(self, parent: ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for rid in parent.child_ids:
            self._parent_of.pop(rid, None)

    def _requests_in_flight(self) -> list[Request]:
        """Queued, running, or held for their store reads."""
        held = self.store.held_requests() if self.store is not None else []
        return [*self.scheduler.requests.values(), *held]

    def _unload_idle_loras(self) -> None:
        """Keep at most max_cpu_loras adapters loaded, unloading idle ones (on the engine thread: it alone
        knows which adapters the requests in flight need)."""
        if self.loras is not None and self.loras.manager.max_cpu_loras is not None:
            self.loras.manager.unload_idle({r.lora_name for r in self._requests_in_flight() if r.lora_name})

    def _held_for_store(self, req: Request) -> bool:
        """Whether the store tier holds the request for its reads. A fault in the store's code costs the
        request its store hit, never the request: it computes its blocks."""
        if self.store is None:
            return False
        try:
            return self.store.hold(req)
        except Exception:
            log.exception("KV store: holding request %s for its reads failed; it computes its blocks",
                          req.request_id)
            self.store.drop(req.request_id)
            return False

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its last output (finish_reason "abort"), or None if it
        is not running or waiting. A request with n > 1: every sequence of it."""
        parent = self._parents.get(request_id)
        if parent is not None:
            merged = None
            for rid in parent.child_ids:
                out = self._abort_one(rid)
                if out is not None:
                    merged = parent.merge(out)
            self._drop_parent(parent)
            return merged
        out = self._abort_one(request_id)
        parent = self._parent_of.get(request_id)
        if out is None or parent is None:
            return out
        merged = parent.merge(out)
        if merged.finished:
            self._drop_parent(parent)
        return merged

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        held = self.store.drop(request_id) if self.store is not None else None
        if held is not None:
            held.status = RequestStatus.FINISHED_ABORTED
            held.metrics.finished_time = time.time()
        stopped = req or held
        out = self._output(stopped) if stopped is not None else None
        self._forget(request_id)
        return out

    def recover(self, pin_again: bool = True) -> None:
        """After a step raised or was interrupted (an exception, Ctrl-C): abort every request, and forget
        every cached block. Blocks are cached when they are scheduled, before the forward writes them, so
        a step that did not finish may have left cached blocks half-written; a later request must never
        hit one (a wrong token). The engine then serves as a fresh one would, except that the pinned
        prefixes are computed and pinned again under their ids (`pin_again`; not after a Ctrl-C)."""
        saved = self._forget_everything()
        if pin_again:
            self._pin_again(saved)

    def _pin_cached(self, pin: Pin) -> bool:
        """Pin a released pin's blocks again, under its id and until its expiry (nothing if that has
        passed); False when they are not all cached."""
        now = time.monotonic()
        if pin.expires_at is not None and pin.expires_at <= now:
            return True
        try:
            self.pins.pin(pin.hashes, now=now, ttl=None if pin.expires_at is None else pin.expires_at - now,
                          num_tokens=pin.num_tokens, source=pin.source, pin_id=pin.pin_id, expires_at=pin.expires_at)
        except PrefixNotCached:
            return False
        return True

    def _forget_everything(self) -> list[Pin]:
        """Abort every request, release every pin and forget every cached block; the released pins (and
        those a failed `_pin_again` could not make: they are tried again with these)."""
        for rid in list(self.scheduler.requests):
            self.abort_request(rid)
        if self.store is not None:
            for rid in self.store.held_ids():
                self.abort_request(rid)
        self._parents.clear()
        self._parent_of.clear()
        saved, self._pins_lost = self._pins_lost + self.pins.clear(), []
        for _ in range(2):  # hand out the failed step's copies and the next one's: the host tier lets go
            self.kv.end_schedule_step()
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("the engine's cache could not be reset; create a new engine")
        if self.runner.prompt_rows is not None:  # (after new weights, the rows are the old model's)
            self.runner.prompt_rows.clear()
        return saved

    def _pin_again(self, saved: Sequence[Pin]) -> None:
        """Make `saved` pins again, with their ids and expiry, computing each prefix (a reset forgot its
        blocks). One at a time, so that each is pinned while its blocks are surely cached. With nothing
        else running (a reset waits for idle; a recovery aborted everything), these steps are the only
        ones. A step that fails here (or Ctrl-C) leaves half-written blocks again: everything is forgotten
        once more, and the pins not made wait for the next reset or recovery (logged) rather than being
        tried again in a loop; a pin that cannot be made for a reason of its own is dropped alone.
        These steps are the engine's own work, not traffic: the prefix-cache and token counters (and so
        `/metrics` and the hit rate a user reads) leave them out."""
        counted = replace(self.scheduler.stats)
        try:
            with self.kv.stats_paused():
                self._make_pins(saved)
        finally:
            self.scheduler.stats = counted

    def _make_pins(self, saved: Sequence[Pin]) -> None:
        for i, pin in enumerate(saved):
            try:
                if self._pin_cached(pin):
                    continue
                tokens, salt = pin.source  # type: ignore[misc]  # (set by pin_prefix)
                self.add_request(list(tokens), SamplingParams.greedy(1), cache_salt=salt)
            except Exception:  # this pin alone cannot be made (nothing ran): the others go on
                log.exception("pin %s could not be made again after the cache was reset; it is dropped",
                              pin.pin_id)
                continue
            try:
                while self.has_unfinished_requests():
                    self.step()
                if not self._pin_cached(pin):
                    raise PrefixNotCached(f"pin_prefix: {pin.pin_id}'s prefix was computed but not cached")
            except BaseException as e:  # a step failed (or Ctrl-C): half-written blocks again
                rest = [p for p in saved[i:] if p.expires_at is None or p.expires_at > time.monotonic()]
                log.error("a step failed while pinning prefixes again after a reset (%r); the cache is reset "
                          "once more, and %d pins wait for the next reset or recovery", e, len(rest))
                lost = rest + self._forget_everything()
                self._pins_lost = lost
                if not isinstance(e, Exception):
                    raise
                return

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.store is not None and self.store.num_held() > 0)

    # -- the step loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.store is not None:
            for req in self.store.pump():  # their store reads landed in host blocks (or timed out)
                self.scheduler.add_request(req)
        if self.pins.pins:
            self.pins.expire(time.monotonic())  # expired pins' blocks are evictable from this step on
        out = self.scheduler.schedule()
        if not out.scheduled:
            # Copies owed from the last step (write-through) still run: the host tier counts on them.
            self.runner.execute_swaps(out.swap_plan)
            if self.store is not None:
                self.store.after_swaps(out.swap_plan)
                if self.store.num_held():
                    time.sleep(0.001)  # only requests waiting on the store: do not spin the CPU
            return []
        steps = self._steps(out)
        timed = self.store is not None and self.store.times(out.scheduled)
        if timed:  # (on a GPU, the previous step's kernels must not be counted in this one)
            self.runner.synchronize()
            started, swaps = time.perf_counter(), self.runner.swap_seconds
        sampled = self.runner.execute(steps, out.swap_plan)
        if self.store is not None:
            if timed:
                self.runner.synchronize()
                compute = time.perf_counter() - started - (self.runner.swap_seconds - swaps)
                self.store.step_computed(compute, out.scheduled)
            self.store.after_swaps(out.swap_plan)
        if self.stage_outputs is not None:
            self.stage_outputs.collect(out, self.runner.last_outputs)
        progressed = self.scheduler.update_from_output(out, sampled)
        if self.runner.last_prompt_logprobs:
            for s in out.scheduled:
                scored = self.runner.last_prompt_logprobs.get(s.request.request_id)
                if scored is not None:
                    s.request.add_prompt_logprobs(*scored)
        if self.runner.last_logprobs:
            for req in progressed:
                if req.logprobs is not None:
                    req.logprobs.append(self.runner.last_logprobs[req.request_id])
        results = []
        merged: dict[str, RequestOutput] = {}  # n > 1: one output a step for each request, all its sequences
        for req in progressed:
            result = self._output(req)
            if req.status.finished:
                self._forget(req.request_id)
            parent = self._parent_of.get(req.request_id)
            if parent is None:
                results.append(result)
            else:
                merged[parent.request_id] = result = parent.merge(result)
                if result.finished:
                    self._drop_parent(parent)
        results.extend(merged.values())
        return results

    def _steps(self, out: SchedulerOutput) -> list[SeqStep]:
        steps = []
        for s in out.scheduled:
            req = s.request
            end = s.start_pos + s.num_new_tokens
            tables = s.block_ids
            steps.append(SeqStep(req.request_id, req.all_token_ids[s.start_pos:end], s.start_pos, tables[0],
                                 end == req.num_tokens, req.sampling_params, self._generators.get(req.request_id),
                                 tables if len(tables) > 1 else None, lora=req.lora_name,
                                 logprobs=req.sampling_params.logprobs,
                                 history=(req.all_token_ids, req.num_prompt_tokens)
                                 if end == req.num_tokens and req.sampling_params.penalized else None,
                                 banned=req.banned_tokens() if end == req.num_tokens else None,
                                 grammar=req.grammar.mask() if req.grammar is not None and end == req.num_tokens
                                 else None,
                                 prompt_logprobs=req.prompt_logprobs_step(s.start_pos, end)))
            if req.mm_inputs is not None:
                self.mm.step_inputs(steps[-1], req.num_preemptions, req.mm_inputs, s.start_pos, end)
        return steps

    def _output(self, req: Request) -> RequestOutput:
        # (the stop checker brought the text up to date when the token was appended)
        finished = req.status.finished
        reason = req.status.value if finished else None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.all_token_ids[:req.num_prompt_tokens],
            outputs=[CompletionOutput(0, req.output_text, list(req.output_token_ids), reason,
                                      req.stop_reason if finished else None,
                                      list(req.logprobs) if req.logprobs is not None else None)],
            finished=finished, num_cached_tokens=req.metrics.num_cached_tokens, metrics=req.metrics,
            # (complete before the first token; never changed after: the list itself, not a copy)
            prompt_logprobs=req.prompt_logprobs if not req.scoring_prompt else None,
            stage_outputs=self.stage_outputs.take(req.request_id) if finished and self.stage_outputs else None)

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.detokenizer is not None:
            self.detokenizer.forget(request_id)
        self.mm.forget(request_id)
        if self.stage_outputs is not None:
            self.stage_outputs.forget(request_id)
