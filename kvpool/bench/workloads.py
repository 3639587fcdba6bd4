"""Request traces: JSON lines of {"id", "prompt": [ids], "decode": [ids]} (or Mooncake's published
format, converted), and generators for them.

The generators produce the two standard shapes of `../shared/peers/make_trace.py` (same parameters):
shared-prefix (a few long system prompts, unique suffixes) and multi-turn (interleaved conversations
whose every turn resends the whole history). Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict


class TraceRequest(TypedDict):
    id: str
    prompt: list[int]
    decode: list[int]


def load_trace(path: str | Path, block_size: int = 16) -> list[TraceRequest]:
    """A trace file: make_trace's JSON lines, or a Mooncake trace as its authors publish it (lines of
    `hash_ids`, `input_length`, `output_length`), converted by `from_mooncake` for `block_size`."""
    out: list[TraceRequest] = []
    mooncake: list[dict] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
            if not isinstance(r, dict):
                raise ValueError(f"{path}:{n}: a trace line must be a JSON object")
            if "hash_ids" in r and "prompt" not in r:
                for key in ("input_length", "output_length"):
                    if not isinstance(r.get(key), int) or r[key] < 0:
                        raise ValueError(f"{path}:{n}: Mooncake trace line lacks an integer {key!r} >= 0")
                if not isinstance(r["hash_ids"], list) or not all(isinstance(h, int) for h in r["hash_ids"]):
                    raise ValueError(f"{path}:{n}: 'hash_ids' must be a list of ints")
                mooncake.append(r)
                continue
            for key in ("id", "prompt", "decode"):
                if key not in r:
                    raise ValueError(f"{path}:{n}: trace line lacks {key!r}")
            for key in ("prompt", "decode"):
                if not isinstance(r[key], list) or not all(isinstance(t, int) for t in r[key]):
                    raise ValueError(f"{path}:{n}: {key!r} must be a list of token ids")
            out.append(r)
    if mooncake and out:
        raise ValueError(f"{path}: mixes Mooncake lines (hash_ids) with make_trace lines (prompt)")
    trace = from_mooncake(mooncake, block_size) if mooncake else out
    if not trace:
        raise ValueError(f"{path}: the trace holds no request")
    return trace


MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces
_DECODE_BASE = 1 << 30


def from_mooncake(records: list[dict], block_size: int = 16) -> list[TraceRequest]:
    """Mooncake trace records as a replayable trace, one 512-token Mooncake block becoming one block of
    `block_size` tokens: the mapping of `../shared/peers/mooncake_trace.py` (equal output at block size
    16, checked by a test). Hash id h becomes `block_size` tokens derived from h; the last block keeps its
    share of a partial block (so it is cached only where Mooncake's was full); outputs are scaled alike
    and unique per request."""
    scale = MOONCAKE_BLOCK / block_size
    out: list[TraceRequest] = []
    for i, r in enumerate(records):
        ids = r["hash_ids"]
        if not ids:
            continue
        rem = r["input_length"] - MOONCAKE_BLOCK * (len(ids) - 1)
        last = max(1, min(block_size, math.ceil(rem / scale)))
        prompt: list[int] = []
        for k, h in enumerate(ids):
            width = block_size if k < len(ids) - 1 else last
            prompt.extend((h * block_size + j) % _DECODE_BASE for j in range(width))
        n_dec = max(1, math.ceil(r["output_length"] / scale))
        out.append(TraceRequest(id=f"mc{i}", prompt=prompt,
                                decode=[_DECODE_BASE + (i * 97 + j) % _DECODE_BASE for j in range(n_dec)]))
    return out


def write_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def shared_prefix_trace(n_requests: int = 2000, *, seed: int = 0, n_systems: int = 20, sys_min: int = 256,
                        sys_max: int = 1024, prompt_max: int = 2048, decode_len: int = 64,
                        vocab: int = 32000) -> list[TraceRequest]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(sys_min, sys_max))] for _ in range(n_systems)]
    out: list[TraceRequest] = []
    for i in range(n_requests):
        sp = systems[rng.randrange(n_systems)]
        total = rng.randint(max(512, len(sp) + 16), prompt_max)
        out.append(TraceRequest(id=f"req-{i}",
                                prompt=sp + [rng.randrange(vocab) for _ in range(total - len(sp))],
                                decode=[rng.randrange(vocab) for _ in range(decode_len)]))
    return out


def multi_turn_trace(n_conversations: int = 64, turns: int = 6, *, seed: int = 0, system_len: int = 512,
                     user_min: int = 32, user_max: int = 256, answer_min: int = 32, answer_max: int = 128,
                     vocab: int = 32000) -> list[TraceRequest]:
    return list(_multi_turn(random.Random(seed), n_conversations, turns, system_len, user_min, user_max,
                            answer_min, answer_max, vocab))


def _multi_turn(rng: random.Random, n_conv: int, turns: int, system_len: int, user_min: int, user_max: int,
                answer_min: int, answer_max: int, vocab: int) -> Iterator[TraceRequest]:
    system = [rng.randrange(vocab) for _ in range(system_len)]
    history = [list(system) for _ in range(n_conv)]
    order = [c for c in range(n_conv) for _ in range(turns)]
    rng.shuffle(order)
    done = [0] * n_conv
    for c in order:
        history[c] += [rng.randrange(vocab) for _ in range(rng.randint(user_min, user_max))]
        answer = [rng.randrange(vocab) for _ in range(rng.randint(answer_min, answer_max))]
        yield TraceRequest(id=f"c{c}-t{done[c]}", prompt=list(history[c]), decode=answer)
        history[c] += answer
        done[c] += 1


def generated_shared_prefix(groups: int = 8, system_len: int = 1024, questions: int = 8,
                            question_len: int = 64, *, seed: int = 0, token_range: tuple[int, int] = (1000, 40000),
                            shared: bool = True) -> list[list[int]]:
    """SGLang's generated-shared-prefix shape: per group one system prompt, then its questions.

    Prompts are ordered group by group. With shared=False every prompt gets its own system prompt of
    the same length: the same work with nothing to reuse (the control for caching's overhead).
    """
    rng = random.Random(seed)
    lo, hi = token_range

    def toks(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    prompts = []
    for _ in range(groups):
        system = toks(system_len)
        for _ in range(questions):
            prompts.append((system if shared else toks(system_len)) + toks(question_len))
    return prompts
