"""What a prefix hit needs from each layer group, in a line a router can read and apply to its index.

A hybrid model's replica can serve a prefix of n blocks only if every group can (`KVCacheManager._hybrid_hit`):
- full attention: blocks 0..n-1 all cached;
- a sliding window needing w blocks before the hit point (`SlidingWindowSpec.window_blocks`): blocks
  n-w..n-1 cached, or all of 0..n-1 when n < w (a window of one token, w = 0: any n);
- a state (Mamba, linear attention, short convolution): the state after block n-1 cached;
- cross-attention: per request, never looked up (no condition).
n = 0 is always servable. A router that counted a hash as cached when any group held it credited a replica
whose window or state blocks were gone with the whole prefix (the full-attention chain outlives them), and
sent the request where it recomputed everything. kvpool replicas state their groups' rules on /health
(header `kvpool-kv-groups`, `encode`), their KV events carry each block's group (`group_idx`), and the
router finds the longest prefix every group serves (`longest_servable`) exactly as the replica would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.core.kv_cache_spec import CrossAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

HEADER = "kvpool-kv-groups"
KINDS = ("full", "window", "state", "none")


@dataclass(frozen=True)
class GroupRule:
    kind: str  # one of KINDS
    window_blocks: int = 0  # "window": cached blocks needed right before the hit point

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{HEADER}: unknown group kind {self.kind!r} (known: {', '.join(KINDS)})")
        if not isinstance(self.window_blocks, int) or self.window_blocks < 0:
            raise ValueError(f"{HEADER}: a window needs an int >= 0 of blocks, got {self.window_blocks!r}")


def rule_of(spec: KVCacheSpec) -> GroupRule:
    if isinstance(spec, SlidingWindowSpec):
        return GroupRule("window", spec.window_blocks)
    if isinstance(spec, MambaSpec):
        return GroupRule("state")
    if isinstance(spec, CrossAttentionSpec):
        return GroupRule("none")
    return GroupRule("full")


def encode(rules: Sequence[GroupRule]) -> str:
    """One entry per group, in group order: `full,window:3,state,none`."""
    return ",".join(f"window:{r.window_blocks}" if r.kind == "window" else r.kind for r in rules)


def parse(text: str) -> tuple[GroupRule, ...]:
    """`encode`'s inverse; ValueError naming the header for anything else (so a router can ignore it)."""
    rules = []
    for part in text.split(","):
        kind, sep, arg = part.strip().partition(":")
        if kind == "window":
            if not sep or not arg.isdigit() or len(arg) > 9:
                raise ValueError(f"{HEADER}: a window is `window:<blocks>`, got {part.strip()!r}")
            rules.append(GroupRule("window", int(arg)))
        elif sep:
            raise ValueError(f"{HEADER}: only a window takes an argument, got {part.strip()!r}")
        else:
            rules.append(GroupRule(kind))
    if not any(r.kind != "none" for r in rules):
        raise ValueError(f"{HEADER}: no group that caches a prefix in {text!r}")
    return tuple(rules)


def longest_servable(max_blocks: int, held: Callable[[int, int], bool], rules: Sequence[GroupRule]) -> int:
    """The largest n <= max_blocks every group serves, `held(group, index)` saying whether a group's block
    at that index of the prompt is cached (anywhere the replica can read it from)."""
    n_max = max_blocks
    for g, r in enumerate(rules):  # full-attention chains bound every other group's search
        if r.kind == "full":
            n = 0
            while n < n_max and held(g, n):
                n += 1
            n_max = n
    if n_max == 0:
        return 0
    # Per window or state group: for each index, the length of the cached run ending there.
    checks: list[tuple[int, list[int]]] = []
    for g, r in enumerate(rules):
        if r.kind in ("window", "state") and not (r.kind == "window" and r.window_blocks == 0):
            runs, run = [], 0
            for i in range(n_max):
                run = run + 1 if held(g, i) else 0
                runs.append(run)
            checks.append((r.window_blocks if r.kind == "window" else 1, runs))
    for n in range(n_max, 0, -1):
        # n blocks need the last min(need, n) of them in every group: a window shorter than the prefix
        # reaches back to block 0, a state needs only the block at the boundary.
        if all(runs[n - 1] >= min(need, n) for need, runs in checks):
            return n
    return 0
