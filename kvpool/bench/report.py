"""Shared output of every benchmark: a human table on stdout, then one JSON object as the last line."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence


class BenchFailed(RuntimeError):
    """A benchmark run that could not finish (a replica did not start, a request failed): the CLI prints the
    message in one line and exits 1, as it does for bad input with 2."""


def name_list(flag: str, text: str, known: Sequence[str], key: Callable[[str], str] = str) -> list[str]:
    """The names a comma-separated flag gives (`flag`: its field name, for the message). A ValueError naming the
    flag when it gives none or one whose `key` is not in `known`, so a bad list stops the command before any
    benchmark runs (an empty one would otherwise run nothing and fail at the table)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"{flag}: name at least one of {', '.join(known)}")
    for n in names:
        if key(n) not in known:
            raise ValueError(f"{flag}: unknown {n!r} (one of {', '.join(known)})")
    return names


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated between the nearest ranks (numpy's default, as `vllm bench serve`
    reports them): the 50th is the median, the 99th of 64 values lies between the two largest."""
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]  # (rows may be none)
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    # Text columns read left to right; numbers line up on the right.
    out += ["  ".join(v.rjust(w) if isinstance(raw, int | float) else v.ljust(w)
                      for v, raw, w in zip(r, r_raw, widths, strict=True))
            for r, r_raw in zip(body, rows, strict=True)]
    return "\n".join(out)


def emit(table: str, result: dict, as_json: bool) -> None:
    print(table)
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
