"""Images in the thinker: a seeded random vision tower's embeddings replace placeholder tokens, the
image's content hash and offset enter the block hashes, and the encoder cache spares encoder runs,
including the seed's straddling image where only the first block is a prefix hit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.engine.engine import LLMEngine
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.encoder_cache import EncoderCache
from kvpool.runner.multimodal import EmbedsInput, ImageInput
from kvpool.runner.vision import TinyVisionEncoder

P = 1  # the placeholder token id


def image(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((3, 8, 8), generator=g)


def engine(model: Path, caching: bool = True, **kw: object) -> LLMEngine:
    kw = {"num_blocks": 64, "stage_outputs": True, "vision_encoder": TinyVisionEncoder(out_dim=64, seed=0), **kw}
    return LLMEngine(model=str(model), dtype="float32", skip_tokenizer_init=True, block_size=4, batch_invariant=True,
                     enable_prefix_caching=caching, **kw)


def run(eng: LLMEngine, prompt: list[int], images: list[ImageInput]) -> RequestOutput:
    req = eng.add_request(prompt, SamplingParams.greedy(4), mm_inputs=images)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id == req.request_id:
                out = o
    assert out is not None
    return out


def same(a: RequestOutput, b: RequestOutput) -> bool:
    assert a.stage_outputs is not None and b.stage_outputs is not None
    return a.token_ids == b.token_ids and torch.equal(a.stage_outputs["hidden_states"],
                                                      b.stage_outputs["hidden_states"])


def test_straddling_image_hits_its_first_block_and_the_encoder_cache(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir)
    assert eng.mm.encoder is not None and eng.mm.encoder.num_tokens == 4
    # [t0 t1 Im0 Im1] [Im2 Im3 foo]: the image straddles the block boundary.
    first = run(eng, [5, 6, P, P, P, P, 9], [ImageInput(2, image(0))])
    assert eng.mm.encoder_runs == 1 and first.num_cached_tokens == 0
    # [t0 t1 Im0 Im1] [Im2 Im3 bar baz]: block 0 (with the image's first half) is a hit; Im2 and Im3
    # are recomputed with the embeddings from the encoder cache: no second encoder run.
    second = run(eng, [5, 6, P, P, P, P, 10, 11], [ImageInput(2, image(0).numpy())])  # same content, as numpy
    assert second.num_cached_tokens == 4
    assert eng.mm.encoder_runs == 1 and eng.mm.cache.hits == 1
    assert eng.stage_outputs is not None and eng.stage_outputs.rows_from_cache == 4
    fresh = engine(tiny_llama_dir, caching=False)
    ref = run(fresh, [5, 6, P, P, P, P, 10, 11], [ImageInput(2, image(0))])
    assert same(second, ref)
    # Same placeholder tokens, another image: no hit, and the encoder runs for it.
    third = run(eng, [5, 6, P, P, P, P, 10, 11], [ImageInput(2, image(1))])
    assert third.num_cached_tokens == 0 and eng.mm.encoder_runs == 2
    assert not torch.equal(third.stage_outputs["hidden_states"][2:], second.stage_outputs["hidden_states"][2:])
    ref3 = run(fresh, [5, 6, P, P, P, P, 10, 11], [ImageInput(2, image(1))])
    assert same(third, ref3)
    eng.kv.check_integrity()


def test_a_buffer_the_caller_reuses_after_adding_changes_nothing(tiny_llama_dir: Path) -> None:
    """The request keeps its own copy of the pixels (a tensor or an array) and of the embeddings: a caller
    that reuses its buffer for the next input once the request is made must not make it compute from the new
    input under the old one's hash (its blocks and encoder-cache entry then served the old input's requests
    the new input's output)."""
    prompt = [P] * 4 + [5, 6, 7, 8, 9]
    embeds = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    cases = [(ImageInput, image(0), image(1)), (ImageInput, image(0).numpy(), image(1).numpy()),
             (EmbedsInput, embeds, embeds + 1)]
    for kind, first, second in cases:
        eng = engine(tiny_llama_dir)
        buf = first.copy() if isinstance(first, np.ndarray) else first.clone()
        eng.add_request(prompt, SamplingParams.greedy(4), mm_inputs=[kind(0, buf)])
        buf[...] = second  # the caller's next input, in the same buffer
        while eng.has_unfinished_requests():
            eng.step()
        later = run(eng, [*prompt, 10], [kind(0, first)])
        assert later.num_cached_tokens == 8, kind
        assert same(later, run(engine(tiny_llama_dir, caching=False), [*prompt, 10], [kind(0, first)])), kind


