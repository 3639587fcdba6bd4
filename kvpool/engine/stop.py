"""When a request stops, decided in one place: its stop tokens (EOS unless `ignore_eos`), `max_tokens`, and
its stop strings, checked in that order after each token the scheduler appends.

Stop strings need the text, so the request's text is brought up to date here too: while a request runs,
by incremental decoding (the tokenizers library's DecodeStream), O(new tokens) per step where a full decode
would be O(output) and quadratic over a long generation; once it is finished, by one full decode.

Both decode the output after the prompt's last few tokens (`PROMPT_CONTEXT`), as vLLM's detokenizer does:
alone, the first token of a Llama-2 or Mistral style tokenizer (a Metaspace "▁word" and a decoder that
strips the text's leading space) would lose its space, and prompt + completion would not read as the whole.
A request ended by a stop token (EOS or one of its stop_token_ids) leaves that token's text out unless
`include_stop_str_in_output`, as vLLM does (the token stays in the token ids).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tokenizers.decoders import DecodeStream

from kvpool.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)

PROMPT_CONTEXT = 5  # prompt tokens decoded before the output (vLLM's initial detokenization offset)


def _text_ids(req: Request) -> list[int]:
    """The output tokens whose text is the output's: all but a final stop token, unless asked for."""
    ids = req.output_token_ids
    if req.stopped_by_token and ids and not req.sampling_params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def check_stop_tokens(req: Request) -> bool:
    """Stop tokens and the length limit only (no tokenizer): finished? (sets the request's status)."""
    return req.check_stop_token()


class Detokenizer:
    """A request's output text, grown incrementally while it runs (see the module doc)."""

    def __init__(self, tokenizer: Any, lock: threading.Lock) -> None:
        self.tokenizer = tokenizer
        self.lock = lock  # a fast tokenizer may refuse concurrent use ("Already borrowed")
        self._streams: dict[str, list[Any]] = {}  # request id -> [DecodeStream, tokens fed to it]
        # request id -> the prompt tokens its output is decoded after, and their text
        self._contexts: dict[str, tuple[list[int], str]] = {}

    def _context(self, req: Request) -> tuple[list[int], str]:
        """The prompt's last PROMPT_CONTEXT tokens, fewer where their text holds a broken character (the
        window starting inside one, or the prompt ending inside one that the output completes): decoded after
        those, the output's first piece would carry prompt text. With their text. Called with the lock held."""
        ctx = self._contexts.get(req.request_id)
        if ctx is None:
            tail = req.all_token_ids[max(0, req.num_prompt_tokens - PROMPT_CONTEXT):req.num_prompt_tokens]
            skip = req.sampling_params.skip_special_tokens
            texts = ((tail[i:], self.tokenizer.decode(tail[i:], skip_special_tokens=skip)) for i in range(len(tail)))
            ctx = next(((ids, text) for ids, text in texts if "\ufffd" not in text), ([], ""))
            self._contexts[req.request_id] = ctx
        return ctx

    def decode(self, req: Request) -> str:
        ids = _text_ids(req)
        skip = req.sampling_params.skip_special_tokens
        with self.lock:
            context, head = self._context(req)
            whole = self.tokenizer.decode(context + ids, skip_special_tokens=skip)
            if whole.startswith(head):
                return whole[len(head):]
            # (the context's last character completed only with the output's bytes: decoded alone)
            return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def update(self, req: Request) -> int:
        """Bring `req.output_text` up to date; returns where the new text starts."""
        start = len(req.output_text)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if req.status.finished or backend is None:
            req.output_text = self.decode(req)
            return min(start, len(req.output_text))
        state = self._streams.get(req.request_id)
        if state is None:
            with self.lock:
                context, _ = self._context(req)
            state = self._streams[req.request_id] = [
                DecodeStream(ids=context, skip_special_tokens=req.sampling_params.skip_special_tokens), 0]
        stream, done = state
        ids = req.output_token_ids
        pieces = []
        with self.lock:
            for tok in ids[done:]:
                try:
                    piece = stream.step(backend, tok)
                except Exception as e:
                    if "Invalid prefix" not in str(e):
                        raise
                    # Byte tokens that make no UTF-8 character, then a whole token: the stream's state is
                    # broken (tokenizers raises "Invalid prefix encountered"). A fresh one goes on from this
                    # token, as vLLM's detokenizer does; the final text is a full decode anyway.
                    stream = state[0] = DecodeStream(skip_special_tokens=req.sampling_params.skip_special_tokens)
                    piece = stream.step(backend, tok)
                if piece:
                    pieces.append(piece)
        state[1] = len(ids)
        req.output_text += "".join(pieces)
        return start

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._contexts.pop(request_id, None)


class StopChecker:
    """The scheduler's stop decision with a tokenizer: stop tokens and length, then the text and its stop
    strings. Returns whether the request is finished (its status and `stop_reason` set)."""

    def __init__(self, detokenizer: Detokenizer | None) -> None:
        self.detokenizer = detokenizer

    def __call__(self, req: Request) -> bool:
        finished = req.check_stop_token()
        if not finished and req.grammar is not None and req.grammar.error:
            # Its structured output's matcher stopped following the text (one of llguidance's bounds, reached
            # mid-way): the text ends here, a prefix of what was asked for, and stop_reason says why.
            log.warning("request %s: structured output stopped: %s", req.request_id, req.grammar.error)
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = f"structured_outputs: {req.grammar.error}"
            finished = True
        if self.detokenizer is None:
            return finished
        stops = req.sampling_params.stop
        if stops and req.stop_reason in stops:
            return finished  # cut at a stop string already: the text is final
        new_from = self.detokenizer.update(req)
        if (stops and req.num_output_tokens > req.sampling_params.min_tokens  # (vLLM's: none up to min_tokens)
                and self._match(req, stops, new_from) and req.status is not RequestStatus.FINISHED_STOPPED):
            # A stop string the last allowed token completed is a stop, not the length limit (as vLLM).
            req.status = RequestStatus.FINISHED_STOPPED
            finished = True
        return finished

    @staticmethod
    def _match(req: Request, stops: list[str], new_from: int) -> bool:
        text = req.output_text
        # Only text that arrived this step can complete a stop string: search from len(stop)-1 before it.
        hits = [(p, s) for s in stops if (p := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
        if not hits:
            return False
        pos, s = min(hits)
        req.output_text = text[: pos + (len(s) if req.sampling_params.include_stop_str_in_output else 0)]
        req.stop_reason = s
        return True
