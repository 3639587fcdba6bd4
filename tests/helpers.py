"""Shared test helpers: word-level 'tokenizers' for the seeds' examples, manager shortcuts, a tiny
random-weight Llama and transformers' greedy reference. (Fixtures live in conftest.py; tests import
helpers from here, never from a conftest, since every test folder may have its own.)"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvpool.core.request import CacheRequest


class Words:
    """Maps each distinct word to a stable token id, so the seeds' sentences become token lists."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids) + 100) for w in text.split()]


def schedule(mgr: KVCacheManager, req: CacheRequest) -> KVCacheBlocks | None:
    """What the scheduler does to admit a request: lookup, then allocate the whole prompt."""
    hit, n_hit = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
    if out is not None:
        req.num_computed_tokens = req.num_tokens
    return out


def decode(mgr: KVCacheManager, req: CacheRequest, token: int) -> KVCacheBlocks | None:
    """One decode step: append the sampled token, then make room for it."""
    req.append_output_token_ids(token)
    out = mgr.allocate_slots(req, 1)
    if out is not None:
        req.num_computed_tokens += 1
    return out


def snapshot(mgr: KVCacheManager) -> tuple:
    """Everything an allocation could change, in both tiers: to assert that a failed one changed nothing."""
    pool, host = mgr.block_pool, mgr.host_pool
    return ([b.ref_cnt for b in pool.blocks], pool.free_block_ids(),
            {h: b.block_id for h, b in pool.cached.items()},
            {rid: [b.block_id for b in bl] for rid, bl in mgr.managers[0].req_to_blocks.items()},
            None if host is None else ([b.ref_cnt for b in host.blocks], host.free_block_ids(),
                                       {h: b.block_id for h, b in host.cached.items()}),
            (list(mgr._swap_plan.swap_out), list(mgr._swap_plan.swap_in)),
            None if mgr.host is None else (list(mgr.host._pinned), list(mgr.host._next_pinned)))


def run_request(mgr: KVCacheManager, rid: str, tokens: list[int], block_size: int,
                output: Sequence[int] = ()) -> tuple[list[int], int]:
    """Admit, compute and finish a request in one go, decoding `output` one token a step first
    (checking the pool after): the ids of its blocks and its hit tokens."""
    req = CacheRequest(rid, tokens, hasher=BlockHasher(block_size))
    hit, n_hit = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
    assert out is not None
    req.num_computed_tokens = req.num_tokens
    ids = [b.block_id for b in out.blocks[0]]
    for t in output:
        req.append_output_token_ids(t)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    if output:
        ids = mgr.get_block_ids(rid)[0]
    mgr.free(req)
    mgr.check_integrity()  # the policy's own invariants too
    return ids, n_hit


def make_request(rid: str, tokens: list[int], block_size: int, **kw: object) -> CacheRequest:
    return CacheRequest(rid, tokens, hasher=BlockHasher(block_size), **kw)  # type: ignore[arg-type]

TINY_VOCAB = 256


