"""LoRA adapters applied by the runner: greedy tokens identical to transformers + peft (PeftModel) for each
adapter alone and for adapters and the base model mixed in one batch, with prefix caching on and off;
cached blocks shared within an adapter and never across adapters; clear errors for what cannot serve."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import TINY_VOCAB, make_peft_adapter, make_tiny_model, peft_greedy

from kvpool.engine.llm import LLM
from kvpool.engine.lora_request import LoRARequest, parse_lora_modules
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.lora import write_random_adapter

N_OUT = 12
BLOCK = 16
rng = random.Random(7)
SHARED = [rng.randrange(TINY_VOCAB) for _ in range(40)]  # a prefix several prompts (and adapters) share
PROMPTS = [[*SHARED, *(rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 20)))] for _ in range(3)] + [
    [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(3)]
# Adapter of each prompt in the mixed batch (None: the base model).
MIXED = [None, "attn", "all", "attn", "all", None]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-loras")
    return {"attn": make_peft_adapter(tiny_llama_dir, root / "attn", r=8, targets=["q_proj", "v_proj"], seed=1),
            "all": make_peft_adapter(tiny_llama_dir, root / "all", r=16, targets="all-linear", seed=2),
            # rank and alpha patterns, rsLoRA: PEFT's scaling rules
            "patterns": make_peft_adapter(tiny_llama_dir, root / "patterns", r=4, seed=3,
                                          targets=["k_proj", "o_proj", "up_proj", "down_proj"], use_rslora=True,
                                          rank_pattern={"down_proj": 8}, alpha_pattern={"o_proj": 3})}


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    out: dict[str | None, list[list[int]]] = {None: peft_greedy(tiny_llama_dir, None, PROMPTS, N_OUT)}
    for name, path in adapters.items():
        out[name] = peft_greedy(tiny_llama_dir, path, PROMPTS, N_OUT)
        assert out[name] != out[None], f"adapter {name} does not change the tokens: the test would prove nothing"
    return out


def requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def tiny_llm(model: Path, **kw: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=128, block_size=BLOCK,
                                   enable_lora=True, max_loras=3, max_lora_rank=16)
    args.update(kw)
    return LLM(str(model), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no caching"])
def test_tokens_equal_peft_alone_and_mixed(caching: bool, tiny_llama_dir: Path, adapters: dict[str, Path],
                                           expected: dict[str | None, list[list[int]]]) -> None:
    llm = tiny_llm(tiny_llama_dir, enable_prefix_caching=caching)
    loras = requests(adapters)
    sp = SamplingParams.greedy(N_OUT)
    for name in [None, *adapters]:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=loras[name] if name else None)
        assert [o.token_ids for o in outs] == expected[name], name
    # Adapters and the base model in one batch (prefill and decode steps both mixed), twice: the second
    # time every prompt's prefix is cached, under its own adapter only.
    for _ in range(2):
        outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=[loras[n] if n else None for n in MIXED])
        assert [o.token_ids for o in outs] == [expected[n][i] for i, n in enumerate(MIXED)]
    assert llm.engine.kv.usage == 0


def test_chunked_steps_of_three_adapters(tiny_llama_dir: Path, adapters: dict[str, Path],
                                         expected: dict[str | None, list[list[int]]]) -> None:
    """Chunked prefill cutting prompts at any token, three adapters and the base model in each step (the
    rows sorted into adapter segments, then back to each request's output)."""
    loras = requests(adapters)
    names = ["patterns", "all", None, "attn", "patterns", "all"]
    llm = tiny_llm(tiny_llama_dir, max_num_batched_tokens=40)
    outs = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    assert [o.token_ids for o in outs] == [expected[n][i] for i, n in enumerate(names)]


def test_max_loras_limits_the_adapters_running_together(tiny_llama_dir: Path, adapters: dict[str, Path],
                                                        expected: dict[str | None, list[list[int]]]) -> None:
    llm = tiny_llm(tiny_llama_dir, max_loras=1)
    loras = requests(adapters)
    seen: list[set[str]] = []
    real_step = llm.engine.scheduler.schedule

    def schedule():  # what runs together: at most one adapter, the base model beside it
        out = real_step()
        seen.append({s.request.lora_name for s in out.scheduled if s.request.lora_name is not None})
        return out

    llm.engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in MIXED])
    assert [o.token_ids for o in outs] == [expected[n][i] for i, n in enumerate(MIXED)]
    assert max(map(len, seen)) == 1 and set().union(*seen) == {"attn", "all"}
    assert llm.engine.runner.lora is not None and llm.engine.runner.lora.num_slot_loads >= 2


