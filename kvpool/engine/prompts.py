"""What the engine accepts as a prompt, normalised to text or a list of token ids, with a clear error.

A prompt is text (`str`) or token ids: a list or tuple of ints (numpy integers too), a numpy array or a
torch tensor of them, or vLLM's prompt dicts (`{"prompt": text}`, `{"prompt_token_ids": ids}`). Anything
else is a TypeError naming `prompt`; bytes in particular are refused rather than read as token ids.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

Prompt = str | Sequence[int]


def is_single_prompt(value: Any) -> bool:
    """Whether `value` is one prompt rather than a list of prompts (LLM.generate takes either)."""
    if isinstance(value, str | dict) or hasattr(value, "tolist"):
        return True
    return isinstance(value, Sequence) and len(value) > 0 and isinstance(value[0], numbers.Integral)


def normalize_prompt(prompt: Any, field: str = "prompt") -> str | list[int]:
    """Text, or token ids as a list of Python ints; TypeError naming `field` for anything else."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        elif set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        else:
            raise TypeError(f"{field}: a prompt dict holds exactly 'prompt' (text) or 'prompt_token_ids', "
                            f"got keys {sorted(map(str, prompt))}")
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist") and not isinstance(prompt, list):  # a numpy array or a torch tensor
        prompt = prompt.tolist()
    if isinstance(prompt, list | tuple) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                for t in prompt):
        return [int(t) for t in prompt]
    raise TypeError(f"{field}: expected text (str) or token ids (a list of ints), got "
                    f"{type(prompt).__name__}{'' if not isinstance(prompt, list | tuple) else ' holding other values'}")