def test_an_image_inside_the_hit_needs_no_encoder(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir, encoder_cache_size="1b")  # the cache keeps nothing
    run(eng, [P, P, P, P, 20, 21], [ImageInput(0, image(0))])
    assert eng.mm.encoder_runs == 1 and len(eng.mm.cache) == 0
    out = run(eng, [P, P, P, P, 30, 31, 32], [ImageInput(0, image(0))])
    assert out.num_cached_tokens == 4 and eng.mm.encoder_runs == 1  # block 0 holds the whole image
    out = run(eng, [P, P, P, P, 30, 31, 32], [ImageInput(0, image(2))])
    assert out.num_cached_tokens == 0 and eng.mm.encoder_runs == 2


def test_chunked_prefill_runs_the_encoder_once(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir, max_num_batched_tokens=3)  # the image spans chunks [0,3) and [3,6)
    out = run(eng, [5, 6, P, P, P, P, 9, 9], [ImageInput(2, image(0))])
    assert eng.mm.encoder_runs == 1 and eng.mm.cache.hits >= 1
    assert same(out, run(engine(tiny_llama_dir, caching=False), [5, 6, P, P, P, P, 9, 9], [ImageInput(2, image(0))]))


def test_image_file_and_bad_inputs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    eng = engine(tiny_llama_dir)
    f = tmp_path / "img.npy"
    np.save(f, image(0).numpy())
    a = run(eng, [5, 6, P, P, P, P, 9], [ImageInput(2, f)])
    assert a.num_cached_tokens == 0 and eng.mm.encoder_runs == 1
    free = eng.kv.get_num_free_blocks()
    with pytest.raises(ValueError, match=r"images: expected pixel shape \(3, 8, 8\), got \(3, 4, 4\)"):
        eng.add_request([5, P, P, P, P], mm_inputs=[ImageInput(1, torch.zeros(3, 4, 4))])
    with pytest.raises(ValueError, match="mm_inputs: image at offset 3 needs 4 placeholder tokens; the prompt has 5"):
        eng.add_request([5, P, P, P, P], mm_inputs=[ImageInput(3, image(0))])
    with pytest.raises(ValueError, match="mm_inputs: inputs at offsets 0 and 2 overlap"):
        eng.add_request([P] * 8, mm_inputs=[ImageInput(2, image(0)), ImageInput(0, image(1))])
    with pytest.raises(ValueError, match=r"mm_inputs: embeddings must be \(n >= 1, 64\), got \(2, 3\)"):
        eng.add_request([P] * 8, mm_inputs=[EmbedsInput(0, torch.zeros(2, 3))])
    with pytest.raises(ValueError, match=r"mm_inputs: image file '/nonexistent\.npy' not found"):
        eng.add_request([P] * 8, mm_inputs=[ImageInput(0, "/nonexistent.npy")])
    # Values that would make every logit NaN, types that are not numbers, offsets that are not ints, and
    # inputs not given as the prompt's list: each refused by its field, before anything runs.
    nan = image(0).clone()
    nan[1, 2, 3] = float("nan")
    bad = [(ImageInput(0, nan), r"mm_inputs: image pixels must be finite \(NaN or inf found\)"),
           (EmbedsInput(0, torch.full((2, 64), float("inf"))), r"mm_inputs: embeddings must be finite"),
           (EmbedsInput(0, torch.zeros(2, 64, dtype=torch.bool)), r"embeddings must be an array of numbers, got dtype "
                                                                  r"torch\.bool"),
           (EmbedsInput(0, [["x"] * 64] * 2), r"mm_inputs: embeddings must be an array of numbers"),
           (EmbedsInput("2", torch.zeros(2, 64)), r"mm_inputs: embeds offset must be an int, got '2'"),
           (EmbedsInput(2.5, torch.zeros(2, 64)), r"mm_inputs: embeds offset must be an int, got 2\.5"),
           (EmbedsInput(0, torch.zeros(2, 64, device="meta")), r"mm_inputs: embeddings must be a dense tensor "
                                                              r"holding its values, got one with layout torch\.strided "
                                                              r"on meta"),
           (ImageInput(0, torch.zeros(3, 8, 8).to_sparse()), r"mm_inputs: image pixels must be a dense tensor .*"
                                                            r"torch\.sparse_coo")]
    for x, message in bad:
        with pytest.raises(ValueError, match=message):
            eng.add_request([P] * 8, mm_inputs=[x])
    with pytest.raises(ValueError, match=r"mm_inputs: a list of the prompt's inputs .*got EmbedsInput"):
        eng.add_request([P] * 8, mm_inputs=EmbedsInput(0, torch.zeros(2, 64)))  # type: ignore[arg-type]
    # Numbers as nested lists or numpy arrays are taken (as float32 where they are not floating point).
    eng.add_request([P] * 8, mm_inputs=[EmbedsInput(0, np.ones((2, 64), dtype=np.int64))])
    eng.add_request([P] * 8, mm_inputs=[EmbedsInput(0, [[0.5] * 64] * 2)])
    while eng.has_unfinished_requests():
        eng.step()
    plain = LLMEngine(model=str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=16)
    with pytest.raises(ValueError, match=r"mm_inputs: this engine has no vision encoder \(set vision_encoder\)"):
        plain.add_request([P] * 8, mm_inputs=[ImageInput(0, image(0))])
    assert eng.kv.get_num_free_blocks() == free and not eng.has_unfinished_requests()


