"""vLLM's bad_words (words never generated), skip_special_tokens=False (special tokens' text kept) and
spaces_between_special_tokens, on a tiny model wearing SmolLM2's tokenizer: tokens against transformers' own
logits with vLLM's ban rule applied, text against the tokenizer's own decode."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from helpers import stepped_text

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def llm(chat_llama_dir: Path) -> LLM:
    return LLM(str(chat_llama_dir), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)


def greedy(llm: LLM, n: int, **kw: object) -> list[int]:
    return llm.generate(PROMPT, SamplingParams.greedy(n, ignore_eos=True, **kw), use_tqdm=False)[0].token_ids


def test_words_are_tokenized_as_they_stand_and_after_a_space(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    assert enc("world peace") != enc(" world peace") and len(enc("world peace")) == len(enc(" world peace"))
    # Both forms of a word whose spaced form has as many tokens; leading spaces dropped first (vLLM's rule).
    assert llm.engine.bad_words_token_ids(["world peace", "  hello"]) == (
        enc("world peace"), enc(" world peace"), enc("hello"), enc(" hello"))
    # " humanity" is one token, "humanity" two: the spaced form is not a variant of the word (vLLM's rule too).
    assert len(enc("humanity")) == 2 and len(enc(" humanity")) == 1
    assert llm.engine.bad_words_token_ids(["humanity"]) == (enc("humanity"),)


def one_token_word(llm: LLM, plain: list[int]) -> tuple[int, str]:
    """The first of `plain`'s tokens that is a word of its own (its text, spaces dropped, is banned as that
    token): where it is, and the word."""
    tok, ban = llm.engine.tokenizer, llm.engine.bad_words_token_ids
    return next((j, w) for j in range(len(plain)) if (plain[j],) in ban([w := tok.decode(plain[j:j + 1]).strip()]))


def reference(model: torch.nn.Module, prompt: list[int], n: int, words: Sequence[tuple[int, ...]]) -> list[int]:
    """Greedy with vLLM's ban: a word's last token is banned where the output (not the prompt) ends with the
    word's other tokens."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for w in words:
            k = len(w) - 1
            if k <= len(out) and (k == 0 or tuple(out[len(out) - k:]) == w[:k]):
                logits[w[-1]] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_greedy_with_bad_words_is_the_reference_with_the_ban(llm: LLM, chat_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    plain = greedy(llm, 8)
    tok = llm.engine.tokenizer
    ban = llm.engine.bad_words_token_ids
    model = AutoModelForCausalLM.from_pretrained(str(chat_llama_dir), dtype=torch.float32)
    prompt = llm.engine.encode(PROMPT)
    # Words that this model's greedy text holds (spelled without the space the text has: their spaced form is
    # what the output holds): the first of two tokens, and the first of one token.
    k = next(k for k in range(1, 6) if tuple(plain[k:k + 2]) in ban([tok.decode(plain[k:k + 2]).strip()]))
    for at, word in ((k + 1, tok.decode(plain[k:k + 2]).strip()), one_token_word(llm, plain)):
        got = greedy(llm, 8, bad_words=[word])
        assert got == reference(model, prompt, 8, ban([word]))
        assert got[:at] == plain[:at] and got[at] != plain[at]  # (the ban bit where the text had the word)
    # A word's first tokens in the prompt do not count: only the output's (vLLM's rule). The prompt ends with
    # " over": a word " over <first token>" bans nothing at the first step.
    first = tok.decode(plain[:1]).strip()
    assert greedy(llm, 1, bad_words=[f"over {first}"]) == plain[:1]


def test_sampled_text_never_holds_a_banned_token(llm: LLM) -> None:
    plain = greedy(llm, 4)
    j, word = one_token_word(llm, plain)
    sp = SamplingParams(temperature=0.7, max_tokens=24, seed=5, ignore_eos=True, allowed_token_ids=plain[:3])
    assert plain[j] in llm.generate(PROMPT, sp, use_tqdm=False)[0].token_ids  # (drawn without the ban)
    sp.bad_words = [word]
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0].token_ids
    assert plain[j] not in out and len(out) == 24


