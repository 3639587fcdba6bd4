"""The scheduler on the real manager, without a model: budgets, chunks, preemption, exact order."""

from __future__ import annotations

import pytest

from kvpool.core.block_pool import DeviceBlockPool
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import FullAttentionSpec, MambaSpec
from kvpool.core.policies import ReusePolicy
from kvpool.engine.request import Request, RequestStatus
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler

BS = 4


def req(rid: str, n: int, max_tokens: int = 8, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams.greedy(max_tokens), hasher=BlockHasher(BS))


def fake_step(s: Scheduler, token: int = 7) -> tuple[list[tuple[str, int]], list[str]]:
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled
               if x.request.num_computed_tokens == x.request.num_tokens}
    s.update_from_output(out, sampled)
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled], out.preempted


def test_budget_chunks_a_long_prompt_while_decodes_continue() -> None:
    s = Scheduler(KVCacheManager(64, BS), max_num_batched_tokens=10)
    s.add_request(req("a", 6))
    assert fake_step(s) == ([("a", 6)], [])
    s.add_request(req("b", 25, start=100))
    # a decodes (1 token); b gets the rest of the budget, in chunks.
    assert fake_step(s) == ([("a", 1), ("b", 9)], [])
    assert fake_step(s) == ([("a", 1), ("b", 9)], [])
    assert fake_step(s) == ([("a", 1), ("b", 7)], [])
    assert s.requests["b"].num_output_tokens == 1


def test_without_chunked_prefill_a_long_prompt_waits() -> None:
    s = Scheduler(KVCacheManager(64, BS), max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(req("a", 12))
    assert fake_step(s) == ([], [])


def test_max_num_seqs() -> None:
    s = Scheduler(KVCacheManager(64, BS), max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, start=10 * i))
    assert [r for r, _ in fake_step(s)[0]] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_frees_the_latest_and_requeues_it_first() -> None:
    kv = KVCacheManager(7, BS)  # 6 usable blocks
    s = Scheduler(kv, max_num_batched_tokens=100)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20, start=100))
    s.add_request(req("c", 3, max_tokens=20, start=200))
    assert fake_step(s) == ([("a", 8), ("b", 8), ("c", 3)], [])  # 2 + 2 + 1 blocks
    # Decodes: a and b need a 3rd block each; one block is free. c (latest) is preempted.
    sched, preempted = fake_step(s)
    assert preempted == ["c"]
    assert sched == [("a", 1), ("b", 1)]
    assert s.requests["c"].status is RequestStatus.PREEMPTED and s.requests["c"].num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.stats.num_preemptions == 1
    kv.check_integrity()


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    kv = KVCacheManager(7, BS)
    s = Scheduler(kv, max_num_batched_tokens=100)
    s.add_request(req("a", 8, max_tokens=2))
    s.add_request(req("c", 9, max_tokens=20, start=200))
    fake_step(s)  # a: 2 blocks, c: 3 blocks
    fake_step(s)  # a decodes its 2nd token: finished, freed
    assert "a" not in s.requests
    c = s.requests["c"]
    s._preempt(s.running.pop())  # as if memory ran short
    sched, _ = fake_step(s)
    # c's 2 full blocks (8 of its 11 tokens) are still cached: only the rest is recomputed.
    assert sched == [("c", 3)]
    assert c.num_computed_tokens == 11 and c.num_output_tokens == 3
    # Its own blocks found again are no hit of the prefix cache a user reads: counted apart, as vLLM does.
    st = kv.stats
    assert (st.requests, st.queries, st.hits) == (2, 8 + 9, 0)
    assert (st.preempted_requests, st.preempted_queries, st.preempted_hits) == (1, 11, 8)


def test_the_policy_hears_what_a_finished_request_generated_and_nothing_for_a_preempted_one() -> None:
    releases: list[int | None] = []

    class Recording(ReusePolicy):
        def on_release(self, num_output_tokens: int | None) -> None:
            releases.append(num_output_tokens)
            super().on_release(num_output_tokens)

    kv = KVCacheManager(7, BS, block_pool=DeviceBlockPool(7, eviction_policy=Recording()))
    s = Scheduler(kv, max_num_batched_tokens=100)
    s.add_request(req("a", 8, max_tokens=2))
    s.add_request(req("c", 9, max_tokens=20, start=200))
    fake_step(s)
    fake_step(s)  # a finishes after 2 tokens
    assert releases == [2]
    s._preempt(s.running.pop())  # c, 2 tokens in: it will resume
    assert releases == [2, None]
    kv.check_integrity()


def lora_req(rid: str, lora: str | None, start: int, max_tokens: int = 3) -> Request:
    r = req(rid, 4, max_tokens=max_tokens, start=start)
    r.lora_name = lora
    return r