def make_tiny_model(path: Path, config_cls: str, model_cls: str, seed: int = 0, **cfg: object) -> Path:
    """A random-weight transformers model of the given classes, saved as a local folder."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    model.save_pretrained(path)
    return path


# The tiny hybrid models of the host-tier and store tests: Gemma-3 (5 sliding-window layers of window 24 and
# one full-attention layer) and LFM2 (short-convolution states and attention).
TINY_HYBRID_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
                          eos_token_id=None, bos_token_id=None, pad_token_id=None)


def make_tiny_hybrid_gemma3(path: Path) -> Path:
    return make_tiny_model(path, "Gemma3TextConfig", "Gemma3ForCausalLM", num_hidden_layers=6, head_dim=16,
                           query_pre_attn_scalar=16, sliding_window=24,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"], **TINY_HYBRID_COMMON)


def make_tiny_hybrid_lfm2(path: Path) -> Path:
    return make_tiny_model(path, "Lfm2Config", "Lfm2ForCausalLM", num_hidden_layers=6, conv_L_cache=3,
                           block_auto_adjust_ff_dim=False,
                           layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
                           **TINY_HYBRID_COMMON)


def make_tiny_llama(path: Path, seed: int = 0, **overrides: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               tie_word_embeddings=False, initializer_range=0.3, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path)
    return path


def rounding_cache(config: Any, kv_dtype: torch.dtype) -> Any:
    """A transformers KV cache that rounds every key and value to `kv_dtype` as it stores them (in their
    own dtype; saturating where fp16's and fp8's range ends): the reference of kvpool's `kv_cache_dtype`."""
    from transformers import DynamicCache

    from kvpool.runner.dtypes import round_to

    class RoundingCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return super().update(round_to(key_states, kv_dtype).to(key_states.dtype),
                                  round_to(value_states, kv_dtype).to(value_states.dtype), layer_idx, *args,
                                  **kwargs)

    return RoundingCache(config=config)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              kv_dtype: torch.dtype | None = None) -> list[list[int]]:
    """transformers' own greedy generate, fp32, one prompt at a time (no padding to blur it). `kv_dtype`:
    its KV cache rounds keys and values to that dtype (`rounding_cache`)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for p in prompts:
            extra = {} if kv_dtype is None else {"cache": rounding_cache(ref.config, kv_dtype)}
            ids = ref.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                               min_new_tokens=max_new_tokens if ref.generation_config.eos_token_id is None
                               else 0, **extra)
            out.append(ids[0][len(p):].tolist())
    return out


# A chat template for a vision model in the style of Llama 3.2 Vision's: content is a string, or a list of
# {"type": "image"} / {"type": "text"} parts, each image rendered as the image token.
MLLAMA_CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<|image|>{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def make_chat_mllama(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random-weight Mllama (Llama 3.2 Vision) served like a real one: SmolLM2's tokenizer plus the
    <|image|> token (id 49152, the first row past the text vocabulary, as in Llama 3.2 Vision), a chat template
    that places it, and transformers' `MllamaImageProcessor` for 8x8 tiles (up to 4) in the folder."""
    from transformers import AutoTokenizer, MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    image_token = tok.convert_tokens_to_ids("<|image|>")
    tok.chat_template = MLLAMA_CHAT_TEMPLATE
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=8, patch_size=4, max_num_tiles=4, intermediate_layers_indices=[0, 1],
                  vision_output_dim=96, initializer_range=0.05)
    # pad (image token + 1) never appears in a prompt (transformers would mask a pad token found in one).
    text = dict(vocab_size=image_token, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1], max_position_embeddings=512,
                initializer_range=0.3, bos_token_id=tok.bos_token_id, eos_token_id=None, pad_token_id=image_token + 1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text,
                                                        image_token_index=image_token))
    with torch.no_grad():  # the gates start at 0, which would hide the image from the text
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.uniform_(0.1, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    MllamaImageProcessorPil(size={"height": 8, "width": 8}, max_image_tiles=4).save_pretrained(path)
    return path
def make_peft_adapter(base_dir: Path, path: Path, *, r: int, targets: str | list[str], seed: int,
                      alpha: int | None = None, **cfg: object) -> Path:
    """A LoRA adapter made and saved by peft itself, with random A and B (init_lora_weights=False), so
    it changes the model's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r,
                                                  target_modules=targets, init_lora_weights=False, **cfg))
    peft_model.save_pretrained(str(path))
    return path


def peft_greedy(base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int
                ) -> list[list[int]]:
    """The reference with an adapter: transformers + PeftModel.from_pretrained, greedy, fp32, one prompt at
    a time (None: the base model alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter is not None:
        ref = PeftModel.from_pretrained(ref, str(adapter))
    ref.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            # Every position attended (no mask guessed from a pad id that a prompt may contain), no EOS.
            x = torch.tensor([p])
            ids = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
            out.append(ids[0][len(p):].tolist())
    return out


def stepped_text(engine: Any, prompt: str, params: Any) -> str:
    """A request's text as the engine's steps bring it, the engine stepped by hand until it finishes (to
    compare with the text `LLM.generate` gives the same request)."""
    req = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req.request_id:
                text = o.outputs[0].text
    return text


def fail_first_step(engine: object, fault: BaseException | None = None) -> dict[str, int]:
    """Make an engine's next step raise `fault` (RuntimeError("kernel exploded") by default) and the later
    ones run as before; the dict returned counts the steps tried since (`steps`)."""
    real, calls = engine.step, {"steps": 0}  # type: ignore[attr-defined]

    def step() -> list:
        calls["steps"] += 1
        if calls["steps"] == 1:
            raise fault if fault is not None else RuntimeError("kernel exploded")
        return real()

    engine.step = step  # type: ignore[attr-defined]
    return calls


def picture(seed: int, size: tuple[int, int] = (13, 21), fmt: str = "PNG", solid: bool = False) -> bytes:
    """Random RGB noise (or one colour: a few bytes however large), encoded; size is (width, height)."""
    import numpy as np
    from PIL import Image

    a = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    if solid:
        a[:] = a[0, 0]
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt)
    return buf.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"
