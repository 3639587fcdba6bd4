"""Shared output of every benchmark: a human table on stdout, then one JSON object as the last line."""

from __future__ import annotations

import json
from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
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
