"""The output's text as vLLM gives it, with a Llama-2 / Mistral style tokenizer (Metaspace "▁word" pieces,
a decoder that strips the text's leading space): decoded after the prompt's last tokens, so the first
output word keeps its space and prompt + completion reads as the whole sequence, streamed or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_tiny_llama, stepped_text

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams

WORDS = ["The", "capital", "of", "France", "is", "Paris", "a", "city", "on", "the", "Seine", "and", "river"]


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"▁{w}", -1.0) for w in WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyzPTFS▁"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0))
    # Llama-2's tokenizer.json: "▁" prepended and for every space; decoded back, the first space stripped.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-metaspace"), seed=5, vocab_size=len(pieces))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def test_the_first_word_keeps_its_space_and_prompt_plus_text_is_the_whole(metaspace_dir: Path) -> None:
    llm = LLM(str(metaspace_dir), dtype="float32", num_blocks=64, block_size=4)
    tok = llm.engine.tokenizer
    prompt = "The capital of France is"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["▁The", "▁capital", "▁of", "▁France", "▁is"]
    seen_space = 0
    for seed in range(8):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
        out = llm.generate(prompt, sp, use_tqdm=False)[0]
        whole = tok.decode(ids + out.token_ids, skip_special_tokens=True)
        assert prompt + out.text == whole, (out.text, tok.convert_ids_to_tokens(out.token_ids))
        seen_space += tok.convert_ids_to_tokens(out.token_ids[0]).startswith("▁")
        # Streamed through the engine step by step: the deltas add up to the same text.
        assert stepped_text(llm.engine, prompt, sp) == out.text
    assert seen_space >= 2  # (the case that lost its space: a first token "▁word")


@pytest.mark.parametrize("text", ["ab 😀😀😀 cd ef gh", "中文字符测试一下 hello 世界",
                                  "<|im_start|>user\nhi 😀<|im_end|>\n<|im_start|>assistant\n日本語 ok"])
def test_every_prompt_output_split_streams_the_final_text_and_no_prompt_text(smol_dir: Path, text: str) -> None:
    """Prompts ending inside a character (a generation cut by max_tokens mid-emoji, continued): decoded after
    them, the output's first piece carried the prompt's text, and the final text was not what had streamed."""
    import threading

    from transformers import AutoTokenizer

    from kvpool.engine.request import Request
    from kvpool.engine.stop import Detokenizer, StopChecker

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    det = Detokenizer(tok, threading.Lock())
    check = StopChecker(det)
    ids = tok.encode(text, add_special_tokens=False)
    for k in range(1, len(ids) - 1):
        prompt, out = ids[:k], ids[k:]
        req = Request(f"r{k}", prompt, SamplingParams(max_tokens=len(out)), eos_token_ids=[])
        texts = []
        for t in out:
            req.append_output_token_ids(t)
            check(req)
            texts.append(req.output_text)
        det.forget(req.request_id)
        final = texts[-1]
        assert all(final.startswith(s.rstrip("\ufffd")) for s in texts), (k, texts)
        head = tok.decode(prompt, skip_special_tokens=True)
        if "\ufffd" not in head:  # a clean boundary: prompt + completion reads as the whole
            assert head + final == tok.decode(ids, skip_special_tokens=True), k


def test_byte_tokens_that_make_no_character_do_not_break_the_stream() -> None:
    """A byte-fallback tokenizer's byte tokens with no UTF-8 character between them, then a whole token: the
    tokenizers library's DecodeStream raises "Invalid prefix" (it would fail the engine's step). A fresh
    stream goes on from that token, as vLLM's detokenizer does."""
    import threading

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from kvpool.engine.request import Request
    from kvpool.engine.stop import Detokenizer, StopChecker

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("<0x32>", -1.0), ("<0xD3>", -1.0), ("▁word", -1.0),
              ("协同", -1.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    check = StopChecker(Detokenizer(hf, threading.Lock()))
    req = Request("r", [5], SamplingParams(max_tokens=10), eos_token_ids=[])
    texts = []
    for t in [3, 4, 6, 5]:  # "2", a lone 0xD3 byte, "协同", " word"
        req.append_output_token_ids(t)
        check(req)
        texts.append(req.output_text)
    assert texts[-1].endswith("协同 word") and texts[0] == "2"
