"""The engine's configuration sections, and the CLI flags their fields define (no model needed)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvpool.cli import build_parser, engine_kwargs
from kvpool.engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from kvpool.server.options import ServerConfig

# Every engine flag the CLI had before the configs defined them: none may disappear.
ENGINE_FLAGS = {"--model", "--dtype", "--device", "--kv-cache-memory", "--block-size", "--no-prefix-caching",
                "--hash-algo", "--hash-seed", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len",
                "--swap-space",
                "--eviction-policy", "--host-eviction", "--write-through", "--state-retention-tokens", "--kv-store",
                "--kv-store-deadline", "--no-hybrid-allocator", "--no-native-kernels", "--pin-budget",
                "--kv-cache-dtype"}
SERVER_FLAGS = {"--host", "--port", "--api-key", "--served-model-name", "--max-pending", "--max-body-bytes",
                "--kv-events-endpoint", "--kv-events-replay-endpoint", "--kv-events-topic", "--pin-prefix"}


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                out[name] = sp
                out.update({f"{name} {k}": v for k, v in subparsers(sp).items()})
    return out


def flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_engine_and_server_flags_are_all_there() -> None:
    subs = subparsers(build_parser())
    for cmd in ("generate", "serve", "bench prefix", "bench multiturn"):
        assert flags(subs[cmd]) >= ENGINE_FLAGS, cmd
    assert flags(subs["serve"]) >= SERVER_FLAGS


def test_flags_parse_into_the_config_fields() -> None:
    args = build_parser().parse_args(["serve", "--no-prefix-caching", "--no-native-kernels", "--kv-store-deadline",
                                      "0.5", "--max-model-len", "300", "--block-size", "8", "--dtype", "float32",
                                      "--port", "9000", "--hash-seed", "s3"])
    kw = engine_kwargs(args)
    assert kw["enable_prefix_caching"] is False and kw["native_kernels"] is False and kw["hybrid_allocator"] is True
    assert (kw["kv_store_deadline_s"], kw["max_model_len"], kw["block_size"], kw["dtype"]) == (0.5, 300, 8, "float32")
    cfg = EngineConfig(**kw)
    assert cfg.cache.block_size == 8 and cfg.scheduler.max_model_len == 300 and cfg.runner.native_kernels is False
    assert cfg.cache.hash_seed == "s3"
    assert args.port == 9000 and args.host == ServerConfig.host
    # Defaults come from the fields: a bare command line gives the configs' defaults.
    bare = EngineConfig(**engine_kwargs(build_parser().parse_args(["generate", "hi"])))
    assert bare == EngineConfig()


def test_flat_keywords_reach_their_sections() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=3, dtype="float32", model="m")
    assert (cfg.cache, cfg.scheduler, cfg.runner) == (CacheConfig(block_size=4), SchedulerConfig(max_num_seqs=3),
                                                      RunnerConfig(dtype="float32", model="m"))
    assert (cfg.block_size, cfg.max_num_seqs, cfg.dtype, cfg.model) == (4, 3, "float32", "m")
    cfg.block_size = 32
    assert cfg.cache.block_size == 32
    with pytest.raises(TypeError, match="EngineConfig: unknown option 'blok_size'"):
        EngineConfig(blok_size=4)
    with pytest.raises(AttributeError, match="no option 'nope'"):
        _ = cfg.nope


def test_native_kernels_help_names_every_kernel() -> None:
    help_text = build_parser().format_help() + subparsers(build_parser())["serve"].format_help()
    assert "prefill attention" in help_text and "fused norm" in help_text


def test_every_subcommand_runs_a_function() -> None:
    subs = subparsers(build_parser())
    runnable = {name: sp for name, sp in subs.items() if sp.get_default("run")}
    assert set(runnable) == set(subs) - {"bench"}
    for name, sp in runnable.items():
        module, fn = sp.get_default("run").split(":")
        assert callable(getattr(importlib.import_module(module), fn)), name
        assert sp.get_default("with_engine") == (flags(sp) >= ENGINE_FLAGS), name


def test_a_new_field_is_a_new_flag() -> None:
    """How a flag is added: one field (here a list, a path and a number, as the LoRA and image options are)."""
    from dataclasses import dataclass

    from kvpool.flags import add_flags, option, values

    @dataclass
    class Extra:
        lora_modules: list[str] = option(  # noqa: RUF009 (option() returns a dataclasses.field)
            help="name=PATH adapters", nargs="+", metavar="NAME=PATH", default_factory=list)
        max_loras: int = option(1, "adapters in one batch")
        media_dir: str | None = option(None, "file:// images only under here", flag="--allowed-local-media-path")
        internal: int = 3  # not a flag

    p = argparse.ArgumentParser()
    add_flags(p, Extra, "extra")
    args = p.parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "4", "--allowed-local-media-path", "/m"])
    assert Extra(**values(Extra, args)) == Extra(["a=/x", "b=/y"], 4, "/m")
    assert Extra(**values(Extra, p.parse_args([]))) == Extra()
    assert "--internal" not in flags(p) and "adapters in one batch (default: 1)" in p.format_help()


def test_sizes_with_units_are_taken_by_every_size_flag() -> None:
    # --swap-space defaults to 0 (an int): its flag must still take "4GiB", as its help says.
    args = build_parser().parse_args(["generate", "hi", "--swap-space", "1GiB", "--kv-cache-memory", "64MiB"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert cfg.swap_space_bytes() == 1 << 30


def test_the_pin_budget_is_a_flag_and_a_fraction() -> None:
    args = build_parser().parse_args(["serve", "--pin-budget", "0.5", "--pin-prefix", "You are terse.",
                                      "--pin-prefix", "@/etc/prompt.txt"])
    assert EngineConfig(**engine_kwargs(args)).pin_budget == 0.5
    assert args.pin_prefix == ["You are terse.", "@/etc/prompt.txt"]
    for ok in (0, 0.2, 1):
        EngineConfig(pin_budget=ok).validate()
    for bad in (1.5, -0.1, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match=r"^pin_budget: a fraction of the pool in \[0, 1\], got "):
            EngineConfig(pin_budget=bad).validate()


@pytest.mark.parametrize(("kw", "message"), [
    (dict(enable_chunked_prefill="no"), r"^enable_chunked_prefill: must be True or False, got 'no'"),
    (dict(enable_chunked_prefill=None), r"^enable_chunked_prefill: must be True or False, got None"),
    (dict(skip_tokenizer_init="no"), r"^skip_tokenizer_init: must be True or False"),
    (dict(enable_kv_events=1), r"^enable_kv_events: must be True or False, got 1"),
    (dict(batch_invariant="yes"), r"^batch_invariant: must be True or False"),
    (dict(stage_outputs=0), r"^stage_outputs: must be True or False"),
    (dict(hash_seed=5), r"^hash_seed: must be a string, bytes or None, got 5"),
    (dict(hash_seed=["a"]), r"^hash_seed: must be a string, bytes or None"),
    # An empty seed hashed exactly as none: a tenant who set one shared every other tenant's blocks.
    (dict(hash_seed=""), r"^hash_seed: empty \(it would hash as no seed\)"),
    (dict(hash_seed=b""), r"^hash_seed: empty"),
    # A prefix read from the store has no stage outputs: the two together gave zeros for its hidden states.
    (dict(kv_store="file:///tmp/x", stage_outputs=True, swap_space="64MiB"),
     r"^kv_store: the store tier does not keep stage outputs"),
    # Checked before a model loads, not when the store opens (an empty value silently meant no store).
    (dict(kv_store="", swap_space="64MiB"), r"^kv_store: a store URL \(file:///dir or redis://host:port\), got ''"),
    (dict(kv_store="bogus://x", swap_space="64MiB"), r"^kv_store: unknown scheme 'bogus'"),
    (dict(kv_store="redis://h:notaport", swap_space="64MiB"), r"^kv_store: 'redis://h:notaport': Port could not"),
    (dict(kv_store="file:///tmp/x?max_size=big", swap_space="64MiB"), r"^kv_store: max_size"),
    (dict(kv_store="file:///tmp/x"), r"^kv_store: the store tier lies below the host tier, and there is none"),
    # Options that would be ignored, silently, with what they act on off.
    (dict(enable_prefix_caching=False, eviction_policy="lhd"), r"^eviction_policy: applies to cached blocks"),
    (dict(enable_prefix_caching=False, hash_seed="s"), r"^hash_seed: applies to cached blocks"),
    (dict(enable_prefix_caching=False, pin_budget=0.5), r"^pin_budget: applies to cached blocks"),
    (dict(max_loras=2), r"^max_loras: bounds LoRA adapters, and LoRA is off"),
    (dict(max_lora_rank=8), r"^max_lora_rank: bounds LoRA adapters, and LoRA is off"),
])
def test_every_switch_and_the_hash_seed_are_checked(kw: dict, message: str) -> None:
    """Every bool option of every section is checked: "no" must not leave a switch on."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw).validate()
    EngineConfig(hash_seed="tenant-1").validate()
    EngineConfig(hash_seed=b"\x01").validate()


