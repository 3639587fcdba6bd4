"""`kvpool bench memory`: KV memory of hybrid models, a uniform allocator versus kvpool's hybrid one.

For each model config in `kvpool/bench/configs/` (the fields of the real configs that size the KV
cache), several context lengths (and image sizes for mllama), it drives two `KVCacheManager`s over the
same byte budget, admitting requests of that context (distinct tokens, chunked prefill, then one
empty step so out-of-window blocks and old Mamba states are released as the next step would) until
one no longer fits:

- uniform: the RFC's baseline, vLLM before the hybrid allocator: every token gets KV in every layer,
  each layer treated as full attention (Mamba layers given the attention layers' KV shape); for
  mllama the text and the image tokens have separate block tables (as vLLM V0 did), both holding all
  40 layers;
- kvpool: the layers grouped by the RFC's rule (`group_layers`), one manager per group, one pool of
  equal pages, or two-level pages when page sizes differ (Jamba's Mamba states).

Waste = 1 - (bytes the model needs) / (bytes the allocator holds), where the need is computed from
the config alone: T tokens for full attention, min(T, window) for sliding-window layers, the encoder
tokens for cross-attention layers, one state for Mamba layers. kvpool's held bytes are its pages in
use (with two-level pages: its large pages not wholly free). The RFC's figures hold for its cases:
Gemma-2 at 8192 tokens (25%), Ministral at 128k (56.25%), mllama with a 4-tile image and a short
prompt (79.6%: the RFC states neither prompt length nor tiles; 43 text tokens with 6404 image tokens
give it with its BLOCK_SIZE=1, `--block-size 1`; 16-token blocks round the 43 tokens up to 48).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.bench.report import emit, format_table
from kvpool.core.grouping import common_page_size, group_layers
from kvpool.core.hashing import BlockHasher
from kvpool.core.kv_cache_manager import KVCacheManager
from kvpool.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    dtype_bytes,
)
from kvpool.core.request import CacheRequest
from kvpool.core.two_level_pool import TwoLevelBlockPool

CONFIG_DIR = Path(__file__).parent / "configs"
MODELS = ["gemma-2-9b", "ministral-8b", "llama-3.2-11b-vision", "jamba-mini", "gemma-3-270m"]
GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated config names (kvpool/bench/configs/NAME.json) or paths to JSON files")
    p.add_argument("--budget", default=None, help="KV memory for every model (e.g. 80GiB); default: each config's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--contexts", default=None, help="comma-separated context lengths instead of each config's")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk, tokens per allocation (the engine's default step budget)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def load_config(name: str) -> dict[str, Any]:
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"models: no config {path} (known: {', '.join(MODELS)})")
    cfg = json.loads(path.read_text())
    for field in ("name", "num_hidden_layers", "num_key_value_heads", "head_dim", "dtype"):
        if field not in cfg:
            raise ValueError(f"{path.name}: missing field {field!r}")
    return cfg


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """'full', 'sliding', 'cross' or 'mamba' for each layer."""
    n = cfg["num_hidden_layers"]
    if "cross_attention_layers" in cfg:
        cross = set(cfg["cross_attention_layers"])
        return ["cross" if i in cross else "full" for i in range(n)]
    if "attn_layer_period" in cfg:
        period, offset = cfg["attn_layer_period"], cfg["attn_layer_offset"]
        return ["full" if i % period == offset else "mamba" for i in range(n)]
    pattern = cfg.get("layer_pattern", ["full"])
    return [pattern[i % len(pattern)] for i in range(n)]


def layer_specs(cfg: dict[str, Any], block_size: int) -> list[KVCacheSpec]:
    kw = dict(block_size=block_size, num_kv_heads=cfg["num_key_value_heads"], head_size=cfg["head_dim"],
              dtype_bytes=dtype_bytes(cfg["dtype"]))
    out: list[KVCacheSpec] = []
    for kind in layer_kinds(cfg):
        if kind == "full":
            out.append(FullAttentionSpec(**kw))
        elif kind == "sliding":
            out.append(SlidingWindowSpec(**kw, sliding_window=cfg["sliding_window"]))
        elif kind == "cross":
            out.append(CrossAttentionSpec(**kw))
        elif kind == "mamba":
            m = cfg["mamba"]
            out.append(MambaSpec(block_size=block_size,
                                 state_shapes=((m["d_conv"] - 1, m["d_inner"]), (m["d_inner"], m["d_state"])),
                                 state_dtype_bytes=(dtype_bytes(m["conv_dtype"]), dtype_bytes(m["ssm_dtype"]))))
        else:
            raise ValueError(f"{cfg['name']}: unknown layer type {kind!r}")
    return out


def encoder_tokens(cfg: dict[str, Any], image: tuple[int, int] | None) -> int:
    """mllama: tiles of image_size pixels (at most max_num_tiles), (image_size / patch)^2 + 1 tokens each."""
    if image is None:
        return 0
    v = cfg["vision"]
    tiles = min(v["max_num_tiles"], math.ceil(image[0] / v["image_size"]) * math.ceil(image[1] / v["image_size"]))
    return tiles * ((v["image_size"] // v["patch_size"]) ** 2 + 1)


def needed_bytes(specs: list[KVCacheSpec], context: int, num_encoder: int) -> int:
    """What the model needs for one request, from the config alone (no blocks)."""
    total = 0
    for s in specs:
        per_token = s.page_size_bytes // s.block_size
        if isinstance(s, MambaSpec):
            total += s.page_size_bytes
        elif isinstance(s, SlidingWindowSpec):
            total += per_token * min(context, s.sliding_window)
        elif isinstance(s, CrossAttentionSpec):
            total += per_token * num_encoder
        else:
            total += per_token * context
    return total


@dataclass
class Fill:
    max_requests: int
    held_bytes: int  # bytes the allocator holds with max_requests requests admitted
    seconds: float


def fill(mgr: KVCacheManager, context: int, num_encoder: int, chunk: int, block_size: int,
         page_bytes: int | None) -> Fill:
    """Admit requests of `context` distinct tokens until one does not fit; count what is held."""
    t0 = time.perf_counter()
    hasher = BlockHasher(block_size, "xxh3_128")
    n = 0
    while True:
        base = n * context
        req = CacheRequest(f"r{n}", range(base, base + context), hasher=hasher, num_encoder_tokens=num_encoder)
        ok = True
        while ok and req.num_computed_tokens < context:
            k = min(chunk, context - req.num_computed_tokens)
            ok = mgr.allocate_slots(req, k) is not None
            if ok:
                req.num_computed_tokens += k
        # The next step's allocation releases what no later token needs (out-of-window blocks, old states).
        if not ok or mgr.allocate_slots(req, 0) is None:
            mgr.free(req)
            break
        n += 1
    pool = mgr.block_pool
    if isinstance(pool, TwoLevelBlockPool):
        held = pool.bytes_in_use()
    else:
        assert page_bytes is not None
        held = (pool.num_usable_blocks - pool.get_num_free_blocks()) * page_bytes
    return Fill(n, held, time.perf_counter() - t0)


def pages_in(budget: int, page: int) -> int:
    if budget // page < 2:
        raise ValueError(f"budget: {budget} bytes hold fewer than 2 pages of {page} bytes (one is the null page)")
    return budget // page


def kvpool_manager(specs: list[KVCacheSpec], budget: int, block_size: int) -> tuple[KVCacheManager, int | None]:
    groups = group_layers(specs)
    page = common_page_size(groups)
    group_specs = [g.spec for g in groups]
    if page is not None:
        return KVCacheManager(pages_in(budget, page), block_size, specs=group_specs), page
    sizes = [g.page_size_bytes for g in groups]
    return KVCacheManager(pages_in(budget, math.lcm(*sizes)), block_size, specs=group_specs, page_sizes=sizes), None


def uniform_manager(specs: list[KVCacheSpec], block_size: int, budget: int, has_encoder: bool
                    ) -> tuple[KVCacheManager, int]:
    attn = next(s for s in specs if not isinstance(s, MambaSpec))
    full = FullAttentionSpec(block_size, attn.num_kv_heads, attn.head_size, attn.dtype_bytes)
    page = full.page_size_bytes * len(specs)  # a block holds every layer
    group_specs: list[KVCacheSpec] = [full]
    if has_encoder:
        group_specs.append(CrossAttentionSpec(block_size, attn.num_kv_heads, attn.head_size, attn.dtype_bytes))
    return KVCacheManager(pages_in(budget, page), block_size, specs=group_specs), page


def measure(cfg: dict[str, Any], context: int, image: tuple[int, int] | None, budget: int, block_size: int,
            chunk: int) -> dict[str, Any]:
    specs = layer_specs(cfg, block_size)
    num_encoder = encoder_tokens(cfg, image)
    need = needed_bytes(specs, context, num_encoder)
    umgr, upage = uniform_manager(specs, block_size, budget, num_encoder > 0)
    uni = fill(umgr, context, num_encoder, chunk, block_size, upage)
    kmgr, kpage = kvpool_manager(specs, budget, block_size)
    kv = fill(kmgr, context, num_encoder, chunk, block_size, kpage)

    def waste(f: Fill) -> float | None:
        return None if f.max_requests == 0 else 1.0 - f.max_requests * need / f.held_bytes

    rfc = cfg.get("rfc_case")
    rfc_waste = None
    if rfc and rfc["context_tokens"] == context and (rfc.get("image") is None or tuple(rfc["image"]) == image):
        rfc_waste = rfc["uniform_waste"]
    return dict(model=cfg["name"], context_tokens=context, image=list(image) if image else None,
                encoder_tokens=num_encoder, budget_bytes=budget, block_size=block_size,
                groups=len(kmgr.managers), two_level=isinstance(kmgr.block_pool, TwoLevelBlockPool),
                needed_bytes_per_request=need,
                uniform_bytes_per_request=uni.held_bytes // uni.max_requests if uni.max_requests else None,
                kvpool_bytes_per_request=kv.held_bytes // kv.max_requests if kv.max_requests else None,
                uniform_waste=waste(uni), kvpool_waste=waste(kv), rfc_uniform_waste=rfc_waste,
                uniform_max_requests=uni.max_requests, kvpool_max_requests=kv.max_requests,
                seconds=round(uni.seconds + kv.seconds, 3))


def cases_of(cfg: dict[str, Any], contexts: list[int] | None) -> list[tuple[int, tuple[int, int] | None]]:
    images: list[tuple[int, int] | None] = [tuple(i) for i in cfg.get("images", [])] or [None]  # type: ignore[misc]
    return [(c, img) for img in images for c in (contexts or cfg.get("contexts", [4096]))]


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvpool.engine.config import parse_size  # torch-free: sizes such as '80GiB'

    if a.block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {a.block_size}")
    if a.chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {a.chunk}")
    contexts = None
    if a.contexts is not None:  # ('' names no length: refused below, not the configs' own lengths)
        try:
            contexts = [int(c) for c in a.contexts.split(",")]
        except ValueError:
            raise ValueError(f"contexts: comma-separated integers expected, got {a.contexts!r}") from None
        if any(c < 1 for c in contexts):
            raise ValueError(f"contexts: every length must be >= 1, got {contexts}")
    cases = []
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    if not names:
        raise ValueError(f"models: name at least one of {', '.join(MODELS)}")
    for name in names:
        cfg = load_config(name)
        budget = parse_size(a.budget or cfg.get("budget", "80GiB"), "budget")
        for context, image in cases_of(cfg, contexts):
            cases.append(measure(cfg, context, image, budget, a.block_size, a.chunk))

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.2f}%"

    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / GIB:.3f}"

    rows = [[c["model"], c["context_tokens"], f"{c['image'][0]}x{c['image'][1]} ({c['encoder_tokens']})"
             if c["image"] else "-", f"{c['budget_bytes'] / GIB:.0f}", c["groups"],
             gib(c["needed_bytes_per_request"]), gib(c["uniform_bytes_per_request"]),
             gib(c["kvpool_bytes_per_request"]),
             pct(c["uniform_waste"]) + ("" if c["rfc_uniform_waste"] is None
                                         else f" (RFC {pct(c['rfc_uniform_waste'])})"),
             pct(c["kvpool_waste"]), c["uniform_max_requests"], c["kvpool_max_requests"]]
            for c in cases]
    table = format_table(["model", "context", "image (tokens)", "budget GiB", "groups", "need GiB/req",
                          "uniform GiB/req", "kvpool GiB/req", "uniform waste", "kvpool waste",
                          "uniform max reqs", "kvpool max reqs"], rows)
    result = dict(benchmark="memory", cases=cases)
    emit(table, result, a.json)
    return result