def test_one_adapter_too_many_waits_a_bounded_time_under_a_steady_flow_of_the_others() -> None:
    s = Scheduler(KVCacheManager(256, BS), max_num_batched_tokens=100, max_loras=2)
    s.LORA_PATIENCE_STEPS = 3
    s.add_request(lora_req("a0", "A", 0))
    s.add_request(lora_req("b0", "B", 10))
    c = lora_req("c", "C", 20)
    s.add_request(c)
    admitted: list[list[str]] = []
    waits: list[int] = []
    for step in range(1, 9):  # a new request of A, of B and of the base model every step
        for lora, start in (("A", 100), ("B", 200), (None, 300)):
            s.add_request(lora_req(f"{lora or 'base'}{step}", lora, start + 10 * step))
        admitted.append([r for r, n in fake_step(s)[0] if n == 4])
        waits.append(c.lora_waits)
    # While C is patient, A's and B's later requests go ahead of it (3 steps); then they are held back
    # (the base model's still go), A and B drain, and C takes the first adapter slot that comes free.
    assert admitted[:3] == [["a0", "b0", "A1", "B1", "base1"], ["A2", "B2", "base2"], ["A3", "B3", "base3"]]
    assert admitted[3:5] == [["base4"], ["base5"]] and waits[:5] == [1, 2, 3, 4, 5]
    # Both drained: C first, then the later requests of one adapter beside it (B's now wait their turn).
    assert admitted[5] == ["c", "A4", "A5", "A6", "base6"] and waits[5] == 0  # (admitted: patience restarts)
    assert not any(r.startswith("B") for a in admitted[5:] for r in a)


def test_abort_frees_blocks_waiting_or_running() -> None:
    kv = KVCacheManager(16, BS)
    s = Scheduler(kv)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, start=50))
    s.schedule()
    assert kv.usage > 0
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert kv.usage == 0 and not s.has_unfinished()
    kv.check_integrity()


def test_duplicate_request_id_rejected() -> None:
    s = Scheduler(KVCacheManager(16, BS))
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("a", 3))


def state_manager(num_blocks: int = 64, caching: bool = True) -> KVCacheManager:
    specs = [FullAttentionSpec(BS), MambaSpec(BS, state_shapes=((8, 2),), state_dtype_bytes=(2,))]
    return KVCacheManager(num_blocks, BS, specs=specs, enable_caching=caching)


def test_state_models_align_prefill_chunks_on_block_boundaries() -> None:
    s = Scheduler(state_manager(), max_num_batched_tokens=10)
    assert s.align_chunks
    s.add_request(req("a", 6))
    # 6 tokens: the chunk stops at 4 (the prompt's last boundary), then the rest, which samples.
    assert fake_step(s) == ([("a", 4)], [])
    assert fake_step(s) == ([("a", 2)], [])
    s.add_request(req("b", 25, start=100))
    # a decodes (1 token, never cut); b's budget-cut chunks end on multiples of 4: 8, then 16, then 24.
    assert fake_step(s) == ([("a", 1), ("b", 8)], [])
    assert fake_step(s) == ([("a", 1), ("b", 8)], [])
    assert fake_step(s) == ([("a", 1), ("b", 8)], [])
    assert fake_step(s) == ([("a", 1), ("b", 1)], [])
    assert s.requests["b"].num_output_tokens == 1
    # A budget too small to reach a boundary is used as it is; the next chunk aligns again.
    s = Scheduler(state_manager(), max_num_batched_tokens=3)
    s.add_request(req("c", 13))
    # 0..3, 3..4, 4..7, 7..8, 8..11, then 11..12 (the last boundary), 12..13.
    assert [fake_step(s)[0][0][1] for _ in range(7)] == [3, 1, 3, 1, 3, 1, 1]
    # No alignment without prefix caching (nothing to cache) or without a state group.
    assert not Scheduler(state_manager(caching=False)).align_chunks
    assert not Scheduler(KVCacheManager(64, BS)).align_chunks


def test_the_output_carries_each_requests_block_tables() -> None:
    kv = KVCacheManager(64, BS)
    s = Scheduler(kv, max_num_batched_tokens=6)
    s.add_request(req("a", 9))
    s.add_request(req("b", 3, start=100))
    out = s.schedule()
    assert [(x.request.request_id, len(x.block_ids[0])) for x in out.scheduled] == [("a", 2)]
    assert all(x.block_ids == kv.get_block_ids(x.request.request_id) for x in out.scheduled)
    s.update_from_output(out, {})
    out = s.schedule()  # a's last 3 tokens, and b
    assert [(x.request.request_id, len(x.block_ids[0])) for x in out.scheduled] == [("a", 3), ("b", 1)]
    assert all(x.block_ids == kv.get_block_ids(x.request.request_id) for x in out.scheduled)


class LetterTokenizer:
    """Token i decodes to the i-th lowercase letter (no backend: the checker decodes in full each time)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize(("include", "text"), [(False, "ab"), (True, "abcd")])
@pytest.mark.parametrize("max_tokens", [10, 4])  # 4: the token that completes "cd" is also the last allowed
def test_stop_strings_are_decided_with_the_stop_tokens(include: bool, text: str, max_tokens: int) -> None:
    import threading

    from kvpool.engine.stop import Detokenizer, StopChecker

    kv = KVCacheManager(64, BS)
    s = Scheduler(kv, stop_checker=StopChecker(Detokenizer(LetterTokenizer(), threading.Lock())))
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=max_tokens, stop=["cd"], include_stop_str_in_output=include),
                hasher=BlockHasher(BS))
    s.add_request(r)
    for tok in (0, 1, 2, 3, 4):  # a b c d: "cd" completes on the fourth token
        out = s.schedule()
        s.update_from_output(out, {"a": tok})
        if r.status.finished:
            break
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == "cd"
    assert r.output_token_ids == [0, 1, 2, 3] and r.output_text == text
    assert kv.get_num_free_blocks() == kv.block_pool.num_usable_blocks  # freed by the scheduler at once
