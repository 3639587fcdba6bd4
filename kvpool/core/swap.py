"""The swap plan: block copies between tiers that the runner executes before a step's forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SwapPlan:
    # (device block id, host block id): copy device -> host. Executed before every swap-in, because a
    # device block evicted this step may be the destination of a swap-in of the same step.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block id, device block id): copy host -> device.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Two-level pools (pages of several sizes): the same copies as (page type, src, dst), page type t
    # being the t-th smallest page size; block ids are per page type. Swap-outs again run first.
    typed_out: list[tuple[int, int, int]] = field(default_factory=list)
    typed_in: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.typed_out or self.typed_in)


@dataclass(slots=True)
class SwapStats:
    """Blocks copied between tiers: in total, and in the last plan handed out."""

    blocks_out: int = 0
    blocks_in: int = 0
    last_out: int = 0
    last_in: int = 0
    steps_with_swaps: int = 0

    def record(self, plan: SwapPlan) -> None:
        self.last_out = len(plan.swap_out) + len(plan.typed_out)
        self.last_in = len(plan.swap_in) + len(plan.typed_in)
        self.blocks_out += self.last_out
        self.blocks_in += self.last_in
        self.steps_with_swaps += bool(plan)