def test_an_adapter_removed_frees_its_weights_and_slot_and_comes_back_to_its_blocks(
        tiny_llama_dir: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]]) -> None:
    llm = tiny_llm(tiny_llama_dir, max_loras=1)
    eng = llm.engine
    loras = requests(adapters)
    sp = SamplingParams.greedy(N_OUT)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=loras["attn"])] == \
        expected["attn"]
    manager = eng.runner.lora
    assert manager is not None and "attn" in manager.adapters and manager.slots == ["attn"]
    # In flight: refused, and nothing changes.
    req = eng.add_request(PROMPTS[0], sp, lora_request=loras["attn"])
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'attn' has 1 requests in flight"):
        eng.remove_lora("attn")
    while eng.has_unfinished_requests():
        eng.step()
    assert req.output_token_ids == expected["attn"][0]
    # By int id (vLLM's form) or by name: gone from the registry, the weights and the slot.
    assert eng.remove_lora(loras["attn"].lora_int_id) is True
    assert eng.list_loras() == [] and "attn" not in manager.adapters and manager.slots == [None]
    assert eng.remove_lora("attn") is False and eng.remove_lora(99) is False
    # A request made for it before it went, queued after: refused, not run without its weights.
    made = eng.make_request(PROMPTS[1], sp, lora_request=loras["all"])
    eng.remove_lora("all")
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'all' was removed; add it again"):
        eng.enqueue(made)
    # Added again from the same files: the same tokens, and its cached blocks are hits again.
    outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=loras["attn"])
    assert [o.token_ids for o in outs] == expected["attn"]
    assert all(o.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK for o, p in zip(outs, PROMPTS, strict=True))
    assert eng.kv.usage == 0


def test_lora_id_runs_the_registered_adapter_it_names(tiny_llama_dir: Path, adapters: dict[str, Path],
                                                     expected: dict[str | None, list[list[int]]]) -> None:
    """`add_request(lora_id=...)` by name or int id runs that adapter (it once ran the base model, its blocks
    keyed as the adapter's); one not registered is refused."""
    llm = tiny_llm(tiny_llama_dir)
    eng = llm.engine
    lora = requests(adapters)["attn"]
    assert eng.add_lora(lora)
    sp = SamplingParams.greedy(N_OUT)
    reqs = [eng.add_request(PROMPTS[0], sp, lora_id="attn"), eng.add_request(PROMPTS[1], sp, lora_id=lora.lora_int_id)]
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.lora_name for r in reqs] == ["attn", "attn"]
    assert [r.output_token_ids for r in reqs] == expected["attn"][:2]
    for bad in ("all", 99):
        with pytest.raises(ValueError, match=rf"^lora_id: no adapter {bad!r} is registered"):
            eng.add_request(PROMPTS[0], sp, lora_id=bad)
    with pytest.raises(ValueError, match=r"^lora_request: give lora_request or lora_id, not both"):
        eng.add_request(PROMPTS[0], sp, lora_id="attn", lora_request=lora)
    plain = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=32, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"^lora_id: no adapter 'attn' is registered"):
        plain.engine.add_request(PROMPTS[0], sp, lora_id="attn")
    assert eng.kv.usage == 0


