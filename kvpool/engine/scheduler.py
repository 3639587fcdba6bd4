"""The scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

Each step it first advances running requests (decodes and unfinished prefill chunks) in FCFS order,
then admits waiting requests while the budget and the KV cache allow. Admission asks the manager for
the longest cached prefix and computes only the rest. When a running request cannot get a block, the
most recently admitted running request is preempted: its blocks are freed (they stay cached, so it
usually re-hits them) and it goes back to the front of the waiting queue.

Models with state layers (a Mamba group) cache a state only where a step ends on a block boundary, so
with prefix caching on, prefill chunks are aligned (vLLM's "align" mode): a chunk cut by the budget
ends on the last boundary it reaches, and the chunk reaching the end of the known tokens first stops
at their last boundary (one extra step, so that a later request sharing them, such as the next turn of
a conversation, resumes from that state instead of recomputing everything).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import MambaSpec
from kvpool.core.swap import SwapPlan
from kvpool.engine.request import Request, RequestStatus
from kvpool.engine.stop import check_stop_tokens


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_pos: int  # num_computed_tokens before this step
    # The request's block table in every KV cache group (group 0 first), as this step's forward sees them:
    # set once the step's allocations and swaps are planned, so the runner need not ask the manager.
    block_ids: tuple[list[int], ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    swap_plan: SwapPlan = field(default_factory=SwapPlan)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class Scheduler:
    # Steps a request may be passed over for its LoRA adapter (max_loras) while later requests of the
    # running adapters go ahead. Past that, no later LoRA request is admitted until it is, so the running
    # adapters drain and one of their slots comes free: without a bound, a steady flow of requests for the
    # running adapters would keep one more adapter waiting forever.
    LORA_PATIENCE_STEPS = 16

    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 enable_chunked_prefill: bool = True,
                 stop_checker: Callable[[Request], bool] = check_stop_tokens, max_loras: int = 0) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.stop_checker = stop_checker  # finished after this token? (kvpool.engine.stop)
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests; 0: no limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.align_chunks = kv.enable_caching and any(isinstance(sp, MambaSpec) for sp in kv.specs)
        # Chunks that stop short of the known tokens' end also stop on a retention boundary, where the
        # manager keeps a state (see MambaManager): in tokens, 0 when no state is retained.
        self.retention = getattr(kv, "state_retention_interval", 0) * kv.block_size

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already running")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _aligned(self, req: Request, num_computed: int, num_new: int) -> int:
        """`num_new` cut so that a prefill chunk ends on a block boundary where one is in reach (see the
        module doc); decodes and chunks that reach no boundary are left as they are."""
        if not self.align_chunks or num_computed >= req.num_tokens - 1:
            return num_new
        bs = self.kv.block_size
        end = num_computed + num_new
        last = req.num_tokens - req.num_tokens % bs  # the last boundary of the known tokens
        if end < last:
            end = end - end % bs
            if self.retention and end - end % self.retention > num_computed:
                end -= end % self.retention
        elif num_computed < last < end:
            end = last
        return end - num_computed if end > num_computed else num_new

    @staticmethod
    def _rows_to_come(req: Request) -> list[bytes]:
        """The blocks whose rows a running scoring request will still write (those before were written, or
        hit: if they are gone from the cache now, waiting for it would not bring them back)."""
        return req.prompt_blocks(req.num_computed_tokens)

    @staticmethod
    def _waits_for_rows(req: Request, scoring: set[bytes]) -> bool:
        """A request scoring its prompt (prompt_logprobs) waits while another one computes the rows of its
        first block missing from the prompt-row cache (`scoring`: the blocks running ones will still write):
        a step or a few later it hits them, where admitted now it would compute them a second time
        (evaluation harnesses send many continuations of one context at once). It never waits on itself, nor
        on a request that is not running, nor when the cache cannot hold its prompt's rows (they would be
        evicted before it read them)."""
        n = req.max_hit_blocks or 0
        blocks = req.prompt_blocks()
        return (n < len(blocks) and blocks[n] in scoring and req.prompt_rows is not None
                and req.prompt_rows.fits(len(blocks)))

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim, preempted=True)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()
        scheduled_running: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._aligned(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
                scheduled_running.append(req)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: it was the last running request
        # Admit waiting requests, unless this step had to preempt (memory is short). A request whose LoRA
        # adapter would be one too many (max_loras) waits, in its place, for the requests after it, for
        # LORA_PATIENCE_STEPS steps; then it holds back every LoRA request after it (base-model requests
        # still go ahead: they take no adapter slot).
        loras = {r.lora_name for r in self.running if r.lora_name is not None} if self.max_loras else set()
        passed: list[Request] = []
        starving = False
        scoring: set[bytes] | None = None  # prompt blocks whose rows running scoring requests compute
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.lora_name is not None and self.max_loras and (
                    starving or (req.lora_name not in loras and len(loras) >= self.max_loras)):
                if not starving:
                    req.lora_waits += 1
                    starving = req.lora_waits > self.LORA_PATIENCE_STEPS
                passed.append(self.waiting.popleft())
                continue
            if req.scoring_prompt and req.prompt_rows is not None:
                if scoring is None:
                    scoring = {h for r in self.running if r.scoring_prompt for h in self._rows_to_come(r)}
                if self._waits_for_rows(req, scoring):
                    passed.append(self.waiting.popleft())
                    continue
            hit, n_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - n_hit
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            num_new = self._aligned(req, n_hit, num_new)
            if self.kv.allocate_slots(req, num_new, n_hit, hit) is None:
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = n_hit
                if n_hit:
                    req.metrics.num_host_cached_tokens = hit.num_host_positions() * self.kv.block_size
            req.num_computed_tokens = n_hit
            req.status = RequestStatus.RUNNING
            req.lora_waits = 0  # (its patience starts again if it is preempted and waits once more)
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, n_hit))
            budget -= num_new
            if req.lora_name is not None:
                loras.add(req.lora_name)
            if scoring is not None and req.scoring_prompt:
                scoring.update(self._rows_to_come(req))
        self.waiting.extendleft(reversed(passed))
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.start_pos < s.request.num_prompt_tokens:
                self.stats.num_prompt_tokens += min(s.request.num_prompt_tokens, s.request.num_computed_tokens
                                                    ) - s.start_pos
        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        out.swap_plan = self.kv.end_schedule_step()
        for s in out.scheduled:
            s.block_ids = self.kv.get_block_ids(s.request.request_id)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append sampled tokens; return the requests that got a token (those the stop checker finished are
        freed)."""
        now = time.time()
        progressed: list[Request] = []
        for s in out.scheduled:
            req = s.request
            tok = sampled.get(req.request_id)
            if tok is None or req.status.finished:
                continue
            req.append_output_token_ids(tok)
            self.stats.num_generation_tokens += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if self.stop_checker(req):
                self._finish(req, now)
            progressed.append(req)
        return progressed

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (an abort); its blocks are freed at once."""
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return None
        req.status = status
        self._finish(req, time.time())
        return req

    def _finish(self, req: Request, now: float) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.metrics.finished_time = now
        self.requests.pop(req.request_id, None)
