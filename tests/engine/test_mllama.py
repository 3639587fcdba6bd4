"""A cross-attention model (Mllama, tiny vision tower) on kvpool's paged cache, token for token against
transformers' `MllamaForConditionalGeneration.generate`: prefix caching on and off, chunked prefill, a pool
small enough to preempt, batched and one at a time, with and without an image, text before the image.
Also the cross-attention blocks (ceil(encoder tokens / block size) per cross group, never cached, freed
with the request), the encoder cache, and the image's content hash in the block hashes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import rounding_cache

from kvpool.core.request import MultiModalItem
from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner import model_runner
from kvpool.runner.models.mllama import CrossAttentionMetadata, plan_cross_attention
from kvpool.runner.multimodal import ImageInput, TiledImageInput

VOCAB = 256
IMAGE = 256  # the image token: the first row past the text vocabulary, as in Llama 3.2 Vision
TILES, PATCHES = 4, (8 // 4) ** 2 + 1  # max_num_tiles; patches per tile (class token included)
ENC = TILES * PATCHES  # 20 encoder tokens per image (padding tiles included, as transformers keeps them)
BS = 4
N_OUT = 12


def make_mllama(path: Path) -> Path:
    """5 text layers (cross-attention at 1 and 3), a 2+1-layer vision tower; gates randomised (they start at 0)."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=8, patch_size=4, max_num_tiles=TILES, intermediate_layers_indices=[0, 1],
                  vision_output_dim=96, initializer_range=0.05)
    # pad 257 is outside what prompts hold (transformers would mask a pad token found in a prompt).
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1, 3], max_position_embeddings=512,
                initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=257,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text,
                                                        image_token_index=IMAGE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.uniform_(0.1, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mllama(tmp_path_factory.mktemp("tiny-mllama"))


def image(seed: int, tiles: int) -> TiledImageInput:
    """Random tiles; aspect ratio id = tiles (the default ratios [1,1], [1,2], [1,3], [1,4] have ids 1..4)."""
    g = torch.Generator().manual_seed(seed)
    return TiledImageInput(torch.randn(TILES, 3, 8, 8, generator=g), tiles, [1] * tiles + [0] * (TILES - tiles))


IMG1, IMG2, IMG3 = image(1, 2), image(2, 3), image(3, 1)
TEXT = [(11 * i + 5) % 250 + 2 for i in range(36)]
A = [IMAGE, *TEXT[:30]]
E = [*TEXT[:6], IMAGE, *TEXT[6:30]]  # text before the image
CASES: list[tuple[str, list[int], TiledImageInput | None]] = [
    ("A", A, IMG1),
    ("B: A's text, another image", A, IMG2),
    ("C: A extended, same image", [*A, 17, 18, 19, 20, 21, 22, 23], IMG1),
    ("D: text only", TEXT, None),
    ("E: text before the image", E, IMG3),
    ("F: A's tokens, no image", A, None),
    ("G: E's text, another image", E, IMG1),
    ("H: E again, an equal image", E, TiledImageInput(IMG3.pixel_values.clone(), 1, [1, 0, 0, 0])),
]
PROMPTS = [c[1] for c in CASES]
IMAGES = [[c[2]] if c[2] is not None else [] for c in CASES]


def hf_reference(model_dir: Path, prompts: list[list[int]], images: list[list[TiledImageInput]],
                 n_out: int = N_OUT, kv_dtype: torch.dtype | None = None) -> list[list[int]]:
    """transformers' greedy generate, fp32, one prompt at a time, with the processor's cross-attention mask
    (`kv_dtype`: its cache rounding keys and values, as `tests/helpers.py::rounding_cache`)."""
    from transformers import MllamaForConditionalGeneration

    ref = MllamaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for prompt, img in zip(prompts, images, strict=True):
            kw: dict[str, Any] = hf_inputs(prompt, img[0]) if img else {}
            if kv_dtype is not None:
                kw["cache"] = rounding_cache(ref.config, kv_dtype)
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                               **kw)
            out.append(ids[0][len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(mllama_dir: Path) -> list[list[int]]:
    return hf_reference(mllama_dir, PROMPTS, IMAGES)


def hf_inputs(prompt: list[int], x: TiledImageInput) -> dict[str, torch.Tensor]:
    """What transformers' processor gives the model for one image: tiles, aspect ratio, cross-attention mask."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    mask = torch.tensor(x.aspect_ratio_mask)
    dense = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(prompt, IMAGE)], [[int(mask.sum())]], TILES, len(prompt))
    return dict(pixel_values=torch.as_tensor(x.pixel_values)[None, None],
                aspect_ratio_ids=torch.tensor([[x.aspect_ratio_id]]), aspect_ratio_mask=mask[None, None],
                cross_attention_mask=torch.tensor(dense))


def test_reference_depends_on_the_image(mllama_dir: Path, reference: list[list[int]]) -> None:
    from transformers import MllamaForConditionalGeneration

    # The images matter, else the comparisons below would not test the cross-attention path.
    assert reference[0] != reference[1] and reference[0] != reference[5]
    assert reference[4] != reference[6]
    assert reference[4] == reference[7]  # an equal image (another tensor) is the same input
    # Text before the image token depends on the image too: transformers gives its rows an all-zero
    # cross-attention mask (they attend to every encoder token; only the MLP output is zeroed). Hence the
    # image keys the first block: no prefix of such a prompt may be shared across images.
    ref = MllamaForConditionalGeneration.from_pretrained(str(mllama_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = [ref(torch.tensor([E]), **hf_inputs(E, x)).logits[0, :6] for x in (IMG3, IMG1)]
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)


SETTINGS = {
    "caching": dict(num_blocks=300),
    "no caching": dict(num_blocks=300, enable_prefix_caching=False),
    "chunked 16": dict(num_blocks=300, max_num_batched_tokens=16),
    "chunked 5": dict(num_blocks=300, max_num_batched_tokens=5),
    # The longest request (38 + 12 tokens) holds 3 * 13 self-attention blocks and 2 * 5 cross-attention
    # blocks: 49 of 53 usable. Together the requests must evict and preempt.
    "small pool": dict(num_blocks=54, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_tokens_equal_transformers(mllama_dir: Path, setting: str, reference: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    batched: list[int] = []  # decodes attending to their images in one call, per planned step

    def plan(*args: Any) -> CrossAttentionMetadata:
        meta = plan_cross_attention(*args)
        batched.append(len(meta.decode_seqs))
        return meta

    monkeypatch.setattr(model_runner, "plan_cross_attention", plan)
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, **SETTINGS[setting])
    eng = llm.engine
    # Five layers, cross-attention at 1 and 3: five groups of one layer (gcd of 3 and 2), in layer order.
    assert [type(s).__name__ for s in eng.kv.specs] == ["FullAttentionSpec", "CrossAttentionSpec"] * 2 + [
        "FullAttentionSpec"]
    params = SamplingParams.greedy(N_OUT)
    alone = [llm.generate([p], params, use_tqdm=False, mm_inputs=[m])[0] for p, m in zip(PROMPTS, IMAGES, strict=True)]
    together = llm.generate(PROMPTS, params, use_tqdm=False, mm_inputs=IMAGES)
    assert [o.outputs[0].token_ids for o in alone] == reference
    assert [o.outputs[0].token_ids for o in together] == reference
    eng.kv.check_integrity()
    assert eng.kv.get_num_free_blocks() == eng.kv.block_pool.num_usable_blocks  # everything released
    # Three distinct images, each through the vision tower once: later uses hit the encoder cache.
    assert eng.mm is not None and eng.mm.encoder_runs == 3
    if setting != "small pool":  # (there, image requests rarely run side by side)
        assert max(batched) >= 2  # the batched decode path was taken (and gave transformers' tokens)
    if setting == "small pool":
        assert eng.scheduler.stats.num_preemptions > 0
    if setting in ("caching", "chunked 16", "chunked 5"):
        # C shares A's 7 full blocks and image; H repeats E with an equal image (30 tokens before its last:
        # 7 blocks). Another image (B, G) or none (F) hits nothing, not even the text before the image.
        assert [o.num_cached_tokens for o in alone] == [0, 0, 28, 0, 0, 0, 0, 28]
    if setting == "no caching":
        assert all(o.num_cached_tokens == 0 for o in alone + together)


def test_cross_blocks_allocated_for_encoder_tokens_and_freed(mllama_dir: Path) -> None:
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=100)
    eng = llm.engine
    usable = eng.kv.block_pool.num_usable_blocks
    eng.add_request(A, SamplingParams.greedy(3), request_id="img", mm_inputs=[IMG1])
    eng.add_request(TEXT, SamplingParams.greedy(3), request_id="txt")
    eng.step()
    tables = eng.kv.get_block_ids("img")
    # Self-attention groups: ceil(31 / 4) = 8 blocks; cross-attention groups: ceil(20 / 4) = 5, never cached.
    assert [len(t) for t in tables] == [8, 5, 8, 5, 8]
    assert [len(t) for t in eng.kv.get_block_ids("txt")] == [9, 0, 9, 0, 9]
    for g in (1, 3):
        assert all(b.block_hash is None for b in eng.kv.managers[g].req_to_blocks["img"])
    assert eng.kv.get_num_free_blocks() == usable - 3 * 8 - 2 * 5 - 3 * 9
    cross_before = [list(tables[1]), list(tables[3])]
    eng.step()  # a decode: the cross tables do not grow
    assert [eng.kv.get_block_ids("img")[g] for g in (1, 3)] == cross_before
    assert eng.abort_request("img")
    eng.kv.check_integrity()
    # Freed cross blocks go to the front of the free queue (nothing cached in them to keep).
    assert set(eng.kv.block_pool.free_block_ids()[:10]) == {b for t in cross_before for b in t}
    # All of the aborted request's blocks are free; the text request holds 3 groups * ceil(37 / 4) blocks.
    assert eng.kv.get_num_free_blocks() == usable - 3 * 10
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.get_num_free_blocks() == usable


def test_encoder_states_written_once_per_admission(mllama_dir: Path) -> None:
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=300,
              max_num_batched_tokens=8)
    eng = llm.engine
    assert eng.mm is not None
    writes: list[str] = []
    step = eng.mm.step

    def spy(request_id: str, num_preemptions: int, p: object) -> object:
        out = step(request_id, num_preemptions, p)  # type: ignore[arg-type]
        if out.states is not None:
            writes.append(request_id)
        return out

    eng.mm.step = spy  # type: ignore[method-assign]
    outs = llm.generate([A, A], SamplingParams.greedy(4), use_tqdm=False, mm_inputs=[[IMG1], [IMG1]])
    # Four prefill chunks and three decodes each, but the encoder states are written once per request (its
    # own cross blocks), and the vision tower runs once for both.
    assert sorted(writes) == [o.request_id for o in outs]
    assert eng.mm.encoder_runs == 1


@pytest.mark.parametrize(("mm", "message"), [
    ([IMG1, IMG2], "mm_inputs: this model takes at most one image per request, got 2"),
    ([ImageInput(0, torch.zeros(3, 8, 8))], "mm_inputs: this cross-attention model takes a TiledImageInput "
                                           "(tiles' pixel values, aspect ratio id and mask), got ImageInput"),
    ([TiledImageInput(torch.zeros(2, 3, 8, 8), 1, [1, 0, 0, 0])],
     "mm_inputs: pixel_values must have shape (4, 3, 8, 8), got (2, 3, 8, 8)"),
    ([TiledImageInput(torch.zeros(4, 3, 8, 8, dtype=torch.bool), 1, [1, 0, 0, 0])],
     "mm_inputs: pixel_values must be an array of numbers, got dtype torch.bool"),
    ([TiledImageInput(torch.full((4, 3, 8, 8), float("nan")), 1, [1, 0, 0, 0])],
     "mm_inputs: pixel_values must be finite (NaN or inf found)"),
    ([TiledImageInput(torch.zeros(4, 3, 8, 8), 0, [1, 0, 0, 0])],
     "mm_inputs: aspect_ratio_id must be an int in [1, 8], got 0"),
    ([TiledImageInput(torch.zeros(4, 3, 8, 8), 1, [0, 1, 0, 0])],
     "mm_inputs: aspect_ratio_mask must be ones for the image's tiles, then zeros; got [0, 1, 0, 0]"),
    ([TiledImageInput(torch.zeros(4, 3, 8, 8), 1, [1, 2, 0, 0])],
     "mm_inputs: aspect_ratio_mask must be 4 zeros and ones, got [1, 2, 0, 0]"),
])
def test_bad_images_are_refused(mllama_dir: Path, mm: list, message: str) -> None:
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=100)
    with pytest.raises(ValueError) as e:
        llm.generate([A, TEXT], SamplingParams.greedy(2), use_tqdm=False, mm_inputs=[[IMG1], mm])
    assert str(e.value) == message
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.get_num_free_blocks() == llm.engine.kv.block_pool.num_usable_blocks


def test_image_needs_its_token(mllama_dir: Path) -> None:
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=100)
    for prompt, n in ((TEXT, 0), ([IMAGE, *TEXT, IMAGE], 2)):
        with pytest.raises(ValueError) as e:
            llm.engine.add_request(prompt, SamplingParams.greedy(2), mm_inputs=[IMG1])
        assert str(e.value) == (f"mm_inputs: the prompt must hold the image token (id {IMAGE}) exactly once for its "
                                f"image; found it {n} times")
    with pytest.raises(ValueError) as e:
        llm.engine.add_request(A, SamplingParams.greedy(2), mm_items=[MultiModalItem("h", 0, 1)])
    assert str(e.value) == "mm_items: a cross-attention model needs the image itself (mm_inputs)"
    with pytest.raises(ValueError, match=r"^prompt_token_ids: token ids must be in \[0, 264\)"):
        llm.engine.add_request([264], SamplingParams.greedy(2))
    from kvpool.runner.vision import TinyVisionEncoder

    with pytest.raises(ValueError, match=r"^vision_encoder: Mllama reads images with its own vision tower"):
        LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=100,
            vision_encoder=TinyVisionEncoder(out_dim=64))


def test_bfloat16_packed_runs(mllama_dir: Path, reference: list[list[int]]) -> None:
    # The default dtype packs every projection (cross-attention ones included) for oneDNN: it must run, and
    # the image must still change what it generates.
    llm = LLM(str(mllama_dir), skip_tokenizer_init=True, block_size=BS, num_blocks=300)
    outs = llm.generate([A, A], SamplingParams.greedy(N_OUT), use_tqdm=False, mm_inputs=[[IMG1], []])
    assert [len(o.outputs[0].token_ids) for o in outs] == [N_OUT, N_OUT]
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_a_bf16_kv_cache_equals_transformers_rounding_its_cache(mllama_dir: Path, reference: list[list[int]]
                                                                ) -> None:
    """Self- and cross-attention keys and values stored in bf16 under the fp32 model (`kv_cache_dtype`)."""
    want = hf_reference(mllama_dir, PROMPTS, IMAGES, kv_dtype=torch.bfloat16)
    assert want != reference  # the rounding changes tokens here: the comparison below can fail
    llm = LLM(str(mllama_dir), dtype="float32", kv_cache_dtype="bfloat16", skip_tokenizer_init=True, block_size=BS,
              num_blocks=300, max_num_batched_tokens=16)
    params = SamplingParams.greedy(N_OUT)
    alone = [llm.generate([p], params, use_tqdm=False, mm_inputs=[m])[0] for p, m in zip(PROMPTS, IMAGES, strict=True)]
    together = llm.generate(PROMPTS, params, use_tqdm=False, mm_inputs=IMAGES)
    assert [o.outputs[0].token_ids for o in alone] == want
    assert [o.outputs[0].token_ids for o in together] == want
    assert [o.num_cached_tokens for o in alone] == [0, 0, 28, 0, 0, 0, 0, 28]
    llm.engine.kv.check_integrity()


def test_long_shared_prefix_with_an_image_cascades(mllama_dir: Path) -> None:
    # Requests sharing 80 tokens and their image decode together through cascade attention over the shared
    # self-attention blocks, each still reading its own cross-attention blocks (on the CPU: a GPU runs no
    # cascades).
    long = [IMAGE, *((7 * i + 3) % 250 + 2 for i in range(80))]
    prompts, images = [[*long, 30, 31], [*long, 40, 41, 42]], [[IMG2], [IMG2]]
    llm = LLM(str(mllama_dir), dtype="float32", skip_tokenizer_init=True, block_size=BS, num_blocks=300, device="cpu")
    llm.generate(prompts[:1], SamplingParams.greedy(1), use_tqdm=False, mm_inputs=images[:1])
    outs = llm.generate(prompts, SamplingParams.greedy(6), use_tqdm=False, mm_inputs=images)
    assert [o.num_cached_tokens for o in outs] == [80, 80]
    assert llm.engine.runner.num_cascade_steps > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(mllama_dir, prompts, images, 6)
