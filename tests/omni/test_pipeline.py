"""The two-stage pipeline gives the talker the same inputs, bit for bit, and so the same codes, with the
thinker's prefix caching (and so its stage-output cache) on or off: across shared-prefix requests,
chunked prefill, a pool small enough to evict and preempt, and the host tier. Tiny random models, on the
CPU: bit-identity rests on its BLAS (kvpool.runner.invariant)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_VOCAB

from kvpool.engine.engine import LLMEngine
from kvpool.omni.pipeline import OmniOutput, Pipeline, StageConfig, reference_pipeline
from kvpool.omni.talker import make_talker
from kvpool.runner.models.llama import PackedLinear, can_pack


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_talker(tmp_path_factory.mktemp("talker"), seed=3, max_position_embeddings=512)


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(TINY_VOCAB) for _ in range(37)] for _ in range(2)]
    return [systems[i % 2] + [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 14))] for i in range(8)]


def run(thinker: Path, talker: Path, caching: bool, on_thinker: Callable[[LLMEngine], None] | None = None,
        dtype: str = "float32", **thinker_engine: object) -> tuple[list[OmniOutput], Pipeline]:
    p = reference_pipeline(str(thinker), str(talker), enable_prefix_caching=caching, thinker_tokens=6,
                           talker_tokens=5, layer=0,
                           thinker_engine=dict(skip_tokenizer_init=True, block_size=4, dtype=dtype, device="cpu",
                                               **{"num_blocks": 128, **thinker_engine}),
                           talker_engine=dict(block_size=4, num_blocks=128, dtype=dtype, device="cpu"))
    if on_thinker is not None:
        on_thinker(p.stages[0].engine)
    ps = prompts()
    # The first request of each group alone, then the rest at once: they hit its cached prefix.
    outs = p.generate(ps[:2]) + p.generate(ps[2:])
    for st in p.stages:
        st.engine.kv.check_integrity()
        assert st.engine.kv.get_num_free_blocks() == st.engine.kv.block_pool.num_usable_blocks
    return outs, p


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    """Both stages' dtype: batch-invariant kernels exist for both (see kvpool.runner.invariant)."""
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, talker_dir: Path, dtype: str) -> list[OmniOutput]:
    return run(tiny_llama_dir, talker_dir, caching=False, dtype=dtype)[0]


def assert_same(got: list[OmniOutput], ref: list[OmniOutput]) -> None:
    assert len(got) == len(ref) == 8
    for g, r in zip(got, ref, strict=True):
        assert g.stages[0].token_ids == r.stages[0].token_ids
        n = len(g.stages[0].prompt_token_ids) + len(g.stages[0].token_ids) - 1  # the last token is never fed back
        assert g.stage_inputs[0].shape == (n, 64)
        assert torch.equal(g.stage_inputs[0], r.stage_inputs[0])
        for k in ("hidden_states", "layer_0"):
            assert torch.equal(g.stages[0].stage_outputs[k], r.stages[0].stage_outputs[k])  # type: ignore[index]
        assert g.codes == r.codes and len(g.codes) == 5


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 5}, {"max_num_batched_tokens": 16}],
                         ids=["one-step-prefill", "chunks-of-5", "chunks-of-16"])
def test_caching_on_equals_off(tiny_llama_dir: Path, talker_dir: Path, reference: list[OmniOutput],
                               engine: dict, dtype: str) -> None:
    got, p = run(tiny_llama_dir, talker_dir, caching=True, dtype=dtype, **engine)
    assert_same(got, reference)
    thinker = p.stages[0].engine
    # 6 of the 8 requests hit their group's 36 cached tokens (9 blocks of 4); their rows came from the cache.
    assert thinker.kv.stats.hits == 6 * 36
    assert thinker.stage_outputs is not None and thinker.stage_outputs.rows_from_cache == 6 * 36
    assert thinker.runner.num_tokens_computed == sum(len(x) for x in prompts()) - 6 * 36 + 8 * 5


@pytest.mark.parametrize("num_blocks", [16, 24])
def test_eviction_and_preemption(tiny_llama_dir: Path, talker_dir: Path, reference: list[OmniOutput],
                                 num_blocks: int, dtype: str) -> None:
    # 15 (23) usable blocks of 4 for requests of up to 14 blocks: requests evict each other's cached
    # blocks (a reused block gets the rows of its new tokens), and with 23 running ones get preempted.
    evicted: list[int] = []
    got, p = run(tiny_llama_dir, talker_dir, caching=True, num_blocks=num_blocks, dtype=dtype,
                 on_thinker=lambda eng: eng.kv.block_pool.eviction_listeners.append(
                     lambda blk, h: evicted.append(blk.block_id)))
    assert_same(got, reference)
    eng = p.stages[0].engine
    assert evicted
    rows = eng.stage_outputs.rows_from_cache  # type: ignore[union-attr]
    if num_blocks == 16:
        assert 0 < rows < 6 * 36  # some prefixes were evicted before their group's requests came
    else:
        assert eng.scheduler.stats.num_preemptions > 0 and rows == 6 * 36