def test_past_max_cpu_loras_idle_adapters_are_unloaded_and_reloaded_when_asked_for(
        tiny_llama_dir: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]],
        tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "attn"
    shutil.copytree(adapters["attn"], folder)
    loras = {**requests(adapters), "attn": LoRARequest("attn", 1, str(folder))}
    llm = tiny_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    eng, manager = llm.engine, llm.engine.runner.lora
    assert manager is not None
    sp = SamplingParams.greedy(N_OUT)

    def run(name: str) -> list[int]:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=loras[name])
        assert [o.token_ids for o in outs] == expected[name], name
        return [o.num_cached_tokens for o in outs]

    run("attn")
    run("all")
    assert list(manager.adapters) == ["attn", "all"] and manager.num_unloads == 0
    run("patterns")  # a third: the least recently used idle one goes
    assert list(manager.adapters) == ["all", "patterns"] and manager.num_unloads == 1
    # Asked for again: read from its folder, the same tokens, its cached blocks hits as before.
    cached = run("attn")
    assert list(manager.adapters) == ["patterns", "attn"]
    assert all(c == (len(p) - 1) // BLOCK * BLOCK for c, p in zip(cached, PROMPTS, strict=True))
    # In flight, an adapter stays loaded whatever the bound: a request of each of the three at once.
    reqs = [eng.add_request(PROMPTS[i], sp, lora_request=loras[n]) for i, n in enumerate(["all", "patterns", "attn"])]
    assert set(manager.adapters) == {"all", "patterns", "attn"}
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [expected[n][i] for i, n in enumerate(["all", "patterns", "attn"])]
    run("all")
    run("patterns")
    assert set(manager.adapters) == {"all", "patterns"}  # the two used last
    # Unloaded, then its files rewritten: refused (its cached KV is keyed by the first files), not reloaded.
    cfg = folder / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha"', '"lora_alpha" ', 1))
    with pytest.raises(ValueError, match=r"^lora_request: the files of adapter 'attn' .* changed since it was first"):
        llm.generate(PROMPTS[:1], sp, use_tqdm=False, lora_request=loras["attn"])
    assert eng.kv.usage == 0 and not eng.has_unfinished_requests()


def test_adapters_added_ahead_are_checked_then_kept_within_the_bound(
        tiny_llama_dir: Path, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]]) -> None:
    """As `kvpool serve --lora-modules` adds them at start: each is read and checked, then only
    max_cpu_loras stay loaded; the others are read again when asked for."""
    llm = tiny_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.runner.lora
    assert manager is not None
    loras = requests(adapters)
    for lora in loras.values():
        assert llm.engine.add_lora(lora)
    assert [r.lora_name for r in llm.engine.list_loras()] == list(loras) and list(manager.adapters) == ["patterns"]
    outs = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False, lora_request=loras["attn"])
    assert [o.token_ids for o in outs] == expected["attn"] and list(manager.adapters) == ["attn"]


def test_an_adapter_used_from_its_slot_counts_as_recently_used(tiny_llama_dir: Path, adapters: dict[str, Path],
                                                              expected: dict[str | None, list[list[int]]]) -> None:
    llm = tiny_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=2)
    manager = llm.engine.runner.lora
    assert manager is not None
    loras = requests(adapters)
    for name in ("all", "attn", "attn", "all", "all"):  # all used last, from the slot it kept
        llm.generate(PROMPTS[:1], SamplingParams.greedy(2), use_tqdm=False, lora_request=loras[name])
    llm.generate(PROMPTS[:1], SamplingParams.greedy(2), use_tqdm=False, lora_request=loras["patterns"])
    assert set(manager.adapters) == {"all", "patterns"}  # attn, the least recently used, went


@pytest.mark.parametrize(("kw", "message"), [
    (dict(max_cpu_loras=1, max_loras=2), r"^max_cpu_loras: must be >= max_loras \(2\), got 1"),
    (dict(max_cpu_loras=0), r"^max_cpu_loras: must be an int >= 1 or None, got 0"),
])
def test_max_cpu_loras_is_checked(tiny_llama_dir: Path, kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_llm(tiny_llama_dir, **kw)
    with pytest.raises(ValueError, match=r"^max_cpu_loras: bounds the LoRA adapters kept loaded, and LoRA is off"):
        LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, max_cpu_loras=2)


