"""Per-request accumulation of a stage's per-token outputs (omni pipelines).

Each step the runner returns the outputs of the tokens it computed. A request's rows are gathered in
position order: rows of a prefix hit (positions the step did not compute) are read back from the
runner's stage-output cache at the request's block ids, then the computed rows are appended. A
request recomputing tokens it already has rows for (after a preemption) keeps the rows it has.

A request's rows cover every token that went through the model: the prompt and every generated
token but the last one, which is sampled and never fed back.
"""

from __future__ import annotations

import torch

from kvpool.engine.scheduler import SchedulerOutput
from kvpool.runner.stage_output_cache import StageOutputCache


class _Rows:
    __slots__ = ("chunks", "n")

    def __init__(self) -> None:
        self.chunks: list[dict[str, torch.Tensor]] = []
        self.n = 0

    def append(self, rows: dict[str, torch.Tensor], n: int) -> None:
        if n > 0:
            self.chunks.append(rows)
            self.n += n


class StageOutputCollector:
    def __init__(self, cache: StageOutputCache | None) -> None:
        self.cache = cache
        self._rows: dict[str, _Rows] = {}
        self.rows_from_cache = 0
        self.rows_computed = 0

    def collect(self, out: SchedulerOutput, computed: dict[str, dict[str, torch.Tensor]]) -> None:
        """After the step's forward, before finished requests release their blocks."""
        for s in out.scheduled:
            rid = s.request.request_id
            acc = self._rows.setdefault(rid, _Rows())
            if acc.n < s.start_pos:
                if self.cache is None:
                    raise RuntimeError(f"{rid}: tokens [{acc.n}, {s.start_pos}) were not computed and there is "
                                       "no stage-output cache")
                n_hit = s.start_pos - acc.n
                acc.append(self.cache.read(s.block_ids[0], acc.n, s.start_pos), n_hit)
                self.rows_from_cache += n_hit
            new = computed[rid]
            skip = acc.n - s.start_pos
            n = s.num_new_tokens - skip
            acc.append({k: v[skip:] for k, v in new.items()}, n)
            self.rows_computed += max(n, 0)

    def take(self, request_id: str) -> dict[str, torch.Tensor]:
        """All rows of a request, in position order, concatenated per output name."""
        acc = self._rows.get(request_id)
        if acc is None or not acc.chunks:
            return {}
        names = acc.chunks[0].keys()
        return {k: torch.cat([c[k] for c in acc.chunks]) for k in names}

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