@pytest.mark.parametrize(("kw", "message"), [
    # A bool is an int to Python: True passed the runner's check and failed inside torch.
    (dict(max_loras=True), r"^max_loras: must be an int >= 1, got True"),
    (dict(max_loras=0), r"^max_loras: must be an int >= 1, got 0"),
    (dict(max_lora_rank=False), r"^max_lora_rank: must be an int >= 1, got False"),
    (dict(model=5), r"^model: must be a model folder \(a path\) or None, got 5"),
    (dict(model=""), r"^model: must be a model folder"),
    # NaN passed `deadline <= 0`, and a NaN deadline never fires: requests waited on every store read.
    (dict(kv_store_deadline_s=float("nan")), r"^kv_store_deadline: must be > 0 seconds, got nan"),
    (dict(kv_store_deadline_s=float("inf")), r"^kv_store_deadline: must be > 0 seconds, got inf"),
    (dict(kv_store_deadline_s=0), r"^kv_store_deadline: must be > 0 seconds, got 0"),
    (dict(kv_store_deadline_s="2"), r"^kv_store_deadline: must be > 0 seconds, got '2'"),
    # An empty device name silently meant the default device.
    (dict(device=""), r"^device: must be a string such as 'cpu' or 'cuda', or None, got ''"),
    # Checked once the model had loaded, before.
    (dict(encoder_cache_size="lots"), r"^encoder_cache_size: cannot read 'lots' as a size"),
    (dict(state_retention_budget="x"), r"^state_retention_budget: must be an int >= 0, got 'x'"),
    (dict(stage_output_layers=5), r"^stage_output_layers: a sequence of layer indices, got 5"),
    (dict(kv_cache_memory=10**400), r"^kv_cache_memory: must be a finite size > 0"),
    # Host tier options without a host tier were ignored, silently; a host policy's name was checked only
    # when there was a host tier.
    (dict(write_through=True), r"^write_through: copies blocks to the host tier, and there is none"),
    (dict(write_through=True, swap_space="0GiB"), r"^write_through: copies blocks to the host tier"),
    (dict(host_eviction="arc"), r"^host_eviction: 'arc' orders the host tier, and there is none"),
    (dict(host_eviction="bogus", swap_space="1GiB"), r"^host_eviction: unknown policy 'bogus'; one of "),
    (dict(hash_algo="bogus", enable_prefix_caching=False), r"^hash_algo: unknown algorithm 'bogus'"),
])
def test_lora_counts_the_model_the_deadline_and_the_device_are_checked(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw).validate()


