"""The `kvpool` command line: `generate` text with a model, `serve` the OpenAI-compatible API, and `bench`
the cache, its memory, the engine and a server."""

from __future__ import annotations

import argparse
import ctypes.util
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from kvpool.bench.report import BenchFailed


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags: defined once, by the fields of kvpool.engine.config's sections."""
    from kvpool.engine.config import EngineConfig

    EngineConfig.add_cli_flags(p)


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    from kvpool.engine.config import EngineConfig

    return EngineConfig.cli_values(a)


def _command(sub: Any, name: str, help: str, run: str, *, engine: bool = False,
             add: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """A subcommand: `run` ("module:function") is imported only when the command runs, so building the parser
    stays cheap; with `engine`, the command takes the engine's flags and gets `(args, engine_kwargs)`."""
    p = sub.add_parser(name, help=help)
    if add is not None:
        add(p)
    if engine:
        add_engine_arguments(p)
    p.set_defaults(run=run, with_engine=engine)
    return p


def build_parser() -> argparse.ArgumentParser:
    from kvpool.bench import cluster as bench_cluster
    from kvpool.bench import manager, memory, multiturn, policy, prefix
    from kvpool.bench import omni as bench_omni
    from kvpool.bench import serve as bench_serve
    from kvpool.bench import store as bench_store
    from kvpool.omni import cli as omni_cli
    from kvpool.router import cli as router_cli
    from kvpool.server import options as serve_options

    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: an LLM engine built around its KV cache")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = p.add_subparsers(dest="command", required=True)

    _command(sub, "generate", "generate a completion for a prompt", "kvpool.cli:cmd_generate", engine=True,
             add=add_generate_arguments)
    _command(sub, "serve", "serve the OpenAI-compatible API (completions, chat, metrics)", "kvpool.server.serve:run",
             engine=True, add=serve_options.add_arguments)
    _command(sub, "router", "a cache-aware OpenAI-compatible front door for N replicas", "kvpool.router.app:run",
             add=router_cli.add_arguments)
    _command(sub, "build-kernels", "compile kvpool's CPU kernels for this machine (else done at first use)",
             "kvpool.cli:cmd_build_kernels")
    _command(sub, "omni", "the thinker -> talker pipeline: text, then codes", "kvpool.omni.cli:run",
             add=omni_cli.add_arguments)
    _command(sub, "omni-serve", "serve the omni pipeline over the OpenAI-compatible chat API (images too)",
             "kvpool.omni.serve:run", add=omni_cli.add_serve_arguments)

    bench = sub.add_parser("bench", help="benchmarks (each prints a table, and JSON with --json)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _command(bsub, "manager", "replay a trace through the cache manager alone", "kvpool.bench.manager:run",
             add=manager.add_arguments)
    _command(bsub, "policy", "eviction policies vs the offline optimum", "kvpool.bench.policy:run",
             add=policy.add_arguments)
    _command(bsub, "memory", "KV memory of hybrid models: uniform vs kvpool's allocator", "kvpool.bench.memory:run",
             add=memory.add_arguments)
    _command(bsub, "prefix", "shared-prefix workload: kvpool with/without caching vs transformers",
             "kvpool.bench.prefix:run", engine=True, add=prefix.add_arguments)
    _command(bsub, "multiturn", "multi-turn chats: device-only vs device + host tier, and the ceiling",
             "kvpool.bench.multiturn:run", engine=True, add=multiturn.add_arguments)
    _command(bsub, "serve", "load-test an OpenAI-compatible server on this machine", "kvpool.bench.serve:run",
             add=bench_serve.add_arguments)
    _command(bsub, "cluster", "two replicas + router on loopback: routing policies", "kvpool.bench.cluster:run",
             add=bench_cluster.add_arguments)
    _command(bsub, "store", "the store tier's backends: throughput, round trips", "kvpool.bench.store:run",
             add=bench_store.add_arguments)
    _command(bsub, "omni", "the two-stage pipeline with stage-output caching on/off", "kvpool.bench.omni:run",
             add=bench_omni.add_arguments)
    return p


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", nargs="+", help="the prompt (several: one completion each)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    # Left out: the model's value (its generation_config.json, unless --generation-config vllm), else greedy.
    gen.add_argument("--temperature", type=float, default=None,
                     help="default: the model's (generation_config.json), else 0: greedy")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0: off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def cmd_build_kernels(a: argparse.Namespace) -> None:
    from kvpool.runner import kernels

    print(kernels.build())


def cmd_generate(a: argparse.Namespace, engine_kw: dict[str, Any]) -> None:
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    given = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k))
             if v is not None}
    SamplingParams(**given, max_tokens=a.max_tokens, seed=a.seed, stop=a.stop)  # (bad values: before the load)
    llm = LLM(**engine_kw)
    sampling = {"temperature": 0.0, **llm.engine.sampling_defaults, **given}
    params = SamplingParams(**sampling, max_tokens=a.max_tokens, seed=a.seed, stop=a.stop)
    chat = not a.raw and getattr(llm.tokenizer, "chat_template", None)
    if chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in a.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(a.prompt, params, use_tqdm=False)
    for q, o in zip(a.prompt, outs, strict=True):
        if len(a.prompt) > 1:
            print(f"### {q}")
        print(o.text)


def _preload_tcmalloc() -> None:
    """Restart this command with tcmalloc preloaded when the system has it (`KVPOOL_MALLOC=system` opts out).

    PyTorch on the CPU allocates and frees many large short-lived tensors per step; glibc's malloc hands
    them back to the kernel and faults them in again. tcmalloc keeps them: engine steps ran ~9% faster
    here (see docs/benchmarks.md). vLLM's CPU build asks its users for the same preload. It can only
    take effect at process start, hence the re-exec; `LLM` in a user's own process runs as it is.
    """
    if sys.platform != "linux" or os.environ.get("KVPOOL_MALLOC", "tcmalloc") != "tcmalloc":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return  # already in place (or preloading it failed: ld.so warned and ignored it; don't loop)
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None:
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{preload}" if preload else lib)
    os.execve(sys.executable, [sys.executable, "-m", "kvpool.cli", *sys.argv[1:]], env)


def _tcmalloc_mapped() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" in f.read()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _preload_tcmalloc()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        allocator = "tcmalloc" if _tcmalloc_mapped() else "the system's malloc"
        logging.getLogger("kvpool.cli").debug("allocator: %s", allocator)
    module, name = args.run.split(":")
    try:
        run = getattr(importlib.import_module(module), name)
        if args.with_engine:
            run(args, engine_kwargs(args))
        else:
            run(args)
    except (ValueError, OSError) as e:  # bad input, a missing or unreadable file: one line, no traceback
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 2
    except BenchFailed as e:  # a benchmark that could not finish: why, in one line
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
