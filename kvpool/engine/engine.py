"""The engine: tokenizer, scheduler, KV cache manager and model runner, driven one step at a time.

`add_request` validates and queues; `step` schedules, runs one forward over the whole batch, appends
the sampled tokens, applies stop conditions and returns the outputs of the requests that progressed.
The engine knows nothing of HTTP: the server drives it from its own thread.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.request import MultiModalItem
from kvpool.engine.config import EngineConfig, parse_size
from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.engine.request import Request, RequestStatus
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerOutput
from kvpool.engine.stage_outputs import StageOutputCollector
from kvpool.runner.model_files import resolve_model
from kvpool.runner.model_runner import ModelRunner, SeqStep
from kvpool.runner.multimodal import MMInput, MultiModalProcessor, PlacedInput

log = logging.getLogger(__name__)


def _eos_ids(model_dir: Any) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            if v is not None:
                ids += v if isinstance(v, list) else [v]
                break
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kw: Any) -> None:
        config = config or EngineConfig(**kw)
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.runner = ModelRunner(self.model_dir, dtype=config.dtype, block_size=config.block_size,
                                  kv_cache_memory=config.kv_cache_bytes(), device=config.device,
                                  num_blocks=config.num_blocks, stage_outputs=config.stage_outputs,
                                  stage_output_layers=config.stage_output_layers,
                                  stage_output_cache=config.enable_prefix_caching,
                                  batch_invariant=config.batch_invariant)
        bs = config.block_size
        # A request must fit the pool alone, so it can always finish once the others are preempted.
        capacity = (self.runner.num_blocks - 1) * bs
        self.max_model_len = min(config.max_model_len or self.runner.max_model_len, self.runner.max_model_len,
                                 capacity)
        num_host = config.num_host_blocks
        if num_host is None:
            num_host = self.runner.allocate_host_cache(config.swap_space_bytes())
        elif num_host:
            self.runner.allocate_host_cache(num_host * self.runner.bytes_per_block)
        self.kv = KVCacheManager(self.runner.num_blocks, bs, enable_caching=config.enable_prefix_caching,
                                 enable_kv_events=config.enable_kv_events, num_host_blocks=num_host,
                                 host_eviction=config.host_eviction, write_through=config.write_through)
        self.hasher = (BlockHasher(bs, config.hash_algo, config.hash_seed)
                       if config.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.eos_token_ids = _eos_ids(self.model_dir)
        self._generators: dict[str, torch.Generator] = {}
        self._ids = itertools.count()
        self.mm = MultiModalProcessor(self.runner.arch.hidden_size, config.vision_encoder,
                                      parse_size(config.encoder_cache_size, "encoder_cache_size"))
        self._mm_inputs: dict[str, list[PlacedInput]] = {}
        self.stage_outputs = (StageOutputCollector(self.runner.stage_cache, lambda rid: self.kv.get_block_ids(rid)[0])
                              if config.stage_outputs else None)

    # -- requests --------------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; pass token ids")
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("messages: each message needs a 'role' and a 'content'")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, lora_id: int | str | None = None,
                    cache_salt: str | None = None, mm_items: Sequence[MultiModalItem] = (),
                    mm_inputs: Sequence[MMInput] = ()) -> Request:
        params = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text: str | None = prompt
            ids = self.encode(prompt)
        else:
            text, ids = None, list(prompt)
        vocab = self.runner.arch.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab})")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.scheduler.requests:  # checked before hashing the prompt
            raise ValueError(f"request_id: {rid!r} is already in use")
        placed: list[PlacedInput] = []
        if mm_inputs:
            if mm_items:
                raise ValueError("mm_inputs: give mm_inputs (content) or mm_items (hashes only), not both")
            placed = self.mm.prepare(mm_inputs, len(ids))
            mm_items = [p.item for p in placed]
        req = Request(rid, ids, params, hasher=self.hasher, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, lora_id=lora_id, mm_items=mm_items,
                      cache_salt=cache_salt, prompt=text)
        if params.seed is not None:
            g = torch.Generator(device=self.runner.device)
            g.manual_seed(params.seed)
            self._generators[rid] = g
        self.scheduler.add_request(req)
        if placed:
            self._mm_inputs[rid] = placed
        return req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not running or waiting."""
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return req is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            # Copies owed from the last step (write-through) still run: the host tier counts on them.
            self.runner.execute_swaps(out.swap_plan)
            return []
        sampled = self.runner.execute(self._steps(out), out.swap_plan)
        if self.stage_outputs is not None:
            self.stage_outputs.collect(out, self.runner.last_outputs)
        progressed = self.scheduler.update_from_output(out, sampled)
        results = []
        for req in progressed:
            self._check_stop_strings(req)
            results.append(self._output(req))
            if req.status.finished:
                self._forget(req.request_id)
        return results

    def _steps(self, out: SchedulerOutput) -> list[SeqStep]:
        steps = []
        for s in out.scheduled:
            req = s.request
            end = s.start_pos + s.num_new_tokens
            steps.append(SeqStep(req.request_id, req.all_token_ids[s.start_pos:end], s.start_pos,
                                 self.kv.get_block_ids(req.request_id)[0], end == req.num_tokens,
                                 req.sampling_params, self._generators.get(req.request_id)))
            placed = self._mm_inputs.get(req.request_id)
            if placed:
                steps[-1].embeds = self.mm.embeddings(placed, s.start_pos, end)
        return steps

    def _detokenize(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)

    def _check_stop_strings(self, req: Request) -> None:
        stops = req.sampling_params.stop
        if not stops or self.tokenizer is None:
            return
        text = self._detokenize(req)
        hits = [(text.find(s), s) for s in stops if s in text]  # type: ignore[union-attr]
        if hits:
            pos, s = min(hits)
            req.output_text = text[: pos + (len(s) if req.sampling_params.include_stop_str_in_output else 0)]
            if not req.status.finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = s

    def _output(self, req: Request) -> RequestOutput:
        finished = req.status.finished
        if not (req.sampling_params.stop and req.stop_reason in req.sampling_params.stop):
            req.output_text = self._detokenize(req)
        reason = req.status.value if finished else None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.all_token_ids[:req.num_prompt_tokens],
            outputs=[CompletionOutput(0, req.output_text, list(req.output_token_ids), reason,
                                      req.stop_reason if finished else None)],
            finished=finished, num_cached_tokens=req.metrics.num_cached_tokens, metrics=req.metrics,
            stage_outputs=self.stage_outputs.take(req.request_id) if finished and self.stage_outputs else None)

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._mm_inputs.pop(request_id, None)
        if self.stage_outputs is not None:
            self.stage_outputs.forget(request_id)