def test_any_zero_swap_space_turns_the_host_tier_off() -> None:
    for zero in (0, 0.0, "0", "0GiB", " 0 MiB", None):
        assert EngineConfig(swap_space=zero).swap_space_bytes() == 0
    assert EngineConfig(swap_space="1GiB", write_through=True, host_eviction="arc").swap_space_bytes() == 1 << 30
    EngineConfig(swap_space="1GiB", write_through=True, host_eviction="arc").validate()
    EngineConfig(num_host_blocks=4, write_through=True).validate()


def test_good_lora_counts_model_deadline_and_device_pass(tmp_path) -> None:  # type: ignore[no-untyped-def]
    EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, model=tmp_path, kv_store_deadline_s=0.5,
                 device="cpu").validate()
    EngineConfig(model="some/folder", kv_store_deadline_s=3).validate()


def test_a_nan_store_deadline_is_refused_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the model loads (the engine validates its config first)."""
    from kvpool.cli import main

    assert main(["generate", "--kv-store-deadline", "nan", "hi"]) == 2
    assert "kvpool: error: kv_store_deadline: must be > 0 seconds, got nan" in capsys.readouterr().err


def test_an_eviction_policy_is_a_name_or_a_policy() -> None:
    from kvpool.core.eviction import LRUPolicy, make_policy

    p = LRUPolicy()
    assert make_policy(p) is p
    with pytest.raises(ValueError, match=r"^eviction_policy: a policy name \(one of \[.*'lru'.*\]\) or an "
                                         r"EvictionPolicy, got 3"):
        make_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "message"), [
    # An empty key let in any client sending an empty token; an empty host listened on every interface.
    (["serve", "--api-key", ""], "argument --api-key: must not be empty (a key; leave the flag out to require none)"),
    (["serve", "--host", " "], "argument --host: must not be empty (an address, e.g. 127.0.0.1 or 0.0.0.0)"),
    (["serve", "--host", "999.1.1.1"], "argument --host: '999.1.1.1' is not an IP address"),
    (["omni-serve", "--api-key", ""], "argument --api-key: must not be empty"),
    (["omni-serve", "--host", ""], "argument --host: must not be empty"),
    (["omni-serve", "--port", "70000"], "argument --port: must be in 0..65535"),
    (["router", "--replica", "http://127.0.0.1:9", "--host", "::zz"], "argument --host: '::zz' is not an IP address"),
    (["router", "--replica", "http://127.0.0.1:9", "--api-key", ""], "argument --api-key: must not be empty"),
    (["router", "--replica", "http://127.0.0.1:9", "--host", ""], "argument --host: must not be empty"),
    (["router", "--replica", "http://127.0.0.1:9", "--port", "70000"], "argument --port: must be in 0..65535"),
    (["router", "--replica", "http://127.0.0.1:9", "--port", "-1"], "argument --port: must be in 0..65535"),
])
def test_empty_keys_and_hosts_are_refused_by_the_cli(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_api_key_lets_no_one_in() -> None:
    from starlette.requests import Request

    from kvpool.server.errors import APIError, check_api_key

    empty = Request({"type": "http", "headers": [(b"authorization", b"Bearer ")]})
    with pytest.raises(APIError):
        check_api_key(empty, "")
