"""Multi-stage pipelines: stage N's per-token outputs become stage N+1's input embeddings.

A stage is an `LLMEngine` running one model, configured by a `StageConfig`: the model, whether
prefix caching is on (per stage), which per-token outputs it passes on (`hidden_states`, the final
normed states, and `layer_{i}`, the residual stream after layer i), and how it samples. A stage with
prefix caching on keeps its outputs in the stage-output cache beside its KV blocks, so a prefix hit
still hands the next stage every token's outputs (see kvpool/runner/stage_output_cache.py).

Between two stages a `Connector` concatenates the passed outputs per token and projects them into
the next model's hidden size (a fixed, seeded linear map); the next stage's prompt is that many
placeholder tokens whose embeddings are replaced by the projection (`EmbedsInput`), hashed by content
so its own prefix cache only hits on identical inputs.

So each later stage's prompt grows with the first stage's prompt and output: the pipeline holds a request
only if every stage does, and `Pipeline.max_model_len` is the longest first-stage prompt + output that they
all hold. `Pipeline.generate` refuses a longer request (`check_request`) before any stage runs, rather than
after the first stage has done its work for a prompt the second cannot take.

The reference pipeline (`reference_pipeline`): the thinker, SmolLM2 by default, writes text; the
talker, a seeded random-weight decoder (kvpool/omni/talker.py), turns the thinker's states into codes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvpool.engine.llm import LLM
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.runner.multimodal import EmbedsInput, ImageInput, MMInput

_LAYER = re.compile(r"layer_(\d+)")


@dataclass
class StageConfig:
    name: str
    model: str | None = None  # a local HF folder; None: the default SmolLM2
    enable_prefix_caching: bool = True
    outputs: tuple[str, ...] = ()  # per-token outputs passed to the next stage, concatenated in this order
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: dict[str, Any] = field(default_factory=dict)  # any other EngineConfig field

    def output_layers(self) -> tuple[int, ...]:
        layers = []
        for name in self.outputs:
            m = _LAYER.fullmatch(name)
            if m:
                layers.append(int(m.group(1)))
            elif name != "hidden_states":
                raise ValueError(f"outputs: {name!r} is not 'hidden_states' or 'layer_<i>' (stage {self.name!r})")
        return tuple(layers)


class Stage:
    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.llm = LLM(config.model, enable_prefix_caching=config.enable_prefix_caching,
                       stage_outputs=bool(config.outputs), stage_output_layers=config.output_layers(), **config.engine)
        self.engine = self.llm.engine

    def run(self, prompts: Sequence[Sequence[int]], mm_inputs: Sequence[Sequence[MMInput]] | None = None,
            sampling: Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the engine); outputs in the prompts' order. `sampling`: one
        per prompt (default: the stage's own)."""
        return self.llm.generate([list(p) for p in prompts], sampling or self.config.sampling, use_tqdm=False,
                                 mm_inputs=mm_inputs)


