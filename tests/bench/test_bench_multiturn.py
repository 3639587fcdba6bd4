"""`kvpool bench multiturn` systems with a KV dtype (`NAME:KV_DTYPE`): the same memory as NAME's pool holds
twice the blocks in bf16 under an fp32 model, and outputs are compared with no-cache in the same KV dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.bench import multiturn
from kvpool.cli import build_parser, engine_kwargs


def test_a_kv_dtype_system_gets_the_same_memory_and_its_own_reference(chat_llama_dir: Path) -> None:
    args = build_parser().parse_args([
        "bench", "multiturn", "--model", str(chat_llama_dir), "--dtype", "float32", "--conversations", "6",
        "--turns", "3", "--concurrency", "2", "--system-len", "40", "--user-len", "16:32", "--answer-len", "4:8",
        "--device-blocks", "12", "--host-blocks", "8",
        "--systems", "no-cache,device,no-cache:bfloat16,device:bfloat16,device+host:bfloat16"])
    res = multiturn.run(args, engine_kwargs(args))
    s = res["systems"]
    assert s["device"]["device_blocks"] == 12 and s["device:bfloat16"]["device_blocks"] == 24
    assert s["device+host:bfloat16"]["device_blocks"] == 24
    # Each system against its own KV dtype's reference: bf16's rounding does not count as a difference.
    assert all(s[n]["outputs_identical"] for n in ("device", "device:bfloat16", "device+host:bfloat16"))
    # Twice the blocks keep more of the conversations between their turns.
    assert s["device:bfloat16"]["hit_rate"] > s["device"]["hit_rate"]


def test_the_hit_rate_is_what_requests_saw_at_their_first_admission(chat_llama_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool so small that requests are preempted: the hit rate is each request's cached prompt tokens at
    its first admission, and the manager's counters (lookup_hit_rate, vLLM's prefix_cache_queries/hits)
    agree, a preempted request's admissions again being counted apart."""
    from kvpool.engine.engine import LLMEngine

    seen: list = []
    step = LLMEngine.step

    def recording(self: LLMEngine) -> list:
        outs = step(self)
        seen.extend(o for o in outs if o.finished)
        return outs

    monkeypatch.setattr(LLMEngine, "step", recording)
    args = build_parser().parse_args([
        "bench", "multiturn", "--model", str(chat_llama_dir), "--dtype", "float32", "--conversations", "8",
        "--turns", "3", "--concurrency", "4", "--system-len", "40", "--user-len", "16:32", "--answer-len", "4:8",
        "--device-blocks", "14", "--systems", "device"])
    s = multiturn.run(args, engine_kwargs(args))["systems"]["device"]
    assert s["preemptions"] > 0
    cached, prompt = sum(o.num_cached_tokens for o in seen), sum(len(o.prompt_token_ids) for o in seen)
    assert s["hit_rate"] == cached / prompt and s["lookup_hit_rate"] == s["hit_rate"]
