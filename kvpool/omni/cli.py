"""`kvpool omni "prompt"`: the reference thinker -> talker pipeline from the shell."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="+", help="the prompt (several: one pipeline run each, batched)")
    p.add_argument("--model", default=None, help="thinker: local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--talker", default=None, help="talker folder (default: the seeded random talker)")
    p.add_argument("--image", action="append", default=None,
                   help="a (3, 8, 8) float image as a .npy file, placed before the prompt (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the thinker's chat template")
    p.add_argument("--thinker-tokens", type=int, default=48)
    p.add_argument("--talker-tokens", type=int, default=32)
    p.add_argument("--layer", type=int, default=None, help="thinker layer whose states are passed on (default: middle)")
    p.add_argument("--no-prefix-caching", action="store_true", help="both stages: no prefix (or stage-output) caching")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="both stages (batch-invariant kernels exist for both)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0, help="seed of the talker, connector and vision tower weights")


def run(a: argparse.Namespace) -> None:
    from kvpool.omni.pipeline import reference_pipeline
    from kvpool.runner.multimodal import ImageInput

    engine = dict(block_size=a.block_size, kv_cache_memory=a.kv_cache_memory)
    pipe = reference_pipeline(a.model, a.talker, enable_prefix_caching=not a.no_prefix_caching,
                              thinker_tokens=a.thinker_tokens, talker_tokens=a.talker_tokens, layer=a.layer,
                              thinker_engine=engine, talker_engine=engine, vision=bool(a.image), seed=a.seed,
                              dtype=a.dtype)
    thinker = pipe.stages[0].engine
    prompts, images = [], []
    n_img = thinker.mm.encoder.num_tokens if thinker.mm.encoder is not None else 0
    for q in a.prompt:
        if a.raw or not getattr(thinker.tokenizer, "chat_template", None):
            ids = thinker.encode(q)
        else:
            ids = thinker.apply_chat_template([{"role": "user", "content": q}])
        placed = [ImageInput(i * n_img, f) for i, f in enumerate(a.image or [])]
        prompts.append([pipe.PLACEHOLDER] * (n_img * len(placed)) + ids)
        images.append(placed)
    for q, o in zip(a.prompt, pipe.generate(prompts, images), strict=True):
        if len(a.prompt) > 1:
            print(f"### {q}")
        print(f"thinker: {o.text}")
        print(f"talker:  {' '.join(map(str, o.codes))}")
        print(f"         ({len(o.stage_inputs[0])} input embeddings, {o.stages[0].num_cached_tokens} cached thinker "
              f"tokens, {o.latency:.2f}s)")