class Connector(nn.Module):
    """Per-token outputs of one stage -> input embeddings of the next: concatenate, then a seeded linear map."""

    def __init__(self, in_dim: int, out_dim: int, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.proj = nn.Linear(in_dim, out_dim)

    @torch.inference_mode()
    def forward(self, outputs: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
        x = torch.cat([outputs[n].float() for n in names], dim=-1)
        return self.proj(x)


@dataclass
class OmniOutput:
    stages: list[RequestOutput]  # one per stage
    stage_inputs: list[torch.Tensor]  # the input embeddings each later stage received
    latency: float = 0.0

    @property
    def text(self) -> str:
        return self.stages[0].text

    @property
    def codes(self) -> list[int]:
        return self.stages[-1].token_ids


class Pipeline:
    PLACEHOLDER = 0  # token id under a stage's input embeddings (overridden, so any valid id does)

    def __init__(self, stages: Sequence[StageConfig], seed: int = 0) -> None:
        if not stages:
            raise ValueError("stages: a pipeline needs at least one stage")
        for a in stages[:-1]:
            if not a.outputs:
                raise ValueError(f"outputs: stage {a.name!r} feeds another stage but passes on no outputs")
        self.configs = list(stages)
        self.stages = [Stage(c) for c in stages]
        self.seed = seed
        self.connectors: list[Connector | None] = [None] * (len(stages) - 1)
        self.max_model_len, self._bound_by = self._longest_request()
        if self.max_model_len < 2:  # not even a one-token prompt and one token to generate
            mt = next(c.sampling.max_tokens for c in self.configs if c.name == self._bound_by)
            raise ValueError(f"max_tokens: the {self._bound_by} stage's max_tokens ({mt}) leaves the pipeline a "
                             f"context of {self.max_model_len} tokens, and a request needs at least 2 (a prompt "
                             f"token and one to generate); lower it or give that stage a longer max_model_len")

    def _longest_request(self) -> tuple[int, str]:
        """The most tokens (prompt + max_tokens) of a first-stage request that every stage holds, and the stage
        that bounds it. Stage i+1's prompt is stage i's prompt and output less its last token (never fed back,
        so it has no outputs to pass on), and it must leave room for stage i+1's own max_tokens: for a first
        stage's prompt + output of S tokens, stage i's prompt + output is S + extra."""
        first = self.stages[0].engine.max_model_len
        limit, bound_by, extra = first, self.configs[0].name, 0
        for stage, cfg in zip(self.stages[1:], self.configs[1:], strict=True):
            mt = cfg.sampling.max_tokens
            # Its prompt S + extra - 1, plus its max_tokens (None: at least one), within its context.
            fits = stage.engine.max_model_len - extra + 1 - (1 if mt is None else mt)
            if fits < limit:
                limit, bound_by = fits, cfg.name
            if mt is None:
                break  # it fills its own context whatever S is: later stages' prompts no longer depend on S
            extra += mt - 1
        return limit, bound_by

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """ValueError, naming the field as the engine does (`prompt_token_ids`, `max_tokens`), for a first-stage
        request some stage could not hold (`max_model_len`)."""
        limit, n = self.max_model_len, num_prompt_tokens
        first = self.configs[0].name
        why = "" if self._bound_by == first else (
            f" (bound by the {self._bound_by} stage, whose prompt grows with the {first}'s prompt and output)")
        if n >= limit:
            raise ValueError(f"prompt_token_ids: the prompt has {n} tokens; the pipeline's context holds {limit}, "
                             f"and one must be left to generate{why}")
        if max_tokens is not None and max_tokens > limit - n:
            raise ValueError(f"max_tokens: {max_tokens} new tokens after a {n}-token prompt exceed the pipeline's "
                             f"context of {limit} tokens (at most {limit - n}){why}")

    def _connector(self, i: int, in_dim: int) -> Connector:
        c = self.connectors[i]
        if c is None:
            c = self.connectors[i] = Connector(in_dim, self.stages[i + 1].engine.runner.arch.hidden_size,
                                               seed=self.seed + i)
        return c

    @property
    def vision_encoder(self) -> Any:
        """The first stage's vision tower (a `TinyVisionEncoder`), or None: the pipeline takes no images."""
        return getattr(self.stages[0].engine.mm, "encoder", None)

    def image_prompt(self, ids: Sequence[int], images: Sequence[torch.Tensor | np.ndarray | str | Path]
                     ) -> tuple[list[int], list[MMInput]]:
        """The first stage's prompt and inputs for `ids` after `images` (pixel tensors, or `.npy` files): each
        image takes its tower's `num_tokens` placeholder tokens, in order, before the text. `kvpool omni --image`
        and `kvpool omni-serve` both place images so (a chat template renders text only, so the images cannot go
        inside it)."""
        if not images:
            return list(ids), []
        enc = self.vision_encoder
        if enc is None:
            raise ValueError("images: this pipeline's first stage has no vision stage (build it with vision=True)")
        n = int(enc.num_tokens)
        placed: list[MMInput] = [ImageInput(i * n, px) for i, px in enumerate(images)]
        return [self.PLACEHOLDER] * (n * len(images)) + list(ids), placed

    def generate(self, prompts: Sequence[Sequence[int]], mm_inputs: Sequence[Sequence[MMInput]] | None = None,
                 sampling: Sequence[SamplingParams] | None = None) -> list[OmniOutput]:
        """Each prompt (token ids; images as `ImageInput`s for the first stage) through every stage. `sampling`:
        the first stage's, one per prompt (default: its `StageConfig`'s); later stages always sample as
        configured. ValueError before any stage runs for a request some stage could not hold (`check_request`);
        a first-stage max_tokens of None writes until the pipeline's context is full, not the first stage's."""
        t0 = time.perf_counter()
        given = sampling or [self.configs[0].sampling] * len(prompts)
        if len(given) != len(prompts):
            raise ValueError(f"sampling: {len(given)} sampling params for {len(prompts)} prompts")
        first: list[SamplingParams] = []
        for p, sp in zip(prompts, given, strict=True):
            self.check_request(len(p), sp.max_tokens)
            if sp.max_tokens is None:  # (the first stage alone would fill its own context, past what later hold)
                sp = dataclasses.replace(sp, max_tokens=self.max_model_len - len(p))
            first.append(sp)
        outs = self.stages[0].run(prompts, mm_inputs, first)
        results = [OmniOutput([o], []) for o in outs]
        for i in range(1, len(self.stages)):
            names = self.configs[i - 1].outputs
            embeds = []
            for o in outs:
                assert o.stage_outputs is not None
                width = sum(o.stage_outputs[n].shape[-1] for n in names)
                embeds.append(self._connector(i - 1, width)(o.stage_outputs, names))
            outs = self.stages[i].run([[self.PLACEHOLDER] * e.shape[0] for e in embeds],
                                      [[EmbedsInput(0, e)] for e in embeds])
            for r, o, e in zip(results, outs, embeds, strict=True):
                r.stages.append(o)
                r.stage_inputs.append(e)
        for r in results:
            r.latency = time.perf_counter() - t0
        return results


def reference_pipeline(thinker: str | None = None, talker: str | None = None, *, enable_prefix_caching: bool = True,
                       thinker_tokens: int = 32, talker_tokens: int = 32, layer: int | None = None,
                       thinker_engine: dict[str, Any] | None = None, talker_engine: dict[str, Any] | None = None,
                       vision: bool | dict[str, Any] = False, seed: int = 0, dtype: str = "auto") -> Pipeline:
    """Thinker (SmolLM2 by default) -> talker (seeded random decoder emitting codes).

    The thinker passes its final hidden states and the residual stream after its middle layer
    (`layer`). Both stages run in batch-invariant mode (in `dtype`: bfloat16 or float32; `auto` picks one,
    see kvpool.runner.dtypes), so the talker receives the same bits, and emits the same codes, with prefix
    caching on or off. `vision` gives the thinker a seeded random vision tower (`TinyVisionEncoder`, a dict: its keyword
    arguments) for image inputs.
    """
    from kvpool.omni.talker import default_talker_dir
    from kvpool.runner.model_files import resolve_model

    thinker_dir = resolve_model(thinker)
    cfg = json.loads((thinker_dir / "config.json").read_text())
    layer = cfg["num_hidden_layers"] // 2 if layer is None else layer
    t_engine = {"dtype": dtype, "batch_invariant": True, **(thinker_engine or {})}
    if vision:
        from kvpool.runner.vision import TinyVisionEncoder

        kw = {"seed": seed, **(vision if isinstance(vision, dict) else {})}
        t_engine["vision_encoder"] = TinyVisionEncoder(out_dim=cfg["hidden_size"], **kw)
    k_engine = {"dtype": dtype, "batch_invariant": True, "skip_tokenizer_init": True, **(talker_engine or {})}
    return Pipeline([
        StageConfig("thinker", str(thinker_dir), enable_prefix_caching, ("hidden_states", f"layer_{layer}"),
                    SamplingParams(temperature=0.0, max_tokens=thinker_tokens), t_engine),
        StageConfig("talker", talker or str(default_talker_dir(seed)), enable_prefix_caching, (),
                    SamplingParams(temperature=0.0, max_tokens=talker_tokens, ignore_eos=True), k_engine),
    ], seed=seed)
