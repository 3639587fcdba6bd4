"""LFM2 (gated short-convolution layers with GQA attention layers), token for token against transformers.

The conv layers' state lives in Mamba groups (`MambaManager`: block j's page holds the state after
blocks 0..j) and the attention layers' KV in a full-attention group; the pages differ in size, so the
engine runs one two-level pool. Exact with prefix caching on and off, chunked prefill of several sizes,
a pool small enough to preempt, and batched against one at a time; prefix hits land on the latest block
boundary whose state is cached, and chunks are aligned on boundaries so that there is one.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import TINY_VOCAB, hf_greedy, make_tiny_model

from kvpool.core.kv_cache_spec import FullAttentionSpec, MambaSpec
from kvpool.core.two_level_pool import TwoLevelBlockPool
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.models.lfm2 import Lfm2Arch
from kvpool.runner.models.llama import PackedLinear, can_pack

# Four conv layers and two attention layers: two Mamba groups and one attention group of two layers.
LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
CONFIG = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None,
              bos_token_id=None, pad_token_id=None, num_hidden_layers=6, layer_types=LAYER_TYPES, conv_L_cache=3,
              block_auto_adjust_ff_dim=False)
BS = 4


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-lfm2"), "Lfm2Config", "Lfm2ForCausalLM", **CONFIG)


PREFIX = [(7 * i + 3) % TINY_VOCAB for i in range(70)]
PROMPTS = [[*PREFIX, 11, 12, 13], [*PREFIX, 21, 22], PREFIX[:40] + [5] * 9, [9] * 30, [4]]
N_OUT = 12

SETTINGS = {
    "caching": dict(num_blocks=200),
    "no caching": dict(num_blocks=200, enable_prefix_caching=False),
    "chunked 5": dict(num_blocks=200, max_num_batched_tokens=5),
    "chunked 8": dict(num_blocks=200, max_num_batched_tokens=8),
    "chunked 16": dict(num_blocks=200, max_num_batched_tokens=16),
    "chunked 7, no caching": dict(num_blocks=200, max_num_batched_tokens=7, enable_prefix_caching=False),
    # Large pages of 2048 bytes: one attention block (2 layers) or two Mamba pages. The longest request
    # (85 tokens) needs 22 attention blocks and 2 pages in each Mamba group: 22 + 2 of the 25 usable.
    "small pool": dict(num_blocks=26, max_num_batched_tokens=32),
}


@pytest.fixture(scope="module")
def reference(lfm2_dir: Path) -> list[list[int]]:
    return hf_greedy(lfm2_dir, PROMPTS, N_OUT)


def make_llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BS, **kw)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_tokens_equal_transformers(setting: str, lfm2_dir: Path, reference: list[list[int]]) -> None:
    llm = make_llm(lfm2_dir, **SETTINGS[setting])
    # One at a time first (later prompts hit earlier ones' states), then all together.
    alone = [llm.generate([p], SamplingParams.greedy(N_OUT), use_tqdm=False)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False)
    assert [o.token_ids for o in alone] == reference
    assert [o.token_ids for o in together] == reference
    llm.engine.kv.check_integrity()
    if setting == "small pool":
        assert llm.engine.scheduler.stats.num_preemptions > 0
    if setting == "chunked 8":
        # Chunks end on multiples of 8, where states are cached: the second prompt shares 70 tokens with
        # the first (hit at 64), the third 40 (hit at 40).
        assert [o.num_cached_tokens for o in alone] == [0, 64, 40, 0, 0]
    if "no caching" in setting:
        assert all(o.num_cached_tokens == 0 for o in alone + together)


def test_one_pool_of_two_page_sizes(lfm2_dir: Path) -> None:
    llm = make_llm(lfm2_dir, num_blocks=50)
    eng = llm.engine
    specs = eng.kv.specs
    assert [type(s) for s in specs] == [MambaSpec, FullAttentionSpec, MambaSpec]
    # Per layer: a state of 64 channels x 2 inputs in fp32 (512 bytes); a block of K and V, 2 heads x 4
    # tokens x 16 dims (1024 bytes). Two layers per group.
    assert eng.runner.page_sizes == [1024, 2048, 1024]
    pool = eng.kv.block_pool
    assert isinstance(pool, TwoLevelBlockPool) and pool.large_page_size == 2048
    # A request alone must fit: 2 pages in each Mamba group (2 large pages), the rest attention blocks.
    assert eng.max_model_len == (50 - 1 - 2) * BS
    paged = eng.runner.paged
    assert paged is not None and len(paged.buffers) == 2  # one byte buffer per layer slot, for every type
    assert [b.numel() * 4 for b in paged.buffers] == [50 * 1024] * 2
    # Block j of a type is bytes [j * page, (j + 1) * page) of its slot's buffer: a state page and an
    # attention block of the same large page overlap, never pages of different large pages.
    base = paged.buffers[1].data_ptr()
    state = eng.runner.kv_caches[4][0]  # layer 4: conv, second layer of its group -> slot 1
    k, v = eng.runner.kv_caches[5]  # layer 5: attention, slot 1
    assert state[7].data_ptr() - base == 7 * 512
    assert k[:, 3].data_ptr() - base == 3 * 1024 and v[:, 3].data_ptr() - base == 3 * 1024 + 512
    assert eng.runner.kv_caches[0][0].data_ptr() == paged.buffers[0].data_ptr()


def _tables(llm: LLM, rid: str) -> tuple[list[int], list[int], list[int]]:
    return llm.engine.kv.get_block_ids(rid)  # type: ignore[return-value]


def test_mamba_groups_hold_at_most_two_pages(lfm2_dir: Path) -> None:
    llm = make_llm(lfm2_dir, num_blocks=50)
    eng = llm.engine
    prompt = PREFIX[:30]
    eng.add_request(prompt, SamplingParams.greedy(8), request_id="r")
    eng.step()  # tokens 0..28: the chunk stops at the prompt's last boundary
    m1, attn, m2 = _tables(llm, "r")
    assert len(attn) == 7 and 0 not in attn
    for m in (m1, m2):
        assert m[:6] == [0] * 6 and m[6] != 0
    held = {g: eng.kv.managers[g].req_to_blocks["r"][6] for g in (0, 2)}
    assert all(b.block_hash is not None for b in held.values())  # the state after 28 tokens is cached
    eng.step()  # tokens 28..30, samples the first token: input page 6, output page 7
    m1, attn, m2 = _tables(llm, "r")
    for m in (m1, m2):
        assert m[:6] == [0] * 6 and m[6] != 0 and m[7] != 0 and len(m) == 8
    assert eng.kv.managers[0].req_to_blocks["r"][7].block_hash is None  # a state mid-block: not cached
    eng.step()  # position 30: page 6 is no longer the input: released (it stays cached)
    m1, _, m2 = _tables(llm, "r")
    for m in (m1, m2):
        assert m[:7] == [0] * 7 and m[7] != 0 and len(m) == 8
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in held.values())
    eng.step()  # position 31: the state after 32 tokens lands in page 7 and is cached
    assert eng.kv.managers[0].req_to_blocks["r"][7].block_hash is not None
    eng.step()  # position 32: a new page for block 8, page 7 is the input
    m1, attn, m2 = _tables(llm, "r")
    assert len(attn) == 9 and 0 not in attn
    for m in (m1, m2):
        assert m[:7] == [0] * 7 and 0 not in m[7:] and len(m) == 9
    eng.kv.check_integrity()
    while eng.has_unfinished_requests():
        eng.step()
    assert all(len(eng.kv.managers[g].req_to_blocks) == 0 for g in range(3))
    eng.kv.check_integrity()


def test_hit_is_the_latest_cached_boundary(lfm2_dir: Path) -> None:
    prompt = PREFIX[:30]
    turn2_extra = [17, 18, 19, 20, 21, 22, 23]
    llm = make_llm(lfm2_dir, num_blocks=100)
    eng = llm.engine
    first = llm.generate([prompt], SamplingParams.greedy(6), use_tqdm=False)[0]
    # Prefill stops at 28 (state cached), then 30; decoding computes positions 30..34 and caches the
    # state after 32 tokens. The next turn extends the whole conversation: its hit is at 32.
    turn2 = prompt + first.token_ids + turn2_extra  # 43 tokens
    before = eng.runner.num_tokens_computed
    out = llm.generate([turn2], SamplingParams.greedy(5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert eng.runner.num_tokens_computed - before == (43 - 32) + 4  # the rest of the prompt, then 4 decodes
    # Sharing only the first 29 tokens: the latest boundary with a cached state is 28.
    other = prompt[:29] + [99] * 10
    out_other = llm.generate([other], SamplingParams.greedy(5), use_tqdm=False)[0]
    assert out_other.num_cached_tokens == 28
    ref = hf_greedy(lfm2_dir, [prompt, turn2, other], 6)
    assert first.token_ids == ref[0]
    assert out.token_ids == ref[1][:5] and out_other.token_ids == ref[2][:5]
    eng.kv.check_integrity()


def test_without_aligned_chunks_no_state_is_cached(lfm2_dir: Path) -> None:
    """The reason for aligning: a prompt computed in one step leaves a state only at its end, mid-block."""
    prompt = PREFIX[:30]
    llm = make_llm(lfm2_dir, num_blocks=100)
    llm.engine.scheduler.align_chunks = False
    llm.generate([prompt], SamplingParams.greedy(1), use_tqdm=False)
    out = llm.generate([prompt[:29] + [99] * 10], SamplingParams.greedy(1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    llm = make_llm(lfm2_dir, num_blocks=100, enable_prefix_caching=False)
    assert not llm.engine.scheduler.align_chunks


def test_hit_on_a_state_computed_in_the_same_step(lfm2_dir: Path) -> None:
    """B and C are admitted in the step that computes A's state after 28 tokens (cached at allocation):
    they start from it, so the forward must write A's state before they read it; C has a single token
    to compute, like a decode, but its input state is not its own."""
    a = PREFIX[:30]
    b = PREFIX[:28] + [99] * 12
    c = [*PREFIX[:28], 98]
    llm = make_llm(lfm2_dir, num_blocks=100)
    eng = llm.engine
    for rid, p in (("a", a), ("b", b), ("c", c)):
        eng.add_request(p, SamplingParams.greedy(6), request_id=rid)
    eng.step()
    assert [eng.scheduler.requests[r].metrics.num_cached_tokens for r in "abc"] == [0, 28, 28]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert [outs["a"], outs["b"], outs["c"]] == hf_greedy(lfm2_dir, [a, b, c], 6)


def test_ff_width_and_bad_configs(lfm2_dir: Path) -> None:
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    for mult, multiple in ((1.0, 256), (1.3, 64), (0.7, 32)):
        cfg = Lfm2Config(hidden_size=64, intermediate_size=1000, block_ffn_dim_multiplier=mult,
                         block_multiple_of=multiple, num_hidden_layers=2, layer_types=["conv", "full_attention"])
        width = Lfm2MLP(cfg).w1.out_features
        assert Lfm2Arch.from_hf_config(cfg.to_dict()).intermediate_size == width
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"config.layer_types: unknown layer types \['mamba'\]"):
        Lfm2Arch.from_hf_config({**base, "layer_types": ["conv", "mamba"]})
    with pytest.raises(ValueError, match=r"config\.layer_types: 1 entries for 2 layers"):
        Lfm2Arch.from_hf_config({**base, "layer_types": ["conv"]})
    with pytest.raises(ValueError, match=r"config\.conv_L_cache: must be an int >= 2"):
        Lfm2Arch.from_hf_config({**base, "layer_types": ["conv", "full_attention"], "conv_L_cache": 1})
    arch = Lfm2Arch.from_hf_config({**base, "full_attn_idxs": [1]})
    assert arch.layer_types == ("conv", "full_attention")
    with pytest.raises(ValueError, match="hybrid_allocator: a model with state layers needs the hybrid allocator"):
        make_llm(lfm2_dir, num_blocks=50, hybrid_allocator=False)
    with pytest.raises(ValueError, match=r"state_retention_tokens: must be a multiple of block_size \(4\) >= 0, got 6"):
        make_llm(lfm2_dir, num_blocks=50, state_retention_tokens=6)
    with pytest.raises(ValueError, match="batch_invariant: models with state layers are not supported"):
        make_llm(lfm2_dir, num_blocks=50, batch_invariant=True)


def test_bf16_packed_runs(lfm2_dir: Path) -> None:
    """bf16 on the CPU packs every projection (oneDNN) where it can; the model still generates."""
    llm = LLM(str(lfm2_dir), device="cpu", dtype="bfloat16", skip_tokenizer_init=True, block_size=BS, num_blocks=100)
    model = llm.engine.runner.model
    if can_pack(torch.bfloat16, torch.device("cpu")):
        assert isinstance(model.layers[0].conv.in_proj, PackedLinear)
        assert isinstance(model.layers[2].self_attn.q_proj, PackedLinear)
        assert isinstance(model.layers[2].feed_forward.w2, PackedLinear)
    outs = llm.generate(PROMPTS[:2], SamplingParams.greedy(4), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_random_shared_prefixes_small_pool(lfm2_dir: Path) -> None:
    """Prompts cut from three shared prefixes at random points, all at once, in both orders, through a
    pool that preempts: hits on states of every age (earlier steps, the same step, other requests')."""
    rng = random.Random(3)
    systems = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(20, 50))] for _ in range(3)]
    prompts = [systems[i % 3][:rng.randint(1, len(systems[i % 3]))] + [rng.randrange(TINY_VOCAB)
                                                                      for _ in range(rng.randint(0, 12))]
               for i in range(12)]
    ref = hf_greedy(lfm2_dir, prompts, 8)
    llm = make_llm(lfm2_dir, num_blocks=25, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams.greedy(8), use_tqdm=False)
    again = llm.generate(prompts[::-1], SamplingParams.greedy(8), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert [o.token_ids for o in again] == ref[::-1]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in again) > 0
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("retention", [16, 0])
def test_states_retained_every_interval_survive_pressure(retention: int, lfm2_dir: Path) -> None:
    # A long prompt in chunks of 32 tokens; a branch off it at token 40; a filler in between that needs
    # most of a small pool. Retained states (every 16 tokens) are held with the request and released as
    # hit points with the attention blocks before them, so the state after 32 tokens survives the filler;
    # without retention, intermediate states go to the front when the next chunk starts and the filler
    # takes them first, leaving attention blocks no state can resume from: the branch hits nothing.
    long = [(3 * i + 1) % TINY_VOCAB for i in range(100)]
    branch = [*long[:40], 7, 7, 7]
    filler = [(5 * i + 1) % TINY_VOCAB for i in range(60)]
    prompts = [long, filler, branch]
    llm = make_llm(lfm2_dir, num_blocks=38, max_num_batched_tokens=32, state_retention_tokens=retention)
    outs = [llm.generate([p], SamplingParams.greedy(4), use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == hf_greedy(lfm2_dir, prompts, 4)
    assert outs[-1].num_cached_tokens == (32 if retention else 0)
    llm.engine.kv.check_integrity()