def test_image_files_that_are_not_a_npy_array(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # What `kvpool omni --image FILE` and Python callers may pass: each is a ValueError naming mm_inputs and the
    # file, not numpy's own exception (EOFError for an empty file) or words, and no block stays held.
    eng = engine(tiny_llama_dir, num_blocks=32)
    free = eng.kv.get_num_free_blocks()
    good = image(0).numpy()
    np.save(tmp_path / "good.npy", good)
    whole = (tmp_path / "good.npy").read_bytes()
    files = {
        "empty.npy": b"",
        "truncated.npy": whole[:200],
        "text.npy": b"hello, not an array\n",
        "bad_header.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'}" + b" " * 10,
    }
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    np.save(tmp_path / "object.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "arrays.npz", x=good)
    for name in [*files, "object.npy", "arrays.npz"]:
        path = tmp_path / name
        with pytest.raises(ValueError) as e:
            eng.add_request([5, P, P, P, P, 9], mm_inputs=[ImageInput(1, path)])
        assert str(e.value).startswith(f"mm_inputs: image file {str(path)!r} is not a readable .npy array ("), name
    assert eng.kv.get_num_free_blocks() == free and not eng.has_unfinished_requests()
    out = run(eng, [5, P, P, P, P, 9], [ImageInput(1, tmp_path / "good.npy")])  # a good one still is
    assert out.finished


def test_encoder_cache_is_lru_bounded_by_bytes() -> None:
    c = EncoderCache(capacity_bytes=2 * 64)
    t = [torch.full((4, 4), float(i)) for i in range(3)]  # 64 bytes each
    c.put("a", t[0])
    c.put("b", t[1])
    assert c.get("a") is t[0]  # a is now the most recent
    c.put("c", t[2])  # evicts b, the least recently used
    assert c.keys() == ["a", "c"] and c.used_bytes == 128 and c.evictions == 1
    assert c.get("b") is None and (c.hits, c.misses) == (1, 1)
    c.put("big", torch.zeros(100))  # 400 bytes: never fits, not kept, nothing evicted for it
    assert c.keys() == ["a", "c"]
    with pytest.raises(ValueError, match="encoder_cache_size: must be >= 0 bytes, got -1"):
        EncoderCache(-1)


def test_an_image_key_names_the_encoder_so_a_shared_store_never_serves_another_towers_kv(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two engines sharing a store, the same model and pixels, different vision towers: the second must
    compute its own KV (the first one's embeddings of the same picture are not its own)."""
    prompt, img = [P] * 4 + list(range(10, 30)), [ImageInput(0, image(0))]

    def tokens(seed: int, store: bool) -> tuple[list[int], int]:
        kw = dict(num_host_blocks=64, write_through=True, kv_store=f"file://{tmp_path}") if store else {}
        eng = engine(tiny_llama_dir, vision_encoder=TinyVisionEncoder(out_dim=64, seed=seed), stage_outputs=False,
                     **kw)
        out = run(eng, prompt, img)
        if eng.store is not None:
            eng.store.close()
        return out.token_ids, out.num_cached_tokens

    first = tokens(0, store=True)
    assert tokens(0, store=True) == (first[0], 20)  # the same tower hits the store
    own = tokens(1, store=False)
    assert own[0] != first[0] and tokens(1, store=True) == (own[0], 0)


def test_hashes_without_content_and_a_vision_encoder_that_is_not_one_are_refused(tiny_llama_dir: Path) -> None:
    from kvpool.core.request import MultiModalItem

    eng = engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"^mm_items: give the inputs themselves \(mm_inputs\)"):
        eng.add_request([P] * 4 + [9, 10], mm_items=[MultiModalItem("h", 0, 4)])
    assert eng.kv.get_num_free_blocks() == 63 and not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"^vision_encoder: expected an nn.Module with check\(pixels\) and num_tokens"):
        engine(tiny_llama_dir, vision_encoder="siglip")