def test_special_tokens_text_is_kept_when_asked(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    plain = greedy(llm, 2)
    allowed = [*specials, *plain]
    for skip in (True, False):
        sp = SamplingParams(temperature=1.0, max_tokens=12, seed=2, ignore_eos=True, allowed_token_ids=allowed,
                            skip_special_tokens=skip)
        out = llm.generate(PROMPT, sp, use_tqdm=False)[0]
        assert set(out.token_ids) & set(specials)  # (special tokens were drawn)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip)
        assert ("<|im_" in out.text) is not skip
        # Grown step by step (the incremental decoder's text): the same.
        assert stepped_text(llm.engine, PROMPT, sp) == out.text


def test_the_stop_tokens_text_stays_out_with_special_tokens_kept(llm: LLM) -> None:
    # EOS is a special token: its text is left out unless include_stop_str_in_output, as vLLM's.
    tok = llm.engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    plain = greedy(llm, 2)
    for include in (False, True):
        sp = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, allowed_token_ids=[eos, plain[0]],
                            skip_special_tokens=False, include_stop_str_in_output=include,
                            logit_bias={eos: 100})
        out = llm.generate(PROMPT, sp, use_tqdm=False)[0]
        assert out.token_ids[-1] == eos and out.outputs[0].finish_reason == "stop"
        assert out.text.endswith("<|im_end|>") is include


def test_spaces_between_special_tokens_and_bad_input(llm: LLM) -> None:
    # SmolLM2's decoder joins special tokens without a space: False changes nothing and is taken.
    sp = SamplingParams.greedy(3, ignore_eos=True, spaces_between_special_tokens=False)
    assert llm.generate(PROMPT, sp, use_tqdm=False)[0].token_ids == greedy(llm, 3)
    for bad, msg in ((["ok", "  "], "bad_words: every entry must be a string"), ("word", "bad_words: a list"),
                     ([1], "bad_words: every entry")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip_special_tokens: must be True or False"):
        SamplingParams(skip_special_tokens="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad_words: at most 128 words"):
        SamplingParams(bad_words=["w"] * 129)
    # Bounded once tokenized too (each step matches them against the output): sequences, then tokens.
    words = [f"w{i}" for i in range(100)]  # (two sequences each: as written and after a space)
    with pytest.raises(ValueError, match="bad_words: at most 128 token sequences of 1024 tokens in all, got 200"):
        llm.generate(PROMPT, SamplingParams.greedy(1, bad_words=words), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words: at most 128 token sequences of 1024 tokens in all, got 2 of"):
        llm.generate(PROMPT, SamplingParams.greedy(1, bad_words=["word " * 600]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_need_the_tokenizer(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", skip_tokenizer_init=True, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="bad_words: need the tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams.greedy(2, bad_words=["x"]), use_tqdm=False)


def test_spaces_between_special_tokens_false_is_refused_where_the_decoder_spaces_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # A WordPiece decoder (BERT's) joins tokens with spaces, special ones too: False would need a text of its
    # own, which kvpool does not make.
    from helpers import make_tiny_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "the", "fox", "##es"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-wordpiece"), seed=2, vocab_size=len(vocab))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                            eos_token="[SEP]").save_pretrained(path)
    llm = LLM(str(path), dtype="float32", num_blocks=16, block_size=4)
    assert llm.engine.tokenizer.decode([1, 2], skip_special_tokens=False) == "[CLS] [SEP]"
    with pytest.raises(ValueError, match="spaces_between_special_tokens: False is not supported with this model"):
        llm.generate("the fox", SamplingParams.greedy(2, spaces_between_special_tokens=False,
                                                      skip_special_tokens=False), use_tqdm=False)
    # With special tokens left out of the text (the default), there is nothing to space: taken.
    quiet = SamplingParams.greedy(2, ignore_eos=True, spaces_between_special_tokens=False)
    assert len(llm.generate("the fox", quiet, use_tqdm=False)[0].token_ids) == 2
    assert len(llm.generate("the fox", SamplingParams.greedy(2, ignore_eos=True), use_tqdm=False)[0].token_ids) == 2