def test_host_tier(tiny_llama_dir: Path, talker_dir: Path, reference: list[OmniOutput], dtype: str) -> None:
    got, p = run(tiny_llama_dir, talker_dir, caching=True, num_blocks=16, num_host_blocks=64, dtype=dtype)
    assert_same(got, reference)
    eng = p.stages[0].engine
    # Unrelated requests push the first group out of the device pool, into the host tier ...
    rng = random.Random(9)
    p.generate([[rng.randrange(TINY_VOCAB) for _ in range(50)] for _ in range(2)])
    swapped_in = eng.runner.num_blocks_swapped_in
    from_cache = eng.stage_outputs.rows_from_cache  # type: ignore[union-attr]
    # ... so its prefix comes back by host -> device copies, the stage outputs with it.
    again = p.generate(prompts()[:1])[0]
    n_hit = (len(prompts()[0]) - 1) // 4 * 4  # the same prompt again: every full block but the last token's
    assert again.stages[0].num_cached_tokens == n_hit
    assert eng.runner.num_blocks_swapped_in - swapped_in == n_hit // 4
    assert eng.stage_outputs.rows_from_cache - from_cache == n_hit  # type: ignore[union-attr]
    assert torch.equal(again.stage_inputs[0], reference[0].stage_inputs[0]) and again.codes == reference[0].codes


def test_stage_config_is_checked(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="outputs: 'logits' is not 'hidden_states' or 'layer_<i>' "
                                         r"\(stage 'a'\)"):
        StageConfig("a", outputs=("logits",)).output_layers()
    with pytest.raises(ValueError, match="outputs: stage 'a' feeds another stage but passes on no outputs"):
        Pipeline([StageConfig("a", str(tiny_llama_dir)), StageConfig("b", str(tiny_llama_dir))])
    with pytest.raises(ValueError, match=r"stage_output_layers: layer 5 is not in \[0, 2\)"):
        Pipeline([StageConfig("a", str(tiny_llama_dir), outputs=("layer_5",),
                              engine=dict(skip_tokenizer_init=True, num_blocks=16))])
    with pytest.raises(ValueError, match="batch_invariant: needs dtype float32 or bfloat16, got 'float16'"):
        Pipeline([StageConfig("a", str(tiny_llama_dir), engine=dict(skip_tokenizer_init=True, num_blocks=16,
                                                                     dtype="float16", batch_invariant=True))])


def test_a_talker_whose_answer_fills_its_context_is_refused_at_build(tiny_llama_dir: Path, talker_dir: Path) -> None:
    """A talker max_tokens past its own context left the pipeline a negative context: it was built, and every
    request refused with a message blaming the prompt."""
    with pytest.raises(ValueError, match=r"^max_tokens: the talker stage's max_tokens \(5000\) leaves the pipeline "
                                         r"a context of -\d+ tokens, and a request needs at least 2"):
        reference_pipeline(str(tiny_llama_dir), str(talker_dir), thinker_tokens=6, talker_tokens=5000, layer=0,
                           dtype="float32", thinker_engine=dict(skip_tokenizer_init=True, num_blocks=32))


def test_batch_invariance_is_what_makes_it_exact(tiny_llama_dir: Path, talker_dir: Path) -> None:
    # Without batch-invariant kernels the thinker's rows for the same tokens differ in the last bits
    # between a prefix hit and a recomputation: the stage-output cache alone is not enough. fp32, whose
    # F.linear (MKL) rows depend on the row count on every CPU seen (bf16's do not, see test_batch_invariance;
    # nor, on an AVX2-only EPYC, did oneDNN's prepacked fp32 kernel: then there is nothing to show), and
    # requests one at a time, so a hit's suffix (1-2 rows) and its recomputation (~40 rows) run at row
    # counts the matmul kernels treat differently.
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=g), torch.randn(40, 64, generator=g)  # the tiny model's q projection
    # The linear layer the engine runs: oneDNN's prepacked kernel where this torch has it, else F.linear.
    lin = PackedLinear(w, None) if can_pack(torch.float32, torch.device("cpu")) else (lambda t: F.linear(t, w))
    if all(torch.equal(lin(x[:k])[0], lin(x)[0]) for k in (2, 3)):
        pytest.skip("this CPU's fp32 matmul gives a row the same bits within 2, 3 or 40 rows: nothing to show")
    systems = [random.Random(5).randrange(TINY_VOCAB) for _ in range(37)]
    ps = [systems + [7 + i] * (1 + i % 2) for i in range(4)]
    outs = {}
    for caching in (True, False):
        p = reference_pipeline(str(tiny_llama_dir), str(talker_dir), enable_prefix_caching=caching, thinker_tokens=6,
                               talker_tokens=5, layer=0, dtype="float32",
                               thinker_engine=dict(skip_tokenizer_init=True, block_size=4, num_blocks=128,
                                                   batch_invariant=False))
        outs[caching] = [o for prompt in ps for o in p.generate([prompt])]
    assert any(not torch.equal(a.stage_inputs[0], b.stage_inputs[0]) for a, b in zip(outs[True], outs[False],
                                                                                       strict=True))


def test_the_default_talker_is_keyed_by_what_generates_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch's and transformers' initialisers decide the seeded weights: an upgrade gets a talker of its own
    instead of an older install's folder, and the same install finds its folder again."""
    from kvpool.omni.talker import default_talker_dir

    monkeypatch.setenv("KVPOOL_CACHE", str(tmp_path))
    first = default_talker_dir(0)
    assert (first / "config.json").is_file() and default_talker_dir(0) == first
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    upgraded = default_talker_dir(0)
    assert upgraded != first and (upgraded / "config.json").is_file()
    assert default_talker_dir(1) not in (first, upgraded)
