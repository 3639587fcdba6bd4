"""The model's sampling defaults (generation_config.json: temperature, top_p, top_k) for requests that leave a
field out, as vLLM's `--generation-config auto`: offline (`LLM.generate` without sampling parameters,
`get_default_sampling_params`) and over HTTP; `vllm` keeps kvpool's own defaults; bad values are skipped."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from server_helpers import make_engine

from kvpool.engine.llm import LLM
from kvpool.engine.sampling_params import SamplingParams
from kvpool.server.serve import start_server

PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42]]


@pytest.fixture(scope="module")
def top1_dir(chat_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (with a tokenizer) whose author's defaults are top_k 1 (so a request that leaves top_k
    out decodes greedily whatever its temperature) and temperature 0.7."""
    path = tmp_path_factory.mktemp("top1") / "model"
    shutil.copytree(chat_llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 1}))
    return path


def llm(model: Path, **kw: object) -> LLM:
    return LLM(str(model), dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=4, **kw)  # type: ignore[arg-type]


def tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_offline_defaults_come_from_the_model(top1_dir: Path, tiny_llama_dir: Path) -> None:
    model = llm(top1_dir)
    assert model.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1)
    greedy = tokens(model.generate(PROMPTS, SamplingParams.greedy(16), use_tqdm=False))
    assert tokens(model.generate(PROMPTS, use_tqdm=False)) == greedy  # no parameters: the model's top_k 1
    sampled = tokens(model.generate(PROMPTS, SamplingParams(max_tokens=16, seed=3), use_tqdm=False))
    assert sampled != greedy  # given parameters are the caller's: top_k off, temperature 1
    # "vllm": kvpool's own defaults, as a model without the file gets.
    own = llm(top1_dir, generation_config="vllm")
    assert own.get_default_sampling_params() == SamplingParams() == llm(tiny_llama_dir).get_default_sampling_params()
    with pytest.raises(ValueError, match="generation_config"):
        llm(top1_dir, generation_config="model")


def test_values_that_are_not_sampling_parameters_are_skipped(tiny_llama_dir: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.8, "top_k": "many"}))
    with caplog.at_level(logging.WARNING, logger="kvpool.engine.generation_defaults"):
        assert llm(path).get_default_sampling_params() == SamplingParams(top_p=0.8)
    assert "temperature: must be >= 0" in caplog.text and "top_k: must be an int" in caplog.text
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^model: .*generation_config.json is not valid JSON"):
        llm(path)


def test_a_request_that_leaves_fields_out_gets_the_models_values(top1_dir: Path) -> None:
    h = start_server(make_engine(top1_dir), served_model_name="tiny")
    try:
        def text(**body: object) -> str:
            r = httpx.post(f"{h.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "seed": 5,
                                                            "ignore_eos": True, **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert text() == greedy  # top_k left out: the model's 1
        assert text(temperature=1.5) == greedy  # (still top_k 1)
        assert text(top_k=0) != greedy  # the request's own top_k: off, at the model's temperature 0.7
    finally:
        h.stop()


def test_a_models_repetition_penalty_is_a_default_too() -> None:
    """As vLLM reads it (Qwen2.5-Instruct ships 1.05); one that is no penalty (0) is skipped, not a failed start."""
    from kvpool.engine.generation_defaults import read_defaults

    assert read_defaults({"repetition_penalty": 1.05, "temperature": 0.7}) == {"repetition_penalty": 1.05,
                                                                                "temperature": 0.7}
    assert read_defaults({"repetition_penalty": 0}) == {}
    assert read_defaults({"repetition_penalty": 1.05}, "vllm") == {}