def test_blocks_shared_within_an_adapter_never_across(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_llama_dir)
    loras = requests(adapters)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(3 * BLOCK + 5)]
    sp = SamplingParams.greedy(2)

    def cached(lora: LoRARequest | None, p: list[int] = prompt) -> int:
        return llm.generate(p, sp, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(loras["attn"]) == 0
    assert cached(loras["attn"]) == 3 * BLOCK  # the same adapter: every full block is a hit
    assert cached(loras["all"]) == 0  # another adapter: nothing shared
    assert cached(None) == 0  # nor with the base model
    assert cached(None) == 3 * BLOCK and cached(loras["all"]) == 3 * BLOCK
    # A prompt branching off the cached one, same adapter: its common full blocks are hits.
    assert cached(loras["attn"], prompt[:2 * BLOCK] + [1] * 20) == 2 * BLOCK
    # Block ids: each adapter's chain is its own set of blocks.
    pool = llm.engine.kv.block_pool
    assert len(pool.cached) == 3 * (3 * BLOCK // BLOCK) + 1  # 3 chains of 3 blocks, and the branch's block


def test_random_adapter_files_read_by_peft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`write_random_adapter` (the benchmark's adapters) writes what PEFT reads, to the same tokens."""
    path = write_random_adapter(tmp_path / "rand", tiny_llama_dir, rank=8, targets=["q_proj", "gate_proj"], seed=5)
    want = peft_greedy(tiny_llama_dir, path, PROMPTS[:3], N_OUT)
    llm = tiny_llm(tiny_llama_dir, max_loras=1, max_lora_rank=8)
    outs = llm.generate(PROMPTS[:3], SamplingParams.greedy(N_OUT), use_tqdm=False,
                        lora_request=LoRARequest("rand", 1, str(path)))
    assert [o.token_ids for o in outs] == want


def test_bf16_applies_the_adapters(tiny_llama_dir: Path, adapters: dict[str, Path],
                                   expected: dict[str | None, list[list[int]]]) -> None:
    """bf16 (packed oneDNN projections where the CPU has them): not exact against fp32, but the adapters'
    deltas land: a mixed batch's first tokens are the fp32 reference's for most prompts."""
    llm = tiny_llm(tiny_llama_dir, dtype="bfloat16")
    loras = requests(adapters)
    outs = llm.generate(PROMPTS, SamplingParams.greedy(N_OUT), use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in MIXED])
    firsts = [o.token_ids[0] == expected[n][i][0] for i, (o, n) in enumerate(zip(outs, MIXED, strict=True))]
    assert sum(firsts) >= len(PROMPTS) - 1, firsts


# -- what cannot serve: a clear ValueError, before anything runs ----------------------------------------


def test_bad_adapters_are_refused(tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    llm = tiny_llm(tiny_llama_dir, max_lora_rank=8)
    sp = SamplingParams.greedy(2)

    def refused(lora: LoRARequest, *words: str) -> None:
        with pytest.raises(ValueError, match="lora_request") as e:
            llm.generate([1, 2, 3], sp, use_tqdm=False, lora_request=lora)
        for w in words:
            assert w in str(e.value)

    refused(LoRARequest("gone", 1, str(tmp_path / "nope")), "no such folder")
    (tmp_path / "empty").mkdir()
    refused(LoRARequest("empty", 1, str(tmp_path / "empty")), "adapter_config.json")
    refused(LoRARequest("all", 2, str(adapters["all"])), "rank 16", "max_lora_rank=8")
    head = make_peft_adapter(tiny_llama_dir, tmp_path / "head", r=4, targets=["q_proj", "lm_head"], seed=4)
    refused(LoRARequest("head", 3, str(head)), "lm_head", "not supported")
    emb = make_peft_adapter(tiny_llama_dir, tmp_path / "emb", r=4, targets=["embed_tokens"], seed=4)
    refused(LoRARequest("emb", 4, str(emb)), "embed_tokens", "not supported")
    dora = tmp_path / "dora"
    shutil.copytree(adapters["attn"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(LoRARequest("dora", 5, str(dora)), "use_dora")
    # Adapters peft loads by rewriting the base weights (a PiSSA adapter served on the plain base gave other
    # tokens than peft), and variants peft computes otherwise: refused by name.
    for i, (field, value, words) in enumerate([
            ("init_lora_weights", "pissa", ("init_lora_weights='pissa'", "rewrites the base model's weights")),
            ("init_lora_weights", "pissa_niter_4", ("pissa_niter_4",)), ("init_lora_weights", "olora", ("olora",)),
            ("init_lora_weights", "corda", ("corda",)), ("init_lora_weights", "loftq", ("loftq",)),
            ("kasa_config", {"r": 4}, ("kasa_config",)), ("use_bdlora", True, ("use_bdlora=True",))]):
        variant = tmp_path / f"variant{i}"
        shutil.copytree(adapters["attn"], variant)
        (variant / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        refused(LoRARequest(f"variant{i}", 100 + i, str(variant)), *words, "not supported")
    narrow = make_tiny_model(tmp_path / "narrow", "LlamaConfig", "LlamaForCausalLM", vocab_size=TINY_VOCAB,
                             hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)
    other = make_peft_adapter(narrow, tmp_path / "other", r=4, targets=["q_proj"], seed=4)
    refused(LoRARequest("other", 6, str(other)), "another base model")
    # One name is one adapter; one id one name.
    llm.generate([1, 2, 3], sp, use_tqdm=False, lora_request=LoRARequest("attn", 7, str(adapters["attn"])))
    refused(LoRARequest("attn", 8, str(adapters["attn"])), "already in use")
    refused(LoRARequest("attn2", 7, str(adapters["attn"])), "already adapter 'attn'")
    assert llm.engine.kv.usage == 0 and not llm.engine.scheduler.has_unfinished()
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/a")
    with pytest.raises(ValueError, match="lora_request: one per prompt"):
        llm.generate([[1, 2], [3, 4]], sp, use_tqdm=False, lora_request=[None])


def test_malformed_adapter_configs_are_refused(tiny_llama_dir: Path, adapters: dict[str, Path],
                                               tmp_path: Path) -> None:
    """Config values of the wrong type or range: a ValueError naming the field (a server's 400), never the
    TypeError or ZeroDivisionError of the scaling alpha / r computed from them."""
    from safetensors.torch import load_file, save_file

    llm = tiny_llm(tiny_llama_dir)
    sp = SamplingParams.greedy(2)
    ids = iter(range(1, 100))

    def variant(name: str, rank_zero: bool = False, **cfg_edit: object) -> LoRARequest:
        d = tmp_path / name
        shutil.copytree(adapters["attn"], d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(cfg_edit)
        if rank_zero:  # the tensors as a rank-0 adapter would have them; the config says nothing of r
            del cfg["r"]
            st = d / "adapter_model.safetensors"
            save_file({k: (v[:0] if "lora_A" in k else v[:, :0]).contiguous() for k, v in load_file(st).items()},
                      str(st))
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return LoRARequest(name, next(ids), str(d))

    cases = [
        (variant("alpha_null", lora_alpha=None), "lora_alpha must be a finite number, got None"),
        (variant("alpha_str", lora_alpha="16"), "lora_alpha must be a finite number, got '16'"),
        (variant("alpha_bool", lora_alpha=True), "lora_alpha must be a finite number, got True"),
        (variant("r_zero", r=0), "r must be an int >= 1, got 0"),
        (variant("r_str", r="8"), "r must be an int >= 1, got '8'"),
        (variant("rank_zero", rank_zero=True), "has rank 0"),
        (variant("rslora_str", use_rslora="false"), "use_rslora must be true or false, got 'false'"),
        (variant("rp_list", rank_pattern=["q_proj"]), "rank_pattern must be a JSON object"),
        (variant("rp_zero", rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] must be an int >= 1, got 0"),
        (variant("ap_str", alpha_pattern={"q_proj": "x"}), "alpha_pattern['q_proj'] must be a finite number"),
        (variant("ap_regex", alpha_pattern={"q_proj(": 2}), "alpha_pattern key 'q_proj(' is not a valid regular"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match="lora_request") as e:
            llm.generate([1, 2, 3], sp, use_tqdm=False, lora_request=lora)
        assert f"adapter {lora.lora_name!r}" in str(e.value) and message in str(e.value), str(e.value)
    # Nothing was left behind, and a sound adapter still serves.
    assert llm.engine.kv.usage == 0 and not llm.engine.scheduler.has_unfinished()
    llm.generate([1, 2, 3], sp, use_tqdm=False, lora_request=LoRARequest("attn", 99, str(adapters["attn"])))


def test_lora_needs_enable_lora_and_a_llama(tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=32)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([1, 2, 3], SamplingParams.greedy(2), use_tqdm=False,
                     lora_request=LoRARequest("attn", 1, str(adapters["attn"])))
    gemma = make_tiny_model(tmp_path / "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", vocab_size=TINY_VOCAB,
                            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16)
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are supported for Llama-family models"):
        LLM(str(gemma), dtype="float32", skip_tokenizer_init=True, num_blocks=32, enable_lora=True)
    with pytest.raises(ValueError, match="max_loras"):
        tiny_llm(tiny_llama_dir, max_loras=0)


def test_lora_modules_parsing() -> None:
    a, b = parse_lora_modules(["sql=/x/sql", '{"name": "chat", "path": "/x/chat", "base_model_name": "m"}'])
    assert (a.lora_name, a.lora_int_id, a.lora_path) == ("sql", 1, "/x/sql")
    assert (b.lora_name, b.lora_int_id, b.lora_path, b.base_model_name) == ("chat", 2, "/x/chat", "m")
    for bad in (["sql"], ["=/x"], ["a=/x", "a=/y"], ['{"name": "a"}'], ["{bad json"]):
        with pytest.raises(ValueError, match="lora_modules"):
            parse_lora_modules(bad)


# -- SmolLM2: the real model, short --------------------------------------------------------------------

SMOL_OUT = 5


@pytest.fixture(scope="module")
def smol_adapters(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-loras")
    return {"attn": make_peft_adapter(smol_dir, root / "attn", r=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      seed=1),
            "all": make_peft_adapter(smol_dir, root / "all", r=16, targets="all-linear", seed=2)}


def test_smollm2_adapters_equal_peft(smol_dir: Path, smol_adapters: dict[str, Path]) -> None:
    llm = LLM(str(smol_dir), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
              max_lora_rank=16)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    want = {name: peft_greedy(smol_dir, path, prompts, SMOL_OUT) for name, path in [(None, None),
                                                                                    *smol_adapters.items()]}
    assert want["attn"] != want[None] and want["all"] != want[None]
    loras = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(smol_adapters.items())}
    sp = SamplingParams.greedy(SMOL_OUT, ignore_eos=True)
    for name in smol_adapters:
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras[name])
        assert [o.token_ids for o in outs] == want[name], name
    names = ["all", None, "attn", "all", "attn", None]
    outs = llm.generate(prompts * 3, sp, use_tqdm=False, lora_request=[loras[n] if n else None for n in names])
    assert [o.token_ids for o in outs] == [want[n][i % 2] for i, n in enumerate(names)]


@pytest.mark.parametrize("clash", ["name", "id"])
def test_two_requests_registering_clashing_adapters_at_once_one_is_refused(
        tiny_llama_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch, clash: str) -> None:
    """One name from two folders (or one id for two names), registered from two threads at once: loading is
    slow, so both once passed the check and both ran with whichever adapter loaded first."""
    import threading
    import time

    from kvpool.runner import lora

    load = lora.load_adapter

    def slow_load(*a: object, **kw: object) -> object:
        time.sleep(0.3)  # both threads are past their checks before either inserts
        return load(*a, **kw)

    monkeypatch.setattr(lora, "load_adapter", slow_load)
    eng = tiny_llm(tiny_llama_dir).engine
    reqs = ([LoRARequest("z", 1, str(adapters["attn"])), LoRARequest("z", 1, str(adapters["all"]))]
            if clash == "name" else
            [LoRARequest("y", 1, str(adapters["attn"])), LoRARequest("w", 1, str(adapters["all"]))])
    got: list[object] = [None, None]
    start = threading.Barrier(2)

    def make(i: int) -> None:
        start.wait()
        try:
            got[i] = eng.make_request([1, 2, 3], SamplingParams.greedy(2), lora_request=reqs[i])
        except ValueError as e:
            got[i] = e

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [g for g in got if isinstance(g, ValueError)]
    assert len(errors) == 1, got
    assert ("already in use" if clash == "name" else "already adapter") in str(errors[0])
    kept = reqs[got.index(next(g for g in got if not isinstance(g, ValueError)))]
    assert [(r.lora_name, r.lora_path) for r in eng.list_loras()] == [(kept.lora_name, kept.lora_path)]


def test_adapter_files_rewritten_while_loading_are_refused(tiny_llama_dir: Path, adapters: dict[str, Path],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights loaded and the digest that keys the adapter's blocks must be of the same files."""
    from kvpool.runner import lora

    folder = tmp_path / "moving"
    shutil.copytree(adapters["attn"], folder)
    load = lora.load_adapter

    def load_then_rewrite(*a: object, **kw: object) -> object:
        out = load(*a, **kw)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(adapters["all"] / name, folder / name)
        return out

    monkeypatch.setattr(lora, "load_adapter", load_then_rewrite)
    llm = tiny_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"^lora_request: the adapter files in .* changed while they were read"):
        llm.engine.make_request([1, 2, 3], SamplingParams.greedy(2), lora_request=LoRARequest("m", 1, str(folder)))
    assert llm.engine.list_loras() == [] and "m" not in llm.engine.runner.lora.adapters
    monkeypatch.setattr(lora, "load_adapter", load)
    llm.engine.make_request([1, 2, 3], SamplingParams.greedy(2), lora_request=LoRARequest("m", 1, str(folder)))
    assert [r.lora_name for r in llm.engine.list_loras()] == ["m"]
