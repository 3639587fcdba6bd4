"""The host tier behind hybrid models, token for token: Gemma-3 (a full-attention group and five
sliding-window groups in one pool) and LFM2 (attention blocks and conv states on a two-level pool).

A long prompt runs, fillers then push every block of it out of a device pool that cannot hold both,
and a prompt sharing its prefix comes back: its hit is restored, mostly from the host tier, in every
group, and the tokens equal transformers' (fp32) or the host-tier-off run's (bf16). All prompts run
together on the same small pool too, with preemptions."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_VOCAB, hf_greedy, make_tiny_hybrid_gemma3, make_tiny_hybrid_lfm2

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

BS = 4
PREFIX = [(7 * i + 3) % TINY_VOCAB for i in range(70)]
FIRST, AGAIN = [*PREFIX, 11, 12, 13], [*PREFIX, 21, 22]
FILLERS = [[(5 * i + 1) % TINY_VOCAB for i in range(90)], [(11 * i + 2) % TINY_VOCAB for i in range(90)]]
N_OUT = 12
N_LONG = 13  # all prompts together, each decoding into blocks the others need (preemptions)
# The shared 70 tokens: 17 full blocks; LFM2 has states only where chunks of 32 ended (32, 64).
HIT = {"gemma3": 68, "lfm2": 64}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid_gemma3(tmp_path_factory.mktemp("tiny-gemma3-host"))


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid_lfm2(tmp_path_factory.mktemp("tiny-lfm2-host"))


# Device pools that hold one long request and little else; host tiers that hold everything.
POOLS = {"gemma3": dict(num_blocks=160, num_host_blocks=600), "lfm2": dict(num_blocks=30, num_host_blocks=120)}
PROMPTS = [FIRST, *FILLERS, AGAIN]
# Run together with the prompts above: more than the small pool holds at once (preemptions).
EXTRA = [[(k * i + 3) % TINY_VOCAB for i in range(80)] for k in (13, 17, 19, 23)] + [[*FIRST, 5], [*AGAIN, 6]]


@pytest.fixture(scope="module")
def references(gemma3_dir: Path, lfm2_dir: Path) -> dict[str, list[list[int]]]:
    return {"gemma3": hf_greedy(gemma3_dir, PROMPTS, N_OUT), "lfm2": hf_greedy(lfm2_dir, PROMPTS, N_OUT),
            "gemma3 together": hf_greedy(gemma3_dir, PROMPTS + EXTRA, N_LONG),
            "lfm2 together": hf_greedy(lfm2_dir, PROMPTS + EXTRA, N_LONG)}


def run(path: Path, dtype: str, **kw: object) -> tuple[list[list[int]], list[int], LLM]:
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, block_size=BS, max_num_batched_tokens=32, **kw)
    outs = [llm.generate([p], SamplingParams.greedy(N_OUT), use_tqdm=False)[0] for p in PROMPTS]
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], llm


@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_hits_come_back_from_the_host_tier_in_every_group(model: str, request: pytest.FixtureRequest,
                                                          references: dict[str, list[list[int]]]) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    tokens, cached, llm = run(path, "float32", **POOLS[model])
    assert tokens == references[model]
    kv = llm.engine.kv
    # The shared prefix is a hit, and most of it came back from the host tier.
    assert cached[-1] == HIT[model]
    assert kv.stats.host_hits > HIT[model] // 2
    assert llm.engine.runner.num_blocks_swapped_in > 0
    kv.check_integrity()
    # Without the host tier the same pool has lost the prefix: the hit is the host tier's doing.
    _, cached_off, _ = run(path, "float32", num_blocks=POOLS[model]["num_blocks"])
    assert cached_off[-1] < HIT[model]
    # Together on the same small pool: preemptions, same tokens.
    together = llm.generate(PROMPTS + EXTRA, SamplingParams.greedy(N_LONG), use_tqdm=False)
    assert [o.token_ids for o in together] == references[f"{model} together"]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    kv.check_integrity()


@pytest.mark.parametrize("model", ["gemma3", "lfm2"])
def test_bf16_tokens_equal_with_the_host_tier_on_and_off(model: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{model}_dir")
    on, cached_on, _ = run(path, "bfloat16", **POOLS[model])
    off, _, _ = run(path, "bfloat16", num_blocks=1000 if model == "gemma3" else 200, enable_prefix_caching=False)
    assert on == off
    assert cached_on[-1] == HIT[model]


def test_lfm2_with_pages_of_one_size_copies_its_host_hits(lfm2_dir: Path, references: dict[str, list[list[int]]],
                                                           tmp_path: Path) -> None:
    """At block_size 2 the tiny LFM2's attention pages and conv states are the same size: the manager keeps
    a one-level pool (plans of pairs) over the runner's paged buffers. Its swaps copied nothing (the host hits
    read stale pages: wrong tokens), and a store tier failed to start."""
    kw = dict(dtype="float32", skip_tokenizer_init=True, block_size=2, max_num_batched_tokens=32)
    llm = LLM(str(lfm2_dir), num_blocks=60, num_host_blocks=300, **kw)  # type: ignore[arg-type]
    sizes = llm.engine.runner.page_sizes
    assert sizes is not None and len(set(sizes)) == 1 and not llm.engine.kv.host.typed  # type: ignore[union-attr]
    outs = [llm.generate([p], SamplingParams.greedy(N_OUT), use_tqdm=False)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == references["lfm2"]
    assert outs[-1].num_cached_tokens == HIT["lfm2"] and llm.engine.kv.stats.host_hits > HIT["lfm2"] // 2
    llm.engine.kv.check_integrity()
    # Through a store: a second engine reads the first one's blocks back.
    url = f"file://{tmp_path}"
    first = LLM(str(lfm2_dir), num_blocks=60, num_host_blocks=300, write_through=True, kv_store=url, **kw)
    first.generate([PROMPTS[0]], SamplingParams.greedy(N_OUT), use_tqdm=False)
    first.engine.store.close()  # type: ignore[union-attr]
    second = LLM(str(lfm2_dir), num_blocks=60, num_host_blocks=300, kv_store=url, **kw)
    again = second.generate([PROMPTS[-1]], SamplingParams.greedy(N_OUT), use_tqdm=False)[0]
    assert again.token_ids == references["lfm2"][-1] and again.num_cached_tokens == HIT["lfm2"]
    second.engine.store.close()  # type: ignore[union-attr]
