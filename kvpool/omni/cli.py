"""`kvpool omni "prompt"`: the reference thinker -> talker pipeline from the shell. The pipeline's flags are
shared with `kvpool omni-serve` (kvpool.omni.serve), which serves the same pipeline over HTTP."""

from __future__ import annotations

import argparse
from typing import Any


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """The reference pipeline's flags (both stages)."""
    p.add_argument("--model", default=None, help="thinker: local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--talker", default=None, help="talker folder (default: the seeded random talker)")
    p.add_argument("--thinker-tokens", type=int, default=48)
    p.add_argument("--talker-tokens", type=int, default=32)
    p.add_argument("--layer", type=int, default=None, help="thinker layer whose states are passed on (default: middle)")
    p.add_argument("--no-prefix-caching", action="store_true", help="both stages: no prefix (or stage-output) caching")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="both stages (batch-invariant kernels exist for both; auto: bf16 where native)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0, help="seed of the talker, connector and vision tower weights")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="+", help="the prompt (several: one pipeline run each, batched)")
    p.add_argument("--image", action="append", default=None,
                   help="a (3, 8, 8) float image as a .npy file, placed before the prompt (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the thinker's chat template")
    add_pipeline_arguments(p)


def build_pipeline(a: argparse.Namespace, vision: bool) -> Any:
    """The reference pipeline the flags of `add_pipeline_arguments` describe."""
    from kvpool.omni.pipeline import reference_pipeline

    engine = dict(block_size=a.block_size, kv_cache_memory=a.kv_cache_memory)
    return reference_pipeline(a.model, a.talker, enable_prefix_caching=not a.no_prefix_caching,
                              thinker_tokens=a.thinker_tokens, talker_tokens=a.talker_tokens, layer=a.layer,
                              thinker_engine=engine, talker_engine=engine, vision=vision, seed=a.seed, dtype=a.dtype)


def run(a: argparse.Namespace) -> None:
    pipe = build_pipeline(a, vision=bool(a.image))
    thinker = pipe.stages[0].engine
    prompts, images = [], []
    for q in a.prompt:
        if a.raw or not getattr(thinker.tokenizer, "chat_template", None):
            ids = thinker.encode(q)
        else:
            ids = thinker.apply_chat_template([{"role": "user", "content": q}])
        prompt, placed = pipe.image_prompt(ids, a.image or [])
        prompts.append(prompt)
        images.append(placed)
    for q, o in zip(a.prompt, pipe.generate(prompts, images), strict=True):
        if len(a.prompt) > 1:
            print(f"### {q}")
        print(f"thinker: {o.text}")
        print(f"talker:  {' '.join(map(str, o.codes))}")
        print(f"         ({len(o.stage_inputs[0])} input embeddings, {o.stages[0].num_cached_tokens} cached thinker "
              f"tokens, {o.latency:.2f}s)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`kvpool omni-serve`: the pipeline's flags, the server's, and the image limits of `kvpool serve`."""
    from kvpool.flags import add_flags
    from kvpool.server.options import (
        ImageServerConfig,
        ServerConfig,
        _positive,
        add_allowed_origins,
        host_address,
        nonempty,
        port_number,
    )

    add_pipeline_arguments(p)
    p.add_argument("--no-vision", action="store_true",
                   help="no vision stage in the thinker: requests with images get HTTP 400")
    s = p.add_argument_group("server")
    defaults = ServerConfig()
    s.add_argument("--host", default=defaults.host, type=host_address, help="address to listen on")
    s.add_argument("--port", type=port_number, default=defaults.port, help="port to listen on")
    s.add_argument("--api-key", default=None, type=nonempty("a key; leave the flag out to require none"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default="omni", help="the model id clients send (default: omni)")
    add_allowed_origins(s)
    s.add_argument("--max-body-bytes", type=_positive, default=defaults.max_body_bytes,
                   help="larger request bodies get HTTP 413")
    add_flags(p, ImageServerConfig, "images (chat content parts of type image_url, for the vision stage)")
