"""Prompt rows: the last hidden states of prompt blocks, by block hash, so that prompt log-probabilities
survive a prefix hit.

A cached KV block holds its tokens' keys and values, not their logits, so a request asking for its prompt's
log-probabilities (`SamplingParams.prompt_logprobs`) cannot take a plain prefix hit: vLLM computes such a
request's prompt whole. Evaluation harnesses send exactly these requests, many over one shared context (a
few-shot prompt before each of a question's choices), so kvpool keeps what the logits are made of: the
final hidden state of every prompt position such a request computes, a block's rows under the block's
hash. A later request's hit is limited to the blocks whose rows are here (`complete_prefix`), and the
runner scores the hit positions from their rows with the LM head alone (a fraction of the forward).

Keyed by the chained block hash, a block's rows are exactly its content's wherever its KV comes from (the
device, the host tier, a store written by another replica), and they need no care when a KV block is
evicted or moved. Rows are written as chunks compute them (a block may take two chunks: an entry is
complete, and usable, once every row is in). Rows live on the host, in the model's dtype (on a GPU, one
copy per scoring step).

Eviction: a hit needs a prompt's blocks from its first on, so a prompt's last blocks must go before its
first ones (as vLLM frees a request's blocks, tail first), and the prompts used longest ago before the
others. After each step the runner touches every scoring request's blocks so far from its last to its first
(`touch`), then evicts the least recently touched entries down to the bytes allowed (`shrink`): what goes
is the tail of the prompt scored longest ago. (With eviction during writes instead, the first blocks of
every prompt, written first, went first, and two prompts that did not both fit left no hit at all.)

Scores too: a row's score (the next token's log-probability, its rank and the top k) depends on the block's
tokens alone, except the block's last row, whose next token starts the next block. So an entry also keeps
the scores of its first block_size - 1 rows, as the request that wrote them computed them (with its k): a
later request asking for at most that k takes them as they are, and puts through the LM head only each
block's last row (the LM head and the softmax over the vocabulary cost about 0.4 ms a row on a 2-core Zen 4
for SmolLM2, against about 0.7 ms a token for the forward).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvpool.runner.sampler import TokenLogprobs


@dataclass
class PromptLogprobsStep:
    """What the runner does for a request's prompt log-probabilities in one step (SeqStep.prompt_logprobs).

    Rows from position `first` on are scored: rows [first, start) come from the cache (`read`: the hashes of
    the blocks covering them, in order; `start` is the step's first computed position), the rest from this
    step's forward; targets[j] is the prompt token after row first + j. `write`: (hash, position of its first
    token) of every full prompt block this step's computed rows fall in, whose rows the cache keeps. `chain`:
    the hashes of the prompt's full blocks up to this step's end, touched after the step (`touch`)."""

    k: int
    first: int
    targets: list[int]
    read: list[bytes]
    write: list[tuple[bytes, int]]
    chain: list[bytes] = field(default_factory=list)


@dataclass
class CachedBlock:
    """A complete entry: its rows, and the scores of its first block_size - 1 rows when every one was kept
    (`scores`, computed with `k` top tokens; None: score the rows)."""

    rows: torch.Tensor
    k: int
    scores: list[TokenLogprobs | None] | None

    def scores_for(self, k: int) -> list[TokenLogprobs | None] | None:
        """The kept scores cut to `k` top tokens, if they hold that many."""
        if self.scores is None or k > self.k:
            return None
        return [t if t is None else t.cut(k) for t in self.scores]


class PromptRowCache:
    """Block hash -> (block_size, hidden) rows, bounded in bytes, least recently used first out."""

    def __init__(self, capacity_bytes: int, block_size: int, entry_bytes: int = 0) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"prompt_rows_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.entry_bytes = entry_bytes  # one block's rows (block_size x hidden x dtype), when the runner knows it
        # hash -> [rows, rows filled, k, scores of rows 0 .. block_size - 2 (None: not kept)]
        self._entries: OrderedDict[bytes, list] = OrderedDict()
        self.nbytes = 0
        self.rows_read = 0
        self.rows_written = 0

    def __len__(self) -> int:
        return len(self._entries)

    def complete_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, have every row cached."""
        n = 0
        bs = self.block_size
        for h in hashes:
            e = self._entries.get(h)
            if e is None or e[1] < bs:
                break
            n += 1
        return n

    def read(self, hashes: Sequence[bytes]) -> list[CachedBlock]:
        """Complete entries, in order."""
        out = []
        for h in hashes:
            e = self._entries[h]
            if e[1] < self.block_size:
                raise KeyError(f"prompt rows of block {h.hex()[:12]} are incomplete")
            scores = e[3]
            out.append(CachedBlock(e[0], e[2], scores if scores is not None and None not in scores else None))
        self.rows_read += len(hashes) * self.block_size
        return out

    def write(self, block_hash: bytes, offset: int, rows: torch.Tensor,
              scores: Sequence[TokenLogprobs | None] | None = None, k: int = 0) -> None:
        """Rows `offset` .. of a block, and the writer's scores of them (one per row, None where it has none;
        k: its top count). Rows come in order (a request computes its prompt front to back); rows already
        there (another request with the same block) are kept."""
        bs = self.block_size
        if not 0 <= offset < bs or offset + rows.shape[0] > bs:
            raise ValueError(f"rows [{offset}, {offset + rows.shape[0]}) do not fit a block of {bs}")
        if self.capacity_bytes == 0:
            return
        e = self._entries.get(block_hash)
        if e is None:
            if offset:  # (its first rows were evicted while a request computed the block: start again later)
                return
            buf = torch.empty((bs, rows.shape[1]), dtype=rows.dtype)
            self.nbytes += buf.numel() * buf.element_size()
            e = self._entries[block_hash] = [buf, 0, k, [None] * (bs - 1)]
        end = offset + rows.shape[0]
        if offset <= e[1] < end:  # (rows past the filled ones, contiguous with them)
            new = e[1] - offset
            e[0][e[1]:end].copy_(rows[new:])
            e[2] = min(e[2], k)  # (two writers: the scores hold the smaller top count)
            kept = e[3]
            for j in range(e[1], min(end, bs - 1)):
                kept[j] = scores[j - offset] if scores is not None else None
            self.rows_written += end - e[1]
            e[1] = end

    def fits(self, num_blocks: int) -> bool:
        """Whether a prompt of this many blocks can be kept whole (so that waiting for its rows pays)."""
        return num_blocks * self.entry_bytes <= self.capacity_bytes

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Make these entries the most recently used, the last one most of all."""
        entries = self._entries
        for h in hashes:
            if h in entries:
                entries.move_to_end(h)

    def shrink(self) -> None:
        """Evict least recently touched entries until the cache is within its bytes."""
        while self.nbytes > self.capacity_bytes and self._entries:
            _, (buf, *_rest) = self._entries.popitem(last=False)
            self.nbytes -= buf.numel() * buf.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
